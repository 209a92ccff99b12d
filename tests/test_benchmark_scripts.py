"""The benchmark scripts run end to end on tiny settings and write well-formed results.

Nothing here is timed: speed is the scripts' business (ratios measured in one
run), these tests only keep the scripts from rotting.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import riemannian_ref as rr

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run(script, *args):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], check=True, env=ENV,
                   capture_output=True, text=True, timeout=300)


def test_bench_attention_tiny(tmp_path):
    out = tmp_path / "bench"
    run("bench_attention.py", "--ns", "64", "128", "--ranks", "1", "2", "--B", "1", "2", "--threads", "1",
        "--sides", "mean", "--side-B", "1", "--side-ns", "64", "--reps", "1", "--min-time", "0.002",
        "--mem-ranks", "1", "--out", str(out))
    res = json.loads(out.with_suffix(".json").read_text())
    keys = {(row["side"], row["B"], row["n"], row["r"], row["passes"]) for row in res["time"]}
    assert keys == {("key", B, n, r, p) for B in (1, 2) for n in (64, 128) for r in (1, 2)
                    for p in ("fwd", "fwd+bwd")} | {("mean", 1, 64, r, p) for r in (1, 2) for p in ("fwd", "fwd+bwd")}
    for row in res["time"]:
        assert row["sdpa_ms"] > 0 and row["ours_ms"] > 0 and row["predicted"] > 1 and row["threads"] == 1
        assert abs(row["measured_over_predicted"] * row["predicted"] - row["ratio"]) < 1e-9
    assert {(row["r"], row["passes"]) for row in res["memory"]} == {(1, "fwd"), (1, "fwd+bwd")}
    for row in res["memory"]:  # the floor is the output (+ gradients): B h n d floats, more with the backward
        assert row["floor_MiB"] == pytest.approx(4 * 128 * 64 * 4 / 2 ** 20 * (1 if row["passes"] == "fwd" else 5))
    md = out.with_suffix(".md").read_text()
    assert "| key | 2 | 1 | 128 | 2 | fwd+bwd |" in md and "| mean | 1 | 1 | 64 |" in md
    assert res["machine"]["wall_s"] > 0 and len(res["machine"]["load_after"]) == 3


def test_bench_attention_ablation_tiny(tmp_path):
    out = tmp_path / "ablation"
    run("bench_attention_ablation.py", "--reps", "1", "--min-time", "0.001", "--no-operator", "--out", str(out))
    res = json.loads(out.with_suffix(".json").read_text())
    assert len(res["rows"]) == 5  # exp2, the squares in place (r = 1, 4), the compiled tile (r = 1, 4)
    assert all(row["speedup"] > 0 and len(row["speedup_rounds"]) == 1 for row in res["rows"])
    compiled = [row for row in res["rows"] if row["what"].startswith("compiled tile")]
    assert [row["r"] for row in compiled] == [1, 4] and all(row["compile_s"] > 0 for row in compiled)


def test_ablation_switches_are_loop_options_and_the_entry_is_the_public_function():
    """The ablation changes fields of the operator's LoopOptions (each to another value than the default), and its
    call of the internal entry computes what ``rr.riemannian_attention`` does, exactly."""
    import dataclasses

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_attention_ablation as ab
    from riemannian_ref.attention import _blockwise as bw

    assert {attr for _, attr, _ in ab.SWITCHES} == {f.name for f in dataclasses.fields(bw.LoopOptions)}
    for _, attr, alt in ab.SWITCHES:
        assert getattr(bw.DEFAULT_LOOP, attr) != alt
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 70, 8, generator=g) for _ in range(3))
    Uk = 0.3 * torch.randn(2, 3, 70, 8, 2, generator=g)
    ref = rr.riemannian_attention(q, k, v, U_k=Uk)
    assert torch.equal(ab.operator_call(q, k, v, Uk, bw.DEFAULT_LOOP), ref)
    for _, attr, alt in ab.SWITCHES:
        other = ab.operator_call(q, k, v, Uk, dataclasses.replace(bw.DEFAULT_LOOP, **{attr: alt}))
        torch.testing.assert_close(other, ref, rtol=1e-5, atol=1e-6)


def test_bench_reductions_quick(tmp_path):
    """The three exact routes of one-metric calls and the subspace family, each against SDPA, in one --quick run."""
    out = tmp_path / "reductions"
    run("bench_reductions.py", "--quick", "--threads", "1", "--ms", "1", "2", "--out", str(out))
    res = json.loads(out.with_suffix(".json").read_text())
    keys = {(row["case"], row["causal"], row["route"]) for row in res["rows"]}
    one = ("distance (G = lam I)", "shared metric, r = 4")
    sub = ("subspace, m = 1, r = 1", "subspace, m = 2, r = 2")
    assert keys == ({(c, causal, rt) for c in one for causal in (False, True)
                     for rt in ("operator", "sdpa_bias", "sdpa_lifted")}
                    | {(c, causal, rt) for c in sub for causal in (False, True) for rt in ("sdpa_lifted", "operator")})
    for row in res["rows"]:
        assert row["sdpa_ms"] > 0 and row["ms"] > 0 and len(row["ratio_rounds"]) == 2 and row["predicted"] >= 1
        assert abs(row["measured_over_predicted"] * row["predicted"] - row["ratio"]) < 1e-9
    lifted = {row["m"]: row["predicted"] for row in res["rows"] if row["route"] == "sdpa_lifted" and row["m"]}
    assert 1 < lifted[1] < lifted[2] < 1.1  # SDPA at head size d + m(m+1)/2 + 1 = 66, 68 against 64
    assert set(res["summary"]) == {"one_metric", "subspace"}
    assert res["summary"]["one_metric"]["table"] == res["machine"]["table"]["no_factor"]
    assert res["machine"]["threads"] == 1 and len(res["machine"]["load_before"]) == 3
    md = out.with_suffix(".md").read_text()
    assert "| distance (G = lam I) | yes | sdpa_bias |" in md and "fastest exact route" in md


def test_bench_import_tiny(tmp_path):
    out = tmp_path / "import.json"
    run("bench_import.py", "--runs", "1", "--out", str(out))
    res = json.loads(out.read_text())
    assert set(res["median_s"]) == {"torch", "riemannian_ref"} and all(len(t) == 1 for t in res["times_s"].values())
    assert res["extra_s"] == pytest.approx(res["median_s"]["riemannian_ref"] - res["median_s"]["torch"])
    assert res["extra_over_torch"] == pytest.approx(res["extra_s"] / res["median_s"]["torch"])
    assert Path(res["package"]).resolve().is_relative_to(ROOT)  # it timed this checkout's package


def test_bench_model_targets_tiny(tmp_path):
    """The targets mode: every mode in its own process, ratios per round, a table (n tiny, one round)."""
    out = tmp_path / "bench_model"
    run("bench_model.py", "--targets", "--ns", "32", "--reps", "1", "--modes", "riemannian", "fiber_bundle",
        "--out", str(out))
    res = json.loads((tmp_path / "bench_model_targets.json").read_text())
    modes = {row["mode"] for row in res["rows"]}
    assert modes == {"euclidean", "riemannian", "fiber_bundle"}  # the Euclidean baseline always runs
    for row in res["rows"]:
        assert row["n"] == 32 and row["step_s"] > 0 and row["time_vs_euclidean"] > 0
    eu = next(row for row in res["rows"] if row["mode"] == "euclidean")
    assert eu["time_vs_euclidean"] == 1.0
    assert res["machine"]["metric_form"] == "factor"  # the stored results' form, not the package default
    md = (tmp_path / "bench_model_targets.md").read_text()
    assert "| 32 | fiber_bundle |" in md and 'metric_form="factor"' in md


def test_bench_content_quick(tmp_path):
    out = tmp_path / "content"
    run("bench_content.py", "--quick", "--threads", "1", "--out", str(out))
    res = json.loads(out.with_suffix(".json").read_text())
    whats = {row["what"] for row in res["rows"]}
    assert {"kernel", "layer", "sdpa", "dense path", "flat connection"} <= whats
    assert all(row["ms"] > 0 and row["vs_sdpa"] > 0 for row in res["rows"])
    assert res["machine"]["metric_form"] == "factor"  # the stored results' form, not the package default
