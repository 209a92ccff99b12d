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

The diagnostics (holonomy, closure/torsion and metric-compatibility defects)
return tensors; nothing here prints.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import as_positive, broadcast_batch, check_same, check_tensor, shape_str
from .attention import build_additive_mask, riemannian_attention, riemannian_attention_reference
from .scores import check_score_inputs

__all__ = [
    "CONNECTIONS",
    "rotary_frequencies",
    "rotate_pairs",
    "block_rotation_matrix",
    "transport_angles",
    "connection_rates",
    "connection_attention",
    "sample_triangles",
    "sample_pairs",
    "holonomy_defect",
    "torsion_defect",
    "metric_compatibility_defect",
]

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


def connection_rates(connection: str, n: int, d: int, *, theta: Tensor | None = None,
                     like: Tensor) -> Tensor:
    r"""Per-token rates :math:`\omega_j` of a connection, shape [n, d/2] or [..., n, d/2].

    ``"trivial"`` gives zeros; ``"flat"`` the rotary frequencies (``theta``,
    shape [d/2], default base 10000) repeated for every token; ``"content"``
    returns ``theta`` itself, which must then be given per token,
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
    theta : Tensor, optional
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
        expanded view of ``theta``, no copy); ``theta`` itself, unchanged,
        for ``"content"``.
    """
    if connection not in CONNECTIONS:
        raise ValueError(f"connection must be one of {CONNECTIONS}, got {connection!r}")
    if d % 2:
        raise ValueError(f"connection {connection!r} rotates pairs: the head dimension must be even, got d = {d}")
    if connection == "trivial":
        return torch.zeros(n, d // 2, dtype=like.dtype, device=like.device)
    if connection == "flat":
        if theta is None:
            theta = rotary_frequencies(d, dtype=like.dtype, device=like.device)
        if theta.shape[-1] != d // 2 or theta.dim() != 1:
            raise ValueError(f"theta for the flat connection must have shape [d/2] = [{d // 2}], got {shape_str(theta)}")
        return theta.expand(n, d // 2)
    if theta is None:
        raise ValueError("connection='content' needs theta: the per-token rates, shape [..., n, d/2]")
    if theta.dim() < 2 or theta.shape[-2:] != (n, d // 2):
        raise ValueError(f"theta for the content connection must have shape [..., n, d/2] = [..., {n}, {d // 2}], "
                         f"got {shape_str(theta)}")
    return theta


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


def connection_attention(q: Tensor, k: Tensor, v: Tensor, U_q: Tensor | None = None,
                         U_k: Tensor | None = None, *, lam=1.0, metric_side: str = "key",
                         connection: str = "trivial", theta: Tensor | None = None,
                         positions: Tensor | None = None, attn_mask: Tensor | None = None,
                         is_causal: bool = False, scale: float | None = None, dropout_p: float = 0.0,
                         return_weights: bool = False):
    r"""Riemannian attention with keys, key metrics and values parallel-transported to the query's fibre.

    .. math::
        s_{ij} = -\tfrac{\text{scale}}{2}\,(q_i - P_{j\to i}k_j)^\top \bar G_{ij}\,(q_i - P_{j\to i}k_j),
        \qquad
        o_i = \sum_j A_{ij}\, P_{j\to i} v_j ,

    with :math:`\bar G_{ij}` = :math:`P G_j P^\top` (``"key"``), :math:`G_i`
    (``"query"``) or their mean (``"mean"``), :math:`A = \mathrm{softmax}(S + M)`.
    The values are mixed in fibre :math:`i`.

    Parameters
    ----------
    q, k, v : Tensor, shape [..., n, d]
        Queries, keys and values of one sequence (self-attention: same ``n``;
        values have the head dimension ``d`` because they are transported too).
    U_q, U_k : Tensor, shape [..., n, d, r] or [..., d, r], optional
        Metric factors, as in :func:`riemannian_ref.riemannian_scores`.
    lam : float or Tensor, shape broadcastable to ``q.shape[:-2]``
    metric_side : {"key", "query", "mean"}
    connection : {"trivial", "flat", "content"}
    theta : Tensor, optional
        ``"flat"``: rotary rates, shape [d/2] (default :func:`rotary_frequencies`).
        ``"content"``: per-token rates :math:`\omega_j = \Theta(x_j)`,
        shape [..., n, d/2], broadcasting against ``q.shape[:-2]``.
        ``"trivial"``: must be None.
    positions : Tensor, shape [n] or [..., n], optional
        Token positions :math:`p_i` (default ``0..n-1``).
    attn_mask, is_causal, scale, dropout_p
        As in :func:`riemannian_ref.riemannian_attention`.
    return_weights : bool
        Also return the attention matrix [..., n, n].

    Returns
    -------
    Tensor, shape [..., n, d] (and the weights, shape [..., n, n], on request)

    Notes
    -----
    ``"trivial"`` calls :func:`riemannian_ref.riemannian_attention` directly.
    ``"flat"`` moves everything to one frame: :math:`q_i \mapsto R_i^\top q_i`,
    :math:`k_j \mapsto R_j^\top k_j`, :math:`U \mapsto R^\top U` (so
    :math:`G_j \mapsto R_j^\top G_j R_j`), :math:`v_j \mapsto R_j^\top v_j`,
    calls the same operator, and rotates the output back by :math:`R_i`:
    :math:`O(n d r)` extra. ``"content"`` forms the transported keys and values
    per pair: time :math:`O(n^2 d (1 + r))`, memory a few
    ``[..., n, n, d]`` tensors (e.g. batch 8, 4 heads, n = 256, d = 16 in
    float32 is 128 MiB each), never a ``[n, n, d, d]`` tensor.
    """
    if connection not in CONNECTIONS:
        raise ValueError(f"connection must be one of {CONNECTIONS}, got {connection!r}")
    lam_t, scale_f, per_q, per_k = check_score_inputs(q, k, U_q, U_k, lam, metric_side, scale)
    v = check_tensor(v, "v", min_dim=2)
    check_same(q, "q", [("v", v), ("theta", theta)])
    n, d = q.shape[-2], q.shape[-1]
    if k.shape[-2] != n or v.shape[-2] != n:
        raise ValueError(f"connection_attention is self-attention: q, k, v need the same n, got "
                         f"q {shape_str(q)}, k {shape_str(k)}, v {shape_str(v)}")
    attn_kwargs = dict(lam=lam, metric_side=metric_side, attn_mask=attn_mask, is_causal=is_causal,
                       scale=scale, dropout_p=dropout_p)
    if connection == "trivial":
        if theta is not None:
            raise ValueError("theta is not used by the trivial connection; pass None")
        if return_weights:
            return riemannian_attention_reference(q, k, v, U_q, U_k, return_weights=True, **attn_kwargs)
        return riemannian_attention(q, k, v, U_q, U_k, **attn_kwargs)
    if d % 2:
        raise ValueError(f"connection {connection!r} rotates pairs of coordinates: the head dimension d "
                         f"must be even, got d = {d}")
    if v.shape[-1] != d:
        raise ValueError(f"values are transported between fibres, so v must have the head dimension d = {d}, "
                         f"got {shape_str(v)}")
    p = _positions(positions, n, q)
    if connection == "flat":
        if theta is None:
            theta = rotary_frequencies(d, dtype=q.dtype, device=q.device)
        if theta.dim() != 1 or theta.shape[0] != d // 2:
            raise ValueError(f"theta for the flat connection must have shape [d/2] = [{d // 2}], got {shape_str(theta)}")
        ang = p.unsqueeze(-1) * theta  # angle of R_i                              (..., n, d/2)
        q1 = rotate_pairs(q, -ang)  # R_i^T q_i
        k1 = rotate_pairs(k, -ang)  # R_j^T k_j
        v1 = rotate_pairs(v, -ang)  # R_j^T v_j
        U_q1 = _rotate_factor(_per_token(U_q, per_q, n), -ang) if U_q is not None else None
        U_k1 = _rotate_factor(_per_token(U_k, per_k, n), -ang) if U_k is not None else None
        if return_weights:
            out, A = riemannian_attention_reference(q1, k1, v1, U_q1, U_k1, return_weights=True, **attn_kwargs)
            return rotate_pairs(out, ang), A
        out = riemannian_attention(q1, k1, v1, U_q1, U_k1, **attn_kwargs)
        return rotate_pairs(out, ang)  # back to fibre i: R_i o_i

    # ---- content: per-pair transport
    if theta is None:
        raise ValueError("connection='content' needs theta: the per-token rates Theta(x_j), shape [..., n, d/2]")
    if theta.dim() < 2 or theta.shape[-2:] != (n, d // 2):
        raise ValueError(f"theta for the content connection must have shape [..., n, d/2] = [..., {n}, {d // 2}], "
                         f"got {shape_str(theta)}")
    broadcast_batch({"theta.shape[:-2]": theta.shape[:-2], "q.shape[:-2]": q.shape[:-2]})
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    phi = transport_angles(theta, p)  # angle of P_{j->i}                   (..., n_i, n_j, d/2)
    cos, sin = torch.cos(phi), torch.sin(phi)  # shared by keys, values and the key metric
    kt = _rotate_cs(k.unsqueeze(-3), cos, sin)  # P_{j->i} k_j             (..., n_i, n_j, d)
    diff = q.unsqueeze(-2) - kt  # q_i - P k_j                             (..., n_i, n_j, d)
    lam_s = lam_t.unsqueeze(-1).unsqueeze(-1) if lam_t.dim() > 0 else lam_t
    dist2 = lam_s * (diff * diff).sum(-1)  # (..., n_i, n_j)
    low = 0.0
    if metric_side in ("key", "mean"):
        Uk = _per_token(U_k, per_k, n)  # (..., n_j, d, r)
        back = _rotate_cs(diff, cos, -sin)  # P^T (q_i - P k_j) = P^T q_i - k_j  (..., n_i, n_j, d)
        a = torch.einsum("...ijd,...jdr->...ijr", back, Uk)  # (..., n_i, n_j, r)
        low = low + (a * a).sum(-1) * (0.5 if metric_side == "mean" else 1.0)
    if metric_side in ("query", "mean"):
        Uq = _per_token(U_q, per_q, n)  # (..., n_i, d, r)
        b = torch.einsum("...ijd,...idr->...ijr", diff, Uq)  # (..., n_i, n_j, r)
        low = low + (b * b).sum(-1) * (0.5 if metric_side == "mean" else 1.0)
    S = -0.5 * scale_f * (dist2 + low)  # (..., n_i, n_j)
    M = build_additive_mask(attn_mask, is_causal, n, n, q)
    if M is not None:
        S = S + M
    row_max = S.amax(-1, keepdim=True)
    dead = torch.isneginf(row_max)  # rows with every key masked give 0, not NaN
    S = S - torch.where(dead, torch.zeros_like(row_max), row_max).detach()
    A = torch.exp(S)
    A = A / A.sum(-1, keepdim=True).clamp_min(torch.finfo(A.dtype).tiny)
    if dropout_p > 0.0:
        A = torch.nn.functional.dropout(A, p=dropout_p)
    vt = _rotate_cs(v.unsqueeze(-3), cos, sin)  # P_{j->i} v_j             (..., n_i, n_j, d)
    out = torch.einsum("...ij,...ijd->...id", A, vt)  # mixed in fibre i    (..., n_i, d)
    return (out, A) if return_weights else out


# --------------------------------------------------------------------------- diagnostics
def sample_triangles(n: int, n_triangles: int, *, generator: torch.Generator | None = None,
                     device=None) -> Tensor:
    """Random triangles of three distinct positions, for :func:`holonomy_defect` and :func:`torsion_defect`.

    Each row is three distinct indices drawn uniformly without replacement
    from ``0..n-1`` (in random order); rows are independent, so a triangle
    may repeat. The random numbers are drawn on the CPU, so a seeded
    ``generator`` gives the same triangles on every device.

    Parameters
    ----------
    n : int
        Number of tokens, ``n >= 3``.
    n_triangles : int
        Number of triangles ``T >= 1``.
    generator : torch.Generator, optional
        CPU generator for reproducible draws.
    device : torch.device or str, optional
        Where to put the result (default: the CPU).

    Returns
    -------
    Tensor, shape [n_triangles, 3], dtype long
        Columns ``i, j, k``.
    """
    if n < 3:
        raise ValueError(f"a triangle needs n >= 3 tokens, got n = {n}")
    if n_triangles < 1:
        raise ValueError(f"n_triangles must be >= 1, got {n_triangles}")
    scores = torch.rand(n_triangles, n, generator=generator)
    return scores.topk(3, dim=-1).indices.to(device)  # three distinct indices per row


def sample_pairs(n: int, n_pairs: int, *, generator: torch.Generator | None = None, device=None) -> Tensor:
    """Random ordered pairs of distinct positions, for :func:`metric_compatibility_defect`.

    Each row is two distinct indices drawn uniformly without replacement
    from ``0..n-1``; rows are independent. The random numbers are drawn on
    the CPU, so a seeded ``generator`` gives the same pairs on every device.

    Parameters
    ----------
    n : int
        Number of tokens, ``n >= 2``.
    n_pairs : int
        Number of pairs ``T``.
    generator : torch.Generator, optional
        CPU generator for reproducible draws.
    device : torch.device or str, optional
        Where to put the result (default: the CPU).

    Returns
    -------
    Tensor, shape [n_pairs, 2], dtype long
        Columns ``i, j``.
    """
    if n < 2:
        raise ValueError(f"a pair needs n >= 2 tokens, got n = {n}")
    scores = torch.rand(n_pairs, n, generator=generator)
    return scores.topk(2, dim=-1).indices.to(device)


def _check_rates(rates: Tensor, positions: Tensor | None) -> tuple[Tensor, Tensor]:
    rates = check_tensor(rates, "rates", min_dim=2)
    n = rates.shape[-2]
    return rates, _positions(positions, n, rates)


def holonomy_defect(rates: Tensor, triangles: Tensor, positions: Tensor | None = None,
                    reduce: bool = True) -> Tensor:
    r"""Curvature proxy: :math:`\|P_{k\to i} P_{j\to k} P_{i\to j} - I\|_F` over triangles.

    For block rotations the loop is a rotation by, per block,

    .. math::
        \phi_m &= (p_j - p_i)\omega_{i,m} + (p_k - p_j)\omega_{j,m} + (p_i - p_k)\omega_{k,m} \\
               &= (p_j - p_i)(\omega_{i,m} - \omega_{k,m}) + (p_k - p_j)(\omega_{j,m} - \omega_{k,m}),

    and :math:`\|R(\phi) - I\|_F^2 = \sum_m 8\sin^2(\phi_m/2)`. The second form
    shows (and computes) that equal rates (trivial, flat) give exactly zero.

    Parameters
    ----------
    rates : Tensor, shape [..., n, d/2]
        Rates :math:`\omega_j` (:func:`connection_rates`).
    triangles : Tensor, shape [T, 3]
        Long indices (i, j, k) (:func:`sample_triangles`).
    positions : Tensor, shape [n] or [..., n], optional
    reduce : bool
        Average over triangles (shape [...]) or return all (shape [..., T]).
    """
    rates, p = _check_rates(rates, positions)
    i, j, k = triangles[:, 0], triangles[:, 1], triangles[:, 2]
    p = p.expand(*rates.shape[:-1])
    wi, wj, wk = rates[..., i, :], rates[..., j, :], rates[..., k, :]  # (..., T, d/2)
    pi, pj, pk = p[..., i, None], p[..., j, None], p[..., k, None]  # (..., T, 1)
    phi = (pj - pi) * (wi - wk) + (pk - pj) * (wj - wk)  # (..., T, d/2)
    defect = torch.sqrt(8.0 * torch.sin(0.5 * phi).pow(2).sum(-1))  # (..., T)
    return defect.mean(-1) if reduce else defect


def torsion_defect(x: Tensor, rates: Tensor, triangles: Tensor, positions: Tensor | None = None,
                   reduce: bool = True) -> Tensor:
    r"""Torsion proxy: the closure defect of a transported triangle.

    .. math::
        \big\|(x_k - x_i) - P_{j\to i}(x_k - x_j) - (x_j - x_i)\big\|
        = \big\|(I - P_{j\to i})(x_k - x_j)\big\|,

    computed in the second form, which is exactly zero for ``P = I``.

    Parameters
    ----------
    x : Tensor, shape [..., n, d]
        Fibre vectors (e.g. a head's keys).
    rates : Tensor, shape [..., n, d/2]
    triangles : Tensor, shape [T, 3]
    positions : Tensor, shape [n] or [..., n], optional
    reduce : bool
        Average over triangles (shape [...]) or not (shape [..., T]).
    """
    x = check_tensor(x, "x", min_dim=2)
    rates, p = _check_rates(rates, positions)
    if x.shape[-1] != 2 * rates.shape[-1] or x.shape[-2] != rates.shape[-2]:
        raise ValueError(f"x must have shape [..., n, d] = [..., {rates.shape[-2]}, {2 * rates.shape[-1]}] "
                         f"to match rates {shape_str(rates)}, got {shape_str(x)}")
    i, j, k = triangles[:, 0], triangles[:, 1], triangles[:, 2]
    p = p.expand(*rates.shape[:-1])
    e = x[..., k, :] - x[..., j, :]  # (..., T, d)
    ang = (p[..., i, None] - p[..., j, None]) * rates[..., j, :]  # angle of P_{j->i}    (..., T, d/2)
    defect = (e - rotate_pairs(e, ang)).norm(dim=-1)  # (..., T)
    return defect.mean(-1) if reduce else defect


def metric_compatibility_defect(lam, U: Tensor, rates: Tensor, pairs: Tensor,
                                positions: Tensor | None = None, reduce: bool = True) -> Tensor:
    r"""Metric-compatibility defect :math:`\|P_{j\to i}^\top G_i P_{j\to i} - G_j\|_F` over pairs.

    A connection is metric-compatible when transport is an isometry between
    the fibres' metrics. With :math:`G = \lambda I + U U^\top`,
    :math:`A = P^\top U_i`, :math:`B = U_j`, :math:`c = \lambda_i - \lambda_j`:

    .. math::
        \|c I + A A^\top - B B^\top\|_F^2 = d c^2 + 2c(\|A\|_F^2 - \|B\|_F^2)
        + \|R J R^\top\|_F^2 ,

    where :math:`[A, B] = Q R` (thin QR) and :math:`J = \mathrm{diag}(I_r, -I_r)`:
    :math:`O(d r^2)` per pair, no :math:`d\times d` matrix, and no
    cancellation when the defect is small (the expansion into Gram matrices
    would lose half the digits).

    Parameters
    ----------
    lam : float or Tensor, shape broadcastable to ``U.shape[:-2]`` = [..., n]
        Per token; a per-head ``lam`` of shape [h] is passed as ``lam[:, None]``
        (it then cancels: only the low-rank parts can disagree).
    U : Tensor, shape [..., n, d, r]
    rates : Tensor, shape [..., n, d/2]
    pairs : Tensor, shape [T, 2]
        Long indices (i, j) (:func:`sample_pairs`).
    positions : Tensor, shape [n] or [..., n], optional
    reduce : bool
        Average over pairs (shape [...]) or not (shape [..., T]).
    """
    U = check_tensor(U, "U", min_dim=3)
    rates, p = _check_rates(rates, positions)
    n, d = U.shape[-3], U.shape[-2]
    if rates.shape[-2] != n or 2 * rates.shape[-1] != d:
        raise ValueError(f"rates must have shape [..., n, d/2] = [..., {n}, {d // 2}] to match U {shape_str(U)}, "
                         f"got {shape_str(rates)}")
    lam_t = as_positive(lam, "lam", U)
    broadcast_batch({"lam": lam_t.shape, "U.shape[:-2]": U.shape[:-2]})
    lam_tok = lam_t.expand(torch.broadcast_shapes(lam_t.shape, U.shape[:-2]))  # per token   (..., n)
    i, j = pairs[:, 0], pairs[:, 1]
    p = p.expand(*rates.shape[:-1])
    ang = (p[..., i, None] - p[..., j, None]) * rates[..., j, :]  # angle of P_{j->i}   (..., T, d/2)
    A = _rotate_factor(U[..., i, :, :], -ang)  # P^T U_i                     (..., T, d, r)
    Bm = U[..., j, :, :]  # (..., T, d, r)
    c = lam_tok[..., i] - lam_tok[..., j]  # (..., T)
    # A A^T - B B^T = M J M^T with M = [A, B], J = diag(I, -I); with M = Q R its
    # Frobenius norm is that of the 2r x 2r matrix R J R^T: no cancellation.
    M = torch.cat([A, Bm], dim=-1)  # (..., T, d, 2r)
    R = torch.linalg.qr(M, mode="r").R  # (..., T, min(d, 2r), 2r)
    sign = torch.cat([torch.ones(A.shape[-1]), -torch.ones(Bm.shape[-1])]).to(M)
    low = ((R * sign) @ R.transpose(-1, -2)).pow(2).sum((-1, -2))  # |A A^T - B B^T|_F^2   (..., T)
    sq = d * c * c + 2 * c * (A.pow(2).sum((-1, -2)) - Bm.pow(2).sum((-1, -2))) + low
    defect = sq.clamp_min(0).sqrt()  # (..., T)
    return defect.mean(-1) if reduce else defect
