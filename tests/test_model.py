"""FiberBundleTransformer: shapes, reductions, causality, diagnostics, persistence, config errors."""
import io
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import riemannian_ref as rr

B, N = 2, 12


def _model(seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    cfg = rr.FiberBundleConfig.tiny(**kw)
    return rr.FiberBundleTransformer(cfg).to(dtype).eval()


def _idx(gen, vocab=16, n=N):
    return torch.randint(0, vocab, (B, n), generator=gen)


ALL_VARIANTS = (
    [dict(mode="euclidean"), dict(mode="riemannian", metric_side="key"),
     dict(mode="riemannian", metric_side="query", metric_rank=0),
     dict(mode="riemannian", metric_side="mean", stiefel_qk=True)]
    + [dict(mode="fiber_bundle", connection=c, metric_side=s, precondition_ffn=p)
       for c, s, p in itertools.product(rr.CONNECTIONS, ("key", "query", "mean"), (True, False))]
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
    assert model(idx).shape == (B, N, model.config.vocab_size)


@pytest.mark.parametrize("kw", ALL_VARIANTS, ids=_id)
def test_causal_no_future_leak(gen, kw):
    model = _model(**kw)
    idx = _idx(gen)
    t = 7
    idx2 = idx.clone()
    idx2[:, t:] = (idx2[:, t:] + 1 + torch.randint(0, 14, (B, N - t), generator=gen)) % 16
    a, b = model(idx), model(idx2)
    torch.testing.assert_close(b[:, :t], a[:, :t], rtol=0, atol=1e-12)
    assert (b[:, t:] - a[:, t:]).abs().max() > 1e-6


def test_riemannian_with_zero_metric_factors_is_euclidean_plus_key_bias(gen):
    eu = _model(mode="euclidean")
    ri = _model(seed=1, mode="riemannian", metric_rank=2, lam_init=1.0)
    missing, unexpected = ri.load_state_dict(eu.state_dict(), strict=False)
    assert not unexpected and all(".attn.metric." in m for m in missing)
    with torch.no_grad():
        for blk in ri.blocks:
            blk.attn.metric.proj.weight.zero_()  # U = 0, lam = 1
    x = torch.randn(B, N, ri.config.d_model, generator=gen, dtype=torch.float64)
    a_eu, a_ri = eu.blocks[0].attn, ri.blocks[0].attn
    d = ri.config.head_dim
    _, k, _ = a_eu.project(x)
    bias = -0.5 * (k * k).sum(-1).unsqueeze(-2) / math.sqrt(d)  # (B, h, 1, n)
    gap = a_ri.scores(x) - (a_eu.scores(x) + bias)
    torch.testing.assert_close(gap, gap[..., :1].expand_as(gap))  # constant along each row: same softmax
    # The whole attention output: SDPA with that key bias and a causal mask.
    q, k, v = a_eu.project(x)
    mask = torch.full((N, N), float("-inf"), dtype=x.dtype).triu(1) + bias
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = a_eu.out_proj(ref.transpose(1, 2).reshape(B, N, -1))
    torch.testing.assert_close(a_ri(x), ref)


def test_preconditioned_ffn_with_zero_factors_is_the_plain_ffn_scaled(gen):
    fb = _model(mode="fiber_bundle", connection="trivial", precondition_ffn=True, lam_init=2.0, eta_init=0.5)
    plain = _model(mode="fiber_bundle", connection="trivial", precondition_ffn=False, lam_init=2.0)
    plain.load_state_dict(fb.state_dict(), strict=False)
    blk, ref = fb.blocks[0], plain.blocks[0]
    with torch.no_grad():
        blk.ffn_metric.proj.weight.zero_()  # G_x = 2 I, eta = 0.5: the step is FFN / 4
    x = torch.randn(B, N, fb.config.d_model, generator=gen, dtype=torch.float64)
    y_att = x + ref.attn(ref.ln1(x))
    torch.testing.assert_close(blk(x), y_att + 0.25 * ref.ffn(ref.ln2(y_att)))


def test_preconditioned_ffn_is_a_dense_metric_solve(gen):
    fb = _model(mode="fiber_bundle", connection="flat", ffn_metric_rank=3)
    blk = fb.blocks[1]
    x = torch.randn(B, N, fb.config.d_model, generator=gen, dtype=torch.float64)
    y = x + blk.attn(blk.ln1(x))
    z = blk.ln2(y)
    lam, U = blk.ffn_metric(z)
    G = lam * torch.eye(fb.config.d_model, dtype=x.dtype) + U[:, 0] @ U[:, 0].transpose(-1, -2)  # (B, n, D, D)
    step = torch.linalg.solve(G, blk.ffn(z).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(blk(x), y + blk.eta * step)


def test_diagnostics_values(gen):
    idx = _idx(gen)
    diags = {}
    for conn in rr.CONNECTIONS:
        out = _model(mode="fiber_bundle", connection=conn)(idx, return_diagnostics=True)
        diags[conn] = out.diagnostics
        L, h = 2, 2
        for key in ("holonomy", "torsion", "metric_compatibility", "lam"):
            assert out.diagnostics[key].shape == (L, h), (conn, key)
    for conn in ("trivial", "flat"):
        hol = diags[conn]["holonomy"]
        assert torch.equal(hol, torch.zeros_like(hol)), conn
    assert torch.equal(diags["trivial"]["torsion"], torch.zeros(2, 2, dtype=torch.float64))
    assert (diags["content"]["holonomy"] > 0).all() and (diags["content"]["torsion"] > 0).all()
    assert (diags["flat"]["torsion"] > 0).all()
    # Heterogeneous metrics are not preserved by any of these rotations.
    assert (diags["trivial"]["metric_compatibility"] > 0).all()
    # euclidean mode has no fibre geometry to report
    eu = _model(mode="euclidean")(idx, return_diagnostics=True).diagnostics
    assert set(eu) == {"relative_residual"}


def test_content_with_zero_rate_modulation_equals_flat(gen):
    flat = _model(mode="fiber_bundle", connection="flat")
    content = _model(mode="fiber_bundle", connection="content", content_rate_std=0.0)
    missing, unexpected = content.load_state_dict(flat.state_dict(), strict=False)
    assert not unexpected and all(".attn.rates." in m for m in missing)
    idx = _idx(gen)
    torch.testing.assert_close(content(idx), flat(idx))


@pytest.mark.parametrize("kw", [dict(mode="euclidean"), dict(mode="fiber_bundle", connection="content"),
                                dict(mode="riemannian", tie_weights=False)], ids=_id)
def test_save_load_round_trip_gives_identical_logits(gen, kw):
    model = _model(seed=3, dtype=torch.float32, **kw)
    buf = io.BytesIO()
    torch.save({"config": model.config.__dict__, "state": model.state_dict()}, buf)
    buf.seek(0)
    blob = torch.load(buf, weights_only=True)
    torch.manual_seed(99)  # a different init, overwritten by the load
    clone = rr.FiberBundleTransformer(rr.FiberBundleConfig(**blob["config"])).eval()
    clone.load_state_dict(blob["state"])
    idx = _idx(gen)
    assert torch.equal(clone(idx), model(idx))


@pytest.mark.parametrize("stiefel", [True, False])
def test_stiefel_frames_at_init(stiefel):
    model = _model(dtype=torch.float32, stiefel_qk=stiefel, n_layers=3)
    frames = model.qk_frame_parameters()
    cfg = model.config
    assert len(frames) == 2 * cfg.n_layers
    names = {id(p) for p in frames}
    assert all(id(p) in names for blk in model.blocks for p in (blk.attn.w_q, blk.attn.w_k))
    eye = torch.eye(cfg.head_dim)
    for W in frames:
        assert W.shape == (cfg.n_heads, cfg.d_model, cfg.head_dim)
        gram = W.transpose(-1, -2) @ W
        if stiefel:
            torch.testing.assert_close(gram, eye.expand_as(gram), rtol=0, atol=1e-5)  # float32 QR
        else:
            assert (gram - eye).abs().max() > 0.5


def test_parameter_counts_and_matched_width():
    for mode in rr.MODES:
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
    flops = {m: rr.estimate_flops(rr.FiberBundleConfig.small(mode=m))["total"] for m in rr.MODES}
    assert flops["euclidean"] < flops["riemannian"] < flops["fiber_bundle"]


def test_generate(gen):
    model = _model(dtype=torch.float32, mode="fiber_bundle", connection="content", block_size=16)
    idx = _idx(gen, n=5)
    out = model.generate(idx, 20, temperature=0.0)  # runs past block_size: context is cropped
    assert out.shape == (B, 25) and torch.equal(out[:, :5], idx)
    assert torch.equal(out, model.generate(idx, 20, temperature=0.0))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(model.generate(idx, 6, top_k=3, generator=g1), model.generate(idx, 6, top_k=3, generator=g2))


@pytest.mark.parametrize("kw, match", [
    (dict(d_model=30, n_heads=4), "divisible by n_heads"),
    (dict(d_model=36, n_heads=4, mode="fiber_bundle", connection="flat"), "must be even"),
    (dict(d_model=36, n_heads=4, mode="fiber_bundle", connection="content"), "must be even"),
    (dict(mode="hyperbolic"), "mode must be one of"),
    (dict(connection="levi-civita"), "connection must be one of"),
    (dict(metric_side="both"), "metric_side must be one of"),
    (dict(metric_rank=-1), "metric_rank"),
    (dict(dropout=1.0), "dropout"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        rr.FiberBundleConfig.tiny(**kw)


def test_odd_head_dim_is_fine_without_rotations_and_input_errors(gen):
    rr.FiberBundleConfig.tiny(d_model=36, n_heads=4, mode="fiber_bundle", connection="trivial")
    rr.FiberBundleConfig.tiny(d_model=36, n_heads=4, mode="riemannian")
    model = _model(dtype=torch.float32)
    with pytest.raises(ValueError, match="block_size"):
        model(_idx(gen, n=40))
    with pytest.raises(ValueError, match="idx"):
        model(torch.zeros(2, 3))
