"""The content connections' Triton kernels (riemannian_ref.attention._triton_content) on CPU, in Triton's interpreter.

TRITON_INTERPRET is set before the module is imported (Triton reads it when a
kernel is defined), as in test_triton.py. Every call is the public
``rr.connection_attention`` inside the private
``functional._force_backend("triton")``, which sends a content-connection call
to the kernels on any device (what a CUDA call runs), with blocks of 16 so that
n = 20 spans two query and two key blocks, the second partial. Oracle: the
dense path in float64 (``RR_DISABLE_CKERNEL=1``), values and every gradient.
The interpreter runs each program in numpy (about a second per call here), so
the shapes are tiny and the cases chosen to cover each option at least once.
No GPU speed is measured here.

Tolerance (float32 kernels against float64): the angles reach about 40 rad
here (|p_i - p_j| <= 30, rates <= 0.6, positions up to 1.5 apart), so each
cosine and sine carries about 40 u ~ 2.4e-6 absolute error (u = 6e-8); a score
sums d (1 + r) <= 12 such products of O(1) terms, about 3e-5 in the score,
which the softmax turns into a relative error of the weights; outputs and
gradients are sums of such terms, so their error is about 1e-5 of their
largest entry (measured: at most 3e-6). ``atol = 1e-4 * max|ref|`` keeps a
factor of three to ten over the estimate.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (see the module docstring)

import pytest  # noqa: E402
import torch  # noqa: E402

import riemannian_ref as rr  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (optional: pip install riemannian_ref[gpu])")
from riemannian_ref.attention import _triton_content as TC  # noqa: E402
from riemannian_ref.attention import functional  # noqa: E402

if not TC.interpreted():
    pytest.skip("riemannian_ref.attention._triton_content was imported before TRITON_INTERPRET=1 was set in "
                "this process, so its kernels are compiled for a GPU; run this file on its own",
                allow_module_level=True)

N = 20
NAMES = ("q", "k", "v", "U_k", "rates", "lam")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(TC, "default_blocks", lambda d: (16, 16))


def make(gen, *, B=1, h=1, n=N, d=4, r=2, dv=None, shared=False):
    """float64 leaves; rates in [0, 0.6), lam in [0.5, 1.5)."""
    dv = d if dv is None else dv
    x = dict(q=torch.randn(B, h, n, d, generator=gen, dtype=torch.float64),
             k=torch.randn(B, h, n, d, generator=gen, dtype=torch.float64),
             v=torch.randn(B, h, n, dv, generator=gen, dtype=torch.float64),
             U_k=0.5 * torch.randn(B, h, *(() if shared else (n,)), d, r, generator=gen, dtype=torch.float64),
             rates=0.6 * torch.rand(B, h, n, d // 2, generator=gen, dtype=torch.float64),
             lam=0.5 + torch.rand(h, generator=gen, dtype=torch.float64))
    if not r:
        x["U_k"] = None
    return x


def call(x, mask=None, *, forced, dtype=None, **kw):
    """``connection_attention`` on copies of x (in ``dtype``) and the gradients of a fixed upstream gradient."""
    leaves = {k: (t.to(dtype) if dtype else t).detach().clone().requires_grad_() for k, t in x.items()
              if t is not None}
    kw = dict(dict(connection="content"), **kw)
    uk = leaves.get("U_k") if kw.get("scores", "metric") == "metric" else None
    if forced:
        with functional._force_backend("triton"):
            out = rr.connection_attention(leaves["q"], leaves["k"], leaves["v"], mask, U_k=uk, lam=leaves["lam"],
                                          rates=leaves["rates"], **kw)
    else:
        out = rr.connection_attention(leaves["q"], leaves["k"], leaves["v"], mask, U_k=uk, lam=leaves["lam"],
                                      rates=leaves["rates"], **kw)
    w = torch.linspace(-1.0, 1.0, out.numel(), dtype=torch.float64).view(out.shape).to(out.dtype)
    used = [k for k in NAMES if k in leaves and (k != "U_k" or uk is not None)
            and (k != "lam" or kw.get("scores", "metric") == "metric")]
    grads = torch.autograd.grad(out, [leaves[k] for k in used], w)
    return out, dict(zip(used, grads))


def check(monkeypatch, x, mask=None, *, tol=1e-4, **kw):
    """The kernels (float32) against the dense path (float64): output and every gradient."""
    out, grads = call(x, mask.float() if mask is not None and mask.is_floating_point() else mask, forced=True,
                      dtype=torch.float32, **kw)
    monkeypatch.setenv("RR_DISABLE_CKERNEL", "1")
    ref, grads_ref = call(x, mask, forced=False, **kw)
    monkeypatch.delenv("RR_DISABLE_CKERNEL")
    assert out.dtype == torch.float32 and grads.keys() == grads_ref.keys()
    for name, a, b in [("out", out, ref)] + [(k, grads[k], grads_ref[k]) for k in grads]:
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * b.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")
    return out, grads


CASES = [  # (scores, transport_values, connection, causal, rank)
    ("metric", True, "content", False, 2),
    ("metric", True, "content_source", True, 2),
    ("metric", False, "content", True, 1),
    ("metric", False, "content_source", False, 3),
    ("dot", True, "content", True, 0),
    ("dot", False, "content_source", False, 0),
]


@pytest.mark.parametrize("scores, tv, connection, causal, r", CASES)
def test_outputs_and_gradients_match_the_dense_path(gen, monkeypatch, scores, tv, connection, causal, r):
    x = make(gen, r=r, dv=None if tv else 5)  # untransported values may have another width
    pos = torch.arange(N, dtype=torch.float64) * 1.5 + 2.0  # positions need not be 0..n-1
    check(monkeypatch, x, scores=scores, transport_values=tv, connection=connection, is_causal=causal,
          positions=pos)


def test_mean_side_shared_metric_broadcasting_and_no_factors(gen, monkeypatch):
    """metric_side="mean" without query factors (the key term weighs 1/2), a metric shared by the tokens,
    rates shared by the batch, positions per sequence, a scalar-per-head lam; then G = lam I (no factors)."""
    x = make(gen, B=2, shared=True)
    x["rates"] = x["rates"][:1]
    pos = torch.stack([torch.arange(N, dtype=torch.float64), torch.arange(N, dtype=torch.float64) + 3.0])
    check(monkeypatch, x, metric_side="mean", positions=pos.view(2, 1, N))
    x["U_k"] = None
    check(monkeypatch, x, is_causal=True)


def test_bool_masks_and_rows_that_see_no_key(gen, monkeypatch):
    """Key padding [B, 1, 1, n] with causal (rows that see no key), then a per-element mask [n, n] with a fully
    masked row: those rows give 0 and zero gradients (SDPA's behaviour), the rest match the dense path."""
    x = make(gen, B=2, r=1)
    keep = torch.ones(2, 1, 1, N, dtype=torch.bool)
    keep[0, ..., :3] = False  # with causal: rows 0, 1, 2 of the first sequence see no key
    keep[1, ..., 17:] = False
    out, grads = check(monkeypatch, x, keep, is_causal=True)
    assert (out[0, :, :3] == 0).all() and (grads["q"][0, :, :3] == 0).all() and (grads["rates"][0, :, :3] == 0).all()
    keep = torch.rand(N, N, generator=gen) > 0.3
    keep[7] = False
    out, grads = check(monkeypatch, x, keep, transport_values=False)
    assert (out[..., 7, :] == 0).all() and (grads["q"][..., 7, :] == 0).all()


def test_finfo_min_float_masks(gen, monkeypatch):
    """An additive mask with torch.finfo(float32).min (transformers' convention), one row entirely: that row
    averages the values it sees (untransported here: every value; the scores round away next to the mask, as
    in SDPA and the dense path), with the dense path's gradients; a row of -inf gives 0. The row's maximum and
    sum are kept, not its log-sum-exp, which keeps no digit of log(sum) next to -3.4e38."""
    x = make(gen, r=2)
    low = torch.finfo(torch.float32).min
    bias = torch.randn(1, 1, N, N, generator=gen, dtype=torch.float64)
    bias[..., 1::3] = low
    bias[..., 4, :] = low
    bias[..., 9, :] = float("-inf")
    out, grads = check(monkeypatch, x, bias, transport_values=False)
    torch.testing.assert_close(out[..., 4, :].double(), x["v"].mean(-2), rtol=1e-5, atol=1e-5)
    assert (out[..., 9, :] == 0).all() and all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_compute_in_float32_and_keep_their_dtype(gen, dtype, monkeypatch):
    """Outputs and gradients in the input dtype, within its rounding of the float64 result on the same (rounded)
    inputs: 2 eps of the largest entry (the result's and the gradient's own rounding; rowsum(dO * O) reads the
    float32 output, not the rounded one)."""
    x = {k: t.to(dtype).double() for k, t in make(gen, r=1).items()}
    out, grads = call(x, forced=True, dtype=dtype, is_causal=True)
    monkeypatch.setenv("RR_DISABLE_CKERNEL", "1")
    ref, grads_ref = call(x, forced=False, is_causal=True)
    eps = torch.finfo(dtype).eps
    for a, b in [(out, ref)] + [(grads[k], grads_ref[k]) for k in grads]:
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, rtol=2 * eps, atol=2 * eps * b.abs().max().item())


def test_nothing_pairwise_is_saved_for_the_backward(gen):
    """Memory O(n d): no tensor autograd keeps has n^2 entries (the dense path keeps several n^2 d ones)."""
    n = 24
    x = {k: t.float().requires_grad_() for k, t in make(gen, n=n, d=4, r=2).items()}
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), functional._force_backend("triton"):
        out = rr.connection_attention(x["q"], x["k"], x["v"], is_causal=True, U_k=x["U_k"], lam=x["lam"],
                                      connection="content", rates=x["rates"])
    assert sizes and max(sizes) < n * n, max(sizes)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in x.values())


def test_dispatch_and_refusals(gen, monkeypatch):
    """CPU calls never take the kernels unforced; forced, a call they cannot run raises and says why; the
    backward has no double backward."""
    x = {k: t.float() for k, t in make(gen, n=8).items()}
    q, k, v, Uk, rates, lam = (x[name] for name in NAMES)
    monkeypatch.setattr(TC, "content_attention_triton", lambda *a, **kw: pytest.fail("CPU call reached Triton"))
    rr.connection_attention(q, k, v, U_k=Uk, lam=lam, connection="content", rates=rates)
    assert not TC.dispatch(q, None, 0.0, False, None, "key", "metric")
    assert TC.unsupported_reason(q, None, 0.0, False, None, "key", "metric") is None  # runnable when forced
    monkeypatch.undo()
    with functional._force_backend("triton"):
        with pytest.raises(RuntimeError, match="query-side metric factors"):
            rr.connection_attention(q, k, v, U_q=Uk, U_k=Uk, lam=lam, metric_side="mean", connection="content",
                                    rates=rates)
        with pytest.raises(RuntimeError, match="dropout_p > 0"):
            rr.connection_attention(q, k, v, None, 0.1, U_k=Uk, lam=lam, connection="content", rates=rates)
        with pytest.raises(RuntimeError, match="dtype torch.float64"):
            rr.connection_attention(q.double(), k.double(), v.double(), connection="content",
                                    rates=rates.double(), scores="dot")
        with pytest.raises(RuntimeError, match="requires grad"):
            rr.connection_attention(q, k, v, torch.zeros(8, 8, requires_grad=True), U_k=Uk, lam=lam,
                                    connection="content", rates=rates)
        qq = q.clone().requires_grad_()
        out = rr.connection_attention(qq, k, v, U_k=Uk, lam=lam, connection="content", rates=rates)
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(out.sum(), qq, create_graph=True)
    with pytest.raises(ValueError, match="block_sizes for the Triton kernels"):
        TC._check_blocks((16, 24))


def test_compiled_fullgraph_keeps_the_kernels_as_one_op(gen):
    """torch.compile(fullgraph=True) traces the kernels as the custom op riemannian_ref::triton_content_attention
    (what a compiled model on CUDA runs), forward and backward equal to the eager kernels."""
    x = {k: t.float() for k, t in make(gen, r=1).items()}
    keep = torch.ones(1, 1, 1, N, dtype=torch.bool)
    keep[..., :2] = False
    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    def attend(q, k, v, U_k, rates, lam):
        return rr.connection_attention(q, k, v, keep, is_causal=True, U_k=U_k, lam=lam, connection="content",
                                       rates=rates)

    compiled = torch.compile(attend, fullgraph=True, backend=record)
    res = {}
    for name, fn in (("compiled", compiled), ("eager", attend)):
        leaves = [x[k].clone().requires_grad_() for k in NAMES]
        with functional._force_backend("triton"):
            out = fn(*leaves)
        res[name] = (out, *torch.autograd.grad(out.square().sum(), leaves))
    assert any("riemannian_ref.triton_content_attention.default" in g for g in graphs)
    for c, e in zip(res["compiled"], res["eager"]):
        torch.testing.assert_close(c, e, rtol=0, atol=0)  # the same kernels


def test_kernels_run_in_the_interpreter_when_triton_was_imported_first():
    """triton imported before TRITON_INTERPRET=1 (another test file, a user's notebook): the kernels must not
    call triton.language's own jit functions (tl.zeros, tl.sum), which then stay compiled for a GPU."""
    import subprocess
    import sys

    code = ("import triton, os, torch\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "import riemannian_ref as rr\n"
            "from riemannian_ref.attention import _triton_content as TC, functional\n"
            "q, k, v = (torch.randn(1, 1, 8, 4) for _ in range(3))\n"
            "rates = torch.rand(1, 1, 8, 2, requires_grad=True)\n"
            "with functional._force_backend('triton'):\n"
            "    out = rr.connection_attention(q, k, v, is_causal=True, connection='content', rates=rates)\n"
            "    out.sum().backward()\n"
            "assert TC.interpreted() and rates.grad is not None\n")
    env = {k_: v_ for k_, v_ in os.environ.items() if k_ != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
