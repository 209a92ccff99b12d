r"""Connections on the head bundle: parallel transport between token fibres.

The fibre over token position :math:`i` is the head space :math:`\mathbb{R}^d`
with its metric :math:`G_i`. A *connection* says how a vector of fibre
:math:`j` is carried to fibre :math:`i`, :math:`v \mapsto P_{j\to i} v`, before
it is compared with (keys) or added to (values) the vectors of fibre :math:`i`.
All three connections here are block-diagonal rotations acting on the
consecutive pairs :math:`(x_{2m}, x_{2m+1})`, :math:`m = 0, \dots, d/2 - 1`:

.. math::
    P_{j\to i} = \exp\big((p_i - p_j)\,\Theta_j\big), \qquad
    \Theta_j = \mathrm{blockdiag}_m \begin{pmatrix} 0 & -\omega_{j,m} \\ \omega_{j,m} & 0\end{pmatrix},

i.e. block :math:`m` is turned by the angle :math:`(p_i - p_j)\,\omega_{j,m}`,
with positions :math:`p` and angular *rates* :math:`\omega_j \in \mathbb{R}^{d/2}`:

- ``"trivial"``: :math:`\omega = 0`, :math:`P = I`;
- ``"flat"``: :math:`\omega_{j,m} = \theta_m` (the rotary frequencies), so
  :math:`P_{j\to i} = R_i R_j^\top` with :math:`R_i` the rotary rotation of
  position :math:`i`: rotary position embedding is this gauge connection, and
  it has zero curvature;
- ``"content"``: :math:`\omega_j = \Theta(x_j)` depends on the source token's
  content: curved in general.

Because every :math:`P` is a rotation, :math:`P^\top = P^{-1}`. For the
content connection, however, the reverse edge is not the inverse:
:math:`P_{i\to j} P_{j\to i}` turns by :math:`(p_j - p_i)(\omega_i - \omega_j)`,
since each edge reads its rate at its source; two-edge loops already have
holonomy. Transporting
the key's metric along with the key, :math:`G_j \mapsto P G_j P^\top`, gives the
distance

.. math::
    (q_i - P k_j)^\top P G_j P^\top (q_i - P k_j) = (P^\top q_i - k_j)^\top G_j (P^\top q_i - k_j).

For the flat connection every fibre object can be moved to one common frame
(rotate each by :math:`R^\top` of its own position), which is why rotary
attention costs :math:`O(n d)` extra; for the content connection the angle
:math:`(p_i - p_j)\omega_j` couples the pair, and the transport costs
:math:`O(n^2 d)` elementwise, the same order as the scores.

The diagnostics of a connection (holonomy, transport closure, metric
compatibility) live beside the other measurements, in
:mod:`riemannian_ref.analysis.bundle`.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .._checks import broadcast_batch, check_same, check_tensor, shape_str
from ._validate import check_attention_inputs
from .functional import riemannian_attention
from .reference import additive_mask, masked_softmax, riemannian_attention_reference

__all__ = [
    "CONNECTIONS",
    "rotary_frequencies",
    "rotate_pairs",
    "block_rotation_matrix",
    "transport_angles",
    "connection_rates",
    "connection_attention",
]

#: The accepted values of ``connection``: no transport, rotary (flat), content-dependent rates.
CONNECTIONS = ("trivial", "flat", "content")


# --------------------------------------------------------------------------- rotations
def rotary_frequencies(d: int, base: float = 10000.0, *, dtype=torch.float32, device=None) -> Tensor:
    r"""Rotary rates :math:`\theta_m = \text{base}^{-2m/d}`, shape [d/2].

    Parameters
    ----------
    d : int
        Head dimension; must be even.
    base : float
        The rotary base (10000 in RoFormer).
    """
    if not isinstance(d, int) or d <= 0 or d % 2:
        raise ValueError(f"d must be a positive even int (rotations act on pairs), got {d!r}")
    if not base > 1:
        raise ValueError(f"base must be > 1, got {base!r}")
    m = torch.arange(d // 2, dtype=torch.float64, device=device)
    return (base ** (-2.0 * m / d)).to(dtype)


def rotate_pairs(x: Tensor, angles: Tensor) -> Tensor:
    r"""Rotate each consecutive pair :math:`(x_{2m}, x_{2m+1})` by ``angles[..., m]``.

    Parameters
    ----------
    x : Tensor, shape [..., d]
    angles : Tensor, shape [..., d/2]
        Broadcasts against ``x.shape[:-1]``.

    Returns
    -------
    Tensor, shape broadcast([..., d])
        :math:`\exp(\text{angles}\cdot J)\,x` blockwise. An angle of exactly 0
        returns the pair unchanged, bit for bit.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"x must have an even last dimension (pairs), got {shape_str(x)}")
    if angles.shape[-1] != x.shape[-1] // 2:
        raise ValueError(f"angles must have shape [..., d/2] = [..., {x.shape[-1] // 2}], got {shape_str(angles)}")
    return _rotate_cs(x, torch.cos(angles), torch.sin(angles))


def _rotate_cs(x: Tensor, c: Tensor, s: Tensor) -> Tensor:
    """:func:`rotate_pairs` with the cosines and sines given (reused across calls)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (..., d/2) each
    y1 = x1 * c - x2 * s
    y2 = x1 * s + x2 * c
    return torch.stack((y1, y2), dim=-1).flatten(-2)  # (..., d)


def block_rotation_matrix(angles: Tensor) -> Tensor:
    r"""Dense block-diagonal rotation matrix with the given pair angles (for checks and plots).

    Block :math:`m` (rows and columns :math:`2m, 2m+1`) is
    :math:`\begin{pmatrix} \cos\phi_m & -\sin\phi_m \\ \sin\phi_m & \cos\phi_m \end{pmatrix}`,
    so ``block_rotation_matrix(angles) @ x`` equals ``rotate_pairs(x, angles)``.

    Parameters
    ----------
    angles : Tensor, shape [..., d/2]
        Angles :math:`\phi_m` of the pairs :math:`(x_{2m}, x_{2m+1})`.

    Returns
    -------
    Tensor, shape [..., d, d]
        The rotation, dtype and device of ``angles``; :math:`O(d^2)` memory
        per batch entry, which :func:`rotate_pairs` avoids.
    """
    half = angles.shape[-1]
    d = 2 * half
    eye = torch.eye(d, dtype=angles.dtype, device=angles.device)
    # Column c of the matrix is the rotation applied to the basis vector e_c.
    cols = rotate_pairs(eye.expand(*angles.shape[:-1], d, d), angles.unsqueeze(-2))  # rows are R e_c
    return cols.transpose(-1, -2)


def _positions(positions: Tensor | None, n: int, like: Tensor) -> Tensor:
    if positions is None:
        return torch.arange(n, dtype=like.dtype, device=like.device)
    positions = check_tensor(positions, "positions", min_dim=1, floating=False)
    if positions.shape[-1] != n:
        raise ValueError(f"positions must have shape [..., n] with n = {n}, got {shape_str(positions)}")
    if positions.device != like.device:
        raise ValueError(f"positions is on {positions.device} but the inputs are on {like.device}")
    return positions.to(like.dtype)


def transport_angles(rates: Tensor, positions: Tensor) -> Tensor:
    r"""Angles of :math:`P_{j\to i}`: :math:`\phi_{ij,m} = (p_i - p_j)\,\omega_{j,m}`.

    Parameters
    ----------
    rates : Tensor, shape [..., n, d/2]
        Rates :math:`\omega_j` of the *source* tokens.
    positions : Tensor, shape [n] or [..., n]

    Returns
    -------
    Tensor, shape [..., n, n, d/2]
        Index ``[..., i, j, m]``; memory :math:`O(n^2 d)` per batch entry.
    """
    dp = positions.unsqueeze(-1) - positions.unsqueeze(-2)  # p_i - p_j              (..., n, n)
    return dp.unsqueeze(-1) * rates.unsqueeze(-3)  # (..., n_i, n_j, d/2)


def connection_rates(connection: str, n: int, d: int, *, rates: Tensor | None = None,
                     like: Tensor) -> Tensor:
    r"""Per-token rates :math:`\omega_j` of a connection, shape [n, d/2] or [..., n, d/2].

    ``"trivial"`` gives zeros; ``"flat"`` the rotary frequencies (``rates``,
    shape [d/2], default base 10000) repeated for every token; ``"content"``
    returns ``rates`` itself, which must then be given per token,
    shape [..., n, d/2]. Used by the diagnostics, which need rates for all
    three connections.

    Parameters
    ----------
    connection : {"trivial", "flat", "content"}
        Which connection (one of ``CONNECTIONS``).
    n : int
        Number of tokens.
    d : int
        Head dimension; must be even (the rotations act on pairs).
    rates : Tensor, optional
        ``"flat"``: rotary rates, shape [d/2] (default
        :func:`rotary_frequencies` with base 10000). ``"content"``: the
        per-token rates, shape [..., n, d/2] (required). Ignored by
        ``"trivial"``.
    like : Tensor
        Supplies the dtype and device of the zeros (``"trivial"``) and of the
        default rotary rates (``"flat"``).

    Returns
    -------
    Tensor, shape [n, d/2] or [..., n, d/2]
        Shape [n, d/2] for ``"trivial"`` and ``"flat"`` (the latter an
        expanded view of ``rates``, no copy); ``rates`` itself, unchanged,
        for ``"content"``.
    """
    if connection not in CONNECTIONS:
        raise ValueError(f"connection must be one of {CONNECTIONS}, got {connection!r}")
    if d % 2:
        raise ValueError(f"connection {connection!r} rotates pairs: the head dimension must be even, got d = {d}")
    if connection == "trivial":
        return torch.zeros(n, d // 2, dtype=like.dtype, device=like.device)
    if connection == "flat":
        if rates is None:
            rates = rotary_frequencies(d, dtype=like.dtype, device=like.device)
        if rates.shape[-1] != d // 2 or rates.dim() != 1:
            raise ValueError(f"rates for the flat connection must have shape [d/2] = [{d // 2}], got {shape_str(rates)}")
        return rates.expand(n, d // 2)
    if rates is None:
        raise ValueError("connection='content' needs rates: the per-token rates, shape [..., n, d/2]")
    if rates.dim() < 2 or rates.shape[-2:] != (n, d // 2):
        raise ValueError(f"rates for the content connection must have shape [..., n, d/2] = [..., {n}, {d // 2}], "
                         f"got {shape_str(rates)}")
    return rates


# --------------------------------------------------------------------------- attention
def _per_token(U: Tensor | None, per: bool, n: int) -> Tensor | None:
    """A shared factor [..., d, r] made per-token [..., n, d, r] (a view, no copy)."""
    if U is None or per:
        return U
    return U.unsqueeze(-3).expand(*U.shape[:-2], n, *U.shape[-2:])


def _rotate_factor(U: Tensor, angles: Tensor) -> Tensor:
    """Rotate every column of U [..., n, d, r] by angles [..., n, d/2]."""
    Ut = U.transpose(-1, -2)  # (..., n, r, d)
    return rotate_pairs(Ut, angles.unsqueeze(-2)).transpose(-1, -2)  # (..., n, d, r)


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
    instead (the flat connection is then rotary position embedding).

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
    connection : {"trivial", "flat", "content"}
        :math:`P = I`; rotary rotations :math:`R_i R_j^\top`; rotations by
        :math:`(p_i - p_j)\,\omega_j` with per-token rates.
    rates : Tensor, optional
        ``"flat"``: the rotary rates, shape [d/2] (default
        :func:`rotary_frequencies`). ``"content"``: the per-token rates
        :math:`\omega_j`, shape [..., n, d/2], broadcasting against the batch
        (required). ``"trivial"``: must be None.
    positions : Tensor, shape [n] or [..., n], optional
        Token positions :math:`p_i` (default ``0..n-1``).
    transport_values : bool
        Mix :math:`P_{j\to i} v_j` (the values are transported too) or plain
        :math:`v_j` (with ``scores="dot"`` and ``"flat"`` this is exactly RoPE).
    return_weights : bool
        Also return the attention weights [..., n, n] (computed densely).

    Returns
    -------
    Tensor, shape [..., n, d_v]
        With ``return_weights``, the pair ``(output, weights)``.

    Notes
    -----
    ``"trivial"`` calls the operator directly. ``"flat"`` moves everything to
    one frame: :math:`q_i \mapsto R_i^\top q_i`, :math:`k_j \mapsto R_j^\top k_j`,
    :math:`U \mapsto R^\top U` (so :math:`G_j \mapsto R_j^\top G_j R_j`),
    :math:`v_j \mapsto R_j^\top v_j`, calls the same operator, and rotates the
    output back by :math:`R_i`: :math:`O(n d r)` extra. ``"content"`` forms the
    transported keys and values per pair: time :math:`O(n^2 d (1 + r))`,
    memory a few ``[..., n, n, d]`` tensors (batch 8, 4 heads, n = 256,
    d = 16 in float32 is 128 MiB each), never a ``[n, n, d, d]`` tensor.
    """
    if connection not in CONNECTIONS:
        raise ValueError(f"connection must be one of {CONNECTIONS}, got {connection!r}")
    if scores not in ("metric", "dot"):
        raise ValueError(f"scores must be 'metric' or 'dot', got {scores!r}")
    if scores == "dot" and (U_q is not None or U_k is not None):
        raise ValueError("scores='dot' takes no metric factors: pass U_q=None and U_k=None")
    if not isinstance(transport_values, bool):
        raise ValueError(f"transport_values must be a bool, got {transport_values!r}")
    check_attention_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam,
                           metric_side if scores == "metric" else "key")
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
    p = _positions(positions, n, query)
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
        U_q1 = _rotate_factor(_per_token(U_q, per_q, n), -ang) if U_q is not None else None
        U_k1 = _rotate_factor(_per_token(U_k, per_k, n), -ang) if U_k is not None else None
        res = _attend(q1, k1, v1, attn_mask, dropout_p, is_causal, scale, U_q1, U_k1, lam, metric_side,
                      scores, return_weights)
        out, A = res if return_weights else (res, None)
        if transport_values:
            out = rotate_pairs(out, ang)  # back to fibre i: R_i o_i
        return (out, A) if return_weights else out
    return _content_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam,
                              metric_side, scores, rates, p, transport_values, return_weights)


def _attend(q, k, v, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam, metric_side, scores, return_weights):
    """Attention without transport: the operator, or its dense reference when the weights are wanted."""
    if scores == "dot":
        if not return_weights:  # SDPA; it takes a mask or the causal flag, not both
            if attn_mask is not None and is_causal:
                attn_mask, is_causal = additive_mask(attn_mask, True, q.shape[-2], k.shape[-2], q), False
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
        s = (1.0 / math.sqrt(q.shape[-1])) if scale is None else scale
        S = s * q @ k.transpose(-1, -2)
        M = additive_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], q)
        A = masked_softmax(S if M is None else S + M)
        if dropout_p > 0.0:
            A = torch.nn.functional.dropout(A, p=dropout_p)
        return A @ v, A
    kw = dict(U_q=U_q, U_k=U_k, lam=lam, metric_side=metric_side)
    if return_weights:
        return riemannian_attention_reference(q, k, v, attn_mask, dropout_p, is_causal, scale,
                                              return_weights=True, **kw)
    return riemannian_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, **kw)


def _content_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam, metric_side, scores,
                       rates, p, transport_values, return_weights):
    """The content connection: every pair (i, j) transported by its own rotation, densely."""
    n, d = q.shape[-2], q.shape[-1]
    if rates is None:
        raise ValueError("connection='content' needs rates: the per-token rates omega_j, shape [..., n, d/2]")
    if rates.dim() < 2 or rates.shape[-2:] != (n, d // 2):
        raise ValueError(f"rates for the content connection must have shape [..., n, d/2] = [..., {n}, {d // 2}], "
                         f"got {shape_str(rates)}")
    broadcast_batch({"rates.shape[:-2]": rates.shape[:-2], "query.shape[:-2]": q.shape[:-2]})
    scale_f = (1.0 / math.sqrt(d)) if scale is None else float(scale)
    phi = transport_angles(rates, p)  # angle of P_{j->i}                    (..., n_i, n_j, d/2)
    cos, sin = torch.cos(phi), torch.sin(phi)  # shared by keys, values and the key metric
    kt = _rotate_cs(k.unsqueeze(-3), cos, sin)  # P_{j->i} k_j             (..., n_i, n_j, d)
    if scores == "dot":
        S = scale_f * (q.unsqueeze(-2) * kt).sum(-1)  # (..., n_i, n_j)
    else:
        lam_t = lam if isinstance(lam, Tensor) else torch.tensor(float(lam), dtype=q.dtype, device=q.device)
        per_q = U_q is not None and U_q.dim() == q.dim() + 1
        per_k = U_k is not None and U_k.dim() == k.dim() + 1
        diff = q.unsqueeze(-2) - kt  # q_i - P k_j                         (..., n_i, n_j, d)
        lam_s = lam_t.unsqueeze(-1).unsqueeze(-1) if lam_t.dim() > 0 else lam_t
        dist2 = lam_s * (diff * diff).sum(-1)  # (..., n_i, n_j)
        w = 0.5 if metric_side == "mean" else 1.0
        if U_k is not None:
            back = _rotate_cs(diff, cos, -sin)  # P^T (q_i - P k_j) = P^T q_i - k_j  (..., n_i, n_j, d)
            a = torch.einsum("...ijd,...jdr->...ijr", back, _per_token(U_k, per_k, n))  # (..., n_i, n_j, r)
            dist2 = dist2 + w * (a * a).sum(-1)
        if U_q is not None:
            b = torch.einsum("...ijd,...idr->...ijr", diff, _per_token(U_q, per_q, n))  # (..., n_i, n_j, r)
            dist2 = dist2 + w * (b * b).sum(-1)
        S = -0.5 * scale_f * dist2  # (..., n_i, n_j)
    M = additive_mask(attn_mask, is_causal, n, n, q)
    A = masked_softmax(S if M is None else S + M)
    if dropout_p > 0.0:
        A = torch.nn.functional.dropout(A, p=dropout_p)
    if transport_values:
        vt = _rotate_cs(v.unsqueeze(-3), cos, sin)  # P_{j->i} v_j         (..., n_i, n_j, d)
        out = torch.einsum("...ij,...ijd->...id", A, vt)  # mixed in fibre i (..., n_i, d)
    else:
        out = A @ v
    return (out, A) if return_weights else out
