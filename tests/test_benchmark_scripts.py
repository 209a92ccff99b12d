"""The benchmark scripts run end to end on tiny settings and write well-formed results.

Nothing here is timed: speed is the scripts' business (ratios measured in one
run), these tests only keep the scripts from rotting.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run(script, *args):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], check=True, env=ENV,
                   capture_output=True, text=True, timeout=300)


def test_bench_attention_tiny(tmp_path):
    out = tmp_path / "bench"
    run("bench_attention.py", "--ns", "64", "128", "--ranks", "1", "2", "--reps", "1", "--mem-ranks", "1",
        "--out", str(out))
    res = json.loads(out.with_suffix(".json").read_text())
    assert {(row["n"], row["r"], row["passes"]) for row in res["time"]} == {
        (n, r, p) for n in (64, 128) for r in (1, 2) for p in ("fwd", "fwd+bwd")}
    for row in res["time"]:
        assert row["sdpa_ms"] > 0 and row["ours_ms"] > 0 and row["predicted"] > 1
        assert abs(row["measured_over_predicted"] * row["predicted"] - row["ratio"]) < 1e-9
    assert {(row["r"], row["passes"]) for row in res["memory"]} == {(1, "fwd"), (1, "fwd+bwd")}
    assert "| 128 | 2 | fwd+bwd |" in out.with_suffix(".md").read_text()


def test_bench_attention_ablation_tiny(tmp_path):
    out = tmp_path / "ablation"
    run("bench_attention_ablation.py", "--reps", "1", "--min-time", "0.001", "--out", str(out))
    res = json.loads(out.with_suffix(".json").read_text())
    assert len(res["rows"]) == 5
    assert all(row["speedup"] > 0 and len(row["speedup_rounds"]) == 1 for row in res["rows"])
