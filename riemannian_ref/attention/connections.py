r"""Connections on the head bundle: parallel transport between token fibres.

The fibre over token position :math:`i` is the head space :math:`\mathbb{R}^d`
with its metric :math:`G_i`. A *connection* says how a vector of fibre
:math:`j` is carried to fibre :math:`i`, :math:`v \mapsto P_{j\to i} v`, before
it is compared with (keys) or added to (values) the vectors of fibre :math:`i`.
Every connection here is a block-diagonal rotation acting on the consecutive
pairs :math:`(x_{2m}, x_{2m+1})`, :math:`m = 0, \dots, d/2 - 1`:

.. math::
    P_{j\to i} = \exp\big((p_i - p_j)\,\Theta_{ij}\big), \qquad
    \Theta_{ij} = \mathrm{blockdiag}_m \begin{pmatrix} 0 & -\omega_{ij,m} \\ \omega_{ij,m} & 0\end{pmatrix},

i.e. block :math:`m` is turned by the angle :math:`(p_i - p_j)\,\omega_{ij,m}`,
with positions :math:`p` and the angular *rate* :math:`\omega_{ij}` of the
edge, read from per-token rates :math:`\omega_j \in \mathbb{R}^{d/2}`:

- ``"trivial"``: :math:`\omega = 0`, :math:`P = I`;
- ``"flat"``: :math:`\omega_{ij,m} = \theta_m` (the rotary frequencies), so
  :math:`P_{j\to i} = R_i R_j^\top` with :math:`R_i` the rotary rotation of
  position :math:`i`: zero curvature;
- ``"content"`` (the default content connection): the edge reads the rates of
  *both* endpoints, :math:`\omega_{ij} = (\omega_i + \omega_j)/2`, so that
  :math:`P_{i\to j} = P_{j\to i}^{-1}` (inverse-consistent) and two-edge loops
  have no holonomy; curved in general;
- ``"content_source"``: the edge reads the rate of its source only,
  :math:`\omega_{ij} = \omega_j`; then :math:`P_{i\to j} P_{j\to i}` turns by
  :math:`(p_j - p_i)(\omega_i - \omega_j)`: not inverse-consistent, and its
  holonomy mixes curvature with that failure (kept to reproduce the first
  reading of the book).

Every transport lies in the maximal torus :math:`SO(2)^{d/2}` of block
rotations, an abelian group: transports commute, a loop's holonomy is a sum
of phases per block, and the holonomy group of every connection here is a
subgroup of that torus. Because every :math:`P` is a rotation,
:math:`P^\top = P^{-1}`. Transporting the key's metric along with the key,
:math:`G_j \mapsto P G_j P^\top`, gives the distance

.. math::
    (q_i - P k_j)^\top P G_j P^\top (q_i - P k_j) = (P^\top q_i - k_j)^\top G_j (P^\top q_i - k_j).

A rotation is an isometry of the Euclidean part only: with heterogeneous
metrics no rotation maps :math:`G_j` to :math:`G_i`. The metric-compatible
transports are :math:`P = G_i^{-1/2} O\, G_j^{1/2}` with :math:`O` orthogonal
(:func:`compatible_transport`, a dense reference).

For the flat connection every fibre object can be moved to one common frame
(rotate each by :math:`R^\top` of its own position), which is why rotary
attention costs :math:`O(n d)` extra; for the content connections the angle
couples the pair, and the transport costs :math:`O(n^2 d)` elementwise, the
same order as the scores (on CPU a fused kernel computes it with
:math:`O(n d)` memory, on CUDA Triton kernels).

The diagnostics of a connection (holonomy, transport closure, metric
compatibility) live beside the other measurements, in
:mod:`riemannian_ref.analysis.bundle`.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .._checks import broadcast_batch, check_same, check_tensor, shape_str
from ._validate import autocast_dtype, check_attention_inputs
from .functional import _attention
from .reference import _reference_attention, additive_mask, masked_softmax

__all__ = [
    "CONNECTIONS",
    "rotary_frequencies",
    "rotate_pairs",
    "block_rotation_matrix",
    "transport_angles",
    "connection_rates",
    "edge_rule",
    "compatible_transport",
    "connection_attention",
]

#: The accepted values of ``connection``: no transport, rotary (flat), content-dependent rates
#: read from both endpoints of an edge (inverse-consistent), or from its source only.
CONNECTIONS = ("trivial", "flat", "content", "content_source")

#: How an edge reads its rate from the per-token rates: ``"mean"`` of both endpoints, or the ``"source"``'s.
EDGE_RULES = ("mean", "source")


def edge_rule(connection: str) -> str:
    """The edge rule of a connection: ``"source"`` for ``"content_source"``, ``"mean"`` otherwise.

    For the trivial and flat connections every token has the same rates and
    the two rules give the same transports.

    Parameters
    ----------
    connection : str
        One of ``CONNECTIONS``.
    """
    if connection not in CONNECTIONS:
        raise ValueError(f"connection must be one of {CONNECTIONS}, got {connection!r}")
    return "source" if connection == "content_source" else "mean"


def _check_rule(rule: str) -> str:
    if rule not in EDGE_RULES:
        raise ValueError(f"rule must be one of {EDGE_RULES}, got {rule!r}")
    return rule


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


def transport_angles(rates: Tensor, positions: Tensor, rule: str = "mean") -> Tensor:
    r"""Angles of :math:`P_{j\to i}`: :math:`\phi_{ij,m} = (p_i - p_j)\,\omega_{ij,m}`.

    Parameters
    ----------
    rates : Tensor, shape [..., n, d/2]
        Per-token rates :math:`\omega_j`.
    positions : Tensor, shape [n] or [..., n]
    rule : {"mean", "source"}
        The edge's rate: :math:`\omega_{ij} = (\omega_i + \omega_j)/2`
        (inverse-consistent: :math:`\phi_{ji} = -\phi_{ij}`), or the source's
        :math:`\omega_j`.

    Returns
    -------
    Tensor, shape [..., n, n, d/2]
        Index ``[..., i, j, m]``; memory :math:`O(n^2 d)` per batch entry.
    """
    dp = positions.unsqueeze(-1) - positions.unsqueeze(-2)  # p_i - p_j              (..., n, n)
    if _check_rule(rule) == "source":
        return dp.unsqueeze(-1) * rates.unsqueeze(-3)  # (..., n_i, n_j, d/2)
    edge = 0.5 * (rates.unsqueeze(-2) + rates.unsqueeze(-3))  # (omega_i + omega_j) / 2  (..., n_i, n_j, d/2)
    return dp.unsqueeze(-1) * edge


def connection_rates(connection: str, n: int, d: int, *, rates: Tensor | None = None,
                     like: Tensor) -> Tensor:
    r"""Per-token rates :math:`\omega_j` of a connection, shape [n, d/2] or [..., n, d/2].

    ``"trivial"`` gives zeros; ``"flat"`` the rotary frequencies (``rates``,
    shape [d/2], default base 10000) repeated for every token; the content
    connections return ``rates`` itself, which must then be given per token,
    shape [..., n, d/2]. Used by the diagnostics, which need rates for every
    connection (with :func:`edge_rule` for how an edge reads them).

    Parameters
    ----------
    connection : {"trivial", "flat", "content", "content_source"}
        Which connection (one of ``CONNECTIONS``).
    n : int
        Number of tokens.
    d : int
        Head dimension; must be even (the rotations act on pairs).
    rates : Tensor, optional
        ``"flat"``: rotary rates, shape [d/2] (default
        :func:`rotary_frequencies` with base 10000). ``"content"``: the
        per-token rates, shape [..., n, d/2] (required; also for
        ``"content_source"``). Ignored by ``"trivial"``.
    like : Tensor
        Supplies the dtype and device of the zeros (``"trivial"``) and of the
        default rotary rates (``"flat"``).

    Returns
    -------
    Tensor, shape [n, d/2] or [..., n, d/2]
        Shape [n, d/2] for ``"trivial"`` and ``"flat"`` (the latter an
        expanded view of ``rates``, no copy); ``rates`` itself, unchanged,
        for the content connections.
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
        raise ValueError(f"connection={connection!r} needs rates: the per-token rates, shape [..., n, d/2]")
    if rates.dim() < 2 or rates.shape[-2:] != (n, d // 2):
        raise ValueError(f"rates for the content connection must have shape [..., n, d/2] = [..., {n}, {d // 2}], "
                         f"got {shape_str(rates)}")
    return rates


def compatible_transport(G_i: Tensor, G_j: Tensor, rotation: Tensor | None = None) -> Tensor:
    r"""A metric-compatible transport :math:`P = G_i^{-1/2}\, O\, G_j^{1/2}` (dense reference).

    :math:`P^\top G_i P = G_j^{1/2} O^\top O\, G_j^{1/2} = G_j`: vectors of
    fibre :math:`j` keep their :math:`G_j`-lengths in fibre :math:`i`. Every
    compatible linear map has this form (for invertible :math:`P`,
    :math:`O = G_i^{1/2} P G_j^{-1/2}` is orthogonal exactly when
    :math:`P^\top G_i P = G_j`). With :math:`G_i \ne G_j` it is not a
    rotation, so none of the package's connections is compatible; this
    function builds the compatible ones for checks (symmetric square roots
    by ``eigh``, :math:`O(d^3)`).

    Parameters
    ----------
    G_i, G_j : Tensor, shape [..., d, d]
        SPD metrics of the target and source fibres (e.g. ``LowRankMetric.dense()``).
    rotation : Tensor, shape [..., d, d], optional
        The orthogonal :math:`O` (default the identity).

    Returns
    -------
    Tensor, shape broadcast([..., d, d])
    """
    G_i = check_tensor(G_i, "G_i", min_dim=2)
    G_j = check_tensor(G_j, "G_j", min_dim=2)
    d = G_i.shape[-1]
    for name, G in (("G_i", G_i), ("G_j", G_j)):
        if G.shape[-2:] != (d, d):
            raise ValueError(f"{name} must have shape [..., d, d] with d = {d}, got {shape_str(G)}")
    check_same(G_i, "G_i", [("G_j", G_j), ("rotation", rotation)])

    def power(G: Tensor, p: float) -> Tensor:
        mu, V = torch.linalg.eigh(0.5 * (G + G.transpose(-1, -2)))  # (..., d), (..., d, d)
        if not bool((mu > 0).all()):
            raise ValueError("G_i and G_j must be positive definite")
        return (V * mu.pow(p).unsqueeze(-2)) @ V.transpose(-1, -2)

    A, Bm = power(G_i, -0.5), power(G_j, 0.5)
    if rotation is None:
        return A @ Bm
    rotation = check_tensor(rotation, "rotation", min_dim=2)
    if rotation.shape[-2:] != (d, d):
        raise ValueError(f"rotation must have shape [..., d, d] with d = {d}, got {shape_str(rotation)}")
    return A @ rotation @ Bm


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
    connection : {"trivial", "flat", "content", "content_source"}
        :math:`P = I`; rotary rotations :math:`R_i R_j^\top`; rotations by
        :math:`(p_i - p_j)(\omega_i + \omega_j)/2` (inverse-consistent), or
        by :math:`(p_i - p_j)\,\omega_j` (source rates only).
    rates : Tensor, optional
        ``"flat"``: the rotary rates, shape [d/2] (default
        :func:`rotary_frequencies`). Content connections: the per-token rates
        :math:`\omega_j`, shape [..., n, d/2], broadcasting against the batch
        (required). ``"trivial"``: must be None.
    positions : Tensor, shape [n] or [..., n], optional
        Token positions :math:`p_i` (default ``0..n-1``).
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
    output back by :math:`R_i`: :math:`O(n d r)` extra. The content connections
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
                              metric_side, scores, rates, p, transport_values, return_weights,
                              edge_rule(connection))


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
            _check_content_rates(rates, q)
            return _triton_content.content_attention_triton(
                q, k, v, attn_mask, is_causal, (1.0 / math.sqrt(q.shape[-1])) if scale is None else float(scale),
                U_q, U_k, lam, metric_side, scores, rates, p, transport_values, rule)
    if _fused_ok(q, attn_mask, dropout_p, return_weights):
        from ._content_cpu import content_attention

        up = (lambda t: t.float() if isinstance(t, Tensor) and t.is_floating_point() else t) \
            if q.dtype in (torch.float16, torch.bfloat16) else (lambda t: t)  # noqa: E731
        scale_f = (1.0 / math.sqrt(q.shape[-1])) if scale is None else float(scale)
        _check_content_rates(rates, q)
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


def _check_content_rates(rates, q: Tensor) -> None:
    n, d = q.shape[-2], q.shape[-1]
    if rates is None:
        raise ValueError("a content connection needs rates: the per-token rates omega_j, shape [..., n, d/2]")
    if rates.dim() < 2 or rates.shape[-2:] != (n, d // 2):
        raise ValueError(f"rates for the content connection must have shape [..., n, d/2] = [..., {n}, {d // 2}], "
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
    _check_content_rates(rates, q)
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
