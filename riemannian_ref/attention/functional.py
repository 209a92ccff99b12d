r"""Riemannian attention, the function other code calls.

:func:`riemannian_attention` has the signature of
:func:`torch.nn.functional.scaled_dot_product_attention` plus the metric: it
validates its inputs (errors name the argument), handles autocast and half
precision, and dispatches calls without per-token factors to
``scaled_dot_product_attention`` (one metric for every pair is a dot product
with a key bias), as well as per-token factors that share one subspace
(:class:`~riemannian_ref.geometry.metric.SubspaceFactors`: a dot product of
width :math:`d + m(m+1)/2 + 1`), the others to the blockwise operator (private,
:mod:`riemannian_ref.attention._blockwise`), which never holds more than one
tile of scores, to Triton kernels for supported calls on CUDA tensors
(private, :mod:`riemannian_ref.attention._triton`), or to the dense reference
where the operators have no implementation (dropout). The algorithm, written
to be read, is :func:`riemannian_ref.attention.reference.blockwise_attention`.
"""
from __future__ import annotations

import contextlib
import math
import os

import torch
from torch import Tensor

from .._checks import autocast_dtype, reading_syncs
from ..geometry.metric import SubspaceFactors
from . import _op  # noqa: F401  (registers the custom op that blockwise_operator traces, before any trace)
from ._blockwise import block_sizes_for, blockwise_operator
from ._validate import check_attention_inputs
from .reference import _reference_attention

__all__ = ["riemannian_attention"]


def riemannian_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, *,
                         U_q: Tensor | None = None, U_k: Tensor | None = None, lam=1.0,
                         metric_side: str = "key", enable_gqa: bool = False,
                         block_sizes: tuple[int, int] | None = None) -> Tensor:
    r"""Riemannian attention with the call signature of ``scaled_dot_product_attention``.

    Computes :math:`\mathrm{softmax}(S + M)\,V` with the Riemannian scores
    :math:`s_{ij} = -\tfrac{\text{scale}}{2}(q_i-k_j)^\top \bar G_{ij}(q_i-k_j)`
    of :func:`riemannian_ref.geometry.scores.riemannian_scores`, blockwise: the
    score matrix and the pairwise rank products are never formed whole. Any
    call that works with ``scaled_dot_product_attention`` (positional or by
    keyword) works unchanged, with the same output shape and dtype (meta
    tensors included), within two limits on values: ``scale`` must be finite
    and positive (a distance score with ``scale <= 0`` would favour far keys),
    and the scores must fit the compute dtype (see ``lam``). With no metric
    factors it is distance attention with :math:`G = \lambda I`.

    Parameters
    ----------
    query : Tensor, shape [..., n_q, d]
    key : Tensor, shape [..., n_k, d]
    value : Tensor, shape [..., n_k, d_v]
    attn_mask : Tensor, optional
        Boolean (``True`` = may attend) or additive float mask of the query's
        dtype, broadcastable to ``[..., n_q, n_k]`` without enlarging the
        batch. A float mask that requires grad gets its gradient (a learned
        bias trains), as with SDPA. Masked rows give SDPA's result on every
        backend: a row that sees no key (``False``, ``-inf`` or causally
        hidden everywhere) gives 0 with zero gradients; a row whose visible
        entries are all at most ``-2**120`` (``torch.finfo(dtype).min``, the
        masking value of ``transformers``, for every dtype but float16) gives
        the softmax of its mask alone, i.e. the average of the values it sees,
        as SDPA does (there ``s + m`` rounds to ``m``). Each row enters
        relative to its largest visible entry (a row constant, so exact).
    dropout_p : float
        Dropout on the attention weights. ``dropout_p > 0`` runs the dense
        :func:`~riemannian_ref.attention.reference.riemannian_attention_reference`
        (memory :math:`O(n^2 r)`): the blockwise kernel has no dropout. Pass 0
        in evaluation.
    is_causal : bool
        Top-left aligned causal mask (key ``j`` visible to query ``i`` iff
        ``j <= i``), as ``scaled_dot_product_attention``; unlike SDPA it may be
        combined with ``attn_mask`` (both apply).
    scale : float, optional
        :math:`1/\tau`, default :math:`1/\sqrt d` (1 when ``d = 0``: then
        every distance is 0 and the weights are uniform over the visible
        keys, SDPA's result). What SDPA takes: a Python or NumPy int or
        float, or a 0-d real tensor without gradient (read on the host, as
        SDPA reads it); finite and ``> 0``.
    U_q : Tensor, shape [..., n_q, d, r] or [..., d, r], or SubspaceFactors, optional
        Query metric factors (per token, or one shared metric); for
        ``metric_side`` ``"query"`` and ``"mean"``. Per-token factors that
        share one subspace, :math:`U_i = B C_i`, may come as
        :class:`~riemannian_ref.geometry.metric.SubspaceFactors`
        (``basis`` [..., d, m], ``coef`` [..., n_q, m, r]): the same call
        with ``U_q = B C``, computed on SDPA (see the notes).
    U_k : Tensor, shape [..., n_k, d, r] or [..., d, r], or SubspaceFactors, optional
        Key metric factors; for ``"key"`` and ``"mean"``. ``None`` with
        ``metric_side="key"`` means :math:`G = \lambda I`. As for ``U_q``,
        :class:`~riemannian_ref.geometry.metric.SubspaceFactors` (``coef``
        [..., n_k, m, r]) stand for the per-token factors ``B C``.
    lam : float or Tensor, shape broadcastable to the batch
        Isotropic part :math:`\lambda > 0` (e.g. per head, ``[h]`` for inputs
        ``[B, h, n, d]``). With ``enable_gqa`` its last dimension may count
        the query heads or the key heads (one per key head, as ``U_k``). A
        tensor's values are checked without a host sync off the CPU: on CUDA
        a bad value raises ``RuntimeError`` when the device reaches the check
        (``ValueError`` with ``RR_SYNC_CHECKS=1``, and always on CPU).
        Range: :math:`\max(1, \text{scale}/2)\max\lambda` must stay below
        the compute dtype's largest finite number over 16 (float32 for half
        inputs, whose ``lam`` is held in their dtype), else the call is
        refused naming ``lam`` and ``scale``: past it the scores overflow
        whatever the inputs. The operator reads no more of the data than
        that (the full bound needs extra passes over the inputs on every
        call), so scores that overflow because the inputs themselves are huge give
        NaN rows, as they do in SDPA. The dense reference checks the whole
        bound, data included (see
        :func:`~riemannian_ref.attention.reference.riemannian_attention_reference`),
        and refuses those calls; below that bound every path computes the
        same function.
    metric_side : {"key", "query", "mean"}
        Whose metric measures a pair: :math:`G_j`, :math:`G_i` or
        :math:`(G_i + G_j)/2`.
    enable_gqa : bool
        Grouped-query attention, as SDPA: ``key``, ``value`` (and ``U_k``) may
        have fewer heads (dimension -3) than ``query``, a divisor of its heads;
        query head ``i`` reads key head ``i // g`` (``g`` query heads per key
        head). Nothing is repeated: the heads are grouped as views
        ``[..., h_kv, g]``, and the blockwise operator and the Triton kernels
        read each key head where it is (per-token ``U_k`` given per query head
        makes the key side per query head, copied). ``U_k`` may have ``h_kv``,
        ``h_q`` or 1 heads, ``U_q`` ``h_q`` or 1, ``attn_mask`` 1 or ``h_q``.
    block_sizes : (int, int), optional
        Query and key block sizes of the tiles; default: a rule measured on
        CPU that keeps a tile near 512 KiB.

    Returns
    -------
    Tensor, shape [..., n_q, d_v]
        Rows that see no key give 0, with zero gradients (no NaN); see
        ``attn_mask`` for rows masked with ``finfo.min``.

    Notes
    -----
    Meta tensors: the call returns an output of the right shape and dtype
    on the meta device, as SDPA does (values are not checked there; the
    blockwise operator runs as its registered custom op, whose fake
    implementation gives the shapes, gradients included).

    Cost: the scores of a ``(query block, key block)`` tile are one matrix
    product of width ``(1 + r) * bk`` (plus a second one of ``r * bq`` rows for
    the query side of ``"mean"``/``"query"``), so score FLOPs are ``1 + r``
    times those of :math:`QK^\top` (``1 + 2r`` for ``"mean"``). Shared metrics
    cost nothing pairwise: they fold into :math:`M`. Memory beyond the output
    and the gradients: the row log-sum-exp and, per chunk of the flattened
    batch (about one batch element per thread), one tile of
    ``bq * bk * (1 + r)`` numbers, one stacked key block and the running
    output, in forward and backward; nothing of size ``n_q * n_k`` is stored.
    The softmax needs no running maximum: distance scores are bounded above
    by ``scale/2 * q^T M q`` before any key is seen, so each row's offset is
    fixed after the first key block, and rows that would underflow (every key
    extremely far) are recomputed with the online softmax.

    Precision: float32 and float64 run natively. Float16/bfloat16 inputs are
    computed in float32 and returned in their dtype, on every CPU branch
    (dropout included); on the Triton kernels (CUDA) their matrix products
    take half-precision operands with float32 accumulation, the distances and
    the softmax staying float32 (see GPU below). Under ``torch.autocast`` the inputs may come in mixed
    precisions (a model's float32 ``lam`` next to autocast queries): they are
    computed in float32 and the result has the autocast dtype, as SDPA's
    result has there (float64 inputs, which autocast leaves alone, stay
    float64). The expanded distance cancels terms of size :math:`|q|^2` and
    bfloat16's 8-bit mantissa would leave no correct digit in the differences.

    ``torch.compile``: the blockwise operator is registered as the custom ops
    ``riemannian_ref::attention`` and ``riemannian_ref::attention_backward``
    (private, :mod:`riemannian_ref.attention._op`, with fake implementations
    and the autograd formula), which a trace records as single nodes, so a
    model compiles through it, with ``fullgraph=True`` too, forward and
    backward; eager calls run the same operator without the op layer. The
    Triton kernels are wrapped the same way (``riemannian_ref::triton_attention``),
    and the SDPA path is SDPA itself.

    Dropout: ``dropout_p > 0`` takes the dense reference path (see above),
    in float32 at least;
    SDPA-style, dropout is applied whenever ``dropout_p > 0``, so pass
    ``dropout_p=0`` in evaluation (:class:`~riemannian_ref.attention.layer.RiemannianAttention`
    does).

    Double backward (``create_graph=True``) is not supported by the blockwise
    operator and raises a ``RuntimeError`` that says so; the dense reference
    supports it.

    GPU: CUDA tensors run on Triton kernels (private,
    ``riemannian_ref.attention._triton``: a fused forward and backward with
    the per-token metric terms computed per tile, gradients for query, key,
    value, ``U_q``, ``U_k`` and ``lam``) when ``triton`` is installed (the
    ``gpu`` extra), ``RR_DISABLE_TRITON`` is not set to ``1``, and the call is
    supported: dtype float16, bfloat16 or float32, head dimensions up to 256,
    no dropout, and no float ``attn_mask`` that requires grad (boolean masks,
    float masks without grad and ``is_causal`` are supported;
    ``block_sizes`` is not used there). Every other call with a per-token
    factor, and every such CPU call, takes the blockwise PyTorch operator
    above. Neither path has a double backward. Precision there: float32
    inputs multiply in float32 (no TF32); float16 and bfloat16 inputs, unlike
    on the other branches, multiply on the GPU's matrix units as
    FlashAttention does: the matrix products take operands in the input dtype
    (the inputs themselves, and the attention weights and score gradients
    rounded once to it) and accumulate in float32, while the distance terms,
    the scores, the softmax and its log-sum-exp stay float32 (the scores'
    products multiply inputs, exactly). Measured in Triton's interpreter
    against the float64 reference on the same inputs
    (``benchmarks/check_triton_precision.py``: the largest error over a few
    shapes, masks, causal and grouped-query cases, relative to the tensor's
    largest entry): the output 3.8e-4 in float16 (unit roundoff
    ``u = 2**-11``, 4.9e-4) and 3.1e-3 in bfloat16 (``u = 2**-8``,
    3.9e-3); the gradients of query, key, value and the factors at most
    7.3e-4 and 6.8e-3; that of ``lam``, one sum over every pair of a head
    whose terms cancel, 1.2e-2 and 8.8e-2. Float32: at most 5.9e-7 (``lam`` 3.8e-6), and
    1.0e-5 when queries and keys share a shift three times their distances
    (the expanded distance cancels; the half-precision errors do not grow
    with such a shift).

    Calls without per-token factors and without dropout (``G = lam I``, or one
    shared metric :math:`M = \lambda I + U U^\top` for every pair) are
    exactly dot-product attention with a key bias
    (:func:`~riemannian_ref.geometry.scores.dot_product_form`): they run on
    ``scaled_dot_product_attention`` on lifted inputs (queries
    :math:`[M q_i, 1]`, keys :math:`[k_j, -\tfrac12 k_j^\top M k_j]`), on
    every device, with SDPA's kernels and, on those kernels, SDPA's double
    backward.

    Per-token factors in one subspace per head, :math:`U_j = B C_j` given
    as :class:`~riemannian_ref.geometry.metric.SubspaceFactors` (``B``
    [..., d, m], ``C_j`` [m, r]), are exactly dot-product attention too:
    with :math:`P_j = C_j C_j^\top`, :math:`p_i = B^\top q_i` and
    :math:`\ell(P)` the :math:`m(m+1)/2` upper-triangular entries of a
    symmetric matrix (:math:`\ell_w(p)` those of :math:`p p^\top`, the
    off-diagonal ones doubled), the key-side score is, up to a row constant,
    ``scale`` times :math:`[q_i, \ell_w(p_i), 1] \cdot [G_j k_j, -\tfrac12
    \ell(P_j), -\tfrac12 k_j^\top G_j k_j]`, one dot product of width
    :math:`d + m(m+1)/2 + 1` whatever ``r`` (the query side mirrors it;
    ``"mean"`` with both sides in subspaces adds :math:`m` more for the
    cross term). Such calls run on SDPA on these lifted inputs, forward and
    backward, on every device, while the other side has no per-token
    factors outside a subspace and ``dropout_p == 0``; otherwise the factors
    are multiplied out and the call takes the route a per-token call takes.

    The dispatch table, in order: nothing to compute, the dense reference;
    no per-token factor and no dropout, or factors in a subspace (above),
    the exact route of the device (the private table ``_EXACT_ROUTES``:
    SDPA on lifted inputs on CPU and CUDA, chosen from
    ``benchmarks/bench_reductions.py`` on CPU and for SDPA's fused kernels
    on CUDA; the alternatives, SDPA with the key term as a float mask and
    the per-token operator, are exact too); CUDA with ``triton`` and a
    supported call, the Triton kernels; dropout, the dense reference; else
    the blockwise operator. The kernels are tested in
    Triton's interpreter against the dense reference; their speed on a GPU
    has not been measured.
    """
    from ._validate import group_heads

    if isinstance(U_q, SubspaceFactors) or isinstance(U_k, SubspaceFactors):  # factors in a shared subspace
        return _subspace_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam,
                                   metric_side, enable_gqa, block_sizes)
    dev = query.device.type if isinstance(query, Tensor) else "cpu"
    ac = autocast_dtype(dev)
    if ac is not None:
        # autocast: the inputs may come in mixed precisions (the model's lam in float32, its queries in the
        # autocast dtype); computed in float32, returned in the autocast dtype as SDPA's result is. Float64
        # inputs, which autocast leaves alone, stay float64.
        f64 = query.dtype == torch.float64
        with torch.autocast(dev, enabled=False):
            ins = (query, key, value, attn_mask, U_q, U_k, lam) if f64 else _f32(query, key, value, attn_mask, U_q,
                                                                                   U_k, lam)
            out = riemannian_attention(*ins[:4], dropout_p, is_causal, scale, U_q=ins[4], U_k=ins[5], lam=ins[6],
                                       metric_side=metric_side, enable_gqa=enable_gqa, block_sizes=block_sizes)
        return out if f64 else out.to(ac)
    g = 1
    if enable_gqa:  # views: the batch [..., h_q] becomes [..., h_kv, g], the key side [..., h_kv, 1]
        g, query, key, value, attn_mask, U_q, U_k, lam = group_heads(query, key, value, attn_mask, U_q, U_k, lam)
    lam_t, scale, per_q, per_k, batch = check_attention_inputs(query, key, value, attn_mask, dropout_p, is_causal,
                                                               scale, U_q, U_k, lam, metric_side)
    blocks = _check_block_sizes(block_sizes) if block_sizes is not None else None
    out = _dispatch(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam_t, metric_side,
                    per_q, per_k, batch, blocks, g)
    return out.flatten(-4, -3) if g > 1 else out


def _attention(query: Tensor, key: Tensor, value: Tensor, attn_mask, dropout_p: float, is_causal: bool, scale: float,
               U_q, U_k, lam_t: Tensor, metric_side: str) -> Tensor:
    """:func:`riemannian_attention` of a call its caller has validated (no GQA), unchecked.

    For :func:`~riemannian_ref.attention.connections.connection_attention`,
    which validates a call once (``check_attention_inputs``; ``lam_t`` and
    ``scale`` as it returns them) and may then move the tensors to another
    frame (rotated, shared factors expanded per token) before this. The
    dtype rule is the public one (half precision computed in float32); mixed
    precisions are the caller's to resolve, and autocast is switched off
    here, as the public function does.
    """
    per_q = U_q is not None and U_q.dim() == query.dim() + 1
    per_k = U_k is not None and U_k.dim() == key.dim() + 1
    shapes = [query.shape[:-2], key.shape[:-2], value.shape[:-2]]
    for U, per in ((U_q, per_q), (U_k, per_k)):
        if U is not None:
            shapes.append(U.shape[:-3] if per else U.shape[:-2])
    batch = torch.broadcast_shapes(*shapes)
    dev = query.device.type
    with torch.autocast(dev, enabled=False) if autocast_dtype(dev) is not None else contextlib.nullcontext():
        return _dispatch(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam_t, metric_side,
                         per_q, per_k, batch, None, 1)


def _dispatch(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam_t, metric_side, per_q, per_k,
              batch, blocks, g):
    """A validated call (``g`` > 1: grouped-query views, key side [..., h_kv, 1]) to its backend.

    Float16/bfloat16 are computed in float32 and returned in their dtype on
    every branch but the Triton kernels, which multiply half-precision
    operands on the matrix units with float32 accumulation themselves.
    """
    n_q, n_k = query.shape[-2], key.shape[-2]
    if n_q == 0 or math.prod(batch) == 0:  # nothing to compute
        return _reference_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam_t,
                                    metric_side, per_q, per_k)
    if _FORCED_BACKEND == "triton":  # tests: the kernels on any device (_force_backend)
        return _forced_triton(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam_t,
                              metric_side, per_q, per_k, batch, blocks, g)
    one_metric = dropout_p == 0.0 and not (per_q and U_q.shape[-1]) and not (per_k and U_k.shape[-1])
    if _FORCED_BACKEND in _SDPA_ROUTES and not one_metric:
        raise RuntimeError(f"riemannian_attention under _force_backend({_FORCED_BACKEND!r}): SDPA computes only "
                           f"calls without per-token factors and without dropout exactly; this call has "
                           f"{'dropout_p > 0' if dropout_p > 0.0 else 'per-token factors'}")
    route = _FORCED_BACKEND if _FORCED_BACKEND is not None else _exact_route(query.device.type, "no_factor")
    if one_metric and route in _SDPA_ROUTES:
        # no per-token factor: one metric for every pair, i.e. dot-product attention with a key bias (exact)
        form = _sdpa_form if route == "sdpa_lifted" else _sdpa_bias_form
        if query.dtype in (torch.float16, torch.bfloat16):  # the expanded form cancels: float32, as everywhere
            out = form(*_f32(query, key, value, attn_mask), is_causal, scale, _f32(U_q), _f32(U_k), _f32(lam_t),
                       metric_side, batch, g)
            return out.to(query.dtype)
        return form(query, key, value, attn_mask, is_causal, scale, U_q, U_k, lam_t, metric_side, batch, g)
    if dropout_p == 0.0 and _triton_path(query, value, attn_mask, U_q, U_k):
        from . import _triton  # imports triton: only here, on first use
        return _triton.attention_flat(query, key, value, attn_mask, is_causal, scale, U_q, U_k, lam_t, metric_side,
                                      per_q, per_k, batch, None, g)
    if query.dtype in (torch.float16, torch.bfloat16):  # half inputs: compute in float32, return their dtype
        out = _dispatch(*_f32(query, key, value, attn_mask), dropout_p, is_causal, scale, _f32(U_q), _f32(U_k),
                        _f32(lam_t), metric_side, per_q, per_k, batch, blocks, g)
        return out.to(query.dtype)
    if dropout_p > 0.0:  # the blockwise operator has no dropout: the dense reference (in float32 at least)
        return _reference_attention(query, key, value, _relative_mask(attn_mask, is_causal, n_q, n_k), dropout_p,
                                    is_causal, scale, U_q, U_k, lam_t, metric_side, per_q, per_k)

    # Sort the metric parts: shared ones join M (free), per-token ones give squared terms.
    w = 0.5 if metric_side == "mean" else 1.0
    shared, Uk_tok, Uq_tok = [], None, None
    if U_k is not None and U_k.shape[-1] > 0:
        if per_k:
            Uk_tok = U_k
        else:
            shared.append(U_k)
    if U_q is not None and U_q.shape[-1] > 0:
        if per_q:
            Uq_tok = U_q
        else:
            shared.append(U_q)
    # grouped-query attention: the key side keeps its heads (batch element b reads key head b // g), unless
    # per-token key factors were given per query head
    g = g if g > 1 and (Uk_tok is None or Uk_tok.shape[-4] == 1) else 1
    kv_batch = (*batch[:-1], 1) if g > 1 else batch
    qf, kf, vf = _flat(query, batch, 2), _flat(key, kv_batch, 2), _flat(value, kv_batch, 2)
    lamf = lam_t.expand(batch).reshape(-1)
    W = None
    if shared:
        W = torch.cat([_flat(U, batch, 2) for U in shared], -1)
        if w != 1.0:
            W = W * math.sqrt(w)
    Ukf = _flat(Uk_tok, kv_batch, 3) if Uk_tok is not None else None
    Uqf = _flat(Uq_tok, batch, 3) if Uq_tok is not None else None
    c = math.sqrt(scale * w / 2.0)
    rk = Ukf.shape[-1] if Ukf is not None else 0
    rq = Uqf.shape[-1] if Uqf is not None else 0
    if blocks is None:
        blocks = block_sizes_for(n_q, n_k, 1 + rk + rq)
    rows = None
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        from ._validate import mask_row_max
        rows = mask_row_max(attn_mask, is_causal, n_q, n_k)  # [*mb, 1|n_q]: each row relative to its maximum
        # all 0 (the usual padding mask): nothing to subtract. Only where reading the values is free: on CPU,
        # not while tracing (a branch on values would break a fullgraph trace) and not on CUDA (a host sync
        # per call; subtracting all-zero offsets is exact)
        if not torch.compiler.is_compiling() and not reading_syncs(rows):
            rows = rows if bool(rows.any()) else None
    # the mask keeps its own batch shape (a key-padding mask [B, 1, 1, n_k] stays O(B n_k))
    # eagerly the autograd Function; while torch.compile traces, the same operator as a custom op (_op.py), and
    # on meta tensors too (its fake implementation gives the shapes; the eager operator reads values)
    out = blockwise_operator(qf.contiguous(), kf.contiguous(), vf.contiguous(), lamf, W=W,
                             Uk=Ukf.contiguous() if Ukf is not None else None,
                             Uq=Uqf.contiguous() if Uqf is not None else None, mask=attn_mask, causal=is_causal,
                             scale=scale, ck=c, cq=c, blocks=blocks, batch=tuple(batch), kv_group=g, mask_rows=rows,
                             traced=torch.compiler.is_compiling() or query.device.type == "meta")
    return out.view(*batch, n_q, value.shape[-1])


def _sdpa_form(query, key, value, attn_mask, is_causal, scale, U_q, U_k, lam_t, metric_side, batch, g):
    r"""A call without per-token factors, on ``scaled_dot_product_attention`` of lifted inputs (``"sdpa_lifted"``).

    With one metric :math:`M = \lambda I + W W^\top` for every pair (``W`` the
    shared factors, times :math:`\sqrt{1/2}` for the mean side, as the
    blockwise operator joins them) the score is
    :math:`-\tfrac{s}{2}(q_i - k_j)^\top M (q_i - k_j) = s\,\big((M q_i)^\top k_j
    - \tfrac12 k_j^\top M k_j\big) - \tfrac{s}{2} q_i^\top M q_i`, and the
    last term is constant along a softmax row
    (:func:`~riemannian_ref.geometry.scores.dot_product_form`). The key term
    rides in one extra coordinate, :math:`[M q_i, 1] \cdot [k_j, -\tfrac12
    k_j^\top M k_j]`, so SDPA sees a plain dot product (its fused kernels,
    which take no mask that requires grad, and its gradients) and the mask
    stays the caller's, compact. Grouped-query calls go to SDPA with
    ``enable_gqa`` while the key side has one head per key head.
    """
    Mq, kMk = _one_metric(query, key, U_q, U_k, lam_t, metric_side)
    qa = torch.cat([Mq, torch.ones_like(Mq[..., :1])], -1)
    kb = torch.broadcast_shapes(key.shape[:-1], kMk.shape)
    ka = torch.cat([key.expand(*kb, key.shape[-1]), (-0.5 * kMk).expand(kb).unsqueeze(-1)], -1)
    return _sdpa_run(qa, ka, value, attn_mask, is_causal, scale, batch, g)


def _sdpa_bias_form(query, key, value, attn_mask, is_causal, scale, U_q, U_k, lam_t, metric_side, batch, g):
    r"""A call without per-token factors on SDPA, the key term as an additive float mask (``"sdpa_bias"``).

    The same identity as :func:`_sdpa_form`, with queries :math:`M q_i`, the
    keys as they are, and :math:`-\tfrac{s}{2} k_j^\top M k_j` added to the
    mask (a ``[..., 1, n_k]`` row, broadcast over the queries). The mask then
    needs a gradient (it depends on the keys), which SDPA's fused CPU
    kernels do not give: this route runs on its math kernel.
    """
    Mq, kMk = _one_metric(query, key, U_q, U_k, lam_t, metric_side)
    return _sdpa_run(Mq, key, value, attn_mask, is_causal, scale, batch, g, bias=(-0.5 * scale) * kMk)


def _one_metric(query, key, U_q, U_k, lam_t, metric_side):
    """``M q`` [..., n_q, d] and ``k^T M k`` [..., n_k] of the one metric of a call without per-token factors."""
    w = 0.5 if metric_side == "mean" else 1.0
    lam = lam_t[..., None, None] if lam_t.dim() else lam_t
    Mq = lam * query
    kMk = (lam_t[..., None] if lam_t.dim() else lam_t) * (key * key).sum(-1)  # [..., n_k]
    for U in (U_k, U_q):
        if U is not None and U.shape[-1]:
            Mq = Mq + w * (query @ U) @ U.transpose(-1, -2)
            kMk = kMk + w * (key @ U).square().sum(-1)
    return Mq, kMk


def _sdpa_run(qa, ka, value, attn_mask, is_causal, scale, batch, g, bias=None):
    """SDPA on queries ``qa`` and keys ``ka`` (lifted, or plain with a key ``bias`` [..., n_k] in the mask).

    The grouped-query views of a validated call (``g > 1``: batch
    ``[..., h_kv, g]``, key side ``[..., h_kv, 1]``) back to SDPA's layout,
    the values padded with zero columns to the head size of the queries (the
    fused kernels want one head size), the mask relative per row.
    """
    n_q, n_k = qa.shape[-2], ka.shape[-2]
    mask = _relative_mask(attn_mask, is_causal, n_q, n_k) \
        if attn_mask is not None and attn_mask.dtype != torch.bool else attn_mask
    if bias is not None:
        from .reference import additive_mask

        add = additive_mask(mask, False, n_q, n_k, qa)  # a boolean mask as 0 / -inf
        mask = bias.unsqueeze(-2) if add is None else add + bias.unsqueeze(-2)
    gqa = g > 1 and ka.shape[-3] == 1
    if g > 1:  # views [..., h_kv, g] back to SDPA's layout: h_kv * g query heads
        qa = qa.expand(*batch, *qa.shape[-2:]).flatten(-4, -3)
        if gqa:
            ka, value = ka.squeeze(-3), value.squeeze(-3)
        else:  # the key side differs per query head (a shared query factor per query head, mean side)
            ka = ka.expand(*batch, *ka.shape[-2:]).flatten(-4, -3)
            value = value.expand(*batch, *value.shape[-2:]).flatten(-4, -3)
        if mask is not None and mask.dim() >= 5:
            mask = mask.expand(*batch, *mask.shape[-2:]).flatten(-4, -3)
    else:
        qa = qa.expand(*batch, *qa.shape[-2:])
        ka, value = ka.expand(*batch, *ka.shape[-2:]), value.expand(*batch, *value.shape[-2:])
    dv = value.shape[-1]
    if dv != qa.shape[-1]:  # the fused kernels want one head size for q, k and v: zero columns on v
        value = torch.cat([value, value.new_zeros(()).expand(*value.shape[:-1], qa.shape[-1] - dv)], -1) \
            if dv < qa.shape[-1] else value
        qa = torch.cat([qa, qa.new_zeros(()).expand(*qa.shape[:-1], value.shape[-1] - qa.shape[-1])], -1)
        ka = torch.cat([ka, ka.new_zeros(()).expand(*ka.shape[:-1], value.shape[-1] - ka.shape[-1])], -1)
    out = sdpa_mask_and_causal(qa, ka, value, mask, is_causal, scale, enable_gqa=gqa)[..., :dv]
    return out.unflatten(-3, (-1, g)) if g > 1 else out


def _subspace_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam, metric_side,
                        enable_gqa, block_sizes):
    r""":func:`riemannian_attention` of a call whose ``U_q`` or ``U_k`` is a :class:`SubspaceFactors`.

    Validated as the call with the factors multiplied out (the checks run on
    a zero-stride tensor of that shape, so nothing is multiplied out to
    check), then, where :data:`_EXACT_ROUTES` says ``"sdpa_lifted"``, on SDPA
    with the lifted queries and keys of :func:`_subspace_lift`; calls that
    route elsewhere (dropout, per-token factors on the other side, a forced
    backend, ``"operator"``) run as the same call with ``U = B C`` multiplied
    out.
    """
    from ._validate import check_subspace, group_heads

    dev = query.device.type if isinstance(query, Tensor) else "cpu"
    ac = autocast_dtype(dev)
    for name, U, x, x_name in (("U_q", U_q, query, "query"), ("U_k", U_k, key, "key")):
        if isinstance(U, SubspaceFactors):
            check_subspace(U, name, x, x_name, same_dtype=ac is None)
    if ac is not None:  # mixed precisions in, float32 computed, the autocast dtype out (as the other calls)
        f64 = query.dtype == torch.float64
        with torch.autocast(dev, enabled=False):
            cast = (lambda t: t) if f64 else _f32_factors  # noqa: E731
            out = riemannian_attention(cast(query), cast(key), cast(value), cast(attn_mask), dropout_p, is_causal,
                                       scale, U_q=cast(U_q), U_k=cast(U_k), lam=cast(lam), metric_side=metric_side,
                                       enable_gqa=enable_gqa, block_sizes=block_sizes)
        return out if f64 else out.to(ac)
    # validate as the call with U = B C, on zero-stride stand-ins of that shape
    stand = {id(U): U.coef.new_zeros(()).expand(*torch.broadcast_shapes(U.basis.shape[:-2], U.coef.shape[:-3]),
                                                  U.coef.shape[-3], U.basis.shape[-2], U.coef.shape[-1])
             for U in (U_q, U_k) if isinstance(U, SubspaceFactors)}
    Pq, Pk = (stand.get(id(U), U) for U in (U_q, U_k))
    g = 1
    if enable_gqa:
        hq, hk = (query.shape[-3], key.shape[-3]) if query.dim() >= 3 and key.dim() >= 3 else (1, 1)
        g, query, key, value, attn_mask, Pq, Pk, lam = group_heads(query, key, value, attn_mask, Pq, Pk, lam)
        if g > 1:
            U_q, U_k = (_group_subspace(U, hq, hk) if isinstance(U, SubspaceFactors) else P
                        for U, P in ((U_q, Pq), (U_k, Pk)))
        else:
            U_q, U_k = (U if isinstance(U, SubspaceFactors) else P for U, P in ((U_q, Pq), (U_k, Pk)))
    lam_t, scale, per_q, per_k, batch = check_attention_inputs(query, key, value, attn_mask, dropout_p, is_causal,
                                                               scale, Pq, Pk, lam, metric_side)
    blocks = _check_block_sizes(block_sizes) if block_sizes is not None else None
    other = U_k if isinstance(U_q, SubspaceFactors) else U_q
    other_per_token = isinstance(other, Tensor) and other.dim() == (key if other is U_k else query).dim() + 1 \
        and other.shape[-1] > 0
    route = _FORCED_BACKEND if _FORCED_BACKEND is not None else _exact_route(query.device.type, "subspace")
    lifted = route == "sdpa_lifted" and dropout_p == 0.0 and not other_per_token
    if _FORCED_BACKEND in _SDPA_ROUTES and not lifted:
        why = "the key term of a subspace metric is not a per-key bias" if route == "sdpa_bias" else \
            "dropout_p > 0" if dropout_p > 0.0 else "the other side has per-token factors outside the subspace"
        raise RuntimeError(f"riemannian_attention under _force_backend({route!r}): SDPA does not compute this "
                           f"call exactly: {why}")
    if not lifted or query.shape[-2] == 0 or math.prod(batch) == 0:
        dense = (U.dense() if isinstance(U, SubspaceFactors) else U for U in (U_q, U_k))
        out = _dispatch(query, key, value, attn_mask, dropout_p, is_causal, scale, *dense, lam_t, metric_side,
                        per_q, per_k, batch, blocks, g)
    elif query.dtype in (torch.float16, torch.bfloat16):  # the expanded form cancels: float32, as everywhere
        out = _sdpa_subspace(*_f32(query, key, value, attn_mask), is_causal, scale, _f32_factors(U_q),
                             _f32_factors(U_k), _f32(lam_t), metric_side, batch, g).to(query.dtype)
    else:
        out = _sdpa_subspace(query, key, value, attn_mask, is_causal, scale, U_q, U_k, lam_t, metric_side, batch,
                             g)
    return out.flatten(-4, -3) if g > 1 else out


def _sdpa_subspace(query, key, value, attn_mask, is_causal, scale, U_q, U_k, lam_t, metric_side, batch, g):
    """A subspace call on SDPA: :func:`_subspace_lift`, then :func:`_sdpa_run`."""
    qa, ka = _subspace_lift(query, key, U_q, U_k, lam_t, metric_side)
    return _sdpa_run(qa, ka, value, attn_mask, is_causal, scale, batch, g)


def _subspace_lift(query, key, U_q, U_k, lam_t, metric_side):
    r"""Lifted queries and keys whose dot products are the scores over ``scale``, up to row constants.

    For the key side, :math:`G_j = M + B P_j B^\top` with :math:`P_j = C_j C_j^\top`
    (:math:`m \times m`) and :math:`M = \lambda I + \sum W W^\top` (shared
    factors), :math:`p_i = B^\top q_i`, :math:`\kappa_j = B^\top k_j`:

    .. math::
        -\tfrac12 (q_i - k_j)^\top G_j (q_i - k_j) + \tfrac12 q_i^\top M q_i
        = \big[q_i,\ \ell_w(p_i),\ 1\big] \cdot
          \big[G_j k_j,\ -\tfrac12 \ell(P_j),\ -\tfrac12 k_j^\top G_j k_j\big],

    :math:`\ell(P)` the upper triangle of :math:`P` (:math:`m(m+1)/2` numbers)
    and :math:`\ell_w(p)` that of :math:`p p^\top` with the off-diagonal
    entries doubled, so that :math:`\ell_w(p) \cdot \ell(P) = p^\top P p`:
    width :math:`d + m(m+1)/2 + 1`. The query side is the mirror image (the
    query's metric moves to the query, :math:`\ell_w(B^\top k_j)` to the
    key). With both sides in subspaces (``"mean"``, weights 1/2) the cross
    term of the key side takes an :math:`m`-block of its own,
    :math:`p_i \cdot P_j \kappa_j`: width
    :math:`d + m_k + m_k(m_k+1)/2 + m_q(m_q+1)/2 + 1`. The other side may be
    absent, a shared factor (in :math:`M`) or per-token with ``r = 0``.
    """
    w = 0.5 if metric_side == "mean" else 1.0
    lam = lam_t[..., None, None] if lam_t.dim() else lam_t
    shared = [U for U in (U_q, U_k) if isinstance(U, Tensor) and U.shape[-1] and U.dim() == query.dim()]

    def metric(x):  # M x, M = lam I + w sum W W^T
        out = lam * x
        for W in shared:
            out = out + w * (x @ W) @ W.transpose(-1, -2)
        return out

    Sq = U_q if isinstance(U_q, SubspaceFactors) else None
    Sk = U_k if isinstance(U_k, SubspaceFactors) else None
    Mk = metric(key)
    k_term = (key * Mk).sum(-1)  # k^T M k (+ the subspace parts below)          (..., n_k)
    q_mid, k_mid = [], []  # the blocks between the base block and the constant
    if Sk is not None:
        Bk, Ck = Sk
        Pk = w * (Ck @ Ck.transpose(-1, -2))  # w P_j                                (..., n_k, m, m)
        kap = key @ Bk  # B^T k_j                                                   (..., n_k, m)
        Pkap = (Pk @ kap.unsqueeze(-1)).squeeze(-1)  # w P_j B^T k_j                 (..., n_k, m)
        k_term = k_term + (kap * Pkap).sum(-1)
        p = query @ Bk  # B^T q_i                                                   (..., n_q, m)
        if Sq is not None:  # the key side's cross term in an m-block of its own
            q_mid.append(p)
            k_mid.append(Pkap)
        q_mid.append(_sym_lift(p))
        k_mid.append(-0.5 * _sym_coords(Pk))
    if Sq is not None:
        Bq, Cq = Sq
        Pq = w * (Cq @ Cq.transpose(-1, -2))  # w P_i                                (..., n_q, m, m)
        pi = query @ Bq  # B^T q_i                                                  (..., n_q, m)
        q_base = metric(query) + ((Pq @ pi.unsqueeze(-1)).squeeze(-1)) @ Bq.transpose(-1, -2)  # G_i q_i
        k_base = key
        q_mid.append(-0.5 * _sym_coords(Pq))
        k_mid.append(_sym_lift(key @ Bq))
    else:  # key side only: the cross term is q_i . G_j k_j
        q_base, k_base = query, Mk + Pkap @ Bk.transpose(-1, -2)
    qa = _cat_last([q_base, *q_mid, torch.ones_like(query[..., :1])])
    ka = _cat_last([k_base, *k_mid, (-0.5 * k_term).unsqueeze(-1)])
    return qa, ka


def _sym_coords(P: Tensor) -> Tensor:
    """The upper triangle (diagonal included) of symmetric matrices [..., m, m], as [..., m(m+1)/2]."""
    i, j = torch.triu_indices(P.shape[-1], P.shape[-1], device=P.device)
    return P[..., i, j]


def _sym_lift(p: Tensor) -> Tensor:
    """The upper triangle of :math:`p p^\\top` with off-diagonal entries doubled, [..., m(m+1)/2] for p [..., m]."""
    m = p.shape[-1]
    i, j = torch.triu_indices(m, m, device=p.device)
    wts = torch.where(i == j, 1.0, 2.0).to(p.dtype)
    return p[..., i] * p[..., j] * wts


def _cat_last(parts):
    """Concatenate along the last dimension after broadcasting the others."""
    lead = torch.broadcast_shapes(*(t.shape[:-1] for t in parts))
    return torch.cat([t.expand(*lead, t.shape[-1]) for t in parts], -1)


def _group_subspace(U: SubspaceFactors, hq: int, hk: int) -> SubspaceFactors:
    """The grouped-query views of :class:`SubspaceFactors` (``basis`` heads at -3, ``coef`` heads at -4)."""
    g = hq // hk

    def split(t, dim):
        return t.unflatten(dim, (hk, g)) if t.shape[dim] == hq else t.unsqueeze(dim % t.dim() + 1)

    return SubspaceFactors(split(U.basis, -3), split(U.coef, -4))


def _f32_factors(t):
    """:func:`_f32` that also converts the parts of :class:`SubspaceFactors`."""
    return SubspaceFactors(*_f32(t.basis, t.coef)) if isinstance(t, SubspaceFactors) else _f32(t)


def sdpa_mask_and_causal(q, k, v, attn_mask, is_causal, scale, dropout_p=0.0, enable_gqa=False):
    """SDPA with a mask and ``is_causal`` together, the mask kept compact where SDPA's kernel takes the pair.

    torch 2.13's fused CPU kernels apply both (top-left causal), its math
    kernel (a mask that requires grad, inputs whose last dimension is not
    contiguous, other devices) refuses the pair: there, and while
    ``torch.compile`` traces, the causal part joins the mask, a
    ``[..., n_q, n_k]`` tensor.
    """
    from .connections import _sdpa_takes_mask_and_causal
    from .reference import additive_mask

    sdpa = torch.nn.functional.scaled_dot_product_attention
    if attn_mask is not None and is_causal:
        # (while tracing: one combined mask, which every kernel takes; the probe would run inside the graph)
        if not torch.compiler.is_compiling() and _sdpa_takes_mask_and_causal(q.device):
            try:
                return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=True, scale=scale,
                            enable_gqa=enable_gqa)
            except RuntimeError as exc:  # the math kernel
                if "is_causal" not in str(exc):
                    raise
        attn_mask, is_causal = additive_mask(attn_mask, True, q.shape[-2], k.shape[-2], q), False
    return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa)


def _relative_mask(attn_mask, is_causal: bool, n_q: int, n_k: int):
    """A float mask with each row relative to its largest visible entry, as the fast operators read it.

    Exact (a row constant), and it keeps the sum with the scores from
    rounding away the scores next to a large finite mask (float16's
    ``finfo.min`` is -65504); rows at most ``DOMINANT_MASK`` stay as they are,
    so there the scores still vanish, as in SDPA.
    """
    from ._validate import DOMINANT_MASK, mask_row_max

    if attn_mask is None or attn_mask.dtype == torch.bool:
        return attn_mask
    c = mask_row_max(attn_mask, is_causal, n_q, n_k).unsqueeze(-1)  # [*mb, 1|n_q, 1]
    # all 0: nothing to subtract (looked at only where that is free: on CPU, not while tracing)
    if not torch.compiler.is_compiling() and not reading_syncs(c) and not bool(c.any()):
        return attn_mask
    return attn_mask - torch.where(c <= DOMINANT_MASK, 0.0, c)


_FORCED_BACKEND: str | None = None  # set only by _force_backend

#: The route of the calls that SDPA computes exactly, per device type and kind of call: ``"no_factor"``
#: (no per-token factor: ``G = lam I`` or one shared metric, no dropout) and ``"subspace"`` (per-token factors
#: given as :class:`~riemannian_ref.geometry.metric.SubspaceFactors`, the other side without per-token
#: factors, no dropout). Routes: ``"sdpa_lifted"``, SDPA on lifted inputs (one extra coordinate for the key
#: term, ``m(m+1)/2`` more for a subspace); ``"sdpa_bias"`` (``"no_factor"`` only), SDPA with the key term as an
#: additive float mask, which needs its gradient and so runs on SDPA's math kernel; ``"operator"``, the
#: per-token path (the Triton kernels on CUDA, else the blockwise operator; subspace factors multiplied out).
#: All three are exact. A device type not listed takes ``"sdpa_lifted"``. CPU: the route that
#: ``benchmarks/bench_reductions.py`` (fwd+bwd at B = 4, h = 4, n = 1024, d = 64, two threads) finds fastest;
#: its summary names that route next to this entry, which follows it. CUDA: SDPA on lifted inputs, so that
#: SDPA's fused kernels compute. Nothing is timed inside the library: the table is read, not measured.
_EXACT_ROUTES: dict[str, dict[str, str]] = {
    "cpu": {"no_factor": "sdpa_lifted", "subspace": "sdpa_lifted"},
    "cuda": {"no_factor": "sdpa_lifted", "subspace": "sdpa_lifted"},
}
_SDPA_ROUTES = ("sdpa_lifted", "sdpa_bias")


def _exact_route(device_type: str, kind: str) -> str:
    """The route of :data:`_EXACT_ROUTES` for a device type and a kind of call (``"no_factor"``, ``"subspace"``)."""
    return _EXACT_ROUTES.get(device_type, {}).get(kind, "sdpa_lifted")


@contextlib.contextmanager
def _force_backend(name: str):
    """Make every :func:`riemannian_attention` call in the block run on one backend (private, for tests).

    ``_force_backend("blockwise")``: the CPU operator also for the calls that
    would go to SDPA (no per-token factor, or factors in a shared subspace,
    multiplied out), so its tests reach it. ``_force_backend("sdpa_lifted")``
    and ``_force_backend("sdpa_bias")``: that route of :data:`_EXACT_ROUTES`
    for every call it computes exactly (``"sdpa_bias"``: calls without
    per-token factors; ``"sdpa_lifted"``: those and subspace factors), and a
    ``RuntimeError`` for any other call (per-token factors, dropout).
    ``_force_backend("triton")``, in the spirit of
    ``torch.nn.attention.sdpa_kernel``: the dispatch sends every call with
    something to compute to the Triton kernels, on any device (CPU tensors
    run there when ``TRITON_INTERPRET=1`` was set before ``triton`` was first
    imported), ignoring ``RR_DISABLE_TRITON``; ``block_sizes`` are then the
    kernels' (two powers of two >= 16; default: their own rule). A call the
    kernels do not support raises ``RuntimeError`` saying why (dropout, a
    float64 call, a float mask that requires grad, ...) instead of taking
    another backend. The call is validated exactly as without the block.
    The content connections of ``connection_attention`` go to their own
    kernels (``_triton_content``) the same way.
    Not thread-safe: it sets a module-level flag for the duration of the block.
    """
    global _FORCED_BACKEND
    if name not in ("triton", "blockwise", *_SDPA_ROUTES):
        raise ValueError(f"backend must be 'triton', 'blockwise', 'sdpa_lifted' or 'sdpa_bias' (the backends that "
                         f"can be forced), got {name!r}")
    before = _FORCED_BACKEND
    _FORCED_BACKEND = name
    try:
        yield
    finally:
        _FORCED_BACKEND = before


def _forced_triton(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam_t, metric_side, per_q,
                   per_k, batch, blocks, g):
    """A validated call on the Triton kernels (``_force_backend("triton")``), or RuntimeError saying why not."""
    from . import _triton  # imports triton if installed

    why = "dropout_p > 0 (the kernels have no dropout)" if dropout_p > 0.0 else \
        _triton.unsupported_reason(query, value, attn_mask, U_q, U_k)
    if why is not None:
        raise RuntimeError(f"riemannian_attention under _force_backend('triton'): the Triton kernels do not "
                           f"support this call: {why}")
    return _triton.attention_flat(query, key, value, attn_mask, is_causal, scale, U_q, U_k, lam_t, metric_side,
                                  per_q, per_k, batch, blocks, g)


def _triton_path(query: Tensor, value: Tensor, attn_mask, U_q, U_k) -> bool:
    """Whether a validated call runs on the Triton kernels: CUDA tensors, triton importable, not disabled, supported."""
    if query.device.type != "cuda" or _triton_disabled():
        return False
    from . import _triton  # imports triton if installed (guarded: HAS_TRITON is False otherwise)
    return _triton.usable(query, value, attn_mask, U_q, U_k)


def _triton_disabled() -> bool:
    return os.environ.get("RR_DISABLE_TRITON", "").strip().lower() in ("1", "true", "yes", "on")


def _f32(*ts):
    """Floating tensors in float32 (others, and None, unchanged); one argument gives one result."""
    out = tuple(t.float() if isinstance(t, Tensor) and t.is_floating_point() else t for t in ts)
    return out[0] if len(ts) == 1 else out


def _check_block_sizes(block_sizes) -> tuple[int, int]:
    ok = isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 2 and all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block_sizes)
    if not ok:
        raise ValueError(f"block_sizes must be a pair of positive ints (bq, bk), got {block_sizes!r}")
    return int(block_sizes[0]), int(block_sizes[1])


def _flat(x: Tensor, batch: torch.Size, tail: int) -> Tensor:
    """Broadcast the batch dims of ``x`` to ``batch`` and flatten them: (prod(batch), *tail)."""
    t = x.shape[x.dim() - tail:]
    return x.expand(*batch, *t).reshape(math.prod(batch), *t)
