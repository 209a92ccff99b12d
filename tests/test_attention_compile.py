"""``torch.compile`` traces through the attention: the blockwise operator as a custom op.

- The op path itself: compiled with the ``eager`` backend (dynamo traces,
  the graph runs op by op, so the op's own kernels and autograd formula
  compute), it equals the dense float64 reference, output and every gradient
  (``lam``, shared and per-token factors, a float mask that requires grad),
  and refuses a double backward as the eager operator does.
- ``torch.library.opcheck``: schema, fake implementation, autograd
  registration and AOT dispatch of ``riemannian_ref::attention``.
- ``torch.compile(fullgraph=True)`` of a function calling
  ``rr.riemannian_attention`` (per-token ``U_k``, a boolean mask) with
  inductor (C++ on CPU), forward and backward, against eager and the
  reference; of the tiny Riemannian ``FiberBundleTransformer`` with the
  ``aot_eager`` backend (dynamo and AOTAutograd trace the whole model; the
  inductor code generation of the whole model would take about 30 s more on
  the test machine), forward and backward, against eager. Both check that
  the op is in the traced graph.
- A value check (``lam > 0``) survives compilation as an assertion in the
  graph.
"""
import pytest
import torch

import riemannian_ref as rr
from riemannian_ref.attention import functional

F64 = torch.float64


def _recording(backend: str, graphs: list):
    """A torch.compile backend that records every dynamo graph's call targets, then hands it to ``backend``."""
    from torch._dynamo import lookup_backend

    def compile_fn(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return lookup_backend(backend)(gm, example_inputs)
    return compile_fn


def _has_op(graphs) -> bool:
    return any("riemannian_ref.attention.default" in targets for targets in graphs)


CASES = {
    "key, per-token U_k, float mask with grad, lam per head": dict(side="key", Uk="tok", mask="float"),
    "key, shared U_k, causal, bool mask": dict(side="key", Uk="shared", mask="bool", causal=True),
    "mean, per-token U_q and U_k": dict(side="mean", Uk="tok", Uq="tok"),
    "query, per-token U_q, no factors on the key side": dict(side="query", Uq="tok"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_op_path_equals_the_reference_with_every_gradient(case, gen):
    c = CASES[case]
    B, h, n_q, n_k, d, r = 2, 2, 7, 9, 4, 2
    q = torch.randn(B, h, n_q, d, generator=gen, dtype=F64)
    k = torch.randn(B, h, n_k, d, generator=gen, dtype=F64)
    v = torch.randn(B, h, n_k, 3, generator=gen, dtype=F64)
    lam = torch.rand(h, generator=gen, dtype=F64) + 0.5
    shape = {"tok": (B, h, n_k, d, r), "shared": (B, h, d, r)}
    U_k = 0.5 * torch.randn(shape[c["Uk"]], generator=gen, dtype=F64) if c.get("Uk") else None
    U_q = 0.5 * torch.randn(B, h, n_q, d, r, generator=gen, dtype=F64) if c.get("Uq") else None
    mask = None
    if c.get("mask") == "float":
        mask = torch.randn(B, 1, n_q, n_k, generator=gen, dtype=F64)
    elif c.get("mask") == "bool":
        mask = torch.rand(B, 1, 1, n_k, generator=gen) > 0.3
    leaves = [t.requires_grad_() for t in (q, k, v, lam, U_k, U_q, mask) if t is not None and t.is_floating_point()]
    kw = dict(U_q=U_q, U_k=U_k, lam=lam, metric_side=c["side"], is_causal=c.get("causal", False))
    dout = torch.randn(B, h, n_q, 3, generator=gen, dtype=F64)
    ref = rr.riemannian_attention_reference(q, k, v, mask, **kw)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    graphs = []
    compiled = torch.compile(lambda *a: rr.riemannian_attention(*a, **kw), fullgraph=True,
                             backend=_recording("eager", graphs))
    with functional._force_backend("blockwise"):  # a shared factor alone would go to SDPA
        out = compiled(q, k, v, mask)
    grads = torch.autograd.grad(out, leaves, dout)
    assert _has_op(graphs)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=1e-9, atol=1e-11)


def test_op_path_refuses_a_double_backward(gen):
    q = torch.randn(1, 5, 3, generator=gen, dtype=F64, requires_grad=True)
    U = torch.randn(1, 5, 3, 1, generator=gen, dtype=F64)
    out = torch.compile(lambda q: rr.riemannian_attention(q, q, q, U_k=U), fullgraph=True, backend="eager")(q)
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


def test_opcheck(gen):
    Bf, n, d, r = 3, 10, 4, 2

    def t(*shape, grad=True):
        return torch.randn(*shape, generator=gen, dtype=F64).requires_grad_(grad)

    lam = (torch.rand(Bf, generator=gen, dtype=F64) + 0.5).requires_grad_()
    common = (d ** -0.5, 0.3, 0.3, [4, 4], [Bf], 1)  # ..., blocks, batch, kv_group
    op = torch.ops.riemannian_ref.attention.default
    # per-token U_k and a float mask with grad (with its row offsets); shared W, per-token U_q and causal;
    # a bool mask, no factors
    mask = t(1, n, n)
    torch.library.opcheck(op, (t(Bf, n, d), t(Bf, n, d), t(Bf, n, d), lam, None, t(Bf, n, d, r), None,
                               mask, False, *common, mask.detach().amax(-1)))
    torch.library.opcheck(op, (t(Bf, n, d), t(Bf, n, d), t(Bf, n, d), lam, t(Bf, d, 1), None, t(Bf, n, d, r),
                               None, True, *common, None))
    torch.library.opcheck(op, (t(Bf, n, d), t(Bf, n, d), t(Bf, n, d), lam, None, None, None,
                               torch.rand(Bf, 1, n, generator=gen) > 0.2, False, *common, None))


def test_compiled_function_fullgraph_inductor_matches_eager_and_reference(gen):
    B, h, n, d, r = 2, 2, 12, 8, 2
    q, k, v = (torch.randn(B, h, n, d, generator=gen) for _ in range(3))
    U = 0.3 * torch.randn(B, h, n, d, r, generator=gen)
    mask = torch.rand(B, 1, n, n, generator=gen) > 0.3
    mask[..., 0] = True  # every row sees a key

    def fn(q, k, v, U, mask):
        return rr.riemannian_attention(q, k, v, mask, U_k=U, lam=1.5)

    graphs = []
    compiled = torch.compile(fn, fullgraph=True, backend=_recording("inductor", graphs))
    dout = torch.randn(B, h, n, d, generator=gen)
    res = {}
    for name, f, dtype in (("compiled", compiled, torch.float32), ("eager", fn, torch.float32),
                           ("reference", rr.riemannian_attention_reference, F64)):
        xs = [x.to(dtype).requires_grad_() for x in (q, k, v, U)]
        out = f(*xs, mask) if name != "reference" else f(*xs[:3], mask, U_k=xs[3], lam=1.5)
        res[name] = (out, *torch.autograd.grad(out, xs, dout.to(dtype)))
    assert _has_op(graphs)
    for c, e, ref in zip(res["compiled"], res["eager"], res["reference"]):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)  # float32 round-off
        torch.testing.assert_close(c.double(), ref, rtol=1e-4, atol=1e-5)


def test_compiled_transformer_fullgraph_matches_eager():
    torch.manual_seed(0)
    model = rr.FiberBundleTransformer(rr.FiberBundleConfig.tiny(mode="riemannian"))
    idx = torch.randint(model.config.vocab_size, (2, 16))
    graphs = []
    compiled = torch.compile(model, fullgraph=True, backend=_recording("aot_eager", graphs))
    out = compiled(idx)
    grads = torch.autograd.grad(out.logits.square().sum(), list(model.parameters()))
    ref = model(idx)
    ref_grads = torch.autograd.grad(ref.logits.square().sum(), list(model.parameters()))
    assert _has_op(graphs)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-6, atol=1e-6)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-6)


def test_compiled_value_check_becomes_an_assertion_in_the_graph(gen):
    q = torch.randn(1, 6, 4, generator=gen)

    def fn(q, lam):
        return rr.riemannian_attention(q, q, q, lam=lam)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, torch.tensor(2.0)), fn(q, torch.tensor(2.0)))
    with pytest.raises(RuntimeError, match="lam must be finite and > 0"):
        compiled(q, torch.tensor(-1.0))


def test_compiled_gqa_with_a_float_mask_matches_the_reference(gen):
    """Grouped-query heads and a float mask whose rows are offset by their maxima, traced with fullgraph=True."""
    B, hq, hk, n, d, r = 2, 4, 2, 9, 4, 2
    q = torch.randn(B, hq, n, d, generator=gen, dtype=F64)
    k, v = (torch.randn(B, hk, n, d, generator=gen, dtype=F64) for _ in range(2))
    U = 0.3 * torch.randn(B, hk, n, d, r, generator=gen, dtype=F64)
    mask = torch.randn(B, 1, n, n, generator=gen, dtype=F64)
    mask[1, ..., :3] = torch.finfo(F64).min  # padding as transformers writes it

    def fn(q, k, v, U):
        return rr.riemannian_attention(q, k, v, mask, is_causal=True, U_k=U, lam=0.8, enable_gqa=True)

    graphs = []
    compiled = torch.compile(fn, fullgraph=True, backend=_recording("aot_eager", graphs))
    xs = [x.clone().requires_grad_() for x in (q, k, v, U)]
    out = compiled(*xs)
    grads = torch.autograd.grad(out.square().sum(), xs)
    ys = [x.clone().requires_grad_() for x in (q, k, v, U)]
    g = hq // hk
    ref = rr.riemannian_attention_reference(ys[0], ys[1].repeat_interleave(g, 1), ys[2].repeat_interleave(g, 1),
                                            mask, is_causal=True, U_k=ys[3].repeat_interleave(g, 1), lam=0.8)
    ref_grads = torch.autograd.grad(ref.square().sum(), ys)
    assert _has_op(graphs)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_calls_without_per_token_factors_compile_through_sdpa(gen):
    """No per-token factor: the dispatch's SDPA form, traced with fullgraph=True, equals the reference."""
    q, k, v = (torch.randn(2, 2, 7, 4, generator=gen, dtype=F64) for _ in range(3))
    U = 0.5 * torch.randn(2, 2, 4, 2, generator=gen, dtype=F64)
    keep = torch.rand(2, 1, 1, 7, generator=gen) > 0.3
    graphs = []
    fn = torch.compile(lambda q, k, v: rr.riemannian_attention(q, k, v, keep, is_causal=True, U_k=U, lam=0.7),
                       fullgraph=True, backend=_recording("eager", graphs))
    ref = rr.riemannian_attention_reference(q, k, v, keep, is_causal=True, U_k=U, lam=0.7)
    torch.testing.assert_close(fn(q, k, v), ref, rtol=1e-12, atol=1e-12)
    assert not _has_op(graphs) and any("scaled_dot_product_attention" in t for g in graphs for t in g)
