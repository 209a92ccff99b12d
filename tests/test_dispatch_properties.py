"""Property test of the dispatch rules of ``riemannian_attention``: dtypes, masks and GQA, on every CPU backend.

Every drawn call is checked against the dense reference computed in float64 on
the same (rounded) inputs, values and the gradients of every input, with
tolerances derived from the dtypes' epsilons. The axes:

- dtype: float64, float32, bfloat16, float16, and float32 inputs under
  ``torch.autocast("cpu", bfloat16)`` (the result then has the autocast dtype);
- mask: none, bool, float (with ``-inf``), ``torch.finfo(dtype).min`` (a
  row of it gives SDPA's row average), a fully masked row, ``is_causal``
  with left padding at ``finfo.min`` (causal rows that see only padding);
- grouped-query attention: ``h_q = h_kv`` or ``2 h_kv``, ``lam`` per query
  head, per key head or a float;
- metric side ``key``, ``query``, ``mean`` and factors none, shared
  ``[.., d, r]`` or per-token ``[.., n, d, r]``;
- backend: what the dispatch picks (SDPA on the dot-product form for calls
  without per-token factors, else the blockwise operator), the blockwise
  operator forced for every call, or the dense reference the dispatch takes
  for dropout (``dropout_p > 0``, with one fixed dropout mask that the
  float64 oracle applies too).

The Triton kernels are checked in Triton's interpreter (tests/test_triton.py).
"""
import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

import riemannian_ref as rr
from riemannian_ref.attention import functional

F64 = torch.float64
DTYPES = {"float64": F64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "autocast_bf16": torch.float32}
MASKS = ("none", "bool", "float", "finfo_min", "dead_row", "causal")
SIDES = ("key", "query", "mean")
P_DROP = 0.25


def _fixed_dropout(A, p=0.5, training=True, inplace=False):
    """One dropout mask per shape, the same for the call and its oracle (attention weights in their own order)."""
    keep = torch.rand(A.numel(), generator=torch.Generator().manual_seed(7), dtype=F64).view(A.shape) >= p
    return A * keep.to(A.dtype) / (1.0 - p)


@st.composite
def calls(draw):
    n_q, n_k = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    return dict(B=draw(st.integers(1, 2)), hk=draw(st.integers(1, 2)), g=draw(st.sampled_from((1, 2))),
                n_q=n_q, n_k=n_k, d=draw(st.integers(1, 4)), dv=draw(st.integers(1, 3)), r=draw(st.integers(1, 2)),
                side=draw(st.sampled_from(SIDES)), factors=draw(st.sampled_from(("none", "shared", "per_token"))),
                lam=draw(st.sampled_from(("float", "query_heads", "key_heads"))),
                backend=draw(st.sampled_from(("auto", "blockwise", "dense"))),
                blocks=(draw(st.integers(1, n_q + 1)), draw(st.integers(1, n_k + 1))),
                seed=draw(st.integers(0, 2 ** 31 - 1)))


def _inputs(spec, mask_kind, dtype):
    """The call's tensors in float64, already rounded to ``dtype`` (the oracle sees what the call sees)."""
    g = torch.Generator().manual_seed(spec["seed"])
    B, hk, n_q, n_k, d, dv, r = (spec[k] for k in ("B", "hk", "n_q", "n_k", "d", "dv", "r"))
    hq = hk * spec["g"]
    rnd = lambda *shape, s=1.0: (s * torch.randn(*shape, generator=g, dtype=F64)).to(dtype).to(F64)  # noqa: E731
    t = {"query": rnd(B, hq, n_q, d), "key": rnd(B, hk, n_k, d), "value": rnd(B, hk, n_k, dv)}
    if spec["factors"] != "none":
        per = spec["factors"] == "per_token"
        if spec["side"] in ("query", "mean"):
            t["U_q"] = rnd(B, hq, n_q, d, r, s=0.6) if per else rnd(1, hq, d, r, s=0.6)
        if spec["side"] in ("key", "mean"):
            t["U_k"] = rnd(B, hk, n_k, d, r, s=0.6) if per else rnd(B, hk, d, r, s=0.6)
    if spec["lam"] != "float":
        h = hq if spec["lam"] == "query_heads" else hk
        t["lam"] = (0.5 + torch.rand(h, generator=g, dtype=F64)).to(dtype).to(F64)
    low = torch.finfo(dtype).min
    u = torch.rand(B, 1, n_q, n_k, generator=g)
    if mask_kind == "bool":
        t["attn_mask"] = u > 0.3
    elif mask_kind == "dead_row":
        keep = u > 0.2
        keep[0, :, n_q - 1] = False  # a row that sees no key
        t["attn_mask"] = keep
    elif mask_kind == "float":
        t["attn_mask"] = rnd(B, 1, n_q, n_k).masked_fill(u < 0.2, float("-inf"))
    elif mask_kind == "finfo_min":  # transformers' convention: finfo.min where masked, one row masked everywhere
        m = rnd(B, 1, n_q, n_k, s=0.5).masked_fill(u < 0.3, low)
        m[0, :, 0] = low
        t["attn_mask"] = m.to(dtype).to(F64)
    elif mask_kind == "causal":  # with left padding [B, 1, 1, n_k]: early causal rows see only padding
        m = torch.zeros(B, 1, 1, n_k, dtype=F64)
        m[0, ..., :min(2, n_k - 1)] = low
        t["attn_mask"] = m.to(dtype).to(F64)
    return t


def _repeat_heads(t, g):
    """The oracle's inputs: the key heads repeated to the query heads (``lam`` per key head likewise)."""
    if g == 1:
        return t
    t = dict(t)
    t["key"], t["value"] = t["key"].repeat_interleave(g, -3), t["value"].repeat_interleave(g, -3)
    if "U_k" in t:
        t["U_k"] = t["U_k"].repeat_interleave(g, -4 if t["U_k"].dim() == 5 else -3)
    if "lam" in t and t["lam"].shape[-1] != t["query"].shape[-3]:
        t["lam"] = t["lam"].repeat_interleave(g, -1)
    return t


def _call(t, spec, causal, dropout_p, gqa):
    kw = dict(attn_mask=t.get("attn_mask"), dropout_p=dropout_p, is_causal=causal, U_q=t.get("U_q"),
              U_k=t.get("U_k"), lam=t.get("lam", 0.8), metric_side=spec["side"])
    if gqa is None:
        return rr.riemannian_attention_reference(t["query"], t["key"], t["value"], **kw)
    with functional._force_backend("blockwise") if spec["backend"] == "blockwise" else contextlib.nullcontext():
        return rr.riemannian_attention(t["query"], t["key"], t["value"], enable_gqa=gqa,
                                       block_sizes=spec["blocks"], **kw)


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@settings(max_examples=4)
@given(spec=calls())
def test_every_backend_equals_the_float64_reference(dtype_name, mask_kind, spec):
    dtype = DTYPES[dtype_name]
    t64 = _inputs(spec, mask_kind, dtype)
    causal = mask_kind == "causal"
    dropout_p = P_DROP if spec["backend"] == "dense" else 0.0
    leaves = [k for k, v in t64.items() if v.is_floating_point()]  # a float mask too: a learned bias
    with mock.patch.object(torch.nn.functional, "dropout", _fixed_dropout):
        # the call, in its dtype (autocast: float32 inputs, autocast on)
        x = {k: (v.to(dtype) if v.is_floating_point() else v).requires_grad_(k in leaves) for k, v in t64.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype_name == "autocast_bf16"):
            out = _call(x, spec, causal, dropout_p, gqa=spec["g"] > 1)
        out_dtype = torch.bfloat16 if dtype_name == "autocast_bf16" else dtype
        assert out.dtype == out_dtype and out.shape == (spec["B"], spec["hk"] * spec["g"], spec["n_q"], spec["dv"])
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(out_dtype)
        grads = torch.autograd.grad((out * w).sum(), [x[k] for k in leaves])
        # the oracle: float64, the key heads repeated, the same dropout mask
        o = {k: v.clone().requires_grad_(k in leaves) for k, v in t64.items()}
        rep = _repeat_heads(o, spec["g"])
        ref = _call(rep, spec, causal, dropout_p, gqa=None)
        grads_ref = torch.autograd.grad((ref * w.to(F64)).sum(), [o[k] for k in leaves])
    # tolerances: rounding of the result to its dtype, plus the compute dtype's epsilon at the problem's scale
    eps_c = torch.finfo(F64 if dtype == F64 else torch.float32).eps
    S = rr.riemannian_scores(rep["query"], rep["key"], rep.get("U_q"), rep.get("U_k"), lam=rep.get("lam", 0.8),
                             metric_side=spec["side"])
    scale = (1.0 + S.abs().max().item()) * (1.0 + t64["value"].abs().max().item()) / (1.0 - dropout_p)
    eps_out = torch.finfo(out_dtype).eps
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs()
    assert (err <= eps_out * ref.abs() + 64 * eps_c * scale).all(), f"output off by {err.max().item():.3g}"
    for k, a, b in zip(leaves, grads, grads_ref):
        assert a.shape == b.shape and a.dtype == x[k].dtype and torch.isfinite(a).all(), k
        tol = torch.finfo(a.dtype).eps * b.abs() + 256 * eps_c * scale * (1.0 + b.abs().max().item())
        err = (a.double() - b).abs()
        assert (err <= tol).all(), f"gradient of {k} off by {err.max().item():.3g}"
