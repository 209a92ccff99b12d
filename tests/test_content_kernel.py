"""The fused CPU kernel of the content connections against the dense path (the reference).

The kernel (``attention/_content_kernel.c``, loaded by ``attention/_content_cpu.py``) computes a
query row at a time and stores nothing pairwise; the dense path materialises every pair's rotated
vectors. Both compute the same function: values and every gradient agree in float64 to round-off.
"""
import itertools

import pytest
import torch

import riemannian_ref as rr
from riemannian_ref.attention import _content_cpu

DT = torch.float64

pytestmark = pytest.mark.skipif(not _content_cpu.available(torch.float64),
                                reason=f"no fused content kernel: {_content_cpu.unavailable_reason()}")


def _inputs(gen, B=2, h=3, n=9, d=6, r=2, dtype=DT):
    t = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=gen, dtype=dtype)).requires_grad_()  # noqa: E731
    rates = (0.6 * torch.rand(B, h, n, d // 2, generator=gen, dtype=dtype)).requires_grad_()
    lam = (0.5 + torch.rand(h, generator=gen, dtype=dtype)).requires_grad_()
    return dict(q=t(B, h, n, d), k=t(B, h, n, d), v=t(B, h, n, d), U_q=t(B, h, n, d, r, scale=0.5),
                U_k=t(B, h, n, d, r, scale=0.5), rates=rates, lam=lam)


def _masks(kind, B, n, gen):
    if kind is None:
        return None
    if kind == "bool":  # key padding, one sequence's first two keys hidden (with causal: rows that see nothing)
        keep = torch.rand(B, 1, 1, n, generator=gen) > 0.25
        keep[0, ..., :2] = False
        return keep
    if kind == "float":
        return torch.randn(B, 1, n, n, generator=gen, dtype=DT)
    if kind == "finfo":  # transformers' masking value; one row sees only masked keys
        m = torch.zeros(B, 1, n, n, dtype=DT)
        m[..., 1::3] = torch.finfo(DT).min
        m[1, :, 4, :] = torch.finfo(DT).min
        return m
    raise AssertionError(kind)


def _call(x, side, scores, tv, connection, causal, mask, positions=None):
    dot = scores == "dot"
    return rr.connection_attention(
        x["q"], x["k"], x["v"], mask, is_causal=causal,
        U_q=None if dot or side == "key" else x["U_q"], U_k=None if dot or side == "query" else x["U_k"],
        lam=x["lam"], metric_side=side, scores=scores, connection=connection, rates=x["rates"],
        positions=positions, transport_values=tv)


def _fused_and_dense(monkeypatch, fn):
    """fn() on the kernel and on the dense path (RR_DISABLE_CKERNEL=1)."""
    fused = fn()
    monkeypatch.setenv("RR_DISABLE_CKERNEL", "1")
    dense = fn()
    monkeypatch.delenv("RR_DISABLE_CKERNEL")
    return fused, dense


def _grads(out, x, seed=0):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    leaves = [t for t in x.values() if t.requires_grad]
    got = torch.autograd.grad((out * g).sum(), leaves, allow_unused=True)
    return [torch.zeros_like(t) if gr is None else gr for t, gr in zip(leaves, got)]


CASES = [c for c in itertools.product(("key", "query", "mean"), ("metric", "dot"), (True, False),
                                      ("content", "content_source"), (False, True))
         if not (c[1] == "dot" and c[0] != "key")]


@pytest.mark.parametrize("side,scores,tv,connection,causal", CASES)
@pytest.mark.parametrize("mask", [None, "bool", "float", "finfo"])
def test_fused_matches_dense_values_and_gradients(gen, monkeypatch, side, scores, tv, connection, causal, mask):
    x = _inputs(gen)
    m = _masks(mask, 2, 9, gen)
    pos = torch.arange(9, dtype=DT) * 1.5 + 2.0  # positions need not be 0..n-1
    fused, dense = _fused_and_dense(monkeypatch, lambda: _call(x, side, scores, tv, connection, causal, m, pos))
    torch.testing.assert_close(fused, dense, atol=1e-12, rtol=1e-10)
    for a, b in zip(_grads(fused, x), _grads(dense, x)):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


def test_fully_masked_rows_give_zero_and_no_nan(gen):
    x = _inputs(gen)
    keep = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    keep[0, ..., :3] = False  # with causal: rows 0, 1, 2 of the first sequence see no key
    out = _call(x, "key", "metric", True, "content", True, keep)
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    assert all(torch.isfinite(g).all() for g in _grads(out, x))


def test_broadcast_inputs_match_the_dense_path(gen, monkeypatch):
    """Rates shared by the batch, one shared metric per head, positions per sequence, a scalar lam."""
    x = _inputs(gen)
    x["rates"] = (0.5 * torch.rand(1, 3, 9, 3, generator=gen, dtype=DT)).requires_grad_()
    x["U_k"] = (0.5 * torch.randn(1, 3, 6, 2, generator=gen, dtype=DT)).requires_grad_()
    pos = torch.stack([torch.arange(9, dtype=DT), torch.arange(9, dtype=DT) + 3.0]).view(2, 1, 9)

    def run():
        return rr.connection_attention(x["q"], x["k"], x["v"], is_causal=True, U_k=x["U_k"], lam=0.7,
                                       connection="content", rates=x["rates"], positions=pos)

    fused, dense = _fused_and_dense(monkeypatch, run)
    torch.testing.assert_close(fused, dense, atol=1e-12, rtol=1e-10)
    for a, b in zip(_grads(fused, x), _grads(dense, x)):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


def test_gradcheck_through_the_kernel(gen):
    x = _inputs(gen, B=1, h=1, n=5, d=4, r=1)

    def f(q, k, v, U_k, rates, lam):
        return rr.connection_attention(q, k, v, is_causal=True, U_k=U_k, lam=lam, connection="content",
                                       rates=rates)

    assert torch.autograd.gradcheck(f, (x["q"], x["k"], x["v"], x["U_k"], x["rates"], x["lam"]))


def test_float32_kernel_against_float64_at_long_range_angles(gen, monkeypatch):
    """Positions up to 4000 (angles up to about 4000 rad): the kernel's sin/cos keep float32 accuracy."""
    n = 64
    x = _inputs(gen, B=1, h=2, n=n, d=8, r=2)
    pos = torch.linspace(0, 4000, n, dtype=DT)
    ref = _call(x, "key", "metric", True, "content", False, None, pos)
    x32 = {k: v.detach().float().requires_grad_() for k, v in x.items()}
    out = _call(x32, "key", "metric", True, "content", False, None, pos.float())
    monkeypatch.setenv("RR_DISABLE_CKERNEL", "1")
    dense32 = _call(x32, "key", "metric", True, "content", False, None, pos.float())
    # float32 angles (p_i - p_j) w round to ~2e-4 rad at 4000 rad on both float32 paths alike; the
    # kernel differs from torch's float32 path by its sin/cos (~1e-7 absolute), far below that
    err_kernel = (out.double() - ref).abs().max().item()
    err_dense = (dense32.double() - ref).abs().max().item()
    assert err_kernel <= 2 * err_dense + 1e-5, (err_kernel, err_dense)
    assert (out - dense32).abs().max().item() < 1e-4


def test_nothing_pairwise_is_saved_for_the_backward(gen):
    """Memory O(n d): no tensor autograd keeps has n^2 entries (the dense path keeps n^2 d of them)."""
    n, d = 128, 8
    x = _inputs(gen, B=1, h=1, n=n, d=d, r=2, dtype=torch.float32)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _call(x, "mean", "metric", True, "content", True, None)
    assert max(sizes) < n * n, max(sizes)
    out.sum().backward()


def test_threads_and_vector_width_do_not_change_the_result(gen):
    """Bitwise: 1 or 2 threads, and the kernel built for this CPU or for the baseline instruction set."""
    x = _inputs(gen, B=3, h=2, n=40, d=8, r=2, dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _call(x, "key", "metric", True, "content", True, None)
        torch.set_num_threads(2)
        two = _call(x, "key", "metric", True, "content", True, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    native = _content_cpu._LIBS[torch.float32]
    baseline = _content_cpu._compile(torch.float32, native=False)
    assert baseline is not None
    try:
        _content_cpu._LIBS[torch.float32] = baseline
        base = _call(x, "key", "metric", True, "content", True, None)
        gb = _grads(base, x)
    finally:
        _content_cpu._LIBS[torch.float32] = native
    assert torch.equal(base, one)
    for a, b in zip(gb, _grads(one, x)):
        assert torch.equal(a, b)


def test_double_backward_is_refused_with_a_pointer_to_the_dense_path(gen):
    x = _inputs(gen, B=1, h=1, n=5, d=4)
    out = _call(x, "key", "metric", True, "content", True, None)
    with pytest.raises(RuntimeError, match="RR_DISABLE_CKERNEL=1"):
        torch.autograd.grad(out.sum(), x["q"], create_graph=True)


def test_without_a_compiler_the_dense_path_runs(gen, monkeypatch, tmp_path):
    x = _inputs(gen, B=1, h=1, n=6, d=4)
    ref = _call(x, "key", "metric", True, "content", True, None)
    monkeypatch.setattr(_content_cpu, "_LIBS", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("RR_CACHE_DIR", str(tmp_path / "cache"))
    assert not _content_cpu.available(torch.float64)
    assert "failed" in _content_cpu.unavailable_reason() or "no-such-cc" in _content_cpu.unavailable_reason()
    torch.testing.assert_close(_call(x, "key", "metric", True, "content", True, None), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_keep_exact_positions(gen, dtype):
    """bfloat16 holds the integers exactly only up to 256: positions are built in float32 for half inputs."""
    n = 300
    x = {k: v.detach() for k, v in _inputs(gen, B=1, h=1, n=n, d=4, r=1, dtype=torch.float32).items()}
    half = {k: v.to(dtype) for k, v in x.items()}
    ref = _call({k: v.to(dtype).float() for k, v in x.items()}, "key", "metric", True, "content", True, None)
    out = _call(half, "key", "metric", True, "content", True, None)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=4 * torch.finfo(dtype).eps * ref.abs().max().item(),
                               rtol=0)
