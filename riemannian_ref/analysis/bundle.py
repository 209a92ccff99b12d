r"""Diagnostics of a connection on the head bundle: holonomy, transport closure, metric compatibility.

The connections themselves (rotations by angles :math:`(p_i - p_j)\,\omega_{ij}`,
or by differences :math:`\phi_i - \phi_j` of cumulative phases, on consecutive
coordinate pairs) are in :mod:`riemannian_ref.geometry.transport`;
here are the measurements a reader runs on them, each returning tensors:

- :func:`holonomy_defect`: :math:`\|P_{k\to i} P_{j\to k} P_{i\to j} - I\|_F`
  over triangles of tokens, the discrete curvature (exactly 0 for the trivial
  and flat connections, 0 up to round-off for the cumulative one);
- :func:`transport_closure_defect`: :math:`\|(I - P_{j\to i})(x_k - x_j)\|`,
  how far transport is from the identity on the edge vectors of a triangle
  (not a torsion: it is non-zero for the flat rotary connection);
- :func:`metric_compatibility_defect`: how far transport is from an isometry
  between the fibres' metrics, :math:`\|P^\top G_i P - G_j\|_F`, optionally
  relative to the heterogeneity :math:`\|G_i - G_j\|_F` (its value at
  :math:`P = I`);
- :func:`sample_triangles`, :func:`sample_pairs`: the random index sets they
  average over.

Each takes the per-token rates and the edge ``rule`` of the connection
(:func:`~riemannian_ref.geometry.transport.edge_rule`): ``"mean"`` for the
inverse-consistent content connection (and for trivial and flat, where the
rules agree), ``"source"`` for ``"content_source"``, ``"cumulative"`` for
``"cumulative"`` (the edge's angle is then :math:`\phi_i - \phi_j` of the
per-token phases of :func:`~riemannian_ref.geometry.transport.cumulative_phases`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._checks import as_positive, broadcast_batch, check_tensor, shape_str
from ..geometry.transport import check_positions, check_rule, phases_unchecked, rotate_factor, rotate_pairs

__all__ = [
    "sample_triangles",
    "sample_pairs",
    "holonomy_defect",
    "transport_closure_defect",
    "metric_compatibility_defect",
]


def sample_triangles(n: int, n_triangles: int, *, generator: torch.Generator | None = None,
                     device=None) -> Tensor:
    """Random triangles of three distinct positions, for :func:`holonomy_defect` and :func:`transport_closure_defect`.

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
    return _distinct_indices(n, n_triangles, 3, "n_triangles", generator, device)


def sample_pairs(n: int, n_pairs: int, *, generator: torch.Generator | None = None, device=None) -> Tensor:
    """Random ordered pairs ``(i, j)`` of distinct positions, for :func:`metric_compatibility_defect`.

    Drawn as :func:`sample_triangles` draws its rows (``n >= 2`` here), with
    two columns: a tensor of shape ``[n_pairs, 2]``, dtype long.

    Parameters
    ----------
    n, n_pairs, generator, device
        Tokens, number of pairs (``>= 1``), CPU generator, result device.
    """
    return _distinct_indices(n, n_pairs, 2, "n_pairs", generator, device)


def _distinct_indices(n: int, count: int, k: int, count_name: str, generator, device) -> Tensor:
    """``count`` rows of ``k`` distinct indices in ``0..n-1``, uniform, drawn on the CPU."""
    for name, val, low in (("n", n, k), (count_name, count, 1)):
        if isinstance(val, bool) or not isinstance(val, int) or val < low:
            raise ValueError(f"{name} must be an int >= {low}, got {val!r}")
    scores = torch.rand(count, n, generator=generator)
    return scores.topk(k, dim=-1).indices.to(device)  # k distinct indices per row


def _check_rates(rates: Tensor, positions: Tensor | None) -> tuple[Tensor, Tensor]:
    rates = check_tensor(rates, "rates", min_dim=2)
    n = rates.shape[-2]
    return rates, check_positions(positions, n, rates)


def _check_index(idx: Tensor, name: str, k: int, n: int) -> Tensor:
    """Long indices [T, k] into 0..n-1 (what :func:`sample_triangles` and :func:`sample_pairs` return)."""
    if not isinstance(idx, Tensor) or idx.dtype != torch.long or idx.dim() != 2 or idx.shape[-1] != k:
        got = f"{idx.dtype} {shape_str(idx)}" if isinstance(idx, Tensor) else type(idx).__name__
        raise ValueError(f"{name} must be a long tensor of shape [T, {k}], got {got}")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise ValueError(f"{name} must index tokens 0..{n - 1}, got values in [{int(idx.min())}, {int(idx.max())}]")
    return idx


def _edge_angle(rates: Tensor, p: Tensor, i: Tensor, j: Tensor, rule: str) -> Tensor:
    """Angles of P_{j->i} for index vectors i, j [T]: (p_i - p_j) omega_ij, or phi_i - phi_j, shape [..., T, d/2]."""
    if rule == "cumulative":
        phi = phases_unchecked(rates, p)  # per-token phases                                     (..., n, d/2)
        return phi[..., i, :] - phi[..., j, :]
    w = rates[..., j, :] if rule == "source" else 0.5 * (rates[..., i, :] + rates[..., j, :])
    return (p[..., i, None] - p[..., j, None]) * w


def holonomy_defect(rates: Tensor, triangles: Tensor, positions: Tensor | None = None,
                    reduce: bool = True, *, rule: str = "mean") -> Tensor:
    r"""Discrete curvature: :math:`\|P_{k\to i} P_{j\to k} P_{i\to j} - I\|_F` over triangles.

    All transports are block rotations (an abelian torus), so the loop is a
    rotation by the sum of the three edge angles, per block :math:`m`. With
    ``rule="mean"`` (:math:`\omega_{ab} = (\omega_a + \omega_b)/2`)

    .. math::
        \phi_m = \tfrac12\big[(p_j - p_k)(\omega_{i,m} - \omega_{k,m})
                             + (p_k - p_i)(\omega_{j,m} - \omega_{k,m})\big],

    the signed area of the triangle :math:`(\omega_{\cdot,m}, p_\cdot)` in the
    (rate, position) plane, so the connection is a lattice gauge field whose
    curvature is that area (zero for equal rates, and for two-edge loops). With
    ``rule="source"`` (:math:`\omega_{ab} = \omega_a`, the source's rate)

    .. math::
        \phi_m = (p_j - p_i)(\omega_{i,m} - \omega_{k,m}) + (p_k - p_j)(\omega_{j,m} - \omega_{k,m}).

    With ``rule="cumulative"`` the three edges turn by
    :math:`\phi_j - \phi_i`, :math:`\phi_k - \phi_j` and
    :math:`\phi_i - \phi_k` of the per-token phases
    (:func:`~riemannian_ref.geometry.transport.cumulative_phases`), whose
    sum is zero: the holonomy is the round-off of those three differences,
    about the float epsilon times the largest phase, for every loop (a flat
    connection).

    In all, :math:`\|R(\phi) - I\|_F^2 = \sum_m 8\sin^2(\phi_m/2)`, and the
    differences make equal rates (trivial, flat) give exactly zero with the
    ``"mean"`` and ``"source"`` rules.

    Parameters
    ----------
    rates : Tensor, shape [..., n, d/2]
        Per-token rates :math:`\omega_j` (:func:`~riemannian_ref.geometry.transport.connection_rates`).
    triangles : Tensor, shape [T, 3]
        Long indices (i, j, k) (:func:`sample_triangles`); a repeated index
        gives a two-edge loop.
    positions : Tensor, shape [n] or [..., n], optional
    reduce : bool
        Average over triangles (shape [...]) or return all (shape [..., T]).
    rule : {"mean", "source", "cumulative"}
        How an edge reads its rate (:func:`~riemannian_ref.geometry.transport.edge_rule`).
    """
    rates, p = _check_rates(rates, positions)
    check_rule(rule)
    triangles = _check_index(triangles, "triangles", 3, rates.shape[-2])
    i, j, k = triangles[:, 0], triangles[:, 1], triangles[:, 2]
    p = p.expand(*rates.shape[:-1])
    if rule == "cumulative":  # the loop's angle is the sum of its three edges' angles, each as transport computes it
        ph = phases_unchecked(rates, p)  # per-token phases                                      (..., n, d/2)
        a, b, c = ph[..., i, :], ph[..., j, :], ph[..., k, :]  # (..., T, d/2)
        phi = (b - a) + (c - b) + (a - c)  # edges i -> j, j -> k, k -> i: zero up to round-off
        defect = torch.sqrt(8.0 * torch.sin(0.5 * phi).pow(2).sum(-1))  # (..., T)
        return defect.mean(-1) if reduce else defect
    wi, wj, wk = rates[..., i, :], rates[..., j, :], rates[..., k, :]  # (..., T, d/2)
    pi, pj, pk = p[..., i, None], p[..., j, None], p[..., k, None]  # (..., T, 1)
    if rule == "source":
        phi = (pj - pi) * (wi - wk) + (pk - pj) * (wj - wk)  # (..., T, d/2)
    else:
        phi = 0.5 * ((pj - pk) * (wi - wk) + (pk - pi) * (wj - wk))  # signed area   (..., T, d/2)
    defect = torch.sqrt(8.0 * torch.sin(0.5 * phi).pow(2).sum(-1))  # (..., T)
    return defect.mean(-1) if reduce else defect


def transport_closure_defect(x: Tensor, rates: Tensor, triangles: Tensor, positions: Tensor | None = None,
                             reduce: bool = True, *, rule: str = "mean") -> Tensor:
    r"""Transport-closure defect of a triangle: how far transport is from the identity.

    .. math::
        \big\|(x_k - x_i) - P_{j\to i}(x_k - x_j) - (x_j - x_i)\big\|
        = \big\|(I - P_{j\to i})(x_k - x_j)\big\|,

    computed in the second form, which is exactly zero for ``P = I``. It is
    *not* a torsion: torsion :math:`T(X, Y) = \nabla_X Y - \nabla_Y X - [X, Y]`
    needs a connection on the tangent bundle of the base (a solder form),
    and this bundle's base is a discrete set of positions with abstract
    head-space fibres. The flat rotary connection, which has no curvature,
    scores well above zero here, because its transports are rotations by
    :math:`(p_i - p_j)\theta`.

    Parameters
    ----------
    x : Tensor, shape [..., n, d]
        Fibre vectors (e.g. a head's keys).
    rates : Tensor, shape [..., n, d/2]
    triangles : Tensor, shape [T, 3]
    positions : Tensor, shape [n] or [..., n], optional
    reduce : bool
        Average over triangles (shape [...]) or not (shape [..., T]).
    rule : {"mean", "source", "cumulative"}
        How an edge reads its rate.
    """
    x = check_tensor(x, "x", min_dim=2)
    rates, p = _check_rates(rates, positions)
    check_rule(rule)
    if x.shape[-1] != 2 * rates.shape[-1] or x.shape[-2] != rates.shape[-2]:
        raise ValueError(f"x must have shape [..., n, d] = [..., {rates.shape[-2]}, {2 * rates.shape[-1]}] "
                         f"to match rates {shape_str(rates)}, got {shape_str(x)}")
    triangles = _check_index(triangles, "triangles", 3, rates.shape[-2])
    i, j, k = triangles[:, 0], triangles[:, 1], triangles[:, 2]
    p = p.expand(*rates.shape[:-1])
    e = x[..., k, :] - x[..., j, :]  # (..., T, d)
    ang = _edge_angle(rates, p, i, j, rule)  # angle of P_{j->i}                    (..., T, d/2)
    defect = (e - rotate_pairs(e, ang)).norm(dim=-1)  # (..., T)
    return defect.mean(-1) if reduce else defect


def metric_compatibility_defect(lam, U: Tensor, rates: Tensor, pairs: Tensor,
                                positions: Tensor | None = None, reduce: bool = True, *,
                                rule: str = "mean", relative: bool = False) -> Tensor:
    r"""Metric-compatibility defect :math:`\|P_{j\to i}^\top G_i P_{j\to i} - G_j\|_F` over pairs.

    A connection is metric-compatible when transport is an isometry between
    the fibres' metrics, :math:`P^\top G_i P = G_j`. At :math:`P = I` the
    defect is the heterogeneity :math:`\|G_i - G_j\|_F` of the two metrics,
    so its absolute size mostly measures how different the metrics are;
    ``relative=True`` divides by that heterogeneity (1: no better than no
    transport; 0: compatible). A rotation preserves the spectrum, so when
    :math:`G_i` and :math:`G_j` have different eigenvalues no rotation is
    compatible, and the relative defect of every connection of the package
    is then bounded away from 0; the compatible maps are
    :math:`G_i^{-1/2} O\, G_j^{1/2}` (:func:`~riemannian_ref.geometry.transport.compatible_transport`).
    With :math:`G = \lambda I + U U^\top`,
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
    rule : {"mean", "source", "cumulative"}
        How an edge reads its rate.
    relative : bool
        Divide by the heterogeneity :math:`\|G_i - G_j\|_F`: per pair when
        ``reduce=False``, the ratio of the two averages when ``reduce=True``;
        where the heterogeneity is 0, 0 if the defect is 0 too and ``inf``
        otherwise, never 0/0.
    """
    U = check_tensor(U, "U", min_dim=3)
    rates, p = _check_rates(rates, positions)
    check_rule(rule)
    if not isinstance(relative, bool):
        raise ValueError(f"relative must be a bool, got {relative!r}")
    n, d = U.shape[-3], U.shape[-2]
    if rates.shape[-2] != n or 2 * rates.shape[-1] != d:
        raise ValueError(f"rates must have shape [..., n, d/2] = [..., {n}, {d // 2}] to match U {shape_str(U)}, "
                         f"got {shape_str(rates)}")
    try:
        ok = torch.broadcast_shapes(rates.shape[:-2], U.shape[:-3]) == U.shape[:-3]
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"rates batch dims {shape_str(rates.shape[:-2])} must broadcast to U's "
                         f"{shape_str(U.shape[:-3])} without adding dimensions")
    lam_t = as_positive(lam, "lam", U)
    broadcast_batch({"lam": lam_t.shape, "U.shape[:-2]": U.shape[:-2]})
    lam_tok = lam_t.expand(torch.broadcast_shapes(lam_t.shape, U.shape[:-2]))  # per token   (..., n)
    pairs = _check_index(pairs, "pairs", 2, n)
    i, j = pairs[:, 0], pairs[:, 1]
    p = p.expand(*rates.shape[:-1])
    ang = _edge_angle(rates, p, i, j, rule)  # angle of P_{j->i}                 (..., T, d/2)
    defect = _compatibility(U[..., i, :, :], U[..., j, :, :], lam_tok[..., i] - lam_tok[..., j], ang)
    if not relative:
        return defect.mean(-1) if reduce else defect
    hetero = _compatibility(U[..., i, :, :], U[..., j, :, :], lam_tok[..., i] - lam_tok[..., j],
                            torch.zeros_like(ang))  # |G_i - G_j|_F                    (..., T)
    if reduce:
        defect, hetero = defect.mean(-1), hetero.mean(-1)
    return relative_defect(defect, hetero)


def relative_defect(defect: Tensor, hetero: Tensor) -> Tensor:
    r"""``defect / hetero``, with the convention of equal metrics where ``hetero`` is 0: never 0/0.

    Where the metrics are all equal (heterogeneity 0) a defect can come from
    the transport alone: the ratio is then 0 when the defect is 0 too (for
    instance :math:`G = \lambda I`, which every rotation preserves exactly:
    metrics of rank 0, or factors at 0), and ``inf`` when it is not (one
    shared metric that the transport does not preserve). NaN only from NaN.
    """
    ok = hetero > 0
    return torch.where(ok, defect / torch.where(ok, hetero, torch.ones_like(hetero)),
                       torch.where(defect > 0, torch.inf, torch.where(defect == 0, 0.0, defect)))




def _compatibility(U_i: Tensor, U_j: Tensor, c: Tensor, ang: Tensor) -> Tensor:
    """|P^T G_i P - G_j|_F for G = lam I + U U^T, with P the block rotation of angles ``ang``, per pair."""
    d = U_i.shape[-2]
    A = rotate_factor(U_i, -ang)  # P^T U_i                                     (..., T, d, r)
    Bm = U_j  # (..., T, d, r)
    # A A^T - B B^T = M J M^T with M = [A, B], J = diag(I, -I); with M = Q R its
    # Frobenius norm is that of the 2r x 2r matrix R J R^T: no cancellation.
    M = torch.cat([A, Bm], dim=-1)  # (..., T, d, 2r)
    R = torch.linalg.qr(M, mode="r").R  # (..., T, min(d, 2r), 2r)
    sign = torch.cat([torch.ones(A.shape[-1]), -torch.ones(Bm.shape[-1])]).to(M)
    low = ((R * sign) @ R.transpose(-1, -2)).pow(2).sum((-1, -2))  # |A A^T - B B^T|_F^2   (..., T)
    sq = d * c * c + 2 * c * (A.pow(2).sum((-1, -2)) - Bm.pow(2).sum((-1, -2))) + low
    # equal metrics (P^T U_i = U_j exactly, same lam): exactly 0, not the QR's rounding (which a ratio would blow up)
    same = (A == Bm).all(-1).all(-1) & (c == 0)
    return torch.where(same, 0.0, sq.clamp_min(0).sqrt())  # (..., T)
