r"""Transport between token fibres: the connections' rotations, rates, angles and phases.

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

One connection reads the same per-token rates another way: ``"cumulative"``
integrates them along the sequence into one phase per token,

.. math::
    \phi_i = \sum_{t \le i} \omega_t\,(p_t - p_{t-1}) \quad (p_{-1} = 0), \qquad
    P_{j\to i} = R(\phi_i)\,R(\phi_j)^\top ,

(:func:`cumulative_phases`): block :math:`m` of :math:`P_{j\to i}` turns by
:math:`\phi_{i,m} - \phi_{j,m}`, the integral of the rates over the tokens
after :math:`j` up to :math:`i`. A product of per-token frames, it is flat
(the holonomy of every loop is zero) and inverse-consistent, like the rotary
connection, which it is for constant rates :math:`\omega_t = \theta`
(:math:`\phi_i = \theta p_i`).

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

Attention along a connection (the transported scores and values, the fused
kernels) is :func:`riemannian_ref.attention.connections.connection_attention`;
the diagnostics of a connection (holonomy, transport closure, metric
compatibility) are in :mod:`riemannian_ref.analysis.bundle`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._checks import broadcast_batch, check_same, check_tensor, shape_str

__all__: list[str] = []  # reached as riemannian_ref.geometry.transport.NAME (chapter 7); none re-exported

#: The accepted values of ``connection``: no transport, rotary (flat), content-dependent rates
#: read from both endpoints of an edge (inverse-consistent), or from its source only, or
#: integrated along the sequence into per-token phases (flat, content-dependent).
CONNECTIONS = ("trivial", "flat", "content", "content_source", "cumulative")

#: How an edge reads its angle from the per-token rates: ``"mean"`` of both endpoints' rates, the
#: ``"source"``'s, or the difference of the endpoints' ``"cumulative"`` phases.
EDGE_RULES = ("mean", "source", "cumulative")


def edge_rule(connection: str) -> str:
    """The edge rule of a connection: ``"source"`` for ``"content_source"``, ``"cumulative"`` for
    ``"cumulative"``, ``"mean"`` otherwise.

    For the trivial and flat connections every token has the same rates and
    the ``"mean"`` and ``"source"`` rules give the same transports (so does
    ``"cumulative"``, whose phases are then :math:`\theta p_i`).

    Parameters
    ----------
    connection : str
        One of ``CONNECTIONS``.
    """
    if connection not in CONNECTIONS:
        raise ValueError(f"connection must be one of {CONNECTIONS}, got {connection!r}")
    return {"content_source": "source", "cumulative": "cumulative"}.get(connection, "mean")


def check_rule(rule: str) -> str:
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


def check_positions(positions: Tensor | None, n: int, like: Tensor) -> Tensor:
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
    rule : {"mean", "source", "cumulative"}
        The edge's rate: :math:`\omega_{ij} = (\omega_i + \omega_j)/2`
        (inverse-consistent: :math:`\phi_{ji} = -\phi_{ij}`), or the source's
        :math:`\omega_j`; or, for ``"cumulative"``, no edge rate at all: the
        angle is :math:`\phi_i - \phi_j` of the per-token phases of
        :func:`cumulative_phases`.

    Returns
    -------
    Tensor, shape [..., n, n, d/2]
        Index ``[..., i, j, m]``; memory :math:`O(n^2 d)` per batch entry.
    """
    if check_rule(rule) == "cumulative":
        phi = phases_unchecked(rates, positions)  # (..., n, d/2)
        return phi.unsqueeze(-2) - phi.unsqueeze(-3)  # phi_i - phi_j             (..., n_i, n_j, d/2)
    dp = positions.unsqueeze(-1) - positions.unsqueeze(-2)  # p_i - p_j              (..., n, n)
    if rule == "source":
        return dp.unsqueeze(-1) * rates.unsqueeze(-3)  # (..., n_i, n_j, d/2)
    edge = 0.5 * (rates.unsqueeze(-2) + rates.unsqueeze(-3))  # (omega_i + omega_j) / 2  (..., n_i, n_j, d/2)
    return dp.unsqueeze(-1) * edge


def cumulative_phases(rates: Tensor, positions: Tensor | None = None) -> Tensor:
    r"""Per-token phases of the cumulative connection, :math:`\phi_i = \sum_{t \le i} \omega_t (p_t - p_{t-1})`.

    With :math:`p_{-1} = 0`, so that constant rates :math:`\omega_t = \theta`
    give the rotary angles :math:`\theta p_i` (bit for bit: see below). The
    transport of the cumulative connection is
    :math:`P_{j\to i} = R(\phi_i) R(\phi_j)^\top`, block :math:`m` turned by
    :math:`\phi_{i,m} - \phi_{j,m} = \sum_{j < t \le i} \omega_{t,m}(p_t - p_{t-1})`
    for :math:`j < i`: only the tokens after :math:`j` up to :math:`i` enter.
    Hence :math:`\phi_i` reads the tokens :math:`t \le i` only (a causal
    model stays causal), and padding before the first real token (left
    padding) leaves the transports between real tokens unchanged whatever the
    pads' rates and positions, up to round-off.

    Computed as :math:`\phi_i = \omega_0 p_i + \sum_{t \le i} (\omega_t - \omega_0)(p_t - p_{t-1})`
    (the same sum, since the increments add up to :math:`p_i`): the first
    token's rate times the position, plus a running sum that is exactly 0 for
    constant rates, so that those give :math:`\theta p_i` as the flat
    connection computes it. Time and memory :math:`O(n d)`; differentiable
    in ``rates``.

    Parameters
    ----------
    rates : Tensor, shape [..., n, d/2]
        Per-token rates :math:`\omega_t`.
    positions : Tensor, shape [n] or [..., n], optional
        Token positions :math:`p_t` (default ``0..n-1``), broadcasting
        against ``rates.shape[:-1]``.

    Returns
    -------
    Tensor, shape [..., n, d/2]
        :math:`\phi_{i,m}` at index ``[..., i, m]`` (the broadcast batch of
        ``rates`` and ``positions``), in the dtype of ``rates``.
    """
    rates = check_tensor(rates, "rates", min_dim=2)
    p = check_positions(positions, rates.shape[-2], rates)
    broadcast_batch({"rates.shape[:-2]": rates.shape[:-2], "positions.shape[:-1]": p.shape[:-1]})
    return phases_unchecked(rates, p)


def phases_unchecked(rates: Tensor, p: Tensor) -> Tensor:
    """:func:`cumulative_phases` on validated inputs (``p`` in the dtype of ``rates``)."""
    dp = torch.diff(p, dim=-1, prepend=torch.zeros_like(p[..., :1]))  # p_t - p_{t-1}, p_{-1} = 0   (..., n)
    ref = rates[..., :1, :]  # the first token's rate                         (..., 1, d/2)
    return p.unsqueeze(-1) * ref + torch.cumsum((rates - ref) * dp.unsqueeze(-1), dim=-2)  # (..., n, d/2)


def connection_rates(connection: str, n: int, d: int, *, rates: Tensor | None = None,
                     like: Tensor) -> Tensor:
    r"""Per-token rates :math:`\omega_j` of a connection, shape [n, d/2] or [..., n, d/2].

    ``"trivial"`` gives zeros; ``"flat"`` the rotary frequencies (``rates``,
    shape [d/2], default base 10000) repeated for every token; the content
    connections (``"content"``, ``"content_source"``, ``"cumulative"``) return
    ``rates`` itself, which must then be given per token, shape [..., n, d/2].
    Used by the diagnostics, which need rates for every connection (with
    :func:`edge_rule` for how an edge reads them).

    Parameters
    ----------
    connection : {"trivial", "flat", "content", "content_source", "cumulative"}
        Which connection (one of ``CONNECTIONS``).
    n : int
        Number of tokens.
    d : int
        Head dimension; must be even (the rotations act on pairs).
    rates : Tensor, optional
        ``"flat"``: rotary rates, shape [d/2] (default
        :func:`rotary_frequencies` with base 10000). ``"content"``: the
        per-token rates, shape [..., n, d/2] (required; also for
        ``"content_source"`` and ``"cumulative"``). Ignored by ``"trivial"``.
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
        raise ValueError(f"rates for the {connection} connection must have shape [..., n, d/2] = "
                         f"[..., {n}, {d // 2}], got {shape_str(rates)}")
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


def rotate_factor(U: Tensor, angles: Tensor) -> Tensor:
    """Rotate every column of U [..., n, d, r] by angles [..., n, d/2]."""
    Ut = U.transpose(-1, -2)  # (..., n, r, d)
    return rotate_pairs(Ut, angles.unsqueeze(-2)).transpose(-1, -2)  # (..., n, d, r)
