"""FiberBundleTransformer: shapes, reductions, causality, diagnostics, save/load, config errors.

The presets (tiny, small, attention_stack, grokking) are tested in test_presets.py."""
import itertools
import pickle
import math

import pytest
import torch
import torch.nn.functional as F

import riemannian_ref as rr
from riemannian_ref.geometry.transport import CONNECTIONS
from riemannian_ref.models import MODES
from riemannian_ref.models.transformer import FiberBundleOutput

from _helpers import Boom, payload_globals

B, N = 2, 12


def _model(seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    cfg = rr.FiberBundleConfig.tiny(**kw)
    return rr.FiberBundleTransformer(cfg).to(dtype).eval()


def _idx(gen, vocab=16, n=N):
    return torch.randint(0, vocab, (B, n), generator=gen)


ALL_VARIANTS = (
    [dict(mode="euclidean"), dict(mode="riemannian", attention=dict(metric_side="key")),
     dict(mode="riemannian", attention=dict(metric_side="query", rank=0)),
     dict(mode="riemannian", attention=dict(metric_side="mean", qk_init="orthonormal")),
     dict(mode="riemannian", attention=dict(metric="shared", learn_temperature=True)),
     dict(mode="fiber_bundle", attention=dict(metric="shared", metric_side="mean", connection="flat"))]
    + [dict(mode="fiber_bundle", precondition_ffn=p, attention=dict(connection=c, metric_side=s))
       for c, s, p in itertools.product(CONNECTIONS, ("key", "query", "mean"), (True, False))]
)


def _id(kw):
    return "-".join(f"{v}" for v in kw.values())


@pytest.mark.parametrize("kw", ALL_VARIANTS, ids=_id)
def test_shapes_loss_and_gradients(gen, kw):
    model = _model(dtype=torch.float32, **kw).train()
    idx, targets = _idx(gen), _idx(gen)
    out = model(idx, targets=targets, return_hidden=True, return_diagnostics=True)
    L, D = model.config.n_layers, model.config.d_model
    assert out.logits.shape == (B, N, model.config.vocab_size)
    assert out.hidden.shape == (L + 1, B, N, D)
    assert out.diagnostics["relative_residual"].shape == (L + 1,)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    # At init the model is close to uniform over the vocabulary (targets independent of inputs).
    assert abs(out.loss.item() - math.log(model.config.vocab_size)) < 0.5
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    plain = model(idx)
    assert isinstance(plain, FiberBundleOutput) and plain.loss is None and plain.hidden is None
    assert plain.weights is None and plain.diagnostics is None
    assert plain.logits.shape == (B, N, model.config.vocab_size)


@pytest.mark.parametrize("kw", ALL_VARIANTS, ids=_id)
def test_causal_no_future_leak(gen, kw):
    model = _model(**kw)
    idx = _idx(gen)
    t = 7
    idx2 = idx.clone()
    idx2[:, t:] = (idx2[:, t:] + 1 + torch.randint(0, 14, (B, N - t), generator=gen)) % 16
    a, b = model(idx).logits, model(idx2).logits
    torch.testing.assert_close(b[:, :t], a[:, :t], rtol=0, atol=1e-12)
    assert (b[:, t:] - a[:, t:]).abs().max() > 1e-6


def test_riemannian_with_zero_metric_factors_is_euclidean_plus_key_bias(gen):
    eu = _model(mode="euclidean")
    ri = _model(seed=1, mode="riemannian", attention=dict(rank=2, lam_init=1.0))
    missing, unexpected = ri.load_state_dict(eu.state_dict(), strict=False)
    assert not unexpected and all(".attn.metric." in m for m in missing)
    with torch.no_grad():
        for blk in ri.blocks:
            blk.attn.metric.proj.weight.zero_()  # U = 0, lam = 1
    x = torch.randn(B, N, ri.config.d_model, generator=gen, dtype=torch.float64)
    a_eu, a_ri = eu.blocks[0].attn, ri.blocks[0].attn
    d = ri.config.qk_dim
    _, k, _ = a_eu.project(x)
    bias = -0.5 * (k * k).sum(-1).unsqueeze(-2) / math.sqrt(d)  # (B, h, 1, n)
    gap = a_ri.scores(x) - (a_eu.scores(x) + bias)
    torch.testing.assert_close(gap, gap[..., :1].expand_as(gap))  # constant along each row: same softmax
    # The whole attention output: SDPA with that key bias and a causal mask.
    q, k, v = a_eu.project(x)
    mask = torch.full((N, N), float("-inf"), dtype=x.dtype).triu(1) + bias
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = a_eu.out_proj(ref.transpose(1, 2).reshape(B, N, -1))
    torch.testing.assert_close(a_ri(x)[0], ref)


def test_preconditioned_ffn_with_zero_factors_is_the_plain_ffn_scaled(gen):
    fb = _model(mode="fiber_bundle", precondition_ffn=True, eta_init=0.5,
                attention=dict(connection="trivial", lam_init=2.0))
    plain = _model(mode="fiber_bundle", precondition_ffn=False, attention=dict(connection="trivial", lam_init=2.0))
    plain.load_state_dict(fb.state_dict(), strict=False)
    blk, ref = fb.blocks[0], plain.blocks[0]
    with torch.no_grad():
        blk.ffn_metric.proj.weight.zero_()  # G_x = 2 I, eta = 0.5: the step is FFN / 4
    x = torch.randn(B, N, fb.config.d_model, generator=gen, dtype=torch.float64)
    y_att = x + ref.attn(ref.ln1(x))[0]
    torch.testing.assert_close(blk(x)[0], y_att + 0.25 * ref.mlp(ref.ln2(y_att)))


def test_preconditioned_ffn_is_a_dense_metric_solve(gen):
    fb = _model(mode="fiber_bundle", ffn_metric_rank=3, attention=dict(connection="flat"))
    blk = fb.blocks[1]
    x = torch.randn(B, N, fb.config.d_model, generator=gen, dtype=torch.float64)
    y = x + blk.attn(blk.ln1(x))[0]
    z = blk.ln2(y)
    lam, U = blk.ffn_metric(z)
    G = lam * torch.eye(fb.config.d_model, dtype=x.dtype) + U[:, 0] @ U[:, 0].transpose(-1, -2)  # (B, n, D, D)
    step = torch.linalg.solve(G, blk.mlp(z).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(blk(x)[0], y + blk.eta * step)


def test_diagnostics_values(gen):
    idx = _idx(gen)
    diags = {}
    for conn in CONNECTIONS:
        out = _model(mode="fiber_bundle", attention=dict(connection=conn))(idx, return_diagnostics=True)
        diags[conn] = out.diagnostics
        L, h = 2, 2
        for key in ("holonomy", "transport_closure", "metric_compatibility", "metric_heterogeneity", "lam"):
            assert out.diagnostics[key].shape == (L, h), (conn, key)
    for conn in ("trivial", "flat"):
        hol = diags[conn]["holonomy"]
        assert torch.equal(hol, torch.zeros_like(hol)), conn
    assert torch.equal(diags["trivial"]["transport_closure"], torch.zeros(2, 2, dtype=torch.float64))
    assert (diags["content"]["holonomy"] > 0).all() and (diags["content"]["transport_closure"] > 0).all()
    assert (diags["flat"]["transport_closure"] > 0).all()  # flat, yet far from the identity
    # the cumulative connection is flat too (zero up to float64 round-off), and content-dependent
    assert (diags["cumulative"]["holonomy"] < 1e-12).all() and (diags["cumulative"]["transport_closure"] > 0).all()
    # Relative to the heterogeneity |G_i - G_j|_F: exactly 1 without transport; heterogeneous
    # metrics are not preserved by any of these rotations (relative defect bounded away from 0).
    torch.testing.assert_close(diags["trivial"]["metric_compatibility"], torch.ones(2, 2, dtype=torch.float64))
    for conn in CONNECTIONS:
        assert (diags[conn]["metric_heterogeneity"] > 0).all(), conn
        assert (diags[conn]["metric_compatibility"] > 0.5).all(), conn
    # euclidean mode has no fibre geometry to report
    eu = _model(mode="euclidean")(idx, return_diagnostics=True).diagnostics
    assert set(eu) == {"relative_residual"}


def test_content_with_zero_rate_modulation_equals_flat(gen):
    flat = _model(mode="fiber_bundle", attention=dict(connection="flat"))
    content = _model(mode="fiber_bundle", attention=dict(connection="content", content_rate_std=0.0))
    missing, unexpected = content.load_state_dict(flat.state_dict(), strict=False)
    assert not unexpected and all(".attn.rates." in m for m in missing)
    idx = _idx(gen)
    torch.testing.assert_close(content(idx).logits, flat(idx).logits)


@pytest.mark.parametrize("stiefel", [True, False])
def test_stiefel_frames_at_init(stiefel):
    model = _model(dtype=torch.float32, n_layers=3, attention=dict(qk_init="orthonormal" if stiefel else "normal"))
    frames = model.qk_frame_parameters()
    cfg = model.config
    assert len(frames) == 2 * cfg.n_layers
    names = {id(p) for p in frames}
    assert all(id(p) in names for blk in model.blocks for p in (blk.attn.w_q, blk.attn.w_k))
    eye = torch.eye(cfg.qk_dim)
    for W in frames:
        assert W.shape == (cfg.n_heads, cfg.d_model, cfg.qk_dim)
        gram = W.transpose(-1, -2) @ W
        if stiefel:
            torch.testing.assert_close(gram, eye.expand_as(gram), rtol=0, atol=1e-5)  # float32 QR
        else:
            assert (gram - eye).abs().max() > 0.5


def test_parameter_counts_and_matched_width():
    for mode in MODES:
        cfg = rr.FiberBundleConfig.tiny(mode=mode)
        model = rr.FiberBundleTransformer(cfg)
        counts = rr.count_parameters(model)
        unique = {id(p): p.numel() for p in model.parameters()}
        assert counts["total"] == sum(unique.values()) == rr.count_parameters(cfg)["total"]
        assert counts["head"] == 0  # tied
        if mode == "euclidean":
            assert counts["metric"] == counts["connection"] == counts["ffn_metric"] == 0
    assert rr.count_parameters(rr.FiberBundleConfig.tiny(tie_weights=False))["head"] == 16 * 32
    eu = rr.FiberBundleConfig.small(mode="euclidean")
    fb = rr.FiberBundleConfig.small(mode="fiber_bundle")
    target = rr.count_parameters(eu)["total"]
    matched = rr.match_width(fb, target)
    gap = abs(rr.count_parameters(matched)["total"] - target)
    assert matched.d_model < fb.d_model and gap < abs(rr.count_parameters(fb)["total"] - target)
    flops = {m: rr.estimate_cost(rr.FiberBundleConfig.small(mode=m))["flops"]["total"]["total"] for m in MODES}
    assert flops["euclidean"] < flops["riemannian"] < flops["fiber_bundle"]


def test_generate(gen):
    model = _model(dtype=torch.float32, mode="fiber_bundle", block_size=16, attention=dict(connection="content"))
    idx = _idx(gen, n=5)
    out = model.generate(idx, 20, temperature=0.0)  # runs past block_size: context is cropped
    assert out.shape == (B, 25) and torch.equal(out[:, :5], idx)
    assert torch.equal(out, model.generate(idx, 20, temperature=0.0))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(model.generate(idx, 6, top_k=3, generator=g1), model.generate(idx, 6, top_k=3, generator=g2))


@pytest.mark.parametrize("kw, match", [
    (dict(d_model=30, n_heads=4), "divisible by n_heads"),
    (dict(d_model=36, n_heads=4, mode="fiber_bundle", attention=dict(connection="flat")), "must be even"),
    (dict(d_model=36, n_heads=4, mode="fiber_bundle", attention=dict(connection="content")), "must be even"),
    (dict(mode="hyperbolic"), "mode must be one of"),
    (dict(attention=dict(connection="levi-civita")), "attention: connection must be one of"),
    (dict(attention=dict(metric_side="both")), "metric_side must be one of"),
    (dict(attention=dict(rank=-1)), "rank must be an int >= 0"),
    (dict(metric_rank=2), r"metric_rank moved to attention: use attention=dict\(rank=2\)"),
    (dict(dropout=1.0), "dropout"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        rr.FiberBundleConfig.tiny(**kw)


def test_odd_head_dim_is_fine_without_rotations_and_input_errors(gen):
    rr.FiberBundleConfig.tiny(d_model=36, n_heads=4, mode="fiber_bundle", attention=dict(connection="trivial"))
    rr.FiberBundleConfig.tiny(d_model=36, n_heads=4, mode="riemannian")
    model = _model(dtype=torch.float32, mode="euclidean")  # learned positions: block_size of them
    with pytest.raises(ValueError, match="exceeds block_size = 32"):
        model(_idx(gen, n=40))
    rotary = _model(dtype=torch.float32, mode="fiber_bundle", attention=dict(connection="flat"))  # no table, same limit
    with pytest.raises(ValueError, match="exceeds block_size = 32"):
        rotary(_idx(gen, n=40))
    with pytest.raises(ValueError, match="idx must be"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"idx must hold token ids in \[0, vocab_size\)"):
        model(torch.full((2, 3), 16))
    with pytest.raises(ValueError, match="give exactly one of idx"):
        model()
    with pytest.raises(ValueError, match="targets must have shape"):
        model(_idx(gen), targets=_idx(gen, n=5))


# ------------------------------------------------------------------ save / load with the config

SAVE_VARIANTS = [dict(mode="euclidean"), dict(mode="fiber_bundle", attention=dict(connection="content")),
                 dict(mode="riemannian", tie_weights=False, attention=dict(metric="shared"))]


@pytest.mark.parametrize("kw", SAVE_VARIANTS, ids=_id)
def test_save_load_rebuilds_an_identical_model(gen, tmp_path, kw):
    model = _model(seed=3, dtype=torch.float32, **kw)
    path = tmp_path / "m.pt"
    model.save(path)
    torch.manual_seed(99)  # load builds a fresh model (another init), then overwrites every weight
    clone = rr.FiberBundleTransformer.load(path).eval()
    assert type(clone) is rr.FiberBundleTransformer and clone.config == model.config
    a, b = model.state_dict(), clone.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    idx = _idx(gen)
    assert torch.equal(clone(idx).logits, model(idx).logits)
    # the config the caller expects may be given: the same one is accepted
    again = rr.FiberBundleTransformer.load(path, config=model.config)
    assert torch.equal(again(idx).logits, model(idx).logits)
    # the file holds only plain values and tensors: torch's safe loader reads it
    blob = torch.load(path, weights_only=True)
    assert set(blob) == {"format", "config", "state_dict"} and blob["config"]["mode"] == kw["mode"]


def test_load_with_another_config_names_the_differing_fields(tmp_path):
    model = _model(seed=3, dtype=torch.float32, mode="riemannian", attention=dict(rank=2))
    path = tmp_path / "m.pt"
    model.save(path)
    other = model.config.replace(attention=dict(rank=3, lam_init=2.0))
    with pytest.raises(ValueError, match="saved with another config") as err:
        rr.FiberBundleTransformer.load(path, config=other)
    msg = str(err.value)
    assert "attention.rank: file 2, expected 3" in msg and "attention.lam_init: file 1.0, expected 2.0" in msg
    assert "d_model" not in msg and "mode" not in msg  # only the fields that differ
    assert str(path) in msg


def test_load_refuses_a_pickled_callable_without_calling_it(tmp_path):
    Boom.calls = 0
    path = tmp_path / "evil.pt"
    model = _model(dtype=torch.float32)
    torch.save({"format": "riemannian_ref.FiberBundleTransformer/1", "config": Boom(),
                "state_dict": model.state_dict()}, path)
    with pytest.raises(ValueError, match="not a readable riemannian_ref model file"):
        rr.FiberBundleTransformer.load(path)
    assert Boom.calls == 0
    assert "_helpers._boom" in payload_globals(path)  # the file carries the payload: the refusal is not vacuous
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps(Boom(), protocol=2))
    with pytest.raises(ValueError, match="not a readable"):
        rr.FiberBundleTransformer.load(plain)
    assert Boom.calls == 0


def test_load_refuses_foreign_or_mismatched_files(tmp_path):
    model = _model(dtype=torch.float32)
    torch.save(model.state_dict(), tmp_path / "sd.pt")  # a bare state dict
    with pytest.raises(ValueError, match="not a riemannian_ref model file"):
        rr.FiberBundleTransformer.load(tmp_path / "sd.pt")
    cfg = {**model.config.to_dict(), "n_layers": 3}  # weights of 2 layers under a 3-layer config
    torch.save({"format": "riemannian_ref.FiberBundleTransformer/4", "config": cfg,
                "state_dict": model.state_dict()}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="the weights do not match the saved config"):
        rr.FiberBundleTransformer.load(tmp_path / "bad.pt")
    torch.save({"format": "riemannian_ref.FiberBundleTransformer/1", "config": {"depth": 3},
                "state_dict": {}}, tmp_path / "unknown.pt")
    with pytest.raises(ValueError, match=r"unknown fields \['depth'\]"):
        rr.FiberBundleTransformer.load(tmp_path / "unknown.pt")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_runs_under_autocast_like_the_float32_model(gen, mode, dtype):
    """Float32 weights and int inputs under torch.autocast (the usual mixed precision): every mode runs, forward
    and backward, and stays within a few epsilons of the low dtype of the float32 model (regression: the metric
    modes refused the model's float32 lam next to the autocast queries). The attention computes in float32 and
    returns the autocast dtype, as SDPA does."""
    model = _model(dtype=torch.float32, mode=mode).train()
    idx = _idx(gen, n=16)
    key_mask = torch.ones(B, 16, dtype=torch.bool)
    key_mask[1, 12:] = False  # padding, with the models' causal mask
    ref = model(idx, idx, key_mask=key_mask)
    grads_ref = torch.autograd.grad(ref.loss, list(model.parameters()))
    with torch.autocast("cpu", dtype=dtype):
        out = model(idx, idx, key_mask=key_mask)
        h = model.blocks[0].attn(model._embed(idx, None))[0]
    assert out.logits.dtype == h.dtype == dtype
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    eps = torch.finfo(dtype).eps
    err = (out.logits.float() - ref.logits).abs().max() / ref.logits.abs().max()
    assert err <= 4 * eps, f"logits off by {err / eps:.1f} eps"
    for (name, p), a, b in zip(model.named_parameters(), grads, grads_ref):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        if b.norm() > 0:  # measured: below 2 eps for bfloat16, 7 eps for float16
            assert (a - b).norm() <= 16 * eps * b.norm(), f"{name}: {((a - b).norm() / b.norm() / eps):.1f} eps"
