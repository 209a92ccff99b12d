r"""Attention along a connection: keys, key metrics and values carried between token fibres.

The connections themselves (what :math:`P_{j\to i}` is for ``"trivial"``,
``"flat"``, ``"content"``, ``"content_source"`` and ``"cumulative"``, their
rates, angles and phases) are geometry, in
:mod:`riemannian_ref.geometry.transport`; this module attends along them
(:func:`connection_attention`) and picks the route.

For the flat and cumulative connections every fibre object can be moved to
one common frame (rotate each by :math:`R^\top` of its own token), which is
why rotary attention costs :math:`O(n d)` extra; for the content connections
the angle couples the pair, and the transport costs :math:`O(n^2 d)`
elementwise, the same order as the scores (on CPU a fused kernel computes it
with :math:`O(n d)` memory, on CUDA Triton kernels).

The names of :mod:`riemannian_ref.geometry.transport` are importable from
here too, as before the split.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

from .._checks import autocast_dtype, broadcast_batch, check_same, check_tensor, shape_str
from ..geometry.transport import (CONNECTIONS, check_positions, edge_rule, phases_unchecked,
                                  rotary_frequencies, rotate_factor, rotate_pairs, transport_angles)
from ._validate import check_attention_inputs
from .functional import _attention
from .reference import _reference_attention, additive_mask, masked_softmax

__all__ = ["connection_attention"]

def _per_token(U: Tensor | None, per: bool, n: int) -> Tensor | None:
    """A shared factor [..., d, r] made per-token [..., n, d, r] (a view, no copy)."""
    if U is None or per:
        return U
    return U.unsqueeze(-3).expand(*U.shape[:-2], n, *U.shape[-2:])


def connection_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, *,
                         U_q: Tensor | None = None, U_k: Tensor | None = None, lam=1.0,
                         metric_side: str = "key", scores: str = "metric", connection: str = "trivial",
                         rates: Tensor | None = None, positions: Tensor | None = None,
                         transport_values: bool = True, return_weights: bool = False):
    r"""Attention with keys, key metrics and values parallel-transported to the query's fibre.

    .. math::
        s_{ij} = -\tfrac{\text{scale}}{2}\,(q_i - P_{j\to i}k_j)^\top \bar G_{ij}\,(q_i - P_{j\to i}k_j),
        \qquad
        o_i = \sum_j A_{ij}\, P_{j\to i} v_j ,

    with :math:`\bar G_{ij}` = :math:`P G_j P^\top` (``"key"``), :math:`G_i`
    (``"query"``) or their mean (``"mean"``), :math:`A = \mathrm{softmax}(S + M)`;
    with ``scores="dot"`` the score is :math:`\text{scale}\; q_i^\top P_{j\to i} k_j`
    instead (with the flat connection these are rotary position embedding's
    scores; RoPE itself also leaves the values alone, ``transport_values=False``).

    Parameters
    ----------
    query, key, value : Tensor, shape [..., n, d]
        With a non-trivial connection one sequence (self-attention: the same
        ``n``), and the values have the head dimension ``d`` when they are
        transported.
    attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam, metric_side
        As in :func:`riemannian_ref.attention.functional.riemannian_attention`
        (``U_q``, ``U_k`` must be None with ``scores="dot"``).
    scores : {"metric", "dot"}
        Riemannian distance scores, or scaled dot products.
    connection : {"trivial", "flat", "content", "content_source", "cumulative"}
        :math:`P = I`; rotary rotations :math:`R_i R_j^\top`; rotations by
        :math:`(p_i - p_j)(\omega_i + \omega_j)/2` (inverse-consistent), or
        by :math:`(p_i - p_j)\,\omega_j` (source rates only); or by
        :math:`\phi_i - \phi_j` of the cumulative phases
        :math:`\phi_i = \sum_{t \le i} \omega_t (p_t - p_{t-1})`
        (:func:`cumulative_phases`: flat, content-dependent).
    rates : Tensor, optional
        ``"flat"``: the rotary rates, shape [d/2] (default
        :func:`rotary_frequencies`). Content connections (also
        ``"cumulative"``): the per-token rates :math:`\omega_j`, shape
        [..., n, d/2], broadcasting against the batch (required).
        ``"trivial"``: must be None.
    positions : Tensor, shape [n] or [..., n], optional
        Token positions :math:`p_i` (default ``0..n-1``). For
        ``"cumulative"`` they enter only through the increments
        :math:`p_t - p_{t-1}` of the tokens between the two ends of an edge:
        with left padding the default positions (the pads counted) and
        positions that start at 0 at the first real token give the same
        transports between real tokens, and the pads' rates do not enter
        them (up to round-off). Padding between real tokens does enter (its
        rates and increments lie on the path); give it zero increments
        (repeat the previous position) to skip it.
    transport_values : bool
        Mix :math:`P_{j\to i} v_j` (the values are transported too) or plain
        :math:`v_j`. Rotary position embedding (RoPE) is exactly
        ``scores="dot"``, ``"flat"`` and ``transport_values=False``; with the
        default ``True`` the flat connection has RoPE's scores but also
        rotates the values, :math:`o_i = R_i \sum_j A_{ij} R_j^\top v_j`.
    return_weights : bool
        Also return the attention weights [..., n, n] (computed densely).

    Returns
    -------
    Tensor, shape [..., n, d_v]
        With ``return_weights``, the pair ``(output, weights)``.

    Notes
    -----
    Under ``torch.autocast`` (inputs in mixed precisions) metric scores and
    transports are computed in float32 and returned in the autocast dtype;
    plain dot-product attention without transport is SDPA, run as autocast
    runs it (inputs cast to the autocast dtype). A mask and ``is_causal``
    reach SDPA as they are where SDPA applies the pair (torch 2.13 on CPU),
    as the metric operator keeps them; elsewhere they are combined into one
    mask.

    ``"trivial"`` calls the operator directly. ``"flat"`` moves everything to
    one frame: :math:`q_i \mapsto R_i^\top q_i`, :math:`k_j \mapsto R_j^\top k_j`,
    :math:`U \mapsto R^\top U` (so :math:`G_j \mapsto R_j^\top G_j R_j`),
    :math:`v_j \mapsto R_j^\top v_j`, calls the same operator, and rotates the
    output back by :math:`R_i`: :math:`O(n d r)` extra. ``"cumulative"`` does
    the same with :math:`R_i = R(\phi_i)` (phases and rotations in float32 at
    least, rounded once to the input dtype), so it reaches the same operator
    (SDPA, the blockwise operator, the Triton kernels) with :math:`O(n d r)`
    extra time and memory. The content connections
    couple every pair through its angles, so their time is :math:`O(n^2 d (1 + r))`
    elementwise work (the angles, their cosines and sines, the turned queries and
    their products with :math:`[k_j \mid U_{k,j}]`). On CPU they run on a fused
    kernel (private, ``attention/_content_cpu.py``) that computes a query row
    at a time and recomputes each row in the backward: memory :math:`O(n d r)`,
    nothing pairwise stored, the causal half skipped, results independent of
    the CPU's vector width. It is compiled on first use with the system C
    compiler (about two seconds, cached per user; ``RR_DISABLE_CKERNEL=1``
    turns it off). Dropout, ``return_weights``, a mask that requires grad,
    ``torch.compile`` tracing, a machine without a C compiler and CUDA
    tensors without ``triton`` take the dense path, the readable reference:
    it turns the queries (and the values; the keys too for a query-side
    metric) pair by pair as complex products and keeps the angles for its
    backward, about 1.5 to 3.5
    ``[..., n, n, d]`` tensors (batch 8, 4 heads, n = 256, d = 16 in float32
    is 128 MiB each), never a ``[n, n, d, d]`` one. The fused kernel has no
    double backward (it raises, naming the switch to the dense path).

    On CUDA, with ``triton`` installed, the content connections run on Triton
    kernels (private, ``attention/_triton_content.py``) that compute the
    scores and the transported values in tiles, recomputing each tile's
    angles in the backward: memory :math:`O(n d r)`, nothing pairwise
    stored, causal key blocks past the diagonal skipped, half-precision
    inputs computed in float32; also while ``torch.compile`` traces (as
    custom ops). Query-side metric factors (``metric_side="query"``, or
    ``"mean"`` with ``U_q``), dropout, ``return_weights``, float64, a mask
    that requires grad and ``RR_DISABLE_TRITON=1`` take the dense path there.
    These kernels are tested against the dense path in Triton's interpreter
    on CPU only: they were never run or timed on a GPU (none was available).
    """
    ac = autocast_dtype(query.device.type) if isinstance(query, Tensor) else None
    if ac is not None and query.dtype != torch.float64:  # autocast leaves float64 alone, as it does for SDPA
        return _autocast_attention(ac, query, key, value, attn_mask, dropout_p, is_causal, scale, U_q=U_q, U_k=U_k,
                                   lam=lam, metric_side=metric_side, scores=scores, connection=connection,
                                   rates=rates, positions=positions, transport_values=transport_values,
                                   return_weights=return_weights)
    if connection not in CONNECTIONS:
        raise ValueError(f"connection must be one of {CONNECTIONS}, got {connection!r}")
    if scores not in ("metric", "dot"):
        raise ValueError(f"scores must be 'metric' or 'dot', got {scores!r}")
    if scores == "dot" and (U_q is not None or U_k is not None):
        raise ValueError("scores='dot' takes no metric factors: pass U_q=None and U_k=None")
    if not isinstance(transport_values, bool):
        raise ValueError(f"transport_values must be a bool, got {transport_values!r}")
    # validated once here: the operator and the dense reference below are called unchecked
    lam_t, scale_t = check_attention_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k,
                                            lam, metric_side if scores == "metric" else "key")[:2]
    if scores == "metric":  # (dot scores keep the caller's scale, which SDPA reads as given)
        lam, scale = lam_t, scale_t
    if rates is not None:
        check_tensor(rates, "rates", min_dim=1)
    check_same(query, "query", [("rates", rates)])
    n, d = query.shape[-2], query.shape[-1]
    if connection == "trivial":
        if rates is not None:
            raise ValueError("rates is not used by the trivial connection; pass None")
        return _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam, metric_side,
                       scores, return_weights)
    if key.shape[-2] != n:
        raise ValueError(f"a connection transports within one sequence: query and key need the same n, got "
                         f"query {shape_str(query)}, key {shape_str(key)}")
    if d % 2:
        raise ValueError(f"connection {connection!r} rotates pairs of coordinates: the head dimension d "
                         f"must be even, got d = {d}")
    if transport_values and value.shape[-1] != d:
        raise ValueError(f"values are transported between fibres, so value must have the head dimension "
                         f"d = {d}, got {shape_str(value)} (or pass transport_values=False)")
    if connection == "cumulative":
        ang = _cumulative_angles(rates, positions, query)  # phi_i, float32 at least   (..., n, d/2)
        return _common_frame_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam,
                                       metric_side, scores, ang, transport_values, return_weights)
    p = check_positions(positions, n, query)
    if connection == "flat":
        if rates is None:
            rates = rotary_frequencies(d, dtype=query.dtype, device=query.device)
        if rates.dim() != 1 or rates.shape[0] != d // 2:
            raise ValueError(f"rates for the flat connection must have shape [d/2] = [{d // 2}], "
                             f"got {shape_str(rates)}")
        ang = p.unsqueeze(-1) * rates  # angle of R_i                             (..., n, d/2)
        per_q = U_q is not None and U_q.dim() == query.dim() + 1
        per_k = U_k is not None and U_k.dim() == key.dim() + 1
        q1, k1 = rotate_pairs(query, -ang), rotate_pairs(key, -ang)  # R_i^T q_i, R_j^T k_j
        v1 = rotate_pairs(value, -ang) if transport_values else value  # R_j^T v_j
        U_q1 = rotate_factor(_per_token(U_q, per_q, n), -ang) if U_q is not None else None
        U_k1 = rotate_factor(_per_token(U_k, per_k, n), -ang) if U_k is not None else None
        res = _attend(q1, k1, v1, attn_mask, dropout_p, is_causal, scale, U_q1, U_k1, lam, metric_side,
                      scores, return_weights)
        out, A = res if return_weights else (res, None)
        if transport_values:
            out = rotate_pairs(out, ang)  # back to fibre i: R_i o_i
        return (out, A) if return_weights else out
    if query.dtype in (torch.float16, torch.bfloat16):  # positions in float32: bfloat16 spaces 256, 258, ...
        p = check_positions(positions, n, query.new_empty((), dtype=torch.float32))
    return _content_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam,
                              metric_side, scores, rates, p, transport_values, return_weights,
                              edge_rule(connection))


def _cumulative_angles(rates: Tensor | None, positions: Tensor | None, query: Tensor) -> Tensor:
    """The phases of the cumulative connection for :func:`connection_attention`, validated, in float32 at least.

    Half-precision rates and positions would give phases with a few
    significant digits (float16 spaces 2048 and 2049 by 2), so the phases, and
    the rotations built from them, are computed in float32 for half inputs.
    """
    n = query.shape[-2]
    _check_rates(rates, query, "cumulative")
    wide = torch.promote_types(query.dtype, torch.float32)
    rates = rates.to(wide)
    p = check_positions(positions, n, rates)
    broadcast_batch({"rates.shape[:-2]": rates.shape[:-2], "positions.shape[:-1]": p.shape[:-1]})
    return phases_unchecked(rates, p)


def _turn(x: Tensor, c: Tensor, s: Tensor, axis: int) -> Tensor:
    """Turn the pairs of ``x`` along ``axis`` (-1: vectors [..., d]; -2: factors [..., d, r]) by the angle
    whose cosines and sines are ``c``, ``s`` (shaped to broadcast against one member of each pair); the
    result is contiguous in ``x``'s layout, in the promoted dtype."""
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if axis == -1 else (x[..., 0::2, :], x[..., 1::2, :])
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=axis).flatten(axis - 1, axis)


class _TokenRotation(torch.autograd.Function):
    r"""Per-token rotations :math:`y_t = R(a_t)\, x_t` whose angles :math:`a` are learned.

    ``c``, ``s`` are :math:`\cos a`, :math:`\sin a` (computed once by the caller for every object it
    turns, no gradient through them); the gradient reaches ``a`` from
    :math:`\partial y / \partial a = J y`. The backward keeps the tables and one of the two vectors,
    ``keep="output"`` (:math:`y`, which the attention operator keeps anyway: the same storage) or
    ``"input"`` (:math:`x`, e.g. an operator's output), instead of autograd's copies of both operands of
    every product. ``sign=-1`` turns by the opposite angle with the same tables (:math:`\sin a = -s`).
    The result is rounded to ``x``'s dtype (half precision: turned in the tables' dtype).
    """

    @staticmethod
    def forward(ctx, x, a, c, s, axis, keep, sign):
        y = _turn(x, c, s if sign > 0 else -s, axis).to(x.dtype)
        ctx.axis, ctx.keep, ctx.sign, ctx.x_shape, ctx.x_dtype = axis, keep, sign, x.shape, x.dtype
        ctx.save_for_backward(c, s, (y if keep == "output" else x) if ctx.needs_input_grad[1] else None)
        return y

    @staticmethod
    def backward(ctx, g):
        c, s, t = ctx.saved_tensors
        g = g.to(c.dtype)
        gx = _turn(g, c, -s if ctx.sign > 0 else s, ctx.axis)  # R(a)^T g
        g_x = gx.to(ctx.x_dtype).sum_to_size(ctx.x_shape) if ctx.needs_input_grad[0] else None
        g_a = None
        if ctx.needs_input_grad[1]:
            axis = ctx.axis
            pairs = (lambda u: (u[..., 0::2], u[..., 1::2])) if axis == -1 else \
                (lambda u: (u[..., 0::2, :], u[..., 1::2, :]))  # noqa: E731
            if ctx.keep == "output":  # <g, J y>
                (g1, g2), (y1, y2) = pairs(g), pairs(t.to(c.dtype))
                g_a = g2 * y1 - g1 * y2
            else:  # <R^T g, J x>
                (h1, h2), (x1, x2) = pairs(gx), pairs(t.to(c.dtype))
                g_a = h2 * x1 - h1 * x2
            g_a = g_a.sum_to_size(c.shape)
        return g_x, g_a, None, None, None, None, None


def _common_frame_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam,
                            metric_side, scores, ang, transport_values, return_weights):
    r"""The cumulative connection, :math:`P_{j\to i} = R(\phi_i) R(\phi_j)^\top`, in one common frame.

    Every object is rotated by :math:`R(\phi)^\top` of its own token (queries,
    keys, the factors, so :math:`G_j \mapsto R_j^\top G_j R_j`, and the values
    when they are transported), the ordinary operator runs, and the output is
    rotated back by :math:`R(\phi_i)`: :math:`O(n d r)` extra. ``ang`` holds
    :math:`\phi` [..., n, d/2]; where it is wider than the inputs (half
    precision), the rotations are computed in its dtype and rounded once to
    the input dtype. One table of cosines and sines serves every rotation
    (and a factor shared by both sides is turned once); learned angles go
    through :class:`_TokenRotation`, so that the backward keeps that table
    and the operator's own tensors, :math:`O(n d)` in all. (The flat branch
    of :func:`connection_attention` does the same with rotary angles, one
    table per rotation.)
    """
    n = query.shape[-2]
    learned = ang.requires_grad and torch.is_grad_enabled()
    with torch.no_grad() if learned else contextlib.nullcontext():  # learned: the gradient comes from J y
        c, s = torch.cos(-ang), torch.sin(-ang)  # R(phi)^T, shared by every object   (..., n, d/2)
    a = -ang

    def turn(x, axis=-1, keep="output"):  # R_t^T x_t (factors: every column), returned in x's dtype
        cc, ss = (c, s) if axis == -1 else (c.unsqueeze(-1), s.unsqueeze(-1))
        if learned:
            return _TokenRotation.apply(x, a if axis == -1 else a.unsqueeze(-1), cc, ss, axis, keep, 1)
        return _turn(x, cc, ss, axis).to(x.dtype)

    per_q = U_q is not None and U_q.dim() == query.dim() + 1
    per_k = U_k is not None and U_k.dim() == key.dim() + 1
    q1, k1 = turn(query), turn(key)  # R_i^T q_i, R_j^T k_j
    v1 = turn(value) if transport_values else value  # R_j^T v_j
    U_k1 = turn(_per_token(U_k, per_k, n), -2) if U_k is not None else None
    if U_q is not None:  # self-attention passes one factor for both sides: turned once
        U_q1 = U_k1 if U_q is U_k else turn(_per_token(U_q, per_q, n), -2)
    else:
        U_q1 = None
    res = _attend(q1, k1, v1, attn_mask, dropout_p, is_causal, scale, U_q1, U_k1, lam, metric_side,
                  scores, return_weights)
    out, A = res if return_weights else (res, None)
    if transport_values:  # back to fibre i: R_i o_i, with the same tables (cos is even and sin odd)
        if learned:
            out = _TokenRotation.apply(out, ang, c, s, -1, "input", -1)
        else:
            o1, o2 = out[..., 0::2], out[..., 1::2]
            out = torch.stack((o1 * c + o2 * s, o2 * c - o1 * s), dim=-1).flatten(-2).to(out.dtype)
    return (out, A) if return_weights else out


def _autocast_attention(ac, query, key, value, attn_mask, dropout_p, is_causal, scale, **kw):
    """:func:`connection_attention` under ``torch.autocast`` (dtype ``ac``), whose inputs come in mixed precisions.

    Plain dot-product attention (no transport, no weights) is SDPA, which
    autocast runs in ``ac``: its inputs are cast to ``ac``, as autocast casts
    them. Everything else (metric scores, transports) is computed in float32
    with autocast off; the result, and the weights, come back in ``ac``, the
    dtype autocast gives SDPA's result.
    """
    sdpa = kw["scores"] == "dot" and kw["connection"] == "trivial" and not kw["return_weights"]
    to = (lambda t: t.to(ac) if isinstance(t, Tensor) and t.is_floating_point() else t) if sdpa else \
        (lambda t: t.float() if isinstance(t, Tensor) and t.is_floating_point() else t)  # noqa: E731
    with torch.autocast(query.device.type, enabled=False):
        res = connection_attention(to(query), to(key), to(value), to(attn_mask), dropout_p, is_causal, scale,
                                   **{name: (to(t) if name in ("U_q", "U_k", "lam", "rates") else t)
                                      for name, t in kw.items()})
    return tuple(t.to(ac) for t in res) if kw["return_weights"] else res.to(ac)


_SDPA_MASK_AND_CAUSAL: dict[str, bool] = {}


def _sdpa_takes_mask_and_causal(device: torch.device) -> bool:
    """Whether SDPA applies ``attn_mask`` and ``is_causal`` together on this device (checked once per process).

    SDPA's documentation says the pair raises; torch 2.13's CPU kernels
    accept it and apply both (top-left causal, as here). Where that holds, a
    key-padding mask ``[B, 1, 1, n]`` reaches SDPA as it is, the compact form
    the metric path keeps; elsewhere (other devices, whose kernels cannot be
    probed for every shape and dtype here, and torch versions that raise)
    the two are combined into one ``[B, 1, n, n]`` mask. The probe compares
    the pair with that combination on a small call whose first rows see no
    key, so a version that ignored either part would fail it.
    """
    if device.type != "cpu":
        return False
    if "cpu" not in _SDPA_MASK_AND_CAUSAL:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 1, n, 4, generator=g) for n in (5, 6, 6))
        keep = torch.ones(2, 1, 1, 6, dtype=torch.bool)
        keep[0, ..., :2] = False  # with causal: rows 0 and 1 of the first sequence see no key
        sdpa = torch.nn.functional.scaled_dot_product_attention
        try:
            pair = sdpa(q, k, v, attn_mask=keep, is_causal=True)
            one = sdpa(q, k, v, attn_mask=keep & torch.ones(5, 6, dtype=torch.bool).tril())
            _SDPA_MASK_AND_CAUSAL["cpu"] = bool(torch.allclose(pair, one, atol=1e-6, rtol=1e-5))
        except RuntimeError:
            _SDPA_MASK_AND_CAUSAL["cpu"] = False
    return _SDPA_MASK_AND_CAUSAL["cpu"]


def _attend(q, k, v, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam, metric_side, scores, return_weights):
    """Attention without transport: the operator, or its dense reference when the weights are wanted."""
    if scores == "dot":
        if not return_weights:  # SDPA, with the mask as compact as the metric path keeps it where SDPA allows
            from .functional import sdpa_mask_and_causal

            return sdpa_mask_and_causal(q, k, v, attn_mask, is_causal, scale, dropout_p)
        s = (1.0 / math.sqrt(q.shape[-1])) if scale is None else scale
        S = s * q @ k.transpose(-1, -2)
        M = additive_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], q)
        A = masked_softmax(S if M is None else S + M)
        if dropout_p > 0.0:
            A = torch.nn.functional.dropout(A, p=dropout_p)
        return A @ v, A
    # metric scores: a call connection_attention has validated (lam a tensor, scale a float), so unchecked
    per_q = U_q is not None and U_q.dim() == q.dim() + 1
    per_k = U_k is not None and U_k.dim() == k.dim() + 1
    if return_weights:
        return _reference_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam, metric_side,
                                    per_q, per_k, return_weights=True)
    return _attention(q, k, v, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam, metric_side)


def _as_complex(x: Tensor) -> Tensor:
    """The pairs (x_{2m}, x_{2m+1}) of x [..., d] as complex numbers [..., d/2] (a rotation is then one product)."""
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())


def _as_real(z: Tensor) -> Tensor:
    """Inverse of :func:`_as_complex`: [..., d/2] complex to [..., d] real (a view)."""
    return torch.view_as_real(z).flatten(-2)


class _PairwiseRotation(torch.autograd.Function):
    r"""Every pair's rotations at once: :math:`(P_{j\to i}^\top q_i,\ P_{j\to i} k_j,\ P_{j\to i} v_j)`.

    :math:`P_{j\to i}` turns pair :math:`m` by :math:`\phi_{ij,m}`; on the pairs as complex numbers it is
    the product with :math:`e^{i\phi}`. The backward recomputes :math:`e^{i\phi}` from the angles, so
    only the angles and the per-token inputs are kept (autograd through the products would keep
    :math:`e^{\pm i\phi}` and their operands: about twice the memory).
    """

    @staticmethod
    def forward(ctx, phi, q, k, v):  # phi (..., n_i, n_j, d/2); q, k, v (..., n, d) or None
        cos, sin = torch.cos(phi), torch.sin(phi)
        outs = [None if x is None else _as_real(_as_complex(x).unsqueeze(axis) * torch.complex(cos, sgn * sin))
                for x, axis, sgn in ((q, -2, -1.0), (k, -3, 1.0), (v, -3, 1.0))]
        ctx.save_for_backward(phi, q, k, v)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        phi, *xs = ctx.saved_tensors
        need_phi = ctx.needs_input_grad[0]
        cos, sin = torch.cos(phi), torch.sin(phi)
        g_phi = torch.zeros_like(phi) if need_phi else None
        g_x = [None, None, None]
        for idx, (x, g, axis, sgn) in enumerate(zip(xs, grads, (-2, -3, -3), (-1.0, 1.0, 1.0))):
            if x is None or g is None:
                continue
            u = _as_complex(g) * torch.complex(cos, -sgn * sin)  # the gradient turned back, pair by pair
            if ctx.needs_input_grad[1 + idx]:
                g_x[idx] = _as_real(u.sum(axis)).sum_to_size(x.shape)
            if need_phi:  # d/dphi of the turned pair y = x e^{i sgn phi} is i sgn y
                xc = _as_complex(x).unsqueeze(axis)
                g_phi = g_phi + (-sgn) * (u.real * xc.imag - u.imag * xc.real)
        if need_phi:
            g_phi = g_phi.sum_to_size(phi.shape)
        return (g_phi, *g_x)


def _content_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam, metric_side, scores,
                       rates, p, transport_values, return_weights, rule):
    """:func:`_content_attention_f32` in float32 at least: half-precision inputs (autocast) are upcast, as the
    operator does, since the expanded distance and the complex rotations need the precision; the result
    comes back in the input dtype."""
    from .functional import _FORCED_BACKEND

    if q.device.type == "cuda" or _FORCED_BACKEND == "triton":  # the Triton kernels (_triton_content.dispatch)
        from . import _triton_content

        if _triton_content.dispatch(q, attn_mask, dropout_p, return_weights, U_q, metric_side, scores):
            _check_rates(rates, q)
            return _triton_content.content_attention_triton(
                q, k, v, attn_mask, is_causal, (1.0 / math.sqrt(q.shape[-1])) if scale is None else float(scale),
                U_q, U_k, lam, metric_side, scores, rates, p, transport_values, rule)
    if _fused_ok(q, attn_mask, dropout_p, return_weights):
        from ._content_cpu import content_attention

        up = (lambda t: t.float() if isinstance(t, Tensor) and t.is_floating_point() else t) \
            if q.dtype in (torch.float16, torch.bfloat16) else (lambda t: t)  # noqa: E731
        scale_f = (1.0 / math.sqrt(q.shape[-1])) if scale is None else float(scale)
        _check_rates(rates, q)
        out = content_attention(up(q), up(k), up(v), up(attn_mask), is_causal, scale_f, up(U_q), up(U_k), up(lam),
                                metric_side, scores, up(rates), up(p), transport_values, rule)
        return out.to(q.dtype)
    if q.dtype not in (torch.float16, torch.bfloat16):
        return _content_attention_f32(q, k, v, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam, metric_side,
                                      scores, rates, p, transport_values, return_weights, rule)
    up = lambda t: t.float() if isinstance(t, Tensor) and t.is_floating_point() else t  # noqa: E731
    res = _content_attention_f32(up(q), up(k), up(v), up(attn_mask), dropout_p, is_causal, scale, up(U_q), up(U_k),
                                 up(lam), metric_side, scores, up(rates), up(p), transport_values, return_weights,
                                 rule)
    return tuple(t.to(q.dtype) for t in res) if return_weights else res.to(q.dtype)


def _fused_ok(q: Tensor, attn_mask, dropout_p: float, return_weights: bool) -> bool:
    """Whether a content-connection call runs on the fused O(n d)-memory CPU kernel (``_content_cpu``).

    CPU tensors, no dropout, no weights wanted, no mask that requires grad, not
    while ``torch.compile`` traces, and a C compiler that built the kernel;
    everything else takes the dense path below.
    """
    if q.device.type != "cpu" or dropout_p > 0.0 or return_weights or torch.compiler.is_compiling():
        return False
    if isinstance(attn_mask, Tensor) and attn_mask.requires_grad:
        return False
    from ._content_cpu import available

    return available(torch.float64 if q.dtype == torch.float64 else torch.float32)


def _check_rates(rates, q: Tensor, which: str = "content") -> None:
    """Per-token rates [..., n, d/2] broadcasting against the queries' batch, or ValueError naming ``rates``."""
    n, d = q.shape[-2], q.shape[-1]
    if rates is None:
        raise ValueError(f"a {which} connection needs rates: the per-token rates omega, shape [..., n, d/2]")
    if rates.dim() < 2 or rates.shape[-2:] != (n, d // 2):
        raise ValueError(f"rates for the {which} connection must have shape [..., n, d/2] = [..., {n}, {d // 2}], "
                         f"got {shape_str(rates)}")
    broadcast_batch({"rates.shape[:-2]": rates.shape[:-2], "query.shape[:-2]": q.shape[:-2]})


def _content_attention_f32(q, k, v, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam, metric_side, scores,
                           rates, p, transport_values, return_weights, rule):
    r"""The content connections: every pair (i, j) transported by its own rotation, densely.

    Every :math:`P_{j\to i}` is a rotation, so :math:`q_i^\top P k_j = (P^\top q_i)^\top k_j` and
    :math:`P^\top(q_i - P k_j) = P^\top q_i - k_j`. One pairwise rotation of the queries therefore gives
    the dot product and the key-side metric terms together, in one batched product with
    :math:`[k_j \mid U_{k,j}]`; the Euclidean part is
    :math:`\lambda(|q_i|^2 + |k_j|^2 - 2\, q_i^\top P k_j)`. Only a query-side metric needs the
    transported keys :math:`P k_j` themselves.
    """
    n, d = q.shape[-2], q.shape[-1]
    _check_rates(rates, q)
    scale_f = (1.0 / math.sqrt(d)) if scale is None else float(scale)
    phi = transport_angles(rates, p, rule)  # angle of P_{j->i}              (..., n_i, n_j, d/2)
    # P_{j->i}^T q_i, P_{j->i} k_j (a query-side metric only), P_{j->i} v_j (transported values)  (..., n_i, n_j, d)
    qt, kt, vt = _PairwiseRotation.apply(phi, q, k if (scores == "metric" and U_q is not None) else None,
                                         v if transport_values else None)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    if scores == "dot":
        S = scale_f * torch.einsum("...ijd,...jd->...ij", qt, k)  # (..., n_i, n_j)
    else:
        lam_t = lam if isinstance(lam, Tensor) else torch.tensor(float(lam), dtype=q.dtype, device=q.device)
        lam_s = lam_t.unsqueeze(-1).unsqueeze(-1) if lam_t.dim() > 0 else lam_t
        per_q = U_q is not None and U_q.dim() == q.dim() + 1
        per_k = U_k is not None and U_k.dim() == k.dim() + 1
        w = 0.5 if metric_side == "mean" else 1.0
        Uk = None if U_k is None else _per_token(U_k, per_k, n)
        if Uk is not None:
            batch = torch.broadcast_shapes(batch, Uk.shape[:-3])
        kb = k.expand(*batch, n, d).unsqueeze(-1)  # (..., n_j, d, 1)
        W = kb if Uk is None else torch.cat((kb, Uk.expand(*batch, *Uk.shape[-3:])), -1)  # [k_j | U_kj]
        Y = torch.einsum("...ijd,...jdr->...ijr", qt, W)  # (P^T q_i)^T [k_j | U_kj]   (..., n_i, n_j, 1+r)
        qq, kk = (q * q).sum(-1), (k * k).sum(-1)  # (..., n)
        dist2 = lam_s * (qq.unsqueeze(-1) + kk.unsqueeze(-2) - 2.0 * Y[..., 0])  # lam |q_i - P k_j|^2
        if Uk is not None:
            c = torch.einsum("...jd,...jdr->...jr", k, Uk)  # U_kj^T k_j                 (..., n_j, r)
            a = Y[..., 1:] - c.unsqueeze(-3)  # U_kj^T (P^T q_i - k_j)                    (..., n_i, n_j, r)
            dist2 = dist2 + w * (a * a).sum(-1)
        if U_q is not None:
            Uq = _per_token(U_q, per_q, n)
            e = torch.einsum("...id,...idr->...ir", q, Uq)  # U_qi^T q_i          (..., n_i, r)
            b = e.unsqueeze(-2) - torch.einsum("...ijd,...idr->...ijr", kt, Uq)  # U_qi^T (q_i - P k_j)
            dist2 = dist2 + w * (b * b).sum(-1)
        S = -0.5 * scale_f * dist2  # (..., n_i, n_j)
    M = additive_mask(attn_mask, is_causal, n, n, q)
    A = masked_softmax(S if M is None else S + M)
    if dropout_p > 0.0:
        A = torch.nn.functional.dropout(A, p=dropout_p)
    if transport_values:
        out = torch.einsum("...ij,...ijd->...id", A, vt)  # mixed in fibre i (..., n_i, d)
    else:
        out = A @ v
    return (out, A) if return_weights else out
