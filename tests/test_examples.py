"""examples/: the scripts run, use only the package's public API, and the README quotes their committed results."""
import ast
import importlib
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import riemannian_ref as rr

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "nanogpt_riemannian.py"
RESULTS = {a: [ROOT / "results" / f"nanogpt_char_{a}_s{s}.json" for s in (0, 1, 2)] for a in ("riemannian", "sdpa")}


def test_the_nanogpt_example_trains_and_writes_its_result(tmp_path):
    out = tmp_path / "result.json"
    args = ["--steps", "6", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
            "--batch-size", "8", "--eval-every", "3", "--eval-iters", "2", "--lr", "1e-2", "--quiet", "--out", out]
    run = subprocess.run([sys.executable, EXAMPLE, *map(str, args)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("riemannian: val loss ")
    result = json.loads(out.read_text())
    assert [p["step"] for p in result["curve"]] == [0, 3, 6]
    assert result["curve"][-1]["train"] < result["curve"][0]["train"]
    assert result["config"]["attention"] == "riemannian" and result["config"]["n_layer"] == 1
    assert len(result["sample"]) == 201 and result["wall_time_s"] > 0


def _rr_names(tree: ast.AST) -> set[str]:
    """Dotted names the script reads from the package: rr.X, rr.X.Y, and from-imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "rr":
                names.add(".".join(reversed(chain)))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("riemannian_ref"):
            names.update(f"{node.module[len('riemannian_ref.'):]}.{a.name}".lstrip(".") for a in node.names)
    return names


def test_the_example_uses_only_the_public_api():
    tree = ast.parse(EXAMPLE.read_text(encoding="utf-8"))
    names = _rr_names(tree)
    assert {"MetricNet", "riemannian_attention"} <= names
    for name in names:
        parts = name.split(".")
        assert not any(p.startswith("_") for p in parts), name
        if len(parts) == 1:  # rr.X: a curated name, or a subpackage (the start of rr.data.X)
            assert parts[0] in rr.__all__ or isinstance(getattr(rr, parts[0], None), types.ModuleType), \
                f"rr.{name} is not in riemannian_ref.__all__"
        else:  # rr.module.X: X exported by that public module
            module = importlib.import_module("riemannian_ref." + ".".join(parts[:-1]))
            assert parts[-1] in module.__all__, f"rr.{name} is not in the __all__ of {module.__name__}"


@pytest.mark.parametrize("attention", sorted(RESULTS))
def test_the_readme_quotes_the_committed_results(attention):
    results = [json.loads(p.read_text()) for p in RESULTS[attention]]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    row = re.search(rf"^\| `--attention {attention}` \|(.*)$", readme, re.M)
    assert row, f"README.md has no result row for --attention {attention}"
    cells = [c.strip() for c in row.group(1).split("|")]
    val = [r["val_loss"] for r in results]
    mean = lambda xs: sum(xs) / len(xs)
    assert cells[0] == f"{mean(val):.3f} [{min(val):.3f}, {max(val):.3f}]", cells
    assert cells[1] == f"{mean([r['train_loss'] for r in results]):.3f}", cells
    assert cells[2] == f"{mean([r['wall_time_s'] for r in results]):.0f}", cells
    assert all(r["args"]["steps"] == 1000 and r["config"]["n_layer"] == 4 for r in results)
    assert [r["args"]["seed"] for r in results] == [0, 1, 2]
