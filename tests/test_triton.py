"""The Triton kernels of riemannian_attention (riemannian_ref.attention._triton) on CPU, in Triton's interpreter.

Triton reads TRITON_INTERPRET when a kernel is defined, i.e. when the module
riemannian_ref.attention._triton is imported: this file sets it before that
import (the package itself never imports the module, only a CUDA call or this
test does). Under pytest-xdist (``--dist loadfile``) the variable is set in
every worker that collects this file; it only affects Triton. Every call is
the public ``rr.riemannian_attention`` inside the private
``functional._force_backend("triton")``, which sends it to the kernels on
any device (so the tests run what CUDA calls run). Oracle: the
dense reference, outputs and every gradient, in float32, and per input dtype
in float64 within first-order round-off bounds (their derivation and cases
live in benchmarks/check_triton_precision.py, which also writes the measured
table). The shapes are tiny
(the interpreter runs each program in numpy) and the blocks are 16, so
n = 33 spans three blocks with a partial one. No GPU speed is measured here.
"""
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (see the module docstring)

import pytest  # noqa: E402
import torch  # noqa: E402

import riemannian_ref as rr  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (optional: pip install riemannian_ref[gpu])")
from riemannian_ref.attention import _triton as T  # noqa: E402
from riemannian_ref.attention import functional  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import check_triton_precision as precision  # noqa: E402  (the round-off bounds and their cases)

if not T.interpreted():
    pytest.skip("riemannian_ref.attention._triton was imported before TRITON_INTERPRET=1 was set in this "
                "process, so its kernels are compiled for a GPU; run this file on its own",
                allow_module_level=True)

F32 = torch.float32
BLOCKS = (16, 16)


def on_triton(*args, **kw):
    """The public call rr.riemannian_attention with its dispatch forced onto the Triton kernels (its validation,
    autocast, dtype and GQA handling as for any call; ``block_sizes`` go to the kernels)."""
    with functional._force_backend("triton"):
        return rr.riemannian_attention(*args, **kw)


def make(gen, side, *, B=1, h=2, nq=33, nk=33, d=16, r=2, dv=16, shared=False, dtype=F32):
    q = torch.randn(B, h, nq, d, generator=gen)
    k = torch.randn(B, h, nk, d, generator=gen)
    v = torch.randn(B, h, nk, dv, generator=gen)
    tq, tk = ((), ()) if shared else ((nq,), (nk,))
    Uq = 0.5 * torch.randn(B, h, *tq, d, r, generator=gen) if side in ("query", "mean") else None
    Uk = 0.5 * torch.randn(B, h, *tk, d, r, generator=gen) if side in ("key", "mean") else None
    lam = torch.rand(h, generator=gen) + 0.5
    return [t.to(dtype) if t is not None else None for t in (q, k, v, lam, Uq, Uk)]


def key_padding(gen, B, nk):
    """[B, 1, 1, n_k] bool: each sequence has its last keys padded (at least key 0 stays)."""
    keep = torch.ones(B, 1, 1, nk, dtype=torch.bool)
    for b in range(B):
        keep[b, ..., int(torch.randint(1, nk, (1,), generator=gen)):] = False
    return keep


def outputs_and_grads(fn, ins, mask, causal, side, **kw):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in ins]
    q, k, v, lam, Uq, Uk = leaves
    out = fn(q, k, v, mask, is_causal=causal, lam=lam, U_q=Uq, U_k=Uk, metric_side=side, **kw)
    g = torch.linspace(-1.0, 1.0, out.numel()).view(out.shape).to(out.dtype)  # a fixed upstream gradient
    used = [t for t in leaves if t is not None]
    return [out, *torch.autograd.grad(out, used, g)]


def check_against_reference(ins, mask, causal, side, rtol=1e-4):
    tri = outputs_and_grads(on_triton, ins, mask, causal, side, block_sizes=BLOCKS)
    ref = outputs_and_grads(rr.riemannian_attention_reference, ins, mask, causal, side)
    names = ["out", "q", "k", "v", "lam"] + [n for n, t in (("U_q", ins[4]), ("U_k", ins[5])) if t is not None]
    for name, a, b in zip(names, tri, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * b.abs().max().item(), msg=lambda m: f"{name}: {m}")
    return tri


CASES = [  # (side, n, r, mask kind, causal)
    ("key", 16, 1, "none", False),
    ("key", 33, 2, "none", True),
    ("key", 33, 1, "padding", False),
    ("key", 33, 2, "padding", True),
    ("query", 33, 2, "none", True),
    ("query", 16, 1, "padding", False),
    ("mean", 33, 1, "none", False),
    ("mean", 33, 2, "padding", True),
]


@pytest.mark.parametrize("side, n, r, mask_kind, causal", CASES)
def test_outputs_and_gradients_match_the_dense_reference(gen, side, n, r, mask_kind, causal):
    ins = make(gen, side, B=2, nq=n, nk=n, r=r)
    mask = key_padding(gen, 2, n) if mask_kind == "padding" else None
    check_against_reference(ins, mask, causal, side)


@pytest.mark.parametrize("side", ["key", "mean"])
def test_shared_metrics_and_more_queries_than_keys(gen, side):
    """Shared factors [..., d, r] (expanded per token; the gradient sums back), n_q != n_k, odd d and d_v."""
    ins = make(gen, side, nq=21, nk=18, d=12, dv=5, shared=True)
    check_against_reference(ins, None, True, side)  # causal, top-left aligned as SDPA


def test_no_metric_factors_is_distance_attention(gen):
    ins = make(gen, "key", nq=20, nk=20)
    ins[5] = None  # G = lam I
    check_against_reference(ins, None, False, "key")


def test_general_bool_and_float_masks_and_dead_rows(gen):
    """A per-element boolean mask with a fully masked row, and an additive float mask (no grad) with -inf."""
    ins = make(gen, "key", B=2, nq=20, nk=18, r=1)
    keep = torch.rand(20, 18, generator=gen) > 0.4
    keep[:, 0] = True
    keep[3] = False  # a row that sees no key
    out, dq, *_ = check_against_reference(ins, keep, False, "key")
    assert (out[..., 3, :] == 0).all() and (dq[..., 3, :] == 0).all()
    bias = torch.randn(2, 1, 20, 18, generator=gen).masked_fill(~keep, float("-inf"))
    out, *grads = check_against_reference(ins, bias, True, "key")
    assert (out[..., 3, :] == 0).all() and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("case", precision.QUICK, ids=lambda c: c.name)
def test_round_off_per_dtype_within_its_first_order_bound(dtype, case):
    """Output and every gradient (q, k, v, lam, U_q, U_k) against the float64 reference on the same inputs
    (drawn in float64, rounded to the dtype): every entry's error is within its first-order bound, derived
    from the dtype's unit roundoff u, float32's and the sizes n, d, d_v, g (benchmarks/check_triton_precision.py
    ``bounds``: u times the sums of absolute values of the terms the kernels round, half products on the
    difference form, plus the float32 scores' and sums' error), and half inputs keep their dtype. Shifted
    queries and keys (|q|, |k| about 16-23, |q - k| about 6-8), masks, causal and grouped-query cases."""
    rows = precision.measure(case, precision.DTYPES[dtype])
    for name, r in rows.items():
        assert r["ratio"] <= 1.0, f"{name}: error {r['err']:.3g} exceeds its bound (ratio {r['ratio']:.3g})"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_round_off_does_not_grow_with_a_common_offset(gen, dtype):
    """Moving every query and key by one vector c changes no score, so no output and no gradient; the half
    kernels' error must not grow with |q| either. It would if the backward rounded dS differently in the two
    terms of an expanded difference (sum_i dS_ij q_i - (sum_i dS_ij) k_j) or dropped the gradient of the
    isotropic row constant -scale lam |q_i|^2 / 2, whose terms cancel only while sum_j dS_ij = 0, which the
    rounding breaks: an error proportional to |q|. Inputs on a 2**-4 grid with |q + c| < 16 make q + c exact in
    both dtypes and the float64 reference the same with and without c; with c = +-8 per coordinate an error
    growing with |q| would grow by rms|q + c| / rms|q| (about 8), and the test allows the square root of that,
    halfway on a log scale between no growth and that growth."""
    case = precision.Case("offset", "key", B=1, h=2, h_kv=2, n=24, d=16, r=1, causal=True)
    grid = lambda t: (t.clamp(-3, 3) * 16).round() / 16  # noqa: E731
    q, k = grid(torch.randn(1, 2, 24, 16, generator=gen)), grid(torch.randn(1, 2, 24, 16, generator=gen))
    c = 8.0 * torch.randn(16, generator=gen).sign()
    rest = dict(v=torch.randn(1, 2, 24, 16, generator=gen), lam=torch.rand(2, generator=gen) + 0.5, U_q=None,
                U_k=0.5 * torch.randn(1, 2, 24, 16, 1, generator=gen))
    grad = torch.randn(1, 2, 24, 16, generator=gen).to(dtype)
    rel = {}
    for shift in (0.0, 1.0):
        ins = dict(q=q + shift * c, k=k + shift * c, **rest)
        ins = {name: t.to(dtype) if t is not None else None for name, t in ins.items()}
        assert torch.equal(ins["q"].double() - ins["k"].double(), q.double() - k.double())  # exact shift
        rows = precision.measure(case, dtype, data=dict(ins=ins, mask=None, grad=grad))
        rel[shift] = {name: r["err"] / r["ref"] for name, r in rows.items()}
    growth = ((q + c).square().mean() / q.square().mean()).sqrt().item()
    for name in rel[0.0]:
        assert rel[1.0][name] <= growth ** 0.5 * rel[0.0][name], (name, rel, growth)


def test_precision_table_lists_every_dtype_and_tensor():
    """The table check_triton_precision.py writes: a row per (dtype, offset), a column per tensor, the
    largest relative error over the cases and the largest ratio to the bound (a tensor absent from a case is
    skipped there)."""
    row = {n: dict(err=2e-3, ref=4.0, ratio=0.5) for n in precision.TENSORS if n != "U_q"}
    text = precision.table({("bf16", 0.0): [row, dict(row, U_q=dict(err=1.0, ref=1.0, ratio=0.25))],
                            ("fp32", 4.0): [row]})
    assert "| bf16 | 3.9e-03 | 0 | 5.0e-04 | 5.0e-04 |" in text and "| 1.0e+00 | 5.0e-04 |" in text
    assert "| fp32 | 6.0e-08 | 4 | 0.5 |" in text and "| 0.25 |" in text and "| - |" in text


def test_finfo_min_rows_follow_sdpa(gen):
    """Rows masked with torch.finfo(dtype).min (transformers' convention) give SDPA's result, the average of the
    values they see, with the reference's gradients (they were 0 here, NaN on the CPU operator); -inf rows 0."""
    ins = make(gen, "key", B=2, nq=20, nk=18, r=1)
    low = torch.finfo(torch.float32).min
    bias = torch.randn(2, 1, 20, 18, generator=gen)
    bias[:, :, 3] = low  # every key at finfo.min
    bias[:, :, 5, :7], bias[:, :, 5, 7:] = low, float("-inf")  # finfo.min on the first 7 keys, the rest removed
    bias[:, :, 9] = float("-inf")  # no key at all
    out, *grads = check_against_reference(ins, bias, False, "key")
    v = ins[2]
    torch.testing.assert_close(out[..., 3, :], v.mean(-2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[..., 5, :], v[..., :7, :].mean(-2), rtol=1e-5, atol=1e-5)
    assert (out[..., 9, :] == 0).all() and all(torch.isfinite(g).all() for g in grads)
    sdpa = torch.nn.functional.scaled_dot_product_attention(ins[0], ins[1], v, bias)  # the same masking
    torch.testing.assert_close(out[..., (3, 5, 9), :], sdpa[..., (3, 5, 9), :], rtol=1e-5, atol=1e-5)
    pad = torch.zeros(2, 1, 1, 18)
    pad[0, ..., :4] = low  # left padding with finfo.min and causal rows: rows 0..3 of sequence 0 see only padding
    check_against_reference(ins, pad, True, "key")


def test_gqa_reads_the_key_heads_without_repeating_them(gen, monkeypatch):
    """enable_gqa: the kernels get the key heads as they are (key head b // g), per-token factors and lam per
    key head; outputs and every gradient equal the reference with the heads repeated."""
    q, k, v, _, _, Uk = make(gen, "key", B=2, nq=20, nk=20, h=4, r=2)
    k, v, Uk = k[:, :2], v[:, :2], Uk[:, :2]
    lam = torch.rand(2, generator=gen) + 0.5  # per key head
    keep = key_padding(gen, 2, 20)
    seen = []
    apply = T._TritonAttentionFn.apply
    monkeypatch.setattr(T._TritonAttentionFn, "apply", lambda *a: seen.append(a[1].shape) or apply(*a))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, Uk, lam)]
    out = on_triton(*leaves[:3], keep, is_causal=True, U_k=leaves[3], lam=leaves[4], enable_gqa=True,
                    block_sizes=BLOCKS)
    assert seen == [torch.Size([2 * 2, 20, 16])]  # B * h_kv key rows, not B * h_q
    w = torch.linspace(-1.0, 1.0, out.numel()).view(out.shape)
    grads = torch.autograd.grad(out, leaves, w)
    rep = [t.clone().requires_grad_() for t in (q, k, v, Uk, lam)]
    ref = rr.riemannian_attention_reference(rep[0], rep[1].repeat_interleave(2, 1), rep[2].repeat_interleave(2, 1),
                                            keep, is_causal=True, U_k=rep[3].repeat_interleave(2, 1),
                                            lam=rep[4].repeat_interleave(2))
    grads_ref = torch.autograd.grad(ref, rep, w)
    for a, b in zip((out, *grads), (ref, *grads_ref)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


def test_unsupported_cases_are_refused_clearly(gen):
    """Forced onto the kernels, a call they cannot run raises and says why (it never falls back silently); bad
    kernel block sizes are a ValueError naming block_sizes."""
    q, k, v, lam, _, Uk = make(gen, "key", nq=16, nk=16)
    bias = torch.zeros(16, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="do not support this call: a float attn_mask that requires grad"):
        on_triton(q, k, v, bias, U_k=Uk, lam=lam)
    with pytest.raises(RuntimeError, match="do not support this call: dropout_p > 0"):
        on_triton(q, k, v, None, 0.1, U_k=Uk, lam=lam)
    with pytest.raises(RuntimeError, match="do not support this call: dtype torch.float64"):
        on_triton(q.double(), k.double(), v.double(), U_k=Uk.double(), lam=lam.double())
    with pytest.raises(RuntimeError, match="head dimension above 256"):
        on_triton(*(torch.zeros(1, 1, 2, 257) for _ in range(3)))
    with pytest.raises(ValueError, match="block_sizes for the Triton kernels must be two powers of two"):
        on_triton(q, k, v, U_k=Uk, lam=lam, block_sizes=(16, 24))
    with pytest.raises(ValueError, match="block_sizes must be a pair of positive ints"):  # the public check first
        on_triton(q, k, v, U_k=Uk, lam=lam, block_sizes=(0, 16))
    with pytest.raises(ValueError, match="lam must be finite and > 0"):  # validated as without the block
        on_triton(q, k, v, U_k=Uk, lam=-lam)
    with pytest.raises(ValueError, match="backend must be 'triton'"):
        functional._force_backend("sdpa").__enter__()
    assert functional._FORCED_BACKEND is None  # the block ended (also when its call raised)
    qq = q.clone().requires_grad_()
    out = on_triton(qq, k, v, U_k=Uk, lam=lam, block_sizes=BLOCKS)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), qq, create_graph=True)


def test_dispatch_rule(gen, monkeypatch):
    """CPU calls keep the PyTorch operator; the Triton path is for CUDA tensors and can be switched off."""
    q, k, v, lam, _, Uk = make(gen, "key", nq=8, nk=8, d=4, dv=4)
    assert not T.usable(q, v, None, None, Uk)  # CPU tensors: never dispatched, even under the interpreter
    assert T.unsupported_reason(q, v, None, None, Uk) is None  # ... but runnable through the test entry point
    flat = T.attention_flat
    monkeypatch.setattr(T, "attention_flat", lambda *a, **kw: pytest.fail("CPU call reached the Triton path"))
    rr.riemannian_attention(q, k, v, U_k=Uk, lam=lam)
    calls = []
    monkeypatch.setattr(T, "attention_flat", lambda *a: calls.append(a[-2:]) or flat(*a))
    monkeypatch.setenv("RR_DISABLE_TRITON", "1")  # forcing overrides the switch
    on_triton(q, k, v, U_k=Uk, lam=lam, block_sizes=(32, 16))
    assert calls == [((32, 16), 1)]  # the public call's block_sizes reach the kernels
    monkeypatch.setenv("RR_DISABLE_TRITON", "1")
    assert T.disabled_by_env() and functional._triton_disabled()


def test_the_dispatch_call_site(gen, monkeypatch):
    """riemannian_attention's own call of the kernels (CUDA tensors take it; here forced onto CPU tensors, in the
    interpreter): half inputs, grouped-query views read in place, a finfo.min row, every gradient."""
    monkeypatch.setattr(functional, "_triton_path", lambda *a: True)
    seen = []
    apply = T._TritonAttentionFn.apply
    monkeypatch.setattr(T._TritonAttentionFn, "apply", lambda *a: seen.append(a[1].shape) or apply(*a))
    q, k, v, _, _, Uk = make(gen, "key", nq=18, nk=18, h=4, r=1, dtype=torch.bfloat16)
    k, v, Uk = k[:, :2], v[:, :2], Uk[:, :2]
    lam = (torch.rand(4, generator=gen) + 0.5).bfloat16()
    bias = torch.randn(1, 4, 18, 18, generator=gen).bfloat16()
    bias[..., 5, :] = torch.finfo(torch.bfloat16).min
    leaves = [t.clone().requires_grad_() for t in (q, k, v, Uk)]
    out = rr.riemannian_attention(*leaves[:3], bias, 0.0, True, U_k=leaves[3], lam=lam, enable_gqa=True)
    assert seen == [torch.Size([2, 18, 16])] and out.dtype == torch.bfloat16  # B * h_kv key rows
    w = torch.linspace(-1.0, 1.0, out.numel()).view(out.shape).bfloat16()  # the reference gets the same w
    grads = torch.autograd.grad(out, leaves, w)
    rep = [t.float().requires_grad_() for t in (q, k, v, Uk)]
    ref = rr.riemannian_attention_reference(rep[0], *(t.repeat_interleave(2, 1) for t in rep[1:3]), bias.float(),
                                            0.0, True, U_k=rep[3].repeat_interleave(2, 1), lam=lam.float())
    grads_ref = torch.autograd.grad(ref, rep, w.float())
    # the result's rounding (the kernels round to nearest in the interpreter too), the bfloat16 products of P
    # and dS, and in the gradients rowsum(dO * O) from the output as stored in bfloat16
    eps = torch.finfo(torch.bfloat16).eps
    for a, b in zip((out, *grads), (ref, *grads_ref)):
        assert a.dtype == torch.bfloat16
        assert ((a.float() - b).abs() <= 2 * eps * (b.abs() + 1 + b.abs().max())).all()


def test_blocks_shrink_when_the_gpu_lacks_resources():
    """A launch that runs out of shared memory is retried with the larger block halved, down to 16."""
    from triton.runtime.errors import OutOfResources

    tried = []

    def launch(blocks):
        tried.append(blocks)
        if blocks[0] * blocks[1] > 32 * 32:
            raise OutOfResources(100_000, 99_000, "shared memory")

    assert T._fitting_blocks(launch, (64, 64)) == (32, 32)
    assert tried == [(64, 64), (32, 64), (32, 32)]
    with pytest.raises(OutOfResources):
        T._fitting_blocks(lambda b: launch((64, 64)), (32, 16))


def test_rows_whose_scores_are_all_far_below_zero(gen):
    """Every key far from every query (scores around -1e3): the online softmax keeps the rows exact, no NaN."""
    ins = make(gen, "key", nq=20, nk=20, r=1)
    ins[0] = ins[0] + 12.0  # |q - k|^2 ~ 16 * 144: exp of the raw scores underflows in float32
    out, *grads = check_against_reference(ins, None, True, "key")
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)


def test_compiled_fullgraph_keeps_the_kernels_as_one_op(gen):
    """torch.compile(fullgraph=True) traces the Triton path as the custom op riemannian_ref::triton_attention
    (what a compiled model on CUDA runs), forward and backward equal to the eager kernels and the reference."""
    q, k, v, lam, _, Uk = make(gen, "key", nq=20, nk=20)
    keep = key_padding(gen, 1, 20)
    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    fn = torch.compile(lambda *a: rr.riemannian_attention(*a[:3], keep, is_causal=True, U_k=a[3], lam=a[4]),
                       fullgraph=True, backend=record)
    res = {}
    for name in ("compiled", "eager", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, Uk, lam)]
        if name == "reference":
            out = rr.riemannian_attention_reference(*leaves[:3], keep, is_causal=True, U_k=leaves[3], lam=leaves[4])
        else:
            with functional._force_backend("triton"):
                out = (fn if name == "compiled" else
                       (lambda *a: rr.riemannian_attention(*a[:3], keep, is_causal=True, U_k=a[3], lam=a[4])))(*leaves)
        res[name] = (out, *torch.autograd.grad(out.square().sum(), leaves))
    assert any("riemannian_ref.triton_attention.default" in g for g in graphs)
    for c, e, r in zip(res["compiled"], res["eager"], res["reference"]):
        torch.testing.assert_close(c, e, rtol=0, atol=0)  # the same kernels
        torch.testing.assert_close(c, r, rtol=1e-4, atol=1e-4)


def test_the_cumulative_connection_reaches_the_kernels(gen):
    """connection="cumulative" turns q, k, v and the factors into one frame and calls the ordinary dispatch:
    on the kernels, outputs and gradients (the rates' included) match the dense path of the same call."""
    q, k, v, lam, _, U = make(gen, "key", B=2, nq=33, nk=33)
    rates = 0.5 * torch.rand(2, 2, 33, 8, generator=gen)

    def run(kernels):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, U, rates)]
        kw = dict(U_q=leaves[3], U_k=leaves[3], lam=lam, metric_side="mean", connection="cumulative",
                  rates=leaves[4], is_causal=True)
        if kernels:
            with functional._force_backend("triton"):
                out = rr.connection_attention(*leaves[:3], **kw)
        else:  # with the weights: the dense reference in the same frame
            out = rr.connection_attention(*leaves[:3], **kw, return_weights=True)[0]
        g = torch.linspace(-1.0, 1.0, out.numel()).view(out.shape)
        return [out, *torch.autograd.grad(out, leaves, g)]

    for name, a, b in zip(["out", "q", "k", "v", "U", "rates"], run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item(), msg=lambda m: f"{name}: {m}")
