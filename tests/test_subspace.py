"""Metric factors in a shared subspace (``SubspaceFactors``) and the exact SDPA routes of the dispatch.

Oracle: the dense float64 reference ``riemannian_attention_reference`` with the
factors multiplied out, ``U_j = B C_j``. Checked:

- the lift itself: one dot product of width ``d + m(m+1)/2 + 1`` (``"mean"``
  with both sides in subspaces: ``d + m + m(m+1)/2 + m(m+1)/2 + 1``) gives the
  scores up to row constants, and the score rank stays below the width
  (equal to it for generic inputs);
- ``riemannian_attention`` with ``SubspaceFactors``: values and the gradients
  of query, key, value, basis, coefficients, ``lam`` and a float mask, every
  metric side, masks (bool with a fully masked row, float, causal, both),
  grouped-query attention, half precision and autocast, ``gradcheck`` on
  small sizes, ``torch.compile(fullgraph=True)``;
- the dispatch: subspace calls run on SDPA, not on the operator; dropout,
  per-token factors on the other side and forced backends multiply the
  factors out; the three exact routes of calls without per-token factors
  (the operator, SDPA with the key term as a float mask, SDPA on lifted
  inputs) equal the reference; bad input raises a ValueError naming it;
- the module path: ``MetricNet(subspace=m)``, ``AttentionConfig.subspace``
  and ``FiberBundleConfig(attention=dict(subspace=m))`` give the same outputs and
  gradients as the same metric given as dense per-token factors to the
  blockwise operator.
"""
import contextlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

import riemannian_ref as rr
from riemannian_ref.attention import _blockwise, functional

F64 = torch.float64
SIDES = ["key", "query", "mean"]


def subspace(gen, batch, n, d, m, r, dtype=F64, s=0.7):
    """SubspaceFactors with one basis per head ([1, h, d, m]) and per-token coefficients."""
    return rr.SubspaceFactors(torch.randn(1, *batch[1:], d, m, generator=gen, dtype=dtype),
                              s * torch.randn(*batch, n, m, r, generator=gen, dtype=dtype))


def make(gen, side, B=2, h=2, nq=6, nk=7, d=5, m=2, r=3, dv=4, dtype=F64):
    q = torch.randn(B, h, nq, d, generator=gen, dtype=dtype)
    k = torch.randn(B, h, nk, d, generator=gen, dtype=dtype)
    v = torch.randn(B, h, nk, dv, generator=gen, dtype=dtype)
    Sq = subspace(gen, (B, h), nq, d, m, r, dtype) if side in ("query", "mean") else None
    Sk = subspace(gen, (B, h), nk, d, m, r, dtype) if side in ("key", "mean") else None
    lam = torch.rand(h, generator=gen, dtype=dtype) + 0.5
    return q, k, v, Sq, Sk, lam


def dense(U):
    return U.dense() if isinstance(U, rr.SubspaceFactors) else U


def masks(gen, kind, nq, nk, B=2):
    """(attn_mask, is_causal): none, bool with a fully masked row, float, causal, bool + causal."""
    if kind in ("none", "causal"):
        return None, kind == "causal"
    keep = torch.rand(B, 1, nq, nk, generator=gen) > 0.4
    keep[..., 0] = True
    keep[:, :, 1] = False  # a row that sees no key
    if kind == "float":
        return torch.randn(B, 1, nq, nk, generator=gen, dtype=F64).masked_fill(~keep, float("-inf")), False
    return keep, kind == "bool+causal"


def leaves_of(*ts):
    out = []
    for t in ts:
        if isinstance(t, rr.SubspaceFactors):
            out += [t.basis, t.coef]
        elif isinstance(t, torch.Tensor) and t.is_floating_point():
            out.append(t)
    return out


# ----------------------------------------------------------------------------------------------- the lift
@pytest.mark.parametrize("side", SIDES)
def test_the_lifted_dot_product_is_the_score_up_to_row_constants(gen, side):
    q, k, _, Sq, Sk, lam = make(gen, side, nq=9, nk=11, d=6, m=3)
    lam_t = lam  # validated form: a tensor broadcasting to the batch
    qa, ka = functional._subspace_lift(q, k, Sq, Sk, lam_t, side)
    T = 3 * 4 // 2
    want = {"key": 6 + T + 1, "query": 6 + T + 1, "mean": 6 + 3 + 2 * T + 1}[side]
    assert qa.shape[-1] == ka.shape[-1] == want
    S = rr.riemannian_scores(q, k, dense(Sq), dense(Sk), lam=lam, metric_side=side)
    lifted = (qa @ ka.transpose(-1, -2)) / 6 ** 0.5
    shift = S - lifted  # a constant along each row
    torch.testing.assert_close(shift, shift[..., :1].expand_as(shift), rtol=0, atol=1e-12)


def test_lift_with_a_shared_factor_on_the_other_side(gen):
    """"mean" with a subspace on the key side and one shared factor on the query side: it joins M."""
    q, k, _, _, Sk, lam = make(gen, "key")
    W = 0.5 * torch.randn(1, 2, 5, 3, generator=gen, dtype=F64)
    qa, ka = functional._subspace_lift(q, k, W, Sk, lam, "mean")
    assert qa.shape[-1] == 5 + 3 + 1
    S = rr.riemannian_scores(q, k, W, Sk.dense(), lam=lam, metric_side="mean")
    shift = S - (qa @ ka.transpose(-1, -2)) / 5 ** 0.5
    torch.testing.assert_close(shift, shift[..., :1].expand_as(shift), rtol=0, atol=1e-12)


@pytest.mark.parametrize("d, m, r", [(4, 1, 1), (5, 2, 1), (6, 3, 2), (6, 6, 1)])
def test_score_rank_is_at_most_the_width_and_generically_equal(gen, d, m, r):
    """Row-centred scores (what the softmax sees) have rank d + m(m+1)/2 + 1 at most, attained; r does not matter."""
    width = d + m * (m + 1) // 2 + 1
    n = width + 10
    q, k = torch.randn(n, d, generator=gen, dtype=F64), torch.randn(n, d, generator=gen, dtype=F64)
    S_ = rr.SubspaceFactors(torch.randn(d, m, generator=gen, dtype=F64), torch.randn(n, m, r, generator=gen,
                                                                                     dtype=F64))
    S = rr.riemannian_scores(q, k, None, S_.dense(), lam=0.8)
    P = torch.eye(n, dtype=F64) - 1.0 / n  # removes row constants
    assert rr.numerical_rank(S @ P) == width
    full = width + (1 if m < d else 0)  # the row term q^T M q needs a column unless B spans R^d
    assert rr.numerical_rank(S) == full
    if m == d:  # Theorem 1's one-sided bound, d(d+1)/2 + d + 1
        assert full == rr.score_rank_bound(d, "key")


# --------------------------------------------------------------------------- the call against the reference
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal", "bool+causal"])
def test_values_and_gradients_equal_the_reference(gen, side, mask_kind):
    q, k, v, Sq, Sk, lam = make(gen, side)
    mask, causal = masks(gen, mask_kind, 6, 7)
    leaves = leaves_of(q, k, v, Sq, Sk, lam, mask)
    for t in leaves:
        t.requires_grad_()
    kw = dict(is_causal=causal, lam=lam, metric_side=side)
    out = rr.riemannian_attention(q, k, v, mask, U_q=Sq, U_k=Sk, **kw)
    ref = rr.riemannian_attention_reference(q, k, v, mask, U_q=dense(Sq), U_k=dense(Sk), **kw)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    if mask_kind in ("bool", "bool+causal"):
        assert (out[:, :, 1] == 0).all()
    w = torch.randn(out.shape, generator=gen, dtype=F64)
    grads = torch.autograd.grad((out * w).sum(), leaves, allow_unused=True)
    grads_ref = torch.autograd.grad((ref * w).sum(), leaves, allow_unused=True)
    for a, b in zip(grads, grads_ref):
        assert a is not None and torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("side", SIDES)
def test_gradcheck(gen, side):
    q, k, v, Sq, Sk, lam = make(gen, side, B=1, h=2, nq=4, nk=5, d=3, m=2, r=2, dv=2)
    mask = torch.rand(1, 1, 4, 5, generator=gen) > 0.3
    mask[..., 0] = True
    flat = leaves_of(q, k, v, Sq, Sk, lam)

    def f(*ts):
        it = iter(ts)
        q_, k_, v_ = next(it), next(it), next(it)
        Sq_ = rr.SubspaceFactors(next(it), next(it)) if Sq is not None else None
        Sk_ = rr.SubspaceFactors(next(it), next(it)) if Sk is not None else None
        return rr.riemannian_attention(q_, k_, v_, mask, is_causal=True, U_q=Sq_, U_k=Sk_, lam=next(it),
                                       metric_side=side)

    assert torch.autograd.gradcheck(f, [t.clone().requires_grad_() for t in flat])


@pytest.mark.parametrize("factor_heads", ["key_heads", "query_heads"])
def test_gqa_equals_explicitly_repeated_kv_heads(gen, factor_heads):
    B, hk, g, nq, nk, d, m, r = 2, 2, 3, 5, 6, 4, 2, 2
    hq = hk * g
    q = torch.randn(B, hq, nq, d, generator=gen, dtype=F64)
    k, v = (torch.randn(B, hk, nk, d, generator=gen, dtype=F64) for _ in range(2))
    h = hk if factor_heads == "key_heads" else hq
    Sk = rr.SubspaceFactors(torch.randn(1, h, d, m, generator=gen, dtype=F64),
                            0.6 * torch.randn(B, h, nk, m, r, generator=gen, dtype=F64))
    lam = torch.rand(hq, generator=gen, dtype=F64) + 0.5
    keep = torch.rand(B, 1, nq, nk, generator=gen) > 0.3
    leaves = leaves_of(q, k, v, Sk, lam)
    for t in leaves:
        t.requires_grad_()
    out = rr.riemannian_attention(q, k, v, keep, is_causal=True, U_k=Sk, lam=lam, enable_gqa=True)
    rep = (lambda t, dim: t.repeat_interleave(g, dim)) if factor_heads == "key_heads" else (lambda t, dim: t)
    ref = rr.riemannian_attention_reference(q, k.repeat_interleave(g, -3), v.repeat_interleave(g, -3), keep,
                                            is_causal=True, U_k=rep(Sk.dense(), -4), lam=lam)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(out.shape, generator=gen, dtype=F64)
    for a, b in zip(torch.autograd.grad((out * w).sum(), leaves), torch.autograd.grad((ref * w).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("side", SIDES)
def test_half_precision_is_computed_in_float32(gen, dtype, side):
    q, k, v, Sq, Sk, lam = make(gen, side, dtype=dtype)
    ins = [q, k, v, Sq, Sk, lam]
    leaves = leaves_of(*ins)
    for t in leaves:
        t.requires_grad_()
    out = rr.riemannian_attention(q, k, v, is_causal=True, U_q=Sq, U_k=Sk, lam=lam, metric_side=side)
    assert out.dtype == dtype
    grads = torch.autograd.grad(out.float().square().sum(), leaves)
    assert all(g_.dtype == dtype and torch.isfinite(g_).all() for g_ in grads)
    ins = [t.detach() if isinstance(t, torch.Tensor) else
           rr.SubspaceFactors(t.basis.detach(), t.coef.detach()) if t is not None else None for t in ins]
    up = [rr.SubspaceFactors(t.basis.double(), t.coef.double()) if isinstance(t, rr.SubspaceFactors)
          else t.double() if t is not None else None for t in ins]
    ref = rr.riemannian_attention_reference(up[0], up[1], up[2], is_causal=True, U_q=dense(up[3]),
                                            U_k=dense(up[4]), lam=up[5], metric_side=side)
    # inputs rounded to the dtype are exact in float64; the error is float32's plus the output's rounding
    tol = torch.finfo(dtype).eps * ref.abs() + 1e-4 * (1 + ref.abs().max())
    assert ((out.double() - ref).abs() <= tol).all()
    with functional._force_backend("blockwise"):
        blk = rr.riemannian_attention(q, k, v, is_causal=True, U_q=Sq, U_k=Sk, lam=lam, metric_side=side)
    assert blk.dtype == dtype


def test_autocast_mixed_precisions_give_the_autocast_dtype(gen):
    q, k, v, _, Sk, lam = make(gen, "key", dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = rr.riemannian_attention(q.bfloat16(), k, v, U_k=Sk, lam=lam)
    assert out.dtype == torch.bfloat16
    ref = rr.riemannian_attention_reference(q.bfloat16().double(), k.double(), v.double(), U_k=Sk.dense().double(),
                                            lam=lam.double())
    assert (out.double() - ref).abs().max() < 2e-2


def test_compile_fullgraph_equals_eager(gen):
    q, k, v, _, Sk, lam = make(gen, "key")
    leaves = leaves_of(q, k, v, Sk)
    for t in leaves:
        t.requires_grad_()
    f = lambda q, k, v, B, C: rr.riemannian_attention(q, k, v, is_causal=True, lam=lam,  # noqa: E731
                                                      U_k=rr.SubspaceFactors(B, C))
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    ref = rr.riemannian_attention_reference(q, k, v, is_causal=True, lam=lam, U_k=Sk.dense())
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out.sum(), leaves), torch.autograd.grad(ref.sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


# ------------------------------------------------------------------------------------------- the dispatch
@pytest.fixture
def spy(monkeypatch):
    """Records 'sdpa' and 'operator' as the call reaches SDPA or the blockwise operator."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.append("sdpa") or sdpa(*a, **kw))
    real = _blockwise.blockwise_operator
    monkeypatch.setattr(functional, "blockwise_operator", lambda *a, **kw: seen.append("operator") or real(*a, **kw))
    return seen


def test_subspace_calls_run_on_sdpa_and_others_multiply_out(gen, spy, monkeypatch):
    q, k, v, Sq, Sk, lam = make(gen, "mean")
    tok = 0.5 * torch.randn(2, 2, 6, 5, 3, generator=gen, dtype=F64)
    cases = [(dict(U_k=Sk), "sdpa", None), (dict(U_q=Sq, metric_side="query"), "sdpa", None),
             (dict(U_q=Sq, U_k=Sk, metric_side="mean"), "sdpa", None),
             (dict(U_q=tok, U_k=Sk, metric_side="mean"), "operator", None),
             (dict(U_k=Sk), "operator", "blockwise")]
    for kw, want, forced in cases:
        spy.clear()
        with functional._force_backend(forced) if forced else contextlib.nullcontext():
            out = rr.riemannian_attention(q, k, v, is_causal=True, lam=lam, **kw)
        assert want in spy and ("operator" if want == "sdpa" else "sdpa") not in spy, kw
        ref = rr.riemannian_attention_reference(q, k, v, is_causal=True, lam=lam,
                                                **{n: dense(t) if n.startswith("U") else t for n, t in kw.items()})
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # the table says where subspace calls go: "operator" multiplies the factors out
    monkeypatch.setitem(functional._EXACT_ROUTES, "cpu", {"no_factor": "sdpa_lifted", "subspace": "operator"})
    spy.clear()
    rr.riemannian_attention(q, k, v, U_k=Sk, lam=lam)
    assert spy == ["operator"]


def test_dropout_takes_the_reference_with_the_factors_multiplied_out(gen, monkeypatch):
    q, k, v, _, Sk, lam = make(gen, "key")
    seen = []
    real = functional._reference_attention
    monkeypatch.setattr(functional, "_reference_attention", lambda *a, **kw: seen.append(a[8]) or real(*a, **kw))
    torch.manual_seed(0)
    rr.riemannian_attention(q, k, v, dropout_p=0.3, U_k=Sk, lam=lam)
    assert len(seen) == 1 and torch.equal(seen[0], Sk.dense())


def test_forced_sdpa_routes_refuse_what_they_cannot_compute(gen):
    q, k, v, _, Sk, lam = make(gen, "key")
    tok = torch.randn(2, 2, 7, 5, 2, generator=gen, dtype=F64)
    with functional._force_backend("sdpa_bias"):
        with pytest.raises(RuntimeError, match="not a per-key bias"):
            rr.riemannian_attention(q, k, v, U_k=Sk)
        with pytest.raises(RuntimeError, match="per-token factors"):
            rr.riemannian_attention(q, k, v, U_k=tok)
    with functional._force_backend("sdpa_lifted"):
        with pytest.raises(RuntimeError, match="dropout_p > 0"):
            rr.riemannian_attention(q, k, v, dropout_p=0.1, U_k=Sk)
    with pytest.raises(ValueError, match="backend must be"):
        with functional._force_backend("sdpa"):
            pass


ROUTES = ["blockwise", "sdpa_bias", "sdpa_lifted"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("factor", ["none", "shared_key", "shared_mean"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal", "bool+causal"])
def test_the_three_exact_routes_of_one_metric_equal_the_reference(gen, route, factor, mask_kind):
    """G = lam I or one shared metric: the operator, SDPA + key-term mask, SDPA on lifted inputs; values, grads."""
    q, k, v, _, _, lam = make(gen, "key")
    W = 0.6 * torch.randn(2, 2, 5, 2, generator=gen, dtype=F64)
    kw = {"none": {}, "shared_key": dict(U_k=W), "shared_mean": dict(U_q=W, U_k=W.flip(0), metric_side="mean")}
    kw = kw[factor]
    mask, causal = masks(gen, mask_kind, 6, 7)
    leaves = leaves_of(q, k, v, lam, mask, *kw.values())
    for t in leaves:
        t.requires_grad_()
    with functional._force_backend(route):
        out = rr.riemannian_attention(q, k, v, mask, is_causal=causal, lam=lam, **kw)
    ref = rr.riemannian_attention_reference(q, k, v, mask, is_causal=causal, lam=lam, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(out.shape, generator=gen, dtype=F64)
    for a, b in zip(torch.autograd.grad((out * w).sum(), leaves), torch.autograd.grad((ref * w).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_exact_routes_in_half_precision_and_gqa(gen, route, dtype):
    B, hk, g, nq, nk, d = 2, 2, 2, 5, 6, 4
    q = torch.randn(B, hk * g, nq, d, generator=gen).to(dtype)
    k, v = (torch.randn(B, hk, nk, d, generator=gen).to(dtype) for _ in range(2))
    lam = (torch.rand(hk, generator=gen) + 0.5).to(dtype)
    with functional._force_backend(route):
        out = rr.riemannian_attention(q, k, v, is_causal=True, lam=lam, enable_gqa=True)
    assert out.dtype == dtype
    ref = rr.riemannian_attention_reference(q.double(), k.double().repeat_interleave(g, -3),
                                            v.double().repeat_interleave(g, -3), is_causal=True,
                                            lam=lam.double().repeat_interleave(g))
    assert (out.double() - ref).abs().max() < 4 * torch.finfo(dtype).eps * (1 + ref.abs().max())


def test_the_route_table_is_read_per_device(monkeypatch, gen, spy):
    q, k, v, _, _, lam = make(gen, "key")
    assert functional._exact_route("cpu", "no_factor") in ("sdpa_lifted", "sdpa_bias", "operator")
    assert functional._exact_route("xpu", "subspace") == "sdpa_lifted"  # not listed: SDPA on lifted inputs
    monkeypatch.setitem(functional._EXACT_ROUTES, "cpu", {"no_factor": "operator", "subspace": "sdpa_lifted"})
    out = rr.riemannian_attention(q, k, v, lam=lam)
    assert spy == ["operator"]
    torch.testing.assert_close(out, rr.riemannian_attention_reference(q, k, v, lam=lam), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad, match", [
    (lambda S: dict(U_k=rr.SubspaceFactors(S.basis[..., :4, :], S.coef)),
     r"U_k\.basis must have shape \[\.\.\., d, m\]"),
    (lambda S: dict(U_k=rr.SubspaceFactors(S.basis[0], S.coef)), r"U_k\.basis must have shape"),
    (lambda S: dict(U_k=rr.SubspaceFactors(S.basis, S.coef[..., :5, :, :])), r"U_k\.coef must have shape .* n = 7"),
    (lambda S: dict(U_k=rr.SubspaceFactors(S.basis, S.coef[..., :1, :])), r"U_k\.coef .* m = 2"),
    (lambda S: dict(U_k=rr.SubspaceFactors(S.basis, S.coef.float())), r"U_k\.coef has dtype torch.float32"),
    (lambda S: dict(U_k=rr.SubspaceFactors(S.basis, "C")), r"U_k\.coef must be a torch\.Tensor"),
    (lambda S: dict(U_k=rr.SubspaceFactors(S.basis.expand(3, 2, 5, 2), S.coef)), r"U_k\.basis\.shape\[:-2\]"),
    (lambda S: dict(U_q=rr.SubspaceFactors(S.basis, S.coef[..., :6, :, :]), metric_side="key"),
     r"U_q is not used with metric_side='key'"),
    (lambda S: dict(U_k=rr.SubspaceFactors(S.basis, S.coef[:1].expand(4, 2, 7, 2, 3))), r"batch"),
])
def test_bad_subspace_factors_raise_a_clear_error(gen, bad, match):
    q, k, v, _, Sk, _ = make(gen, "key")
    with pytest.raises(ValueError, match=match):
        rr.riemannian_attention(q, k, v, **bad(Sk))


def test_the_dense_shape_of_subspace_factors(gen):
    S = subspace(gen, (2, 3), 5, 4, 2, 1)
    U = S.dense()
    assert U.shape == (2, 3, 5, 4, 1)
    torch.testing.assert_close(U[1, 2, 3], S.basis[0, 2] @ S.coef[1, 2, 3])


# ---------------------------------------------------------------------------------------- property test
@settings(max_examples=20)
@given(side=st.sampled_from(SIDES), m=st.integers(1, 3), r=st.integers(0, 3), d=st.integers(3, 5),
       nq=st.integers(1, 6), nk=st.integers(1, 6), g=st.sampled_from((1, 2)),
       mask_kind=st.sampled_from(["none", "bool", "float", "causal", "bool+causal"]),
       seed=st.integers(0, 2 ** 31 - 1))
def test_property_every_shape_equals_the_reference(side, m, r, d, nq, nk, g, mask_kind, seed):
    m = min(m, d)
    gen = torch.Generator().manual_seed(seed)
    B, hk = 2, 2
    hq = hk * g
    q = torch.randn(B, hq, nq, d, generator=gen, dtype=F64)
    k, v = (torch.randn(B, hk, nk, d, generator=gen, dtype=F64) for _ in range(2))
    Sq = subspace(gen, (B, hq), nq, d, m, r) if side != "key" else None
    Sk = subspace(gen, (B, hk), nk, d, m, r) if side != "query" else None
    lam = torch.rand(hq, generator=gen, dtype=F64) + 0.5
    mask, causal = None, mask_kind in ("causal", "bool+causal")
    if mask_kind != "none" and mask_kind != "causal":
        keep = torch.rand(B, 1, nq, nk, generator=gen) > 0.3
        mask = keep if mask_kind != "float" else torch.randn(B, 1, nq, nk, generator=gen,
                                                               dtype=F64).masked_fill(~keep, float("-inf"))
    out = rr.riemannian_attention(q, k, v, mask, is_causal=causal, U_q=Sq, U_k=Sk, lam=lam, metric_side=side,
                                  enable_gqa=g > 1)
    rep = lambda t: t.repeat_interleave(g, -4 if t.dim() == 5 else -3)  # noqa: E731
    ref = rr.riemannian_attention_reference(q, rep(k), rep(v), mask, is_causal=causal, U_q=dense(Sq),
                                            U_k=None if Sk is None else rep(Sk.dense()), lam=lam, metric_side=side)
    torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-11)


# ---------------------------------------------------------------------------------------------- the module
def test_metric_net_subspace_returns_subspace_factors_with_the_usual_scale():
    torch.manual_seed(0)
    net = rr.MetricNet(32, 3, 16, 2, subspace=4, strength=1.5, form="factor")
    x = torch.randn(64, 8, 32)
    lam, U = net(x)
    assert isinstance(U, rr.SubspaceFactors) and U.basis.shape == (1, 3, 16, 4) and U.coef.shape == (64, 3, 8, 4, 2)
    assert lam.shape == (3,)
    v = torch.randn(16)
    ratio = (U.dense().transpose(-1, -2) @ v).square().sum(-1).mean() / (1.5 ** 2 * v.square().sum())
    assert 0.5 < ratio < 2  # E |U^T v|^2 = strength^2 |v|^2 on average over the basis's draw
    assert sum(p.numel() for p in net.parameters()) == 3 + 3 * 16 * 4 + 32 * 3 * 4 * 2


@pytest.mark.parametrize("kw, match", [
    (dict(subspace=0), r"subspace must be an int in \[1, head_dim = 8\]"),
    (dict(subspace=9), r"subspace must be an int in \[1, head_dim = 8\]"),
    (dict(subspace=True), r"subspace must be an int"),
    (dict(subspace=2, shared=True), "needs per-token metrics computed from the states"),
    (dict(subspace=2, n_positions=5), "needs per-token metrics computed from the states"),
    (dict(subspace=2, rank=0), "subspace needs rank >= 1"),
])
def test_metric_net_subspace_errors(kw, match):
    args = {"rank": 2, **kw}
    with pytest.raises(ValueError, match=match):
        rr.MetricNet(16, 2, 8, args.pop("rank"), **args)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("form", ["factor", "gains"])
def test_module_with_subspace_equals_dense_factors_on_the_blockwise_operator(side, cross, form):
    torch.manual_seed(0)
    rank = 3 if form == "factor" else 2  # the gains form's directions are orthonormal: rank <= subspace
    cfg = rr.AttentionConfig(d_model=16, n_heads=2, rank=rank, subspace=2, metric_side=side, causal=not cross,
                             learn_temperature=True, cross_attention=cross, metric_bias=True, metric_form=form)
    layer = rr.RiemannianAttention(cfg).double()
    x = torch.randn(2, 9, 16, dtype=F64, requires_grad=True)
    ctx = torch.randn(2, 7, 16, dtype=F64, requires_grad=True) if cross else None
    key_mask = torch.ones(2, 9 if ctx is None else 7, dtype=torch.bool)
    key_mask[0, -2:] = False
    out, _ = layer(x, ctx, key_mask=key_mask)
    params = [p for p in layer.parameters()] + [x] + ([ctx] if cross else [])
    grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True)

    q, k, v = layer.project(x, ctx)
    lam, Uq, Uk, _ = layer.geometry(x, ctx)
    with functional._force_backend("blockwise"):
        o = rr.riemannian_attention(q, k, v, key_mask.view(2, 1, 1, -1), is_causal=not cross, U_q=dense(Uq),
                                    U_k=dense(Uk), lam=lam, metric_side=side)
    ref = layer.out_proj(o.transpose(1, 2).reshape(2, 9, -1))
    grads_ref = torch.autograd.grad(ref.square().sum(), params, allow_unused=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # the two routes' gradients differ by round-off; the gains form's normalisation of the coefficients (through
    # the basis' Gram matrix) amplifies it by the inverse of their smallest singular values (measured: 3e-8 here)
    tol = dict(rtol=1e-10, atol=1e-11) if form == "factor" else dict(rtol=1e-6, atol=1e-9)
    for p, a, b in zip(params, grads, grads_ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, **tol)
    assert any(isinstance(U, rr.SubspaceFactors) for U in (Uq, Uk))
    assert layer.scores(x).shape == (2, 2, 9, 9) if not cross else True


def test_module_with_a_connection_or_weights_multiplies_the_factors_out():
    torch.manual_seed(0)
    cfg = rr.AttentionConfig(d_model=16, n_heads=2, rank=2, subspace=2, connection="flat", causal=True)
    layer = rr.RiemannianAttention(cfg).double()
    x = torch.randn(2, 9, 16, dtype=F64)
    out, _ = layer(x)
    q, k, v = layer.project(x)
    lam, _, Uk, rates = layer.geometry(x)
    o = rr.connection_attention(q, k, v, None, 0.0, True, U_k=Uk.dense(), lam=lam, connection="flat", rates=rates)
    torch.testing.assert_close(out, layer.out_proj(o.transpose(1, 2).reshape(2, 9, -1)), rtol=1e-12, atol=1e-12)
    layer_t = rr.RiemannianAttention(cfg.replace(connection="trivial")).double()
    out_w, A = layer_t(x, return_weights=True)
    assert A.shape == (2, 2, 9, 9) and torch.allclose(out_w, layer_t(x)[0], atol=1e-12)


@pytest.mark.parametrize("kw, match", [
    (dict(subspace=0), r"subspace must be an int in \[1, 8\]"),
    (dict(subspace=9), r"subspace must be an int in \[1, 8\]"),
    (dict(subspace=2, metric="shared"), "subspace needs per-token metrics"),
    (dict(subspace=2, scores="dot"), "subspace needs per-token metrics"),
    (dict(subspace=2, rank=0), "subspace needs per-token metrics"),
])
def test_attention_config_subspace_is_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        rr.AttentionConfig(d_model=16, n_heads=2, **kw)


def test_fiber_bundle_config_metric_subspace():
    cfg = rr.FiberBundleConfig.tiny(mode="riemannian", attention=dict(subspace=3))
    assert cfg.attention.subspace == 3
    model = rr.FiberBundleTransformer(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    out = model(idx)
    out.logits.square().mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if ".attn.metric." in n)
    for mode, att in (("euclidean", {}), ("riemannian", dict(metric="shared")),
                      ("riemannian", dict(metric="position")), ("riemannian", dict(rank=0))):
        with pytest.raises(ValueError, match="attention: subspace needs per-token metrics"):
            rr.FiberBundleConfig.tiny(mode=mode, attention=dict(att, subspace=3))
    with pytest.raises(ValueError, match=r"attention: subspace must be an int in \[1, 16\]"):
        rr.FiberBundleConfig.tiny(mode="riemannian", attention=dict(subspace=17))
