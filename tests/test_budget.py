"""The cost model (riemannian_ref.models.budget) against what actually runs.

Matrix-product FLOPs are compared with torch.utils.flop_counter.FlopCounterMode:
``attention_flops``, the one count of an attention kernel that the cost model
and the benchmarks share, on the operator and SDPA alone; ``estimate_cost`` on
a forward and a backward pass of real models in every mode (the counter
misses in-place ``baddbmm_``, which the operator uses: it is added as a custom
formula); activation memory with the bytes of the tensors autograd saves for
the backward. Both must agree closely: the chapter evaluates the same model at
GPT-2, 1.3B and 7B shapes.
"""
import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import riemannian_ref as rr
from _helpers import nested
from riemannian_ref.attention import _content_cpu, functional
from riemannian_ref.models.budget import attention_flops, estimate_cost

aten = torch.ops.aten

CONFIGS = [dict(mode="euclidean"), dict(mode="riemannian"), dict(mode="riemannian", metric_side="mean"),  # nested()
           dict(mode="riemannian", metric_side="query"), dict(mode="riemannian", connection="flat"),
           dict(mode="riemannian", connection="cumulative"),
           dict(mode="riemannian", metric="shared"), dict(mode="fiber_bundle"),
           dict(mode="fiber_bundle", metric_side="mean"), dict(mode="riemannian", subspace=3),
           dict(mode="riemannian", subspace=3, metric_side="mean"),
           dict(mode="riemannian", subspace=3, metric_side="query"),
           dict(mode="riemannian", subspace=3, connection="flat"),
           dict(mode="riemannian", subspace=2, metric_form="factor")]  # the gains form needs rank <= subspace


def _inplace_bmm(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):
    b, m, k = a_shape
    return 2 * b * m * k * b_shape[-1]


def counted_flops(call):
    """Matrix-product FLOPs of ``call()`` and of the backward of its output, as FlopCounterMode counts them."""
    with sdpa_kernel(SDPBackend.MATH):  # the CPU flash kernel is not counted; the math path is
        with FlopCounterMode(display=False, custom_mapping={aten.baddbmm_: _inplace_bmm}) as fc:
            out = call()
        fwd = fc.get_total_flops()
        with FlopCounterMode(display=False, custom_mapping={aten.baddbmm_: _inplace_bmm}) as fc:
            out.square().sum().backward()
        return fwd, fc.get_total_flops()


def saved_bytes(model, idx):
    """Bytes of the activations autograd keeps for the backward (parameters excluded, storages once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx)
    return sum(seen.values())


@pytest.mark.parametrize("fused", [True, False], ids=["fused-content", "dense-content"])
@pytest.mark.parametrize("extra", CONFIGS, ids=lambda e: "-".join(map(str, e.values())))
def test_matmul_flops_and_activations_match_what_runs(extra, fused, monkeypatch):
    content = rr.FiberBundleConfig.tiny(**nested(**extra)).connection_resolved in ("content", "content_source")
    if not fused:
        if not content:
            pytest.skip("the switch only changes the content connections")
        monkeypatch.setenv("RR_DISABLE_CKERNEL", "1")  # the dense path, as on CUDA or without a C compiler
    elif content and not _content_cpu.available():
        pytest.skip(f"no fused content kernel here: {_content_cpu.unavailable_reason()}")
    torch.manual_seed(0)
    n = 40
    cfg = rr.FiberBundleConfig.tiny(block_size=n, **nested(rank=3, **extra))
    model = rr.FiberBundleTransformer(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, n))
    fwd, bwd = counted_flops(lambda: model(idx).logits)
    cost = estimate_cost(cfg, n, batch=2, fused_content=fused)
    tot = cost["flops"]["total"]
    # the math path does not recompute the scores in its backward, FlashAttention-2 does (2 n^2 hd per layer)
    m, att = cfg.attention.subspace, cfg.attention
    lifted = m is not None and cfg.connection_resolved == "trivial"  # factors in a subspace: SDPA, lifted inputs
    on_sdpa = cfg.mode == "euclidean" or (att.metric == "shared" and cfg.connection_resolved != "content") or lifted
    head = cfg.qk_dim + (1 if cfg.mode != "euclidean" else 0)  # the dot-product form carries the key term
    if lifted:  # and m(m+1)/2 coordinates per subspace side (both sides: m more for the key side's cross term)
        head += m * (m + 1) // 2 * (2 if att.metric_side == "mean" else 1) + (m if att.metric_side == "mean" else 0)
    recompute = 2 * 2 * n * n * cfg.n_heads * head * cfg.n_layers if on_sdpa else 0
    assert tot["matmul_fwd"] == pytest.approx(fwd, rel=0.01)
    assert tot["matmul_bwd"] - recompute == pytest.approx(bwd, rel=0.01)
    assert sum(cost["memory"]["activations"].values()) == pytest.approx(saved_bytes(model, idx), rel=0.08)


@pytest.mark.parametrize("side,rank", [("key", 0), ("key", 1), ("key", 3), ("query", 2), ("mean", 1), ("mean", 3),
                                       ("sdpa", 0)])
def test_attention_flops_is_what_the_kernels_run(side, rank):
    """The per-(batch, head) count of the operator and of SDPA against the counter, forward and backward."""
    B, h, n, d = 2, 3, 40, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, n, d, generator=g, requires_grad=True) for _ in range(3))
    U = torch.randn(B, h, n, d, rank, generator=g) / d
    if side == "sdpa":
        call = functools.partial(F.scaled_dot_product_attention, q, k, v)
        est = attention_flops(n, d, kernel="sdpa")
        recompute = 2 * n * n * d  # FlashAttention-2 recomputes the scores, the math path does not
    else:
        U = U if rank else None  # G = lam I: forced onto the operator below
        factors = dict(U_k=U if side != "query" else None, U_q=U if side != "key" else None)
        call = functools.partial(rr.riemannian_attention, q, k, v, metric_side=side, **factors)
        est = attention_flops(n, d, rank, metric_side=side)
        recompute = 0
    with contextlib.nullcontext() if side == "sdpa" else functional._force_backend("blockwise"):
        fwd, bwd = counted_flops(call)
    assert est["matmul_fwd"] * B * h == fwd
    assert (est["matmul_bwd"] - recompute) * B * h == bwd
    half = attention_flops(n, d, rank, kernel="sdpa" if side == "sdpa" else "blockwise",
                           metric_side="key" if side == "sdpa" else side, causal_skip=True)
    assert half == {key: val / 2 for key, val in est.items()}  # every pairwise term halves


def test_pairwise_terms_and_memory_scale_as_expected():
    base = rr.FiberBundleConfig.small(mode="riemannian")
    c1, c2 = estimate_cost(base, 512), estimate_cost(base, 1024)
    att1, att2 = c1["flops"]["attention"]["total"], c2["flops"]["attention"]["total"]
    assert 2 < att2 / att1 < 4  # projections linear in n, pairs quadratic
    assert c1["flops"]["metric"]["total"] * 2 == pytest.approx(c2["flops"]["metric"]["total"])  # per token
    skip = estimate_cost(base, 1024, causal_skip=True)
    assert skip["flops"]["metric"] == c2["flops"]["metric"]  # per token: nothing to skip
    assert skip["flops"]["attention"]["total"] < 0.75 * att2  # the pairwise part halves
    assert c2["memory"]["pairwise"] == 0  # the operator recomputes: nothing pairwise is kept
    fb = rr.FiberBundleConfig.small(mode="fiber_bundle")
    assert estimate_cost(fb, 4096)["memory"]["pairwise"] == 0  # the fused content kernel recomputes its rows
    p1, p2 = (estimate_cost(fb, n, fused_content=False)["memory"]["pairwise"] for n in (256, 512))
    assert p2 == pytest.approx(4 * p1) and p1 > 0  # the content connection's dense path keeps O(n^2 d) per layer
    half = estimate_cost(base, 1024, dtype_bytes=2)["memory"]
    assert sum(half["activations"].values()) * 2 == pytest.approx(sum(c2["memory"]["activations"].values()))
    eu = estimate_cost(base.replace(mode="euclidean"), 1024)["flops"]
    assert eu["metric"]["total"] == eu["connection"]["total"] == 0


def test_subspace_metrics_cost_a_wider_dot_product_not_r_products():
    """With factors in an m-dim subspace the pairwise cost grows with m(m+1)/2, not with the rank r."""
    # the factor form: its rank may exceed the subspace's dimension (the gains form's may not)
    base = rr.FiberBundleConfig.small(mode="riemannian", attention=dict(rank=4, metric_form="factor"))
    sub = base.replace(attention=dict(subspace=2))
    for seq in (1024, 4096):
        tok, lift = (estimate_cost(c, seq)["flops"]["attention"]["total"] for c in (base, sub))
        eu = estimate_cost(base.replace(mode="euclidean"), seq)["flops"]["attention"]["total"]
        assert eu < lift < tok
        net = (estimate_cost(c, seq)["flops"]["metric"]["total"] for c in (sub, base))
        assert next(net) < next(net)  # the network computes m r coefficients per head, not d r entries
    r8 = estimate_cost(sub.replace(attention=dict(rank=8)), 4096)["flops"]["attention"]
    r4 = estimate_cost(sub, 4096)["flops"]["attention"]
    assert r8["total"] / r4["total"] < 1.01  # the rank only enters the per-token products


@pytest.mark.parametrize("kw,match", [(dict(seq_len=0), "seq_len must be an int >= 1"),
                                      (dict(batch=1.5), "batch must be an int >= 1"),
                                      (dict(dtype_bytes=True), "dtype_bytes must be an int >= 1"),
                                      (dict(optimizer_states=-1), "optimizer_states must be an int >= 0"),
                                      (dict(causal_skip=1), "causal_skip must be a bool")])
def test_bad_arguments_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        estimate_cost(rr.FiberBundleConfig.tiny(), **kw)


@pytest.mark.parametrize("kw,match", [(dict(n=0), "n must be"), (dict(d=2.0), "d must be"),
                                      (dict(rank=-1), "rank must be"), (dict(kernel="flash"), "kernel must be"),
                                      (dict(metric_side="left"), "metric_side must be"),
                                      (dict(causal_skip=None), "causal_skip must be"),
                                      (dict(kernel="sdpa", rank=2), "rank must be 0 for kernel='sdpa'")])
def test_attention_flops_refuses_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        attention_flops(**{"n": 8, "d": 4, **kw})


def test_parameter_total_of_the_cost_model_is_count_parameters():
    from riemannian_ref.models.budget import _parameter_total

    for mode in ("euclidean", "riemannian", "fiber_bundle"):
        cfg = rr.FiberBundleConfig.small(mode=mode, n_layers=5)
        assert _parameter_total(cfg) == rr.count_parameters(cfg)["total"]
