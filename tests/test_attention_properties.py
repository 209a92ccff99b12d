"""Property test: the blockwise operator equals the dense reference and the plain blockwise algorithm.

Hypothesis draws the whole call: batch shapes that broadcast (query, key,
value, factors, lam and mask each with their own size-1 dims), n_q != n_k,
head and value dimensions, metric ranks 0..3 (or no factor at all), per-token
or shared factors on each side, the side, block sizes (1 up to past the
sequence), the scale, bool / float / causal masks and mask + causal, and the
dtype. Outputs and the gradients of every input (the float mask included)
are compared:

- float64: ``riemannian_attention``, ``riemannian_attention_reference`` and
  ``blockwise_attention`` agree to 1e-10;
- float32: each of the three, run in float32, is compared with the float64
  reference on the same inputs, to a tolerance scaled to the magnitudes
  (float32 epsilon times the largest score, value and gradient).
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import riemannian_ref as rr

SIDES = ("key", "query", "mean")
MASKS = ("none", "bool", "float", "causal", "bool+causal", "float+causal")


def _sub_batch(draw, batch, allow_fewer=True):
    """A shape that broadcasts to ``batch`` without enlarging it: some dims 1, maybe fewer leading dims."""
    shape = [draw(st.sampled_from((b, 1))) for b in batch]
    if allow_fewer and shape:
        shape = shape[draw(st.integers(0, len(shape))):]
    return shape


def _expected_shape(spec):
    """Broadcast of the batch dims of query, key, value and the factors (lam and the mask never enlarge it)."""
    shapes = [spec["q_batch"], spec["k_batch"], spec["v_batch"]]
    shapes += [spec[n + "_batch"] for n in ("U_q", "U_k") if spec[n] in ("per_token", "shared")]
    return (*torch.broadcast_shapes(*shapes), spec["n_q"], spec["dv"])


@st.composite
def attention_calls(draw, dtype, mask):
    nb = draw(st.integers(0, 2))
    batch = draw(st.lists(st.integers(1, 3), min_size=nb, max_size=nb))
    n_q, n_k = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    d, dv = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    side = draw(st.sampled_from(SIDES))
    r = draw(st.integers(0, 3))
    spec = dict(batch=batch, n_q=n_q, n_k=n_k, d=d, dv=dv, side=side, r=r, dtype=dtype)
    # q, k, v: the same number of dims, batch dims that broadcast to `batch`
    spec["q_batch"] = _sub_batch(draw, batch, allow_fewer=False)
    spec["k_batch"] = _sub_batch(draw, batch, allow_fewer=False)
    spec["v_batch"] = _sub_batch(draw, batch, allow_fewer=False)
    for name, used in (("U_q", side in ("query", "mean")), ("U_k", side in ("key", "mean"))):
        kind = draw(st.sampled_from(("per_token", "shared", "none"))) if used else "unused"
        spec[name] = kind
        spec[name + "_batch"] = _sub_batch(draw, batch, allow_fewer=False)  # per-token vs shared: by dims
    # lam and the mask broadcast to the inputs' batch without enlarging it
    out_batch = list(_expected_shape(spec)[:-2])
    spec["lam"] = draw(st.sampled_from(("float", "tensor")))
    spec["lam_shape"] = _sub_batch(draw, out_batch)
    spec["mask"] = mask
    spec["mask_batch"] = _sub_batch(draw, out_batch)
    spec["mask_rows"] = draw(st.sampled_from((n_q, 1)))
    spec["mask_cols"] = draw(st.sampled_from((n_k, 1)))
    spec["blocks"] = (draw(st.integers(1, n_q + 2)), draw(st.integers(1, n_k + 2)))
    spec["scale"] = draw(st.one_of(st.none(), st.floats(0.1, 2.0)))
    spec["seed"] = draw(st.integers(0, 2 ** 31 - 1))
    return spec


def _tensors(spec):
    """The inputs of a drawn call, in float64 (leaves: name -> tensor; flags: the rest)."""
    g = torch.Generator().manual_seed(spec["seed"])
    F64 = torch.float64
    n_q, n_k, d, dv, r = spec["n_q"], spec["n_k"], spec["d"], spec["dv"], spec["r"]
    t = {"query": torch.randn(*spec["q_batch"], n_q, d, generator=g, dtype=F64),
         "key": torch.randn(*spec["k_batch"], n_k, d, generator=g, dtype=F64),
         "value": torch.randn(*spec["v_batch"], n_k, dv, generator=g, dtype=F64)}
    for name, n in (("U_q", n_q), ("U_k", n_k)):
        kind = spec[name]
        if kind in ("per_token", "shared"):
            shape = (*spec[name + "_batch"], *((n,) if kind == "per_token" else ()), d, r)
            t[name] = 0.6 * torch.randn(*shape, generator=g, dtype=F64)
    if spec["lam"] == "tensor":
        t["lam"] = 0.3 + torch.rand(tuple(spec["lam_shape"]), generator=g, dtype=F64)
    kind = spec["mask"]
    if kind.startswith("bool") or kind.startswith("float"):
        shape = (*spec["mask_batch"], spec["mask_rows"], spec["mask_cols"])
        keep = torch.rand(*shape, generator=g) > 0.3  # some rows may be fully masked: they give 0
        if kind.startswith("bool"):
            t["attn_mask"] = keep
        else:
            bias = torch.randn(*shape, generator=g, dtype=F64)
            t["attn_mask"] = bias.masked_fill(~keep, float("-inf"))
    return t


def _run(fn, t, spec, dtype, leaves):
    """Call ``fn`` on the inputs in ``dtype``; return the output and the gradients of ``leaves``."""
    x = {k: (v.to(dtype) if v.is_floating_point() else v).detach().requires_grad_(k in leaves)
         for k, v in t.items()}
    kw = dict(attn_mask=x.get("attn_mask"), is_causal=spec["mask"].endswith("causal"), scale=spec["scale"],
              U_q=x.get("U_q"), U_k=x.get("U_k"), lam=x.get("lam", 0.8), metric_side=spec["side"])
    if fn is not rr.riemannian_attention_reference:
        kw["block_sizes"] = spec["blocks"]
    out = fn(x["query"], x["key"], x["value"], **kw)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad((out * w).sum(), [x[k] for k in leaves], allow_unused=True)
    return out, dict(zip(leaves, grads))


def _leaves(t):
    """Every floating input takes a gradient (a float mask too: a learned bias)."""
    return [k for k, v in t.items() if v.is_floating_point()]


# Half the profile's examples per mask kind and dtype: 6 x 20 of each with the ci profile (~5 s).
PER_MASK = max(1, settings.default.max_examples // 2)
FNS = (rr.riemannian_attention, rr.riemannian_attention_reference, rr.blockwise_attention)


# Every mask kind gets its own examples (a drawn flag would leave the rare ones to chance).
@pytest.mark.parametrize("mask", MASKS)
@settings(max_examples=PER_MASK)
@given(data=st.data())
def test_float64_operator_equals_reference_and_plain_blockwise(mask, data):
    spec = data.draw(attention_calls(torch.float64, mask), label="call")
    t = _tensors(spec)
    leaves = _leaves(t)
    (o1, g1), (o2, g2), (o3, g3) = (_run(fn, t, spec, torch.float64, leaves) for fn in FNS)
    assert o1.shape == _expected_shape(spec)
    assert torch.isfinite(o1).all()
    for o in (o2, o3):
        torch.testing.assert_close(o1, o, rtol=1e-10, atol=1e-10)
    for k in leaves:
        ref = g2[k]
        ref = torch.zeros_like(t[k]) if ref is None else ref
        for g in (g1[k], g3[k]):
            g = torch.zeros_like(t[k]) if g is None else g
            assert g.shape == t[k].shape, k
            torch.testing.assert_close(g, ref, rtol=1e-9, atol=1e-9, msg=lambda m: f"gradient of {k}: {m}")


@pytest.mark.parametrize("mask", MASKS)
@settings(max_examples=PER_MASK)
@given(data=st.data())
def test_float32_within_tolerances_scaled_to_the_magnitudes(mask, data):
    spec = data.draw(attention_calls(torch.float32, mask), label="call")
    t = _tensors(spec)
    leaves = _leaves(t)
    o_ref, g_ref = _run(rr.riemannian_attention_reference, t, spec, torch.float64, leaves)  # the oracle
    # the largest finite score: float32 loses eps * |s| in the expanded distance
    S = rr.riemannian_scores(t["query"], t["key"], t.get("U_q"), t.get("U_k"), lam=t.get("lam", 0.8),
                             metric_side=spec["side"], scale=spec["scale"])
    s_max = 1.0 + S.abs().max().item()
    eps = torch.finfo(torch.float32).eps
    v_max = t["value"].abs().max().item()
    for fn in FNS:
        out, grads = _run(fn, t, spec, torch.float32, leaves)
        assert out.dtype == torch.float32 and out.shape == o_ref.shape
        torch.testing.assert_close(out.double(), o_ref, rtol=0, atol=64 * eps * s_max * v_max,
                                   msg=lambda m: f"{fn.__name__} output: {m}")
        for k in leaves:
            ref = g_ref[k] if g_ref[k] is not None else torch.zeros_like(t[k])
            g = grads[k].double() if grads[k] is not None else torch.zeros_like(t[k])
            tol = 256 * eps * s_max * (1.0 + ref.abs().amax().item() if ref.numel() else 1.0) * (1.0 + v_max)
            torch.testing.assert_close(g, ref, rtol=0, atol=tol, msg=lambda m: f"{fn.__name__} d{k}: {m}")
