"""experiments/hf_parity.py: a transformers Llama on SDPA and on the Riemannian backend, paired by seed."""
import json

import pytest
import torch

from _helpers import experiment_script

pytest.importorskip("transformers")


def _script():
    return experiment_script("hf_parity.py")


def test_both_arms_start_from_the_same_weights_and_differ_only_by_the_backend():
    m = _script()
    a = m.parse_args(["--out", "unused.json", "--n-embd", "32", "--n-head", "2", "--block-size", "16"])
    sdpa, rr_model = m.build("sdpa", 20, 3, a), m.build("riemannian", 20, 3, a)
    factor = m.build("factor", 20, 3, a)
    shared = sdpa.state_dict()
    for other in (rr_model, factor):
        extra = {k for k in other.state_dict() if k not in shared}
        assert extra and all("riemannian_metric" in k for k in extra)
        assert all(torch.equal(v, other.state_dict()[k]) for k, v in shared.items())
    assert sdpa.config._attn_implementation == "sdpa"
    assert rr_model.config._attn_implementation == "riemannian"
    forms = {net.form for layer in rr_model.model.layers for net in layer.self_attn.riemannian_metric.heads}
    assert forms == {"gains"}
    forms = {net.form for layer in factor.model.layers for net in layer.self_attn.riemannian_metric.heads}
    assert forms == {"factor"}


def test_a_tiny_run_writes_paired_results(tmp_path):
    out = tmp_path / "hf.json"
    rec = _script().main(["--seeds", "0", "1", "--steps", "2", "--log-every", "1", "--eval-batches", "1",
                          "--final-batches", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
                          "--smoke-chars", "4000", "--out", str(out), "--quiet"])
    saved = json.loads(out.read_text())
    assert saved["complete"] and saved["command"].startswith("python experiments/hf_parity.py")
    assert {(r["arm"], r["seed"]) for r in saved["runs"]} == {(a, s) for a in ("sdpa", "riemannian") for s in (0, 1)}
    s = saved["summary"]["riemannian"]
    assert len(s["paired_diffs"]) == 2 and s["seeds"] == [0, 1]
    base = saved["summary"]["sdpa"]["mean"]
    assert s["pct_vs_sdpa"] == pytest.approx(100 * (s["mean"] / base - 1))
    assert rec["wall_s"] > 0
