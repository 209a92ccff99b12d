r"""Budgets of a :class:`~riemannian_ref.models.transformer.FiberBundleTransformer`: parameters, FLOPs, memory.

:func:`count_parameters` counts a model's (or a config's) parameters by
component, :func:`estimate_cost` the FLOPs and memory of a whole training step
as this package's kernels execute it, and :func:`match_width` resizes a config
to a parameter budget, so that modes can be compared at matched size.
:func:`attention_flops` is the one count of an attention kernel's pairwise
work: :func:`estimate_cost` and the benchmarks both use it.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from .._checks import check_bool, check_choice, check_int
from .config import FiberBundleConfig
from .transformer import FiberBundleTransformer

__all__ = ["count_parameters", "estimate_cost", "match_width"]

_COMPONENTS = ("embedding", "positions", "attention", "metric", "connection", "ffn", "ffn_metric",
               "norms", "head")


def _component(name: str) -> str:
    if name.startswith("tok_emb"):
        return "embedding"
    if name.startswith("pos_emb"):
        return "positions"
    if name.startswith("lm_head"):
        return "head"
    if ".attn.metric" in name or name.endswith(".attn.log_temp"):
        return "metric"
    if ".attn.rates." in name:
        return "connection"
    if ".attn." in name:
        return "attention"
    if ".ffn_metric." in name or name.endswith(".eta"):
        return "ffn_metric"
    if ".mlp." in name:
        return "ffn"
    return "norms"


def _check_config(config) -> None:
    if not isinstance(config, FiberBundleConfig):
        raise ValueError(f"config must be a FiberBundleConfig, got {type(config).__name__}")


def count_parameters(model_or_config) -> dict[str, int]:
    """Parameter counts by component, and ``"total"`` (tied weights counted once).

    Components: embedding, positions, attention (q/k frames, v, out), metric
    (attention metric nets), connection (content-rate maps), ffn, ffn_metric
    (metric of the preconditioned FFN and eta), norms, head (0 when tied).
    A config is instantiated on the ``meta`` device (shapes without storage),
    so counting a billion-parameter config costs no memory and draws no random
    numbers.

    Parameters
    ----------
    model_or_config : FiberBundleTransformer or FiberBundleConfig
        A model, or the config of one.

    Returns
    -------
    dict of str to int
        One count per component above, and ``"total"``.
    """
    if isinstance(model_or_config, FiberBundleConfig):
        # on the meta device: shapes only, no memory (a 7B config counts in a second), no random numbers drawn
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = FiberBundleTransformer(model_or_config)
    elif isinstance(model_or_config, nn.Module):
        model = model_or_config
    else:
        raise ValueError(f"model_or_config must be a FiberBundleTransformer (or any nn.Module) or a "
                         f"FiberBundleConfig, got {type(model_or_config).__name__}")
    counts = dict.fromkeys(_COMPONENTS, 0)
    for name, p in model.named_parameters():  # shared parameters appear once
        counts[_component(name)] += p.numel()
    counts["total"] = sum(counts.values())
    return counts


def match_width(config: FiberBundleConfig, target: int, *, exclude_embedding: bool = False,
                widths: range | None = None) -> FiberBundleConfig:
    """The config with ``d_model`` changed so its parameter count is closest to ``target``.

    Candidate widths are multiples of ``2 * n_heads`` (even head dimensions)
    up to four times the current width. Use it to compare modes at matched
    size: ``match_width(cfg_fb, count_parameters(cfg_eucl)["total"])``.

    Parameters
    ----------
    config : FiberBundleConfig
        The config to resize; every field but ``d_model`` is kept.
    target : int
        The parameter count to match.
    exclude_embedding : bool
        Compare the count without the token embedding and the (untied) LM
        head, e.g. for a ``target`` counted the same way.
    widths : iterable of int, optional
        Candidate widths, in increasing order (default: the multiples of
        ``2 * n_heads`` described above). Widths the config rejects are
        skipped; the search stops at the first width whose count exceeds
        ``target``, since counts grow with the width.

    Returns
    -------
    FiberBundleConfig
        A validated copy of ``config`` with the best width (the smaller on a
        tie).

    Raises
    ------
    ValueError
        If no candidate width gives a valid config.
    """
    _check_config(config)
    check_int(target, "target")
    check_bool(exclude_embedding, "exclude_embedding")
    if widths is not None and not (isinstance(widths, (range, list, tuple))
                                   and all(isinstance(w, int) and not isinstance(w, bool) for w in widths)):
        raise ValueError(f"widths must be a range or sequence of ints, got {widths!r}")
    step = 2 * config.n_heads
    if widths is None:
        widths = range(step, 4 * config.d_model + step, step)
    best, best_gap = None, None
    for D in widths:
        try:
            cand = config.replace(d_model=D)
        except ValueError:
            continue
        c = count_parameters(cand)
        total = c["total"] - (c["embedding"] + c["head"] if exclude_embedding else 0)
        gap = abs(total - target)
        if best_gap is None or gap < best_gap:
            best, best_gap = cand, gap
        if total > target:  # counts grow with the width: nothing further can be closer
            break
    if best is None:
        raise ValueError(f"no valid width in {widths} for this config")
    return best


_COST_PARTS = ("attention", "metric", "connection", "ffn", "ffn_metric", "head")
_COST_KEYS = ("matmul_fwd", "matmul_bwd", "elementwise_fwd", "elementwise_bwd")


def attention_flops(n: int, d: int, rank: int = 0, *, kernel: str = "blockwise", metric_side: str = "key",
                    causal_skip: bool = False) -> dict[str, float]:
    r"""FLOPs of one attention call per (batch, head): the scores, the softmax and the mix of the values.

    Matrix products (2 FLOPs per multiply-add) as the kernel executes them,
    elementwise work at one FLOP per operation (an estimate). ``"sdpa"``, as
    FlashAttention-2: :math:`4 n^2 d` forward, :math:`10 n^2 d` backward (it
    recomputes the scores). ``"blockwise"``, the Riemannian operator
    (``riemannian_attention`` with per-token factors): one product of inner
    size :math:`d + 2` with :math:`1 + r` columns per key (``"query"`` and
    ``"mean"``: :math:`r` more of inner size :math:`d + 1` per query), the
    squares of the rank products, :math:`P\,[V \mid 1]`, and a backward that
    recomputes the scores. Both are checked against
    :class:`~torch.utils.flop_counter.FlopCounterMode` (SDPA's math path, which
    does not recompute).

    Parameters
    ----------
    n : int
        Queries and keys.
    d : int
        Head dimension of the queries, keys and values.
    rank : int
        Metric rank :math:`r` (``"blockwise"`` only; 0: :math:`G = \lambda I`).
    kernel : {"blockwise", "sdpa"}
    metric_side : {"key", "query", "mean"}
        Whose factors measure a pair (``"blockwise"``).
    causal_skip : bool
        Count half the pairs, as a causal kernel that skips the masked half.

    Returns
    -------
    dict of str to float
        ``"matmul_fwd"``, ``"matmul_bwd"``, ``"elementwise_fwd"``,
        ``"elementwise_bwd"``; their sum is a forward and backward pass.
    """
    check_int(n, "n")
    check_int(d, "d")
    check_int(rank, "rank", 0)
    check_choice(kernel, "kernel", ("blockwise", "sdpa"))
    check_choice(metric_side, "metric_side", ("key", "query", "mean"))
    check_bool(causal_skip, "causal_skip")
    n2 = float(n) * n * (0.5 if causal_skip else 1.0)
    if kernel == "sdpa":
        if rank:
            raise ValueError(f"rank must be 0 for kernel='sdpa' (a metric runs there as a wider head), got {rank}")
        return dict(matmul_fwd=4 * n2 * d, matmul_bwd=10 * n2 * d, elementwise_fwd=5 * n2, elementwise_bwd=8 * n2)
    rk = rank if metric_side in ("key", "mean") else 0
    rq = rank if metric_side in ("query", "mean") else 0
    score = 2 * n2 * ((d + 2) * (1 + rk) + rq * (d + 1))  # [q, 1, -o] . [M k, bias | c U_k]; c U_q . k
    mix = 2 * n2 * (d + 1)  # P [V | 1]: the output and the row sum
    # backward: the scores again, P^T dO (dV), [dO | -D] [V | 1]^T (dP) and the two products of dS per column
    return dict(matmul_fwd=score + mix, matmul_bwd=3 * score + 2 * n2 * d + mix,
                elementwise_fwd=n2 * (3 + 2 * (rk + rq)), elementwise_bwd=n2 * (5 + 4 * (rk + rq)))


@functools.lru_cache(maxsize=256)
def _parameter_total(config: FiberBundleConfig) -> int:
    """Parameters of a config, from one- and two-layer copies (blocks are identical): fast at any depth."""
    one, two = (count_parameters(config.replace(n_layers=k))["total"] for k in (1, 2))
    return one + (config.n_layers - 1) * (two - one)


def estimate_cost(config: FiberBundleConfig, seq_len: int | None = None, *, batch: int = 1,
                  causal_skip: bool = False, dtype_bytes: int = 4, optimizer_states: int = 2,
                  fused_content: bool = True) -> dict:
    r"""FLOPs and memory of one training step (forward and backward), by component, as this package runs it.

    The whole-cost model of chapter 6. Components: ``"attention"`` (the
    query/key/value/output projections and every pairwise product: scores,
    the metric's rank products, softmax, the mix of the values),
    ``"metric"`` (the metric network, :math:`r\,D\,hd` multiply-adds per token
    and layer), ``"connection"`` (the rate network and the transport: rotations
    for ``"flat"``, every pair's angles for ``"content"``), ``"ffn"``,
    ``"ffn_metric"`` (the metric of the preconditioned FFN and its Woodbury
    solve) and ``"head"``.

    Matrix products (2 FLOPs per multiply-add) are counted as the kernels
    execute them, the pairwise ones by
    :func:`~riemannian_ref.models.budget.attention_flops`: SDPA (FlashAttention-2)
    for dot products, for one metric per head at head size :math:`d + 1` and
    for ``attention.subspace = m`` at :math:`d + m(m+1)/2 + 1` (``"mean"``:
    :math:`d + m + m(m+1) + 1`, with the lift's per-token products); the
    blockwise operator for per-token factors; the content connection's fused
    CPU kernel (elementwise but for the :math:`O(n d r)` products around it)
    or its dense einsums (``fused_content=False``); every linear layer's
    backward twice its forward. Elementwise work (softmax, squares, rotations,
    the transport of every pair), at one FLOP per operation, is reported
    apart: a fused GPU kernel hides it, a CPU pays it.

    Memory counts what a training step holds: parameters, their gradients and
    ``optimizer_states`` copies (Adam: 2), and the activations autograd keeps
    for the backward (elements, times ``dtype_bytes``). Pairwise activations
    are zero for SDPA, the blockwise operator and the fused content kernel
    (they recompute) and :math:`O(n^2 hd)` per layer for the content
    connection's dense path, which transports every pair with autograd.

    Parameters
    ----------
    config : FiberBundleConfig
    seq_len : int, optional
        Sequence length :math:`n` (default ``config.block_size``).
    batch : int
        Sequences per step (FLOPs and activations scale with it).
    causal_skip : bool
        Count half of every pairwise term, as a causal kernel that skips the
        masked half does (the blockwise operator on CPU skips only whole tiles
        above the diagonal; ``False`` counts every pair, as
        :class:`torch.utils.flop_counter.FlopCounterMode` sees short sequences).
    dtype_bytes : int
        Bytes per stored number (4: float32; 2: bfloat16 activations).
    optimizer_states : int
        Optimizer state tensors per parameter (Adam: 2; SGD: 0).
    fused_content : bool
        The content connections as the fused CPU kernel runs them (default:
        every pairwise term elementwise, nothing pairwise stored), or as the
        dense path does (``False``: CUDA tensors, a CPU without a C compiler,
        ``RR_DISABLE_CKERNEL=1``, dropout or returned weights).

    Returns
    -------
    dict
        ``"flops"``: ``{part: {"matmul_fwd", "matmul_bwd", "elementwise_fwd",
        "elementwise_bwd", "total"}}`` for every part and ``"total"``;
        ``"memory"``: bytes of ``"parameters"``, ``"gradients"``,
        ``"optimizer"``, ``"activations"`` (a dict by part), ``"pairwise"``
        (the part of the activations that grows with :math:`n^2`) and
        ``"total"``.
    """
    _check_config(config)
    cfg = config
    n = cfg.block_size if seq_len is None else check_int(seq_len, "seq_len")
    check_int(batch, "batch")
    check_int(dtype_bytes, "dtype_bytes")
    check_int(optimizer_states, "optimizer_states", 0)
    check_bool(causal_skip, "causal_skip")
    check_bool(fused_content, "fused_content")
    D, L, h, d = cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.qk_dim
    V = cfg.out_dim or 0
    hd = h * d
    n2 = float(n) * n * (0.5 if causal_skip else 1.0)  # pairs per head
    att = cfg.attention  # every block's attention, its connection resolved
    conn, side = att.connection, att.metric_side
    metric_scores = att.scores == "metric"
    r = att.rank if metric_scores else 0
    per_token = metric_scores and att.metric != "shared" and r > 0
    rk = r if per_token and side in ("key", "mean") else 0
    rq = r if per_token and side in ("query", "mean") else 0
    m = att.subspace if per_token else None  # factors B C_i in an m-dimensional subspace per head
    lifted = m is not None and conn == "trivial"  # then one dot product of width d + m(m+1)/2 + 1: SDPA
    tv = 1 if att.transport_values else 0
    parts = {p: dict.fromkeys(_COST_KEYS, 0.0) for p in _COST_PARTS}
    act = dict.fromkeys(_COST_PARTS + ("norms",), 0.0)  # stored elements per sequence
    pairwise = 0.0

    def linear(part, fan_in, fan_out, tokens=n):  # backward: dX and dW, each as costly as the forward
        parts[part]["matmul_fwd"] += 2.0 * tokens * fan_in * fan_out
        parts[part]["matmul_bwd"] += 4.0 * tokens * fan_in * fan_out

    a = parts["attention"]

    def pairs(head, rank=0, **kw):  # one kernel's pairwise work, for every head
        for key, v in attention_flops(n, head, rank, causal_skip=causal_skip, **kw).items():
            a[key] += h * v

    for _ in range(L):
        linear("attention", D, 3 * hd)  # q, k, v
        linear("attention", hd, D)  # output
        act["attention"] += 5 * n * hd + n * h  # q, k, v, the output, its reshaped copy; row statistics
        act["norms"] += 4 * n * D if cfg.layer_norm else 0  # each LayerNorm keeps its input and output
        if conn == "cumulative":  # per-token rates integrated into phases: O(n d), then the common frame
            linear("connection", D, hd // 2)  # the rate network
            c = parts["connection"]
            c["elementwise_fwd"] += 4 * n * hd  # sigmoid, the rates, increments, running sum, phases
            c["elementwise_bwd"] += 4 * n * hd
            act["connection"] += 0.5 * n * hd  # the sigmoid of the rate network (the phases' tables: below)
        if conn in ("content", "content_source") and fused_content:
            # the fused CPU kernel (attention/_content_kernel.c): per query row, the angles, their cosines and
            # sines, the rotated query and its products with [k_j | U_kj] (and, for a query-side metric,
            # the rotated U_qi with k_j), the softmax and the transported values, all elementwise; its
            # backward recomputes the row. Only the O(n d r) terms around it are matrix products.
            linear("connection", D, hd // 2)  # the rate network
            c = parts["connection"]
            a["matmul_fwd"] += 2 * n * hd * (rk + rq)  # U_kj^T k_j, U_qi^T q_i
            a["matmul_bwd"] += 4 * n * hd * (rk + rq)
            half = n2 * hd / 2  # (query, key, pair) triples
            # per triple: the query turned (6), 4 per key-side column, 10 per query-side column, 8 for a
            # transported value; per pair: the score and the softmax
            a["elementwise_fwd"] += half * (6 + 4 * (1 + rk) + 10 * rq + 8 * tv) + n2 * h * (6 + 3 * (rk + rq))
            a["elementwise_bwd"] += half * (6 + 14 * (1 + rk) + 16 * rq + 18 * tv + 4) \
                + n2 * h * (12 + 6 * (rk + rq))
            c["elementwise_fwd"] += half * 33  # the angle (3) and its cosine and sine (a polynomial: 30)
            c["elementwise_bwd"] += half * 36  # the same, recomputed, and the rate gradients
            # kept for the backward: [k | U_k] and the values with keys innermost, the output and row
            # log-sum-exp, |q|^2, |k|^2 and the factor products; the rates in both layouts, the positions
            act["attention"] += n * hd * (1 + rk + tv + rq) + n * h * (3 + rk + rq)
            act["connection"] += n * hd + n
        elif conn in ("content", "content_source"):
            # every pair transported densely (autograd): one pairwise rotation of the queries, whose
            # products with [k_j | U_kj] give the dot products and the key-side metric terms; P k_j for a
            # query-side metric; the mix of transported values; rotations are complex products
            linear("connection", D, hd // 2)  # the rate network
            c = parts["connection"]
            mix = 2 * n2 * hd
            a["matmul_fwd"] += mix + 2 * n2 * hd * (1 + rk + rq) + 2 * n * hd * (rk + rq)
            a["matmul_bwd"] += 2 * (mix + 2 * n2 * hd * (1 + rk + rq) + 2 * n * hd * (rk + rq))
            a["elementwise_fwd"] += n2 * h * (8 + 3 * (rk + rq))
            a["elementwise_bwd"] += 2 * n2 * h * (8 + 3 * (rk + rq))
            rotations = 1 + tv + (1 if rq else 0)
            c["elementwise_fwd"] += n2 * hd * (1.5 + 3 * rotations)  # angles, cos, sin; 3 per rotated coordinate
            c["elementwise_bwd"] += n2 * hd * (1 + 6 * rotations)  # cos, sin again; turned gradients, angle terms
            # the angles (hd / 2; the rotations are recomputed in the backward) and the copies of the rotated
            # queries, values and (query-side metric) keys that the batched products keep
            stored = n2 * (hd * (0.5 + 1 + tv + (1 if rq else 0)) + h * (rk + rq + 3))
            act["connection"] += stored
            pairwise += stored
        elif lifted:
            # SDPA on lifted inputs (functional._subspace_lift): head size d + m(m+1)/2 + 1 per subspace side
            # (both sides: m more for the key side's cross term), the values zero-padded to it; the lift's
            # products per token and head: C C^T (m^2 r), B^T k, B^T q and G k (d m each), P B^T k (m^2) per side
            # ("mean": B^T q and B^T k twice, G_i q_i once)
            both = side == "mean"
            T = m * (m + 1) // 2
            hs = d + T + 1 + (m + T if both else 0)
            lift = 2 * n * h * ((2 if both else 1) * (m * m * r + m * m) + (5 if both else 3) * d * m)
            pairs(hs, kernel="sdpa")
            a["matmul_fwd"] += lift
            a["matmul_bwd"] += 2 * lift
            a["elementwise_fwd"] += 2 * n * h * hs
            a["elementwise_bwd"] += 4 * n * h * hs
            # SDPA keeps the lifted queries and keys, the padded values, its output (head size hs) and the
            # row log-sum-exp; the lift, per side, contiguous copies of q and k for the products with B, C and
            # C^T, P = C C^T, B^T k, B^T q and the two factors of each lifted p p^T; a query-side metric keeps q
            sides = 2 if both else 1
            act["attention"] += (4 * n * h * hs + n * h + sides * n * h * (2 * d + 2 * m * r + m * m + 2 * m + 2 * T)
                                 + (n * hd if side in ("query", "mean") else 0))
        elif not per_token:
            # SDPA; one metric for every pair runs there too, on the dot-product form (head size d + 1):
            # M q per query, (k W)^2 per key for each shared factor W
            pairs(d + 1 if metric_scores else d, kernel="sdpa")
            if metric_scores:
                rs = r * (2 if side == "mean" else 1)
                a["matmul_fwd"] += 6 * n * hd * rs
                a["matmul_bwd"] += 12 * n * hd * rs
                # SDPA keeps [M q, 1], [k, -kMk/2], the zero-padded v and its output (head size d + 1), besides
                # M q and the products with the factors
                act["attention"] += 4 * n * h * (d + 1) + n * hd + 2 * n * h * rs
        else:
            pairs(d, r, metric_side=side)  # the blockwise operator
        if conn in ("flat", "cumulative"):  # rotate q, k, v, the factors and the output: O(n d r)
            c = parts["connection"]
            c["elementwise_fwd"] += 3 * n * hd * (4 + rk + rq)
            c["elementwise_bwd"] += 6 * n * hd * (4 + rk + rq)
            act["connection"] += n * hd  # the rotation tables (cos and sin)
        if per_token and att.metric_form == "gains" and att.metric != "position":
            # gains: a second linear map (the gain logits), Gram-Schmidt on the r columns and the scale by
            # sqrt(lam gamma); autograd keeps the raw, projected and normalised columns, norms and the gains
            width = h * (m if m is not None else d)
            linear("metric", D, h * r)
            parts["metric"]["elementwise_fwd"] += n * width * r * (2 * r + 4) + 4 * n * h * r
            parts["metric"]["elementwise_bwd"] += 2 * n * width * r * (2 * r + 4) + 8 * n * h * r
            # (fitted to saved-tensor hooks at r = 1..6 and m = 2, 3: within 1% without a subspace, 15% with
            # one, where the coefficients' inner products go through the basis' Gram matrix)
            if m is None:
                act["metric"] += n * width * (0.53 * r * r + 2.9 * r - 1)
            else:
                act["metric"] += n * width * (9.5 * r + 3.5 * r * (r - 1))
        if per_token and m is not None:
            linear("metric", D, h * m * r)  # the coefficients C_i; the basis is a parameter
            if not lifted:  # a connection turns each token's subspace: U = B C multiplied out, per-token path
                a["matmul_fwd"] += 2 * n * hd * m * r
                a["matmul_bwd"] += 4 * n * hd * m * r
                act["metric"] += n * hd * r * (2 if rk and rq else 1) + n * h * m * r  # and C, for dB
        elif per_token:
            linear("metric", D, hd * r)  # one metric network serves both sides of self-attention
            act["metric"] += n * hd * r * (2 if rk and rq else 1)  # the operator's contiguous factors
        if cfg.mlp:
            linear("ffn", D, cfg.mlp_ratio * D)
            linear("ffn", cfg.mlp_ratio * D, D)
            parts["ffn"]["elementwise_fwd"] += 8 * n * cfg.mlp_ratio * D  # GELU
            parts["ffn"]["elementwise_bwd"] += 16 * n * cfg.mlp_ratio * D
            act["ffn"] += 2 * n * cfg.mlp_ratio * D
        if cfg.precondition_ffn_resolved:
            rf = cfg.ffn_metric_rank
            linear("ffn_metric", D, D * rf)
            fm = parts["ffn_metric"]
            fm["matmul_fwd"] += 2 * n * D * rf * (rf + 1)  # U^T D^-1 U (capacitance) and U z
            fm["matmul_bwd"] += 4 * n * D * rf * (rf + 1)
            fm["elementwise_fwd"] += n * (4 * D * rf + 2 * D + rf ** 3)  # U^T y, scalings, Cholesky
            fm["elementwise_bwd"] += 2 * n * (4 * D * rf + 2 * D + rf ** 3)
            act["ffn_metric"] += n * (2 * D * rf + 3 * D + rf * rf)
    if V:
        linear("head", D, V)
        act["head"] += n * (V + D)
    flops = {}
    for p, f in parts.items():
        f = {k: batch * v for k, v in f.items()}
        f["total"] = sum(f.values())
        flops[p] = f
    flops["total"] = {k: sum(flops[p][k] for p in _COST_PARTS) for k in flops["attention"]}
    P = _parameter_total(cfg)
    act_b = {p: batch * dtype_bytes * v for p, v in act.items()}
    memory = dict(parameters=4 * P, gradients=4 * P, optimizer=4 * P * optimizer_states, activations=act_b,
                  pairwise=batch * dtype_bytes * pairwise)
    memory["total"] = memory["parameters"] + memory["gradients"] + memory["optimizer"] + sum(act_b.values())
    return {"flops": flops, "memory": memory}
