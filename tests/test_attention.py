"""The blockwise Riemannian attention operator and its module.

Oracle: the dense definition ``riemannian_attention_reference``. The custom
backward is gradchecked in float64 on small sizes with blocks smaller than
the sequence, so tiles, online-softmax rescaling and causal block skipping
are all exercised.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import riemannian_ref as rr

F64 = torch.float64
SIDES = ["key", "query", "mean"]


def make(gen, side, per_token=True, B=2, h=2, nq=5, nk=7, d=3, r=2, dv=4, dtype=F64, rq=None):
    q = torch.randn(B, h, nq, d, generator=gen, dtype=dtype)
    k = torch.randn(B, h, nk, d, generator=gen, dtype=dtype)
    v = torch.randn(B, h, nk, dv, generator=gen, dtype=dtype)
    rq = r if rq is None else rq
    Uq = torch.randn(B, h, *((nq,) if per_token else ()), d, rq, generator=gen, dtype=dtype) * 0.7
    Uk = torch.randn(B, h, *((nk,) if per_token else ()), d, r, generator=gen, dtype=dtype) * 0.7
    lam = torch.rand(h, generator=gen, dtype=dtype) + 0.5
    return (q, k, v, Uq if side in ("query", "mean") else None, Uk if side in ("key", "mean") else None, lam)


def masks(gen, kind, nq, nk, B=2, h=2, dtype=F64):
    """None, a boolean mask with a fully masked row, an additive float mask, or causal."""
    if kind == "none":
        return None, False
    if kind == "causal":
        return None, True
    keep = torch.rand(B, 1, nq, nk, generator=gen) > 0.4
    keep[:, :, 1] = False  # a fully masked row
    keep[:, :, 0, 0] = True
    if kind == "bool":
        return keep, False
    return torch.zeros(B, 1, nq, nk, dtype=dtype).masked_fill(~keep, float("-inf")) + 0.3, False


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal"])
def test_forward_matches_reference_f64(gen, side, per_token, mask_kind):
    q, k, v, Uq, Uk, lam = make(gen, side, per_token)
    mask, causal = masks(gen, mask_kind, 5, 7)
    kw = dict(lam=lam, metric_side=side, attn_mask=mask, is_causal=causal)
    out = rr.riemannian_attention(q, k, v, Uq, Uk, block_sizes=(2, 3), **kw)
    ref = rr.riemannian_attention_reference(q, k, v, Uq, Uk, **kw)
    assert out.shape == (2, 2, 5, 4)
    torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-11)
    if mask_kind in ("bool", "float"):
        assert (out[:, :, 1] == 0).all()  # fully masked row: exactly 0


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "causal"])
def test_gradcheck(gen, side, per_token, mask_kind):
    """fast_mode gradcheck (random directions); one full Jacobian check follows."""
    B, h, nq, nk = 1, 2, 5, 6
    q, k, v, Uq, Uk, lam = make(gen, side, per_token, B=B, h=h, nq=nq, nk=nk, d=3, r=2, dv=2)
    mask, causal = masks(gen, mask_kind, nq, nk, B=B, h=h)
    inputs = [t.requires_grad_() for t in (q, k, v, lam) + tuple(U for U in (Uq, Uk) if U is not None)]

    def f(q, k, v, lam, *Us):
        Us = list(Us)
        Uq_ = Us.pop(0) if side in ("query", "mean") else None
        Uk_ = Us.pop(0) if side in ("key", "mean") else None
        return rr.riemannian_attention(q, k, v, Uq_, Uk_, lam=lam, metric_side=side, attn_mask=mask,
                                       is_causal=causal, block_sizes=(2, 4))

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)


def test_gradcheck_mixed_shared_and_per_token_mean(gen):
    """'mean' with a shared query metric and per-token key metrics, scalar lam, 3-dim input."""
    q = torch.randn(2, 4, 3, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(2, 5, 3, generator=gen, dtype=F64, requires_grad=True)
    v = torch.randn(2, 5, 2, generator=gen, dtype=F64, requires_grad=True)
    Uq = torch.randn(1, 3, 1, generator=gen, dtype=F64, requires_grad=True)  # shared, broadcast over batch
    Uk = torch.randn(2, 5, 3, 1, generator=gen, dtype=F64, requires_grad=True)
    lam = torch.tensor(0.8, dtype=F64, requires_grad=True)
    f = lambda q, k, v, Uq, Uk, lam: rr.riemannian_attention(  # noqa: E731
        q, k, v, Uq, Uk, lam=lam, metric_side="mean", block_sizes=(3, 2))
    assert torch.autograd.gradcheck(f, (q, k, v, Uq, Uk, lam), eps=1e-6, atol=1e-6, rtol=1e-5)  # full Jacobian
    ref = rr.riemannian_attention_reference(q, k, v, Uq, Uk, lam=lam, metric_side="mean")
    torch.testing.assert_close(f(q, k, v, Uq, Uk, lam), ref, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("side", SIDES)
def test_fully_masked_rows_have_zero_output_and_finite_gradients(gen, side):
    q, k, v, Uq, Uk, lam = make(gen, side, nq=4, nk=6)
    keep = torch.ones(4, 6, dtype=torch.bool)
    keep[2] = False
    leaves = [t.requires_grad_() for t in (q, k, v) + tuple(U for U in (Uq, Uk) if U is not None)]
    out = rr.riemannian_attention(q, k, v, Uq, Uk, lam=lam, metric_side=side, attn_mask=keep, block_sizes=(2, 4))
    assert (out[..., 2, :] == 0).all()
    out.square().sum().backward()
    for t in leaves:
        assert torch.isfinite(t.grad).all()
    assert (q.grad[..., 2, :] == 0).all()  # a dead row sends no gradient to its query


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "causal"])
def test_float32_forward_and_gradients_match_reference(gen, side, mask_kind):
    """Realistic sizes in float32, default block sizes (several tiles), against the dense reference."""
    B, h, nq, nk, d, r = 2, 2, 150, 200, 16, 3
    q, k, v, Uq, Uk, lam = make(gen, side, B=B, h=h, nq=nq, nk=nk, d=d, r=r, dv=8, dtype=torch.float32)
    q, k = q / 2, k / 2
    mask, causal = masks(gen, mask_kind, nq, nk, B=B, h=h, dtype=torch.float32)
    kw = dict(lam=lam, metric_side=side, attn_mask=mask, is_causal=causal)
    leaves = (q, k, v, lam) + tuple(U for U in (Uq, Uk) if U is not None)
    g = torch.randn(B, h, nq, 8, generator=gen)
    res = []
    for fn in (rr.riemannian_attention, rr.riemannian_attention_reference):
        ins = [t.detach().clone().requires_grad_() for t in leaves]
        Us = list(ins[4:])
        Uq_ = Us.pop(0) if side in ("query", "mean") else None
        Uk_ = Us.pop(0) if side in ("key", "mean") else None
        out = fn(ins[0], ins[1], ins[2], Uq_, Uk_, **{**kw, "lam": ins[3]})
        (out * g).sum().backward()
        res.append([out] + [t.grad for t in ins])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4 * b.abs().max().item())


def test_causal_with_more_queries_than_keys_is_top_left_aligned(gen):
    q, k, v, _, Uk, lam = make(gen, "key", nq=7, nk=4)
    out = rr.riemannian_attention(q, k, v, None, Uk, lam=lam, is_causal=True, block_sizes=(3, 2))
    keep = torch.ones(7, 4, dtype=torch.bool).tril()
    ref = rr.riemannian_attention_reference(q, k, v, None, Uk, lam=lam, attn_mask=keep)
    torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-11)


def test_euclidean_reduces_to_sdpa_with_key_bias(gen):
    """U = 0 and lam = 1: scores -|q - k|^2 / (2 tau) = SDPA plus the key bias -|k|^2/(2 tau)."""
    q, k, v, _, _, _ = make(gen, "key", nq=9, nk=11, d=8)
    tau = math.sqrt(8)
    bias = (-(k * k).sum(-1) / (2 * tau)).unsqueeze(-2)  # (B, h, 1, n_k)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    for U in (torch.zeros(2, 2, 11, 8, 3, dtype=F64), torch.zeros(2, 2, 11, 8, 0, dtype=F64)):
        out = rr.riemannian_attention(q, k, v, None, U, lam=1.0, block_sizes=(4, 4))
        torch.testing.assert_close(out, sdpa, rtol=1e-12, atol=1e-12)


def test_shared_metric_reduces_to_dot_product_form(gen):
    q, k, v, _, _, lam = make(gen, "key", nq=9, nk=11, d=8)
    U = torch.randn(2, 2, 8, 3, generator=gen, dtype=F64)
    Gq, key_bias = rr.dot_product_form(q, k, U, lam=lam)
    sdpa = F.scaled_dot_product_attention(Gq, k, v, attn_mask=key_bias, scale=1 / math.sqrt(8))
    out = rr.riemannian_attention(q, k, v, None, U, lam=lam)
    torch.testing.assert_close(out, sdpa, rtol=1e-12, atol=1e-12)


def test_batch_broadcasting_and_unbatched(gen):
    q, k, v, _, Uk, lam = make(gen, "key", B=1, h=3)
    Uk1 = Uk[:, :1]  # one metric set for all heads: broadcast over h
    out = rr.riemannian_attention(q, k, v, None, Uk1, lam=lam[:1].expand(3).contiguous() * 0 + 1.2)
    ref = rr.riemannian_attention_reference(q, k, v, None, Uk1, lam=1.2)
    torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-11)
    out2 = rr.riemannian_attention(q[0, 0], k[0, 0], v[0, 0], None, Uk[0, 0])  # no batch dims
    torch.testing.assert_close(out2, rr.riemannian_attention_reference(q[0, 0], k[0, 0], v[0, 0], None, Uk[0, 0]))


@pytest.mark.parametrize("bad, match", [
    (dict(v=torch.zeros(2, 2, 6, 4, dtype=F64)), "v must"),
    (dict(v=torch.zeros(2, 2, 7, 4)), "v has dtype"),
    (dict(Uk=torch.zeros(2, 2, 7, 4, 2, dtype=F64)), "U_k must"),
    (dict(attn_mask=torch.ones(5, 6, dtype=torch.bool)), "attn_mask"),
    (dict(attn_mask=torch.zeros(5, 7)), "attn_mask"),
    (dict(attn_mask=torch.ones(3, 2, 5, 7, dtype=torch.bool)), "attn_mask"),
    (dict(dropout_p=1.0), "dropout_p"),
    (dict(lam=-1.0), "lam"),
    (dict(scale=0.0), "scale"),
    (dict(metric_side="both"), "metric_side"),
])
def test_errors_name_the_argument(gen, bad, match):
    q, k, v, _, Uk, _ = make(gen, "key")
    kw = dict(v=v, Uk=Uk, lam=1.0, attn_mask=None, dropout_p=0.0, scale=None, metric_side="key")
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        rr.riemannian_attention(q, k, kw["v"], None, kw["Uk"], lam=kw["lam"], attn_mask=kw["attn_mask"],
                                dropout_p=kw["dropout_p"], scale=kw["scale"], metric_side=kw["metric_side"])


def test_causal_and_mask_together_is_an_error(gen):
    q, k, v, _, Uk, _ = make(gen, "key")
    with pytest.raises(ValueError, match="attn_mask or is_causal"):
        rr.riemannian_attention(q, k, v, None, Uk, attn_mask=torch.ones(5, 7, dtype=torch.bool), is_causal=True)


def test_dropout_goes_through_the_reference_path(gen):
    """dropout_p > 0: seeded runs equal the dense reference; the mean over masks approaches p = 0."""
    q, k, v, _, Uk, lam = make(gen, "key", nq=4, nk=6)
    torch.manual_seed(0)
    a = rr.riemannian_attention(q, k, v, None, Uk, lam=lam, dropout_p=0.3)
    torch.manual_seed(0)
    b = rr.riemannian_attention_reference(q, k, v, None, Uk, lam=lam, dropout_p=0.3)
    torch.testing.assert_close(a, b)
    torch.manual_seed(1)
    mean = torch.stack([rr.riemannian_attention(q, k, v, None, Uk, lam=lam, dropout_p=0.3) for _ in range(400)]).mean(0)
    exact = rr.riemannian_attention(q, k, v, None, Uk, lam=lam)
    assert (mean - exact).abs().max() < 0.25  # unbiased: 1/(1-p) rescaling


def test_autocast_bf16_runs_in_float32(gen):
    q, k, v, _, Uk, lam = make(gen, "key", dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = rr.riemannian_attention(q.bfloat16(), k, v, None, Uk, lam=lam.bfloat16())
    assert out.dtype == torch.float32
    ref = rr.riemannian_attention_reference(q.bfloat16().float(), k, v, None, Uk, lam=lam.bfloat16().float())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out16 = rr.riemannian_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, Uk.bfloat16())
    assert out16.dtype == torch.bfloat16  # no autocast: computed in float32, returned in the input dtype


# ------------------------------------------------------------------ the module

def cfg(**kw):
    base = dict(d_model=16, n_heads=2, rank=2)
    base.update(kw)
    return rr.RiemannianAttentionConfig(**base)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("shared", [False, True])
def test_module_matches_reference_and_returns_weights(side, shared):
    torch.manual_seed(0)
    m = rr.RiemannianMultiheadAttention(cfg(metric_side=side, shared_metric=shared, learn_temperature=True))
    with torch.no_grad():
        m.log_temp.fill_(0.3)
    x = torch.randn(3, 10, 16)
    y = torch.randn(3, 7, 16)  # cross-attention, n_q != n_k
    kpm = torch.zeros(3, 7, dtype=torch.bool)
    kpm[0, 4:] = True
    out, A = m(x, y, key_padding_mask=kpm)
    assert A is None and out.shape == (3, 10, 16)
    out2, A2 = m(x, y, key_padding_mask=kpm, need_weights=True)
    torch.testing.assert_close(out, out2, rtol=1e-5, atol=1e-5)
    assert A2.shape == (3, 2, 10, 7)
    torch.testing.assert_close(A2.sum(-1), torch.ones(3, 2, 10))
    assert (A2[0, :, :, 4:] == 0).all()
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters() if p.requires_grad)


def test_module_rank0_equals_sdpa_with_key_bias():
    torch.manual_seed(1)
    m = rr.RiemannianMultiheadAttention(cfg(rank=0)).double()
    with torch.no_grad():  # lam = 1 exactly in float64 (the float32 init rounds)
        m.metric_k.rho.fill_(math.log(math.expm1(1.0 - m.cfg.lam_min)))
    x = torch.randn(2, 9, 16, dtype=F64)
    out, _ = m(x, is_causal=True)
    B, n, h, d = 2, 9, 2, 8
    q = m.q_proj(x).view(B, n, h, d).transpose(1, 2)
    k = m.k_proj(x).view(B, n, h, d).transpose(1, 2)
    v = m.v_proj(x).view(B, n, h, d).transpose(1, 2)
    lam = m._lam().view(1, h, 1, 1)
    torch.testing.assert_close(lam, torch.ones_like(lam))  # lam_init = 1
    bias = -(k * k).sum(-1).unsqueeze(-2) / (2 * math.sqrt(d))
    causal = torch.zeros(n, n, dtype=F64).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias + causal)
    ref = m.out_proj(o.transpose(1, 2).reshape(B, n, 16))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_module_shared_metric_equals_dot_product_form():
    torch.manual_seed(2)
    m = rr.RiemannianMultiheadAttention(cfg(shared_metric=True, rank=3)).double()
    x = torch.randn(2, 9, 16, dtype=F64)
    out, _ = m(x)
    B, n, h, d = 2, 9, 2, 8
    q = m.q_proj(x).view(B, n, h, d).transpose(1, 2)
    k = m.k_proj(x).view(B, n, h, d).transpose(1, 2)
    v = m.v_proj(x).view(B, n, h, d).transpose(1, 2)
    lam, _, U = m.metrics(x, x)
    Gq, key_bias = rr.dot_product_form(q, k, U, lam=lam)
    o = F.scaled_dot_product_attention(Gq, k, v, attn_mask=key_bias, scale=1 / math.sqrt(d))
    torch.testing.assert_close(out, m.out_proj(o.transpose(1, 2).reshape(B, n, 16)), rtol=1e-10, atol=1e-10)


def test_module_cross_attention_metric_comes_from_each_side():
    torch.manual_seed(3)
    m = rr.RiemannianMultiheadAttention(cfg(metric_side="mean", kv_dim=12))
    x, y = torch.randn(2, 5, 16), torch.randn(2, 8, 12)
    lam, U_q, U_k = m.metrics(x, y)
    assert U_q.shape == (2, 2, 5, 8, 2) and U_k.shape == (2, 2, 8, 8, 2)
    out, _ = m(x, y)
    assert out.shape == (2, 5, 16)
    with pytest.raises(ValueError, match="key must"):
        m(x, torch.randn(2, 8, 16))


def test_module_errors():
    with pytest.raises(ValueError, match="divisible"):
        rr.RiemannianMultiheadAttention(cfg(d_model=15))
    m = rr.RiemannianMultiheadAttention(cfg())
    with pytest.raises(ValueError, match="query must"):
        m(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(torch.randn(2, 5, 16), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))


def test_compiled_model_runs_and_matches():
    """torch.compile (dynamo, graph break around the operator) gives the eager result and gradients.

    The "eager" backend keeps this test fast; what can break is dynamo tracing the module.
    """
    torch.manual_seed(4)
    m = rr.RiemannianMultiheadAttention(cfg())
    x = torch.randn(2, 6, 16)
    cm = torch.compile(m, backend="eager", fullgraph=False)  # dynamo tracing; inductor: see the docstring
    out, _ = cm(x, is_causal=True)
    ref, _ = m(x, is_causal=True)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    g = m.q_proj.weight.grad.clone()
    m.zero_grad()
    ref.sum().backward()
    torch.testing.assert_close(g, m.q_proj.weight.grad)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("block_sizes", [None, (3, 4)])
def test_float32_rows_whose_scores_are_all_far_below_zero(is_causal, block_sizes):
    """Regression: every score < -88 overflowed the online-softmax rescaling in float32 (NaN)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 12, 8, generator=g) + 6.0
    k = torch.randn(2, 2, 12, 8, generator=g) - 6.0  # |q - k|^2 ~ 1200: scores ~ -200
    v = torch.randn(2, 2, 12, 5, generator=g)
    U = torch.randn(2, 2, 12, 8, 2, generator=g)
    S = rr.riemannian_scores(q, k, U_k=U)
    assert S.max() < -88
    q.requires_grad_(True)
    out = rr.riemannian_attention(q, k, v, U_k=U, is_causal=is_causal, block_sizes=block_sizes)
    ref = rr.riemannian_attention_reference(q, k, v, U_k=U, is_causal=is_causal)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    (g_out,) = torch.autograd.grad(out.sum(), q)
    (g_ref,) = torch.autograd.grad(ref.sum(), q)
    assert torch.isfinite(g_out).all()
    torch.testing.assert_close(g_out, g_ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("mask_kind", ["bool", "float", "causal"])
def test_float32_default_blocks_with_online_rescaling(gen, mask_kind):
    """Default blocks, several key blocks (online rescaling), float32, against the reference."""
    B, h, nq, nk, d, r = 1, 2, 300, 600, 8, 1
    q, k, v, _, Uk, lam = make(gen, "key", B=B, h=h, nq=nq, nk=nk, d=d, r=r, dv=4, dtype=torch.float32)
    assert rr.attention_block_sizes(nq, nk, 1 + r)[1] < nk
    mask, causal = masks(gen, mask_kind, nq, nk, B=B, h=h, dtype=torch.float32)
    kw = dict(lam=lam, attn_mask=mask, is_causal=causal)
    q.requires_grad_(True)
    Uk.requires_grad_(True)
    out = rr.riemannian_attention(q, k, v, None, Uk, **kw)
    ref = rr.riemannian_attention_reference(q, k, v, None, Uk, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    g = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad((out * g).sum(), (q, Uk))
    grads_ref = torch.autograd.grad((ref * g).sum(), (q, Uk))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * b.abs().max().item())


def test_block_size_rules_and_errors(gen):
    # tiles of at most about 2**17 products per batch element, key blocks a multiple of 64
    for n, width in [(512, 2), (4096, 9), (1000, 5)]:
        bq, bk = rr.attention_block_sizes(n, n, width)
        assert bq * bk * width <= 1.5 * 2 ** 17 and bk % 64 == 0 and bk < n
    assert rr.attention_block_sizes(1000, 1000, 17)[1] == 64  # the floor of 64 keys per block
    assert rr.attention_block_sizes(40, 30, 3) == (40, 30)  # small problems: one tile
    with pytest.raises(ValueError, match="width must be a positive int"):
        rr.attention_block_sizes(8, 8, 0)
    with pytest.raises(ValueError, match="n_k must be a positive int"):
        rr.attention_block_sizes(8, 8.0, 2)
    q, k, v, _, Uk, lam = make(gen, "key")
    for bad in [(2,), (0, 3), (2.0, 3), "23", (True, 3)]:
        with pytest.raises(ValueError, match="block_sizes must be a pair of positive ints"):
            rr.riemannian_attention(q, k, v, None, Uk, block_sizes=bad)


def test_no_keys_is_a_clear_error(gen):
    q = torch.randn(2, 3, 4, generator=gen)
    k, v, U = torch.randn(2, 0, 4), torch.randn(2, 0, 5), torch.randn(2, 0, 4, 1)
    for fn in (rr.riemannian_attention, rr.riemannian_attention_reference):
        with pytest.raises(ValueError, match="k must hold at least one key"):
            fn(q, k, v, None, U)
