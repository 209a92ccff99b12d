"""Edge inputs of ``riemannian_attention`` and its reference (issue 28): the range of lam and scale, meta
tensors, empty heads and NumPy scales.

- Range (D9): every path computes the float64 answer, or every path refuses the call with a
  ``ValueError`` naming ``lam`` and ``scale`` (scores that would overflow the compute dtype); the
  dense reference never reads an overflowed row as masked.
- Meta tensors (D10): the output's shape, as SDPA gives it, through the function and the module.
- SDPA's calls (D21): head dimension 0 (uniform weights, SDPA's result) and NumPy or 0-d tensor scales.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import riemannian_ref as rr
from riemannian_ref.attention.functional import _force_backend
from riemannian_ref.attention.layer import AttentionConfig, RiemannianAttention

F64 = torch.float64


def _qkv(gen, d=4, dtype=torch.float32, n_q=4, n_k=6, dv=2):
    q = torch.randn(2, 2, n_q, d, generator=gen, dtype=F64)
    k = torch.randn(2, 2, n_k, d, generator=gen, dtype=F64)
    v = torch.randn(2, 2, n_k, dv, generator=gen, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _calls(q, k, v, gen):
    """(name, kwargs) of calls that take each backend: SDPA (no factor / shared), blockwise, per-token factors."""
    Uk = 0.3 * torch.randn(*k.shape, 2, generator=gen, dtype=F64).to(q.dtype)
    Uq = 0.3 * torch.randn(*q.shape, 2, generator=gen, dtype=F64).to(q.dtype)
    Us = 0.3 * torch.randn(1, 2, q.shape[-1], 2, generator=gen, dtype=F64).to(q.dtype)
    return [("plain", {}), ("shared", dict(U_k=Us)), ("per_token_key", dict(U_k=Uk)),
            ("mean", dict(U_q=Uq, U_k=Uk, metric_side="mean")),
            ("causal_masked", dict(U_k=Uk, is_causal=True))]


def _run(path, q, k, v, **kw):
    if path == "reference":
        return rr.riemannian_attention_reference(q, k, v, **kw)
    if path == "blockwise":
        with _force_backend("blockwise"):
            return rr.riemannian_attention(q, k, v, **kw)
    return rr.riemannian_attention(q, k, v, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_huge_lam_or_scale_gives_the_float64_answer_or_a_clear_error(dtype, gen):
    # D9: lam = 1e38 made the float32 reference read rows as masked (silent zeros), 3e38 gave the operator NaN.
    # The reference checks the whole range bound (data included) and answers exactly or refuses; the
    # operators check lam and scale alone (no pass over the data): they refuse whatever overflows for
    # every input, answer exactly, or (only where the reference refuses) give NaN rows, as SDPA does.
    q, k, v = _qkv(gen, dtype=dtype)
    refused, answered, nan_rows = set(), set(), set()
    for name, kw in _calls(q, k, v, gen):
        kw64 = {a: (b.double() if isinstance(b, torch.Tensor) else b) for a, b in kw.items()}
        for lam, scale in [(1.0, None), (1e6, None), (1e30, None), (1e34, None), (1e36, None), (1e38, None),
                           (3e38, None), (1.0, 1e30), (1.0, 1e37), (1e20, 1e20)]:
            truth = rr.riemannian_attention_reference(q.double(), k.double(), v.double(), lam=lam, scale=scale,
                                                      **kw64)
            outcomes = {}
            for path in ("reference", "default", "blockwise"):
                try:
                    outcomes[path] = _run(path, q, k, v, lam=lam, scale=scale, **kw)
                except ValueError as exc:
                    assert "lam" in str(exc) and "scale" in str(exc) and "overflow" in str(exc), str(exc)
                    outcomes[path] = None
            if outcomes["reference"] is None:
                refused.add((lam, scale))
            else:
                answered.add((lam, scale))
            for path, out in outcomes.items():
                if out is None:
                    assert outcomes["reference"] is None, (name, path, lam, scale)  # the operators refuse less
                    continue
                assert out.dtype == dtype
                ok = torch.isclose(out.double(), truth, rtol=0, atol=2e-3 if dtype == torch.float16 else 1e-5)
                if outcomes["reference"] is None:  # beyond the reference's bound: exact, or NaN rows
                    bad = ~ok.all(-1)
                    assert torch.isnan(out[bad]).all(), (name, path, lam, scale)
                    if bad.any():
                        nan_rows.add((lam, scale))
                else:
                    assert ok.all(), f"{name} {path} lam={lam:g} scale={scale}"
    # the probe's calls: refused; ordinary and large-but-representable values: answered
    assert {(1e38, None), (3e38, None), (1.0, 1e37), (1e20, 1e20)} <= refused
    assert {(1.0, None), (1.0, 1e30)} <= answered
    if dtype == torch.float16:  # lam is held in the inputs' dtype: beyond 65504 it is not representable
        assert (1e6, None) in refused
    else:
        assert {(1e6, None), (1e30, None)} <= answered


def test_the_range_rule_in_float64_and_with_a_lam_tensor(gen):
    # D9: the limit is the compute dtype's: float64 takes lam = 1e38; a per-head lam tensor is checked the same
    q, k, v = _qkv(gen, dtype=F64)
    out = rr.riemannian_attention(q, k, v, lam=1e38)
    torch.testing.assert_close(out, rr.riemannian_attention_reference(q, k, v, lam=1e38), rtol=0, atol=1e-12)
    assert (out != 0).all()  # the nearest key's value: not a row read as masked
    with pytest.raises(ValueError, match="lam and scale are too large"):  # the operator: lam alone
        rr.riemannian_attention(q, k, v, lam=torch.tensor([1.0, 1e308], dtype=F64))
    with pytest.raises(ValueError, match="lam, scale"):  # the reference: lam with the data
        rr.riemannian_attention_reference(q, k, v, lam=torch.tensor([1.0, 1e307], dtype=F64))
    with pytest.raises(ValueError, match="lam, scale"):
        rr.riemannian_attention_reference(q.float(), k.float(), v.float(), lam=torch.tensor([1.0, 1e38]))
    # non-finite inputs: the reference refuses inf; the operator, reading no data, gives non-finite rows
    # there, as SDPA does; NaN passes through both, NaN out
    q2 = q.clone()
    q2[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="overflow"):
        rr.riemannian_attention_reference(q2, k, v)
    assert not torch.isfinite(rr.riemannian_attention(q2, k, v)[0, 0, 0]).all()
    q2[0, 0, 0, 0] = float("nan")
    assert torch.isnan(rr.riemannian_attention(q2, k, v)[0, 0, 0]).all()


@pytest.mark.parametrize("big", [30.0, 1e30])
def test_gradients_at_a_large_accepted_lam(big, gen):
    # D9: within the range the gradients are finite on every path; where the softmax is not saturated,
    # the float64 reference's. (At lam = 1e30 the weights are one-hot and the true gradients of query and
    # key vanish; float32 leaves rounding times lam there, on SDPA as on every softmax backward.)
    q, k, v = _qkv(gen)
    Uk = 0.3 * torch.randn(*k.shape, 2, generator=gen)
    lam = torch.tensor([big, 3.0], requires_grad=True)
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v, Uk)]
    lam64 = lam.detach().double().requires_grad_()
    ref = rr.riemannian_attention_reference(*ins64[:3], U_k=ins64[3], lam=lam64)
    g64 = torch.autograd.grad(ref.square().sum(), [*ins64, lam64])
    for path in ("default", "blockwise", "reference"):
        ins = [t.clone().requires_grad_() for t in (q, k, v, Uk)]
        out = _run(path, *ins[:3], U_k=ins[3], lam=lam)
        g = torch.autograd.grad(out.square().sum(), [*ins, lam])
        for a, b in zip(g, g64):
            assert torch.isfinite(a).all()
            if big < 1e3:
                torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


META_CALLS = [
    dict(),
    dict(U_k=torch.empty(2, 3, 5, 4, 2, device="meta")),
    dict(U_k=torch.empty(1, 3, 4, 2, device="meta")),
    dict(U_q=torch.empty(2, 3, 5, 4, 2, device="meta"), U_k=torch.empty(2, 3, 5, 4, 2, device="meta"),
         metric_side="mean"),
    dict(lam=torch.empty(3, device="meta")),
    dict(attn_mask=torch.empty(2, 1, 5, 5, device="meta")),
    dict(attn_mask=torch.empty(2, 1, 1, 5, device="meta", dtype=torch.bool), is_causal=True),
    dict(U_k=torch.empty(2, 3, 5, 4, 2, device="meta"), attn_mask=torch.empty(2, 1, 5, 5, device="meta")),
    dict(dropout_p=0.1),
    dict(scale=0.3, U_k=torch.empty(2, 3, 5, 4, 2, device="meta"), is_causal=True),
]


@pytest.mark.parametrize("kw", range(len(META_CALLS)))
def test_meta_tensors_give_sdpas_shape(kw):
    # D10
    kw = META_CALLS[kw]
    q = torch.empty(2, 3, 5, 4, device="meta")
    k = torch.empty(2, 3, 5, 4, device="meta")
    v = torch.empty(2, 3, 5, 7, device="meta")
    out = rr.riemannian_attention(q, k, v, **kw)
    assert out.device.type == "meta" and out.shape == (2, 3, 5, 7) and out.dtype == torch.float32
    ref = rr.riemannian_attention_reference(q, k, v, **kw)
    assert ref.device.type == "meta" and ref.shape == (2, 3, 5, 7)


def test_meta_tensors_half_gqa_and_backward():
    # D10: half precision keeps its dtype; grouped-query heads; gradients get their shapes
    q = torch.empty(2, 4, 5, 4, device="meta", dtype=torch.float16)
    k = torch.empty(2, 2, 6, 4, device="meta", dtype=torch.float16)
    v = torch.empty(2, 2, 6, 3, device="meta", dtype=torch.float16)
    sdpa = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    out = rr.riemannian_attention(q, k, v, enable_gqa=True)
    assert out.shape == sdpa.shape and out.dtype == sdpa.dtype
    q, k, v = (torch.empty(2, 3, 5, 4, device="meta", requires_grad=True) for _ in range(3))
    Uk = torch.empty(2, 3, 5, 4, 2, device="meta", requires_grad=True)
    out = rr.riemannian_attention(q, k, v, U_k=Uk)
    out.sum().backward()
    assert q.grad.shape == q.shape and Uk.grad.shape == Uk.shape and q.grad.device.type == "meta"


@pytest.mark.parametrize("kw", [dict(), dict(metric="shared"), dict(metric="position"), dict(connection="flat"),
                                dict(connection="content"), dict(connection="cumulative"), dict(subspace=2),
                                dict(rank=0), dict(scores="dot")])
def test_the_module_on_meta_tensors(kw):
    # D10: RiemannianAttention.forward gives the output shape (no autocast query for meta)
    torch.manual_seed(0)
    m = RiemannianAttention(AttentionConfig(d_model=16, n_heads=2, causal=True, **kw)).to("meta")
    out, w = m(torch.empty(2, 5, 16, device="meta"))
    assert out.shape == (2, 5, 16) and out.device.type == "meta" and w is None


@pytest.mark.parametrize("mask", [None, "bool", "causal"])
@pytest.mark.parametrize("factor", [None, "per_token"])
@pytest.mark.parametrize("path", ["default", "blockwise", "reference"])
def test_head_dimension_zero_is_sdpas_uniform_average(mask, factor, path, gen):
    # D21: d = 0 with scale=None gave ZeroDivisionError; SDPA gives the (masked) mean of the values
    q, k = torch.randn(2, 2, 3, 0, dtype=F64), torch.randn(2, 2, 4, 0, dtype=F64)
    v = torch.randn(2, 2, 4, 3, generator=gen, dtype=F64, requires_grad=True)
    kw = {}
    if mask == "bool":
        kw["attn_mask"] = torch.rand(2, 1, 3, 4, generator=gen) > 0.4
    elif mask == "causal":
        kw["is_causal"] = True
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    if factor:
        kw["U_k"] = torch.randn(2, 2, 4, 0, 2, dtype=F64)
    out = _run(path, q, k, v, **kw)
    torch.testing.assert_close(out, want.nan_to_num(0.0), rtol=0, atol=1e-12)  # SDPA: NaN for an unseen row
    g, = torch.autograd.grad(out.sum(), v)
    g_want, = torch.autograd.grad(want.nan_to_num(0.0).sum(), v)
    torch.testing.assert_close(g, g_want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("scale", [np.float32(0.5), np.float64(0.5), np.float16(0.5), np.int64(2),
                                   torch.tensor(0.5), torch.tensor(0.5, dtype=F64), torch.tensor(2)])
def test_scales_sdpa_accepts(scale, gen):
    # D21: NumPy scalars and 0-d tensors, as SDPA takes them
    q, k, v = _qkv(gen, dtype=F64)
    Uk = torch.randn(*k.shape, 2, generator=gen, dtype=F64)
    for kw in ({}, dict(U_k=Uk)):
        out = rr.riemannian_attention(q, k, v, scale=scale, **kw)
        torch.testing.assert_close(out, rr.riemannian_attention_reference(q, k, v, scale=float(scale), **kw),
                                   rtol=0, atol=1e-12)
    # SDPA agrees with the distance form for the same scale (no factor, lam 1: a key bias, see test_sdpa_compat)
    bias = -float(scale) / 2 * k.square().sum(-1).unsqueeze(-2)
    torch.testing.assert_close(rr.riemannian_attention(q, k, v, scale=scale),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale), rtol=0,
                               atol=1e-12)


@pytest.mark.parametrize("scale", [torch.tensor([0.5]), torch.tensor(0.5, requires_grad=True), np.array([0.5]),
                                   "0.5", True, 0.0, -1.0, float("inf"), float("nan"), torch.tensor(True)])
def test_scales_refused_name_scale(scale, gen):
    # D21: what is not a finite positive real number is refused, naming scale
    q, k, v = _qkv(gen)
    with pytest.raises(ValueError, match="scale must be"):
        rr.riemannian_attention(q, k, v, scale=scale)


def test_subspace_factors_follow_the_range_rule(gen):
    # D9: with factors in a shared subspace (computed on SDPA, never multiplied out) the operator answers
    # exactly or gives NaN rows where the scores overflow (as SDPA); the reference refuses those calls
    from riemannian_ref.geometry.metric import SubspaceFactors

    q, k, v = _qkv(gen)
    basis = torch.linalg.qr(torch.randn(1, 2, 4, 2, generator=gen)).Q
    coef = torch.randn(2, 2, 6, 2, 3, generator=gen)
    for c in (1.0, 1e18):
        U = SubspaceFactors(basis, c * coef)
        out = rr.riemannian_attention(q, k, v, U_k=U)
        want = rr.riemannian_attention_reference(q.double(), k.double(), v.double(), U_k=U.dense().double())
        if c == 1.0:
            torch.testing.assert_close(rr.riemannian_attention_reference(q, k, v, U_k=U.dense()).double(), want,
                                       rtol=0, atol=1e-4)
            torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-4)
        else:
            with pytest.raises(ValueError, match="lam, scale"):
                rr.riemannian_attention_reference(q, k, v, U_k=U.dense())
            bad = ~torch.isclose(out.double(), want, rtol=0, atol=1e-4).all(-1)
            assert torch.isnan(out[bad]).all()


def test_the_range_rule_reads_no_value_off_the_cpu(monkeypatch, gen):
    # D9: on a device whose values cost a sync to read (CUDA), the range check is queued on the device
    # (torch._assert_async: a RuntimeError with the message), never read on the host
    from riemannian_ref import _checks
    from riemannian_ref.attention import functional

    monkeypatch.setattr(_checks, "reading_syncs", lambda t: True)
    monkeypatch.setattr(functional, "reading_syncs", lambda t: True)
    monkeypatch.delenv("RR_SYNC_CHECKS", raising=False)
    q, k, v = _qkv(gen)
    Uk = torch.randn(*k.shape, 2, generator=gen)
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: pytest.fail("bool(tensor): a host sync"))
    assert rr.riemannian_attention(q, k, v).shape == (2, 2, 4, 2)  # (the CPU operator itself reads values)
    for kw in ({}, dict(U_k=Uk)):
        with pytest.raises(RuntimeError, match="lam and scale are too large"):
            rr.riemannian_attention(q, k, v, lam=1e38, **kw)
