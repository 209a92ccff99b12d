"""Attention entropy and metric size as a first-class diagnostic: ``attention_diagnostics`` and ``rr.train``.

The entropy is checked against the weights the layers return, the metric size against a dense eigenvalue
computation; ``rr.train`` records both at every evaluation, warns once per layer below ``entropy_floor``, changes
nothing in the trajectory, and resumes from checkpoints written before the diagnostics existed.
"""
import math
import warnings

import pytest
import torch

import riemannian_ref as rr
from _helpers import nested
from riemannian_ref import data
from riemannian_ref.analysis.collapse import attention_entropy
from riemannian_ref.training import attention_diagnostics


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return rr.FiberBundleTransformer(rr.FiberBundleConfig.tiny(**nested(**{"mode": "riemannian", "block_size": 12,
                                                                            **kw})))


@pytest.mark.parametrize("kw", [dict(), dict(mode="euclidean"), dict(metric_form="factor"), dict(metric="shared"),
                                dict(subspace=4), dict(mode="fiber_bundle")],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_diagnostics_match_the_weights_and_a_dense_eigen_decomposition(kw):
    model = _model(**kw).train()
    idx = torch.randint(0, 16, (3, 12), generator=torch.Generator().manual_seed(0))
    rng = torch.get_rng_state()
    d = attention_diagnostics(model, idx)
    assert model.training and torch.equal(torch.get_rng_state(), rng)  # mode restored, nothing drawn
    model.eval()
    torch.set_grad_enabled(False)
    try:
        out = model(idx, return_weights=True)
    finally:
        torch.set_grad_enabled(True)
    A = out.weights  # [L, B, h, n, n]
    want = [float(attention_entropy(A[i]).mean()) for i in range(len(model.blocks))]
    assert d["attn_entropy"] == pytest.approx(want, rel=1e-5)
    x = model._embed(idx, None)
    for i, blk in enumerate(model.blocks):
        h = blk.ln1(x)
        if kw.get("mode") == "euclidean":
            assert math.isnan(d["metric_eig"][i])
        else:
            lam, _, U, _ = blk.attn.geometry(h)
            U = U.dense() if isinstance(U, rr.SubspaceFactors) else U
            U = U if U.dim() == 5 else U.unsqueeze(2)
            G = lam.view(1, -1, 1, 1, 1) * torch.eye(U.shape[-2]) + U @ U.mT
            assert d["metric_eig"][i] == pytest.approx(torch.linalg.eigvalsh(G)[..., -1].mean().item(), rel=1e-4)
        x = blk(x)[0]


def test_the_gains_form_bounds_the_metric_size_and_the_factor_form_does_not():
    for form, bounded in (("gains", True), ("factor", False)):
        model = _model(metric_form=form)
        with torch.no_grad():
            for blk in model.blocks:
                blk.attn.metric.proj.weight.mul_(30.0)  # grown in training
        d = attention_diagnostics(model, torch.randint(0, 16, (2, 12)))
        lam = [float(b.attn.metric.lam().max()) for b in model.blocks]
        assert all((e <= l * 5 + 1e-5) == bounded for e, l in zip(d["metric_eig"], lam)), (form, d)


def _recall():
    return data.make_task("recall", seed=0, n_train=64, n_val=16, vocab_size=16, n_pairs=3, seq_len=12)


def _cfg(**kw):
    return rr.TrainConfig(**{**dict(lr=3e-3, steps=8, batch_size=8, eval_interval=4, warmup_steps=1), **kw})


def test_train_records_the_diagnostics_at_every_evaluation_and_changes_nothing_else():
    tr, va = _recall()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default floor does not fire here
        res = rr.train(m1 := _model(), tr, va, _cfg())
    h = res.history
    assert len(h["attn_entropy"]) == len(h["step"]) == 3
    assert all(len(e) == 2 and all(0 <= v <= math.log(12) for v in e) for e in h["attn_entropy"])
    assert all(len(e) == 2 and all(v >= 1e-3 for v in e) for e in h["metric_eig"])
    off = rr.train(m2 := _model(), tr, va, _cfg(diagnostics=0))
    assert off.history["attn_entropy"] == [[], [], []] and off.history["metric_eig"] == [[], [], []]
    assert off.history["val_loss"] == h["val_loss"]  # the diagnostics change nothing in the run
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))


def test_a_layer_below_the_entropy_floor_is_reported_once():
    tr, va = _recall()
    with pytest.warns(UserWarning, match=r"attention layer (0|1) has mean attention entropy") as rec:
        rr.train(_model(), tr, va, _cfg(entropy_floor=100.0))  # every layer, every evaluation, is below
    msgs = [str(w.message) for w in rec if "mean attention entropy" in str(w.message)]
    assert len(msgs) == 2 and {m.split("attention layer ")[1][0] for m in msgs} == {"0", "1"}
    assert "entropy_floor=None" in msgs[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rr.train(_model(), tr, va, _cfg(entropy_floor=None))


@pytest.mark.parametrize("kw, msg", [(dict(diagnostics=-1), "diagnostics"), (dict(diagnostics=1.5), "diagnostics"),
                                     (dict(entropy_floor=-0.1), "entropy_floor"),
                                     (dict(entropy_floor=float("nan")), "entropy_floor")])
def test_bad_diagnostic_settings_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _cfg(**kw)


def test_a_checkpoint_written_before_the_diagnostics_resumes(tmp_path):
    tr, va = _recall()
    ck = tmp_path / "ck.pt"
    full = rr.train(_model(), tr, va, _cfg())
    rr.train(_model(), tr, va, _cfg(checkpoint_path=str(ck), stop_at_step=4))
    blob = torch.load(ck, weights_only=True)
    for k in ("attn_entropy", "metric_eig"):
        del blob["history"][k]  # as the loop wrote it before
    torch.save(blob, ck)
    res = rr.train(_model(seed=3), tr, va, _cfg(checkpoint_path=str(ck), resume=True))
    assert res.history["val_loss"] == full.history["val_loss"]
    assert res.history["attn_entropy"][:2] == [[], []] and len(res.history["attn_entropy"][2]) == 2
    blob = torch.load(ck, weights_only=True)
    blob["history"]["attn_entropy"] = [[1.0], "x", [2.0]]
    torch.save(blob, ck)
    with pytest.raises(ValueError, match="attn_entropy"):
        rr.train(_model(), tr, va, _cfg(checkpoint_path=str(ck), resume=True))
