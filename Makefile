# Thin wrappers around dev.py, which does the work with only Python and pip.
.PHONY: setup book test pdf execute bench clean

setup:
	python3 dev.py setup

book:
	python3 dev.py book

test:
	python3 dev.py test

pdf:
	python3 dev.py pdf

# Re-run every notebook in place (stored outputs + widget state).
execute:
	python3 dev.py execute

bench:
	OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_attention.py
	OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_attention_ablation.py

clean:
	rm -rf _build .pytest_cache
