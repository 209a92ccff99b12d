"""riemannian_attention takes every call that scaled_dot_product_attention takes, and with no metric
factors and lam = 1 it is SDPA on distance attention's dot-product form.

With :math:`G = I`, :math:`-\\tfrac{s}{2}|q_i - k_j|^2 = s\\,q_i\\cdot k_j - \\tfrac{s}{2}|k_j|^2
- \\tfrac{s}{2}|q_i|^2`; the last term is constant along a softmax row, so the weights are SDPA's
with queries ``q``, keys ``k`` and the key bias :math:`-\\tfrac{s}{2}|k_j|^2` added to the mask.
"""
import inspect
import math
import re

import pytest
import torch
import torch.nn.functional as F

import riemannian_ref as rr

F64 = torch.float64
NEG = float("-inf")


def _sdpa_positional():
    """SDPA's parameters from its documented signature (a builtin: inspect.signature cannot read it)."""
    doc = " ".join(F.scaled_dot_product_attention.__doc__.split())
    m = re.match(r"scaled_dot_product_attention\((.*?)\)\s*->", doc)
    params = [p.strip() for p in m.group(1).split(",")]
    return [tuple(p.split("=")) if "=" in p else (p,) for p in params]


def test_the_signature_starts_with_sdpas():
    """SDPA's documented parameters, in its order and with its defaults (SDPA takes the first six
    positionally, scale and enable_gqa by keyword); the metric comes after them, keyword-only."""
    sdpa = _sdpa_positional()
    names = [p[0] for p in sdpa]
    assert names == ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    sig = inspect.signature(rr.riemannian_attention).parameters
    positional = [p for p in sig.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional][:6] == names[:6]  # SDPA's positional parameters, in its order
    for spec in sdpa:
        p = sig[spec[0]]
        if len(spec) == 2:  # SDPA's default, as a literal
            assert p.default == eval(spec[1]), p.name
        else:
            assert p.default is p.empty, p.name
    for spec in sdpa[6:]:  # SDPA's keyword arguments (scale, enable_gqa) exist, with SDPA's default
        assert spec[0] in sig and sig[spec[0]].default == eval(spec[1])
    for name in ("U_q", "U_k", "lam", "metric_side"):  # the metric: keywords only, after SDPA's
        assert sig[name].kind == inspect.Parameter.KEYWORD_ONLY
    assert sig["U_q"].default is None and sig["U_k"].default is None and sig["lam"].default == 1.0


def _inputs(gen, batch, n_q, n_k, d=4, dv=3):
    q = torch.randn(*batch, n_q, d, generator=gen, dtype=F64)
    k = torch.randn(*batch, n_k, d, generator=gen, dtype=F64)
    v = torch.randn(*batch, n_k, dv, generator=gen, dtype=F64)
    return q, k, v


def _masks(gen, batch, n_q, n_k):
    keep = torch.rand(*batch, n_q, n_k, generator=gen) > 0.3
    keep[..., 0] = True  # no fully masked row (SDPA's answer there is not 0)
    bias = torch.randn(n_q, n_k, generator=gen, dtype=F64)  # broadcast over the batch
    return keep, bias


def _as_additive(mask, like):
    if mask is None:
        return torch.zeros((), dtype=like.dtype)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=like.dtype).masked_fill(~mask, NEG)
    return mask


def _dot_product_form(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA on q, k with the key bias -scale/2 |k_j|^2 folded into one float mask (causal included)."""
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kk = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3) if enable_gqa else k
    M = (-0.5 * s * (kk * kk).sum(-1)).unsqueeze(-2) + _as_additive(attn_mask, q)
    if is_causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        M = M + torch.zeros(n_q, n_k, dtype=q.dtype).masked_fill(~torch.ones(n_q, n_k, dtype=torch.bool).tril(), NEG)
    return F.scaled_dot_product_attention(q, k, v, M, dropout_p, False, scale=scale, enable_gqa=enable_gqa)


SHAPES = [((), 5, 5), ((3,), 4, 6), ((2, 3), 6, 4), ((2, 3), 1, 7)]


@pytest.mark.parametrize("batch, n_q, n_k", SHAPES)
def test_every_positional_sdpa_call_works_unchanged(gen, batch, n_q, n_k):
    q, k, v = _inputs(gen, batch, n_q, n_k)
    keep, bias = _masks(gen, batch, n_q, n_k)
    calls = [
        (q, k, v),
        (q, k, v, keep),
        (q, k, v, bias),
        (q, k, v, None),
        (q, k, v, None, 0.0),
        (q, k, v, None, 0.0, True),
        (q, k, v, keep, 0.0, False),
        (q, k, v, bias, 0.0, False, {"scale": 0.3}),
        (q, k, v, None, 0.0, False, {"scale": 1.7}),
        (q, k, v, None, 0.0, True, {"scale": 0.6}),
        (q, k, v, {"is_causal": True, "scale": 0.6}),
        (q, k, v, keep, {"scale": 2.0}),
    ]
    for call in calls:  # positional arguments, then (as SDPA allows) keywords
        args = tuple(a for a in call if not isinstance(a, dict))
        kw = next((a for a in call if isinstance(a, dict)), {})
        sdpa = F.scaled_dot_product_attention(*args, **kw)  # SDPA takes the call ...
        ours = rr.riemannian_attention(*args, **kw)  # ... and so do we, unchanged
        assert ours.shape == sdpa.shape and ours.dtype == sdpa.dtype
        torch.testing.assert_close(ours, _dot_product_form(*args, **kw), rtol=1e-12, atol=1e-12)
        # the same call entirely by keyword
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        torch.testing.assert_close(rr.riemannian_attention(**dict(zip(names, args)), **kw), ours, rtol=0, atol=0)
    # one case checked against plain SDPA directly: no mask, keys of equal norm (the bias is constant)
    kn = k / k.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(rr.riemannian_attention(q, kn, v), F.scaled_dot_product_attention(q, kn, v),
                               rtol=1e-12, atol=1e-12)


def test_keyword_extras_gqa_and_mask_with_causal(gen):
    q = torch.randn(2, 6, 5, 4, generator=gen, dtype=F64)
    k = torch.randn(2, 2, 5, 4, generator=gen, dtype=F64)
    v = torch.randn(2, 2, 5, 3, generator=gen, dtype=F64)
    kw = dict(attn_mask=None, dropout_p=0.0, is_causal=True, scale=0.4, enable_gqa=True)
    F.scaled_dot_product_attention(q, k, v, **kw)
    torch.testing.assert_close(rr.riemannian_attention(q, k, v, **kw), _dot_product_form(q, k, v, **kw),
                               rtol=1e-12, atol=1e-12)
    # SDPA refuses an attn_mask with is_causal; riemannian_attention applies both
    keep, _ = _masks(gen, (2, 1), 5, 5)
    both = rr.riemannian_attention(q, k, v, keep, 0.0, True, enable_gqa=True)
    torch.testing.assert_close(both, _dot_product_form(q, k, v, keep, 0.0, True, enable_gqa=True),
                               rtol=1e-12, atol=1e-12)


def test_dropout_p_positional_is_dropout_on_the_weights(gen):
    q, k, v = _inputs(gen, (2,), 4, 6)
    torch.manual_seed(0)
    a = rr.riemannian_attention(q, k, v, None, 0.5)
    torch.manual_seed(0)
    b = rr.riemannian_attention(q, k, v, None, 0.5)
    assert torch.equal(a, b)  # seeded: reproducible
    exact = _dot_product_form(q, k, v)
    assert (a - exact).abs().max() > 1e-3
    torch.manual_seed(1)
    mean = torch.stack([rr.riemannian_attention(q, k, v, None, 0.5) for _ in range(2000)]).mean(0)
    torch.testing.assert_close(mean, exact, rtol=0, atol=0.1)  # unbiased, as SDPA's dropout
    with pytest.raises(ValueError, match="dropout_p"):
        rr.riemannian_attention(q, k, v, None, 1.0)
