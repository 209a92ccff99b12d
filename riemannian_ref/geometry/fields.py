r"""Metric fields over a whole space, curve lengths and shortest paths.

A :class:`MetricField` interpolates metrics given at anchor points,
:math:`G(p) = \sum_k w_k(p) G_k`. The length of a curve :math:`\gamma` is
:math:`\int_0^1 \sqrt{\dot\gamma^\top G(\gamma)\dot\gamma}\,dt`
(:func:`path_length`, Gauss--Legendre on every piece of a polyline), its energy
:math:`\int_0^1 \dot\gamma^\top G(\gamma)\dot\gamma\,dt`
(:func:`path_energy`); :func:`shortest_path` minimises the discretised energy
of a polyline with fixed endpoints, which approximates the geodesic.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .._checks import check_int, check_same, check_tensor, shape_str
from ._paths import check_metric, check_points, gauss_legendre, metric_batch
from .metric import LowRankMetric

__all__ = ["MetricField", "shortest_path"]

_WEIGHTS = ("gaussian", "inverse_distance", "segment")


# ---------------------------------------------------------------- the field
class MetricField:
    r"""A metric field over :math:`\mathbb{R}^m` interpolated from metrics at anchor points.

    .. math:: G(p) = \sum_{k=1}^K w_k(p)\, G_k, \qquad w_k(p) \ge 0,\ \sum_k w_k(p) = 1 .

    A convex combination of SPD matrices is SPD, so :math:`G(p)` is a metric
    everywhere; for :math:`G_k = \lambda_k I + U_k U_k^\top` it is again
    :math:`\bar\lambda(p) I + \tilde U(p) \tilde U(p)^\top` with
    :math:`\bar\lambda = \sum_k w_k \lambda_k` and
    :math:`\tilde U = [\sqrt{w_1} U_1, \dots, \sqrt{w_K} U_K]` of rank
    :math:`K r` (:meth:`at`).

    Parameters
    ----------
    anchors : Tensor, shape [K, m]
        Anchor points (token positions).
    metrics : LowRankMetric with batch shape [K] and d = m, or Tensor of shape [K, m, m]
        The anchors' metrics :math:`G_k`.
    weights : {"gaussian", "inverse_distance", "segment"}
        The partition of unity:

        * ``"gaussian"``: :math:`w_k \propto \exp(-|p - a_k|^2 / (2 h^2))`
          (smooth, positive everywhere; ``bandwidth`` is :math:`h`);
        * ``"inverse_distance"``: :math:`w_k \propto (|p - a_k|^2 + \epsilon h^2)^{-1}`
          (Shepard-like; heavier tails than the Gaussian);
        * ``"segment"``: exactly two anchors :math:`a_0, a_1`;
          :math:`w_1 = \mathrm{clip}(\langle p - a_0, a_1 - a_0\rangle / |a_1 - a_0|^2, 0, 1)`,
          :math:`w_0 = 1 - w_1`. Along the segment from :math:`a_0` to
          :math:`a_1` this is exactly the linear interpolation
          :math:`(1-t) G_0 + t G_1`, so the straight segment's length in this
          field is :func:`segment_length`.
    bandwidth : float
        :math:`h > 0` for ``"gaussian"`` and ``"inverse_distance"``.
    eps : float
        :math:`\epsilon > 0` regularising ``"inverse_distance"`` at the anchors.
    """

    def __init__(self, anchors: Tensor, metrics, *, weights: str = "gaussian",
                 bandwidth: float = 1.0, eps: float = 1e-2):
        anchors = check_tensor(anchors, "anchors", min_dim=2)
        if anchors.dim() != 2 or anchors.shape[0] < 1:
            raise ValueError(f"anchors must have shape [K, m] with K >= 1, got {shape_str(anchors)}")
        K, m = anchors.shape
        metrics = check_metric(metrics, "metrics", m, anchors)
        if tuple(metric_batch(metrics)) != (K,):
            raise ValueError(
                f"metrics must have batch shape [K] = [{K}] (one per anchor), got {list(metric_batch(metrics))}"
            )
        if weights not in _WEIGHTS:
            raise ValueError(f"weights must be one of {_WEIGHTS}, got {weights!r}")
        if weights == "segment" and K != 2:
            raise ValueError(f"weights='segment' needs exactly K = 2 anchors, got anchors {shape_str(anchors)}")
        if isinstance(bandwidth, bool) or not (isinstance(bandwidth, (int, float)) and math.isfinite(bandwidth) and bandwidth > 0):
            raise ValueError(f"bandwidth must be a finite float > 0, got {bandwidth!r}")
        if isinstance(eps, bool) or not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
            raise ValueError(f"eps must be a finite float > 0, got {eps!r}")
        if weights == "segment" and torch.equal(anchors[0], anchors[1]):
            raise ValueError("weights='segment' needs two distinct anchors, got anchors[0] == anchors[1]")
        self.anchors = anchors
        self.metrics = metrics
        self.kind = weights
        self.bandwidth = float(bandwidth)
        self.eps = float(eps)

    @property
    def m(self) -> int:
        """Dimension of the space."""
        return self.anchors.shape[1]

    @property
    def K(self) -> int:
        """Number of anchors."""
        return self.anchors.shape[0]

    def __repr__(self) -> str:
        return f"MetricField(K={self.K}, m={self.m}, weights={self.kind!r}, bandwidth={self.bandwidth})"

    def detach(self) -> "MetricField":
        """The same field with anchors and metrics detached from any autograd graph."""
        M = self.metrics
        if isinstance(M, LowRankMetric):
            M = LowRankMetric(None if M.lam is None else M.lam.detach(), M.U.detach(),
                              delta=None if M.delta is None else M.delta.detach())
        else:
            M = M.detach()
        return MetricField(self.anchors.detach(), M, weights=self.kind, bandwidth=self.bandwidth, eps=self.eps)

    def _check_p(self, p: Tensor, name: str = "points") -> Tensor:
        p = check_tensor(p, name, min_dim=1)
        check_same(self.anchors, "anchors", [(name, p)])
        if p.shape[-1] != self.m:
            raise ValueError(f"{name} must have shape [..., {self.m}], got {shape_str(p)}")
        return p

    def weights(self, points: Tensor) -> Tensor:
        """The partition of unity at ``points``.

        Parameters
        ----------
        points : Tensor, shape [..., m]

        Returns
        -------
        Tensor, shape [..., K]
            Non-negative, summing to one over the last dimension.
        """
        p = self._check_p(points)
        if self.kind == "segment":
            a0, a1 = self.anchors[0], self.anchors[1]
            e = a1 - a0  # (m,)
            t = (((p - a0) * e).sum(-1) / (e * e).sum()).clamp(0.0, 1.0)  # (...)
            return torch.stack([1 - t, t], dim=-1)  # (..., 2)
        d2 = ((p.unsqueeze(-2) - self.anchors) ** 2).sum(-1)  # (..., K)
        h2 = self.bandwidth ** 2
        if self.kind == "gaussian":
            return torch.softmax(-d2 / (2 * h2), dim=-1)  # stable even far from all anchors
        inv = 1.0 / (d2 + self.eps * h2)  # (..., K)
        return inv / inv.sum(-1, keepdim=True)

    def quad(self, points: Tensor, v: Tensor) -> Tensor:
        r""":math:`v^\top G(p) v = \sum_k w_k(p)\, v^\top G_k v` in :math:`O(K m r)` per point.

        Parameters
        ----------
        points : Tensor, shape [..., m]
        v : Tensor, shape [..., m] (same batch as ``points`` or broadcastable)

        Returns
        -------
        Tensor, shape [...]
        """
        w = self.weights(points)  # (..., K)
        v = self._check_p(v, "v")
        return (w * self.anchor_quads(v)).sum(-1)

    def anchor_quads(self, v: Tensor) -> Tensor:
        r""":math:`v^\top G_k v` for every anchor metric, shape [..., K], for ``v`` [..., m]."""
        M = self.metrics
        if not isinstance(M, LowRankMetric):
            return torch.einsum("...a,kab,...b->...k", v, M, v)
        K, m = self.K, self.m
        dvec = (M.lam.expand(K).unsqueeze(-1) if M.delta is None else M.delta).expand(K, m)  # (K, m)
        out = (v * v) @ dvec.transpose(0, 1)  # (..., K)
        if M.r > 0:
            Utv = torch.einsum("...a,kar->...kr", v, M.U.expand(K, m, M.r))  # (..., K, r)
            out = out + (Utv * Utv).sum(-1)
        return out

    def dense(self, points: Tensor) -> Tensor:
        r"""The dense metric :math:`G(p)`, shape [..., m, m], at ``points`` [..., m]."""
        w = self.weights(points)  # (..., K)
        Gk = self.metrics.dense() if isinstance(self.metrics, LowRankMetric) else self.metrics  # (K, m, m)
        return torch.einsum("...k,kij->...ij", w, Gk)

    def at(self, points: Tensor) -> LowRankMetric:
        r"""The field at ``points`` as a :class:`LowRankMetric` of rank :math:`K r`.

        Only for anchors given as a ``LowRankMetric``. With the
        :math:`\lambda I` form the result has ``lam`` of shape [...]; with the
        diagonal form, ``delta`` of shape [..., m].

        Parameters
        ----------
        points : Tensor, shape [..., m]

        Returns
        -------
        LowRankMetric with batch shape [...], d = m, rank K r
        """
        if not isinstance(self.metrics, LowRankMetric):
            raise ValueError("at() needs the anchors' metrics as a LowRankMetric; use dense() for dense metrics")
        w = self.weights(points)  # (..., K)
        M = self.metrics
        K, m, r = self.K, self.m, M.r
        U = M.U.expand(K, m, r)  # (K, m, r)
        Ut = (w.sqrt()[..., :, None, None] * U)  # (..., K, m, r)
        Ut = Ut.movedim(-3, -2).reshape(*w.shape[:-1], m, K * r)  # (..., m, K r)
        if M.delta is None:
            lam = (w * M.lam.expand(K)).sum(-1)  # (...)
            return LowRankMetric(lam, Ut)
        delta = (w.unsqueeze(-1) * M.delta.expand(K, m)).sum(-2)  # (..., m)
        return LowRankMetric(None, Ut, delta=delta)


# ------------------------------------------------------------------- curves
def _check_path(path: Tensor, field: MetricField) -> Tensor:
    if not isinstance(field, MetricField):
        raise ValueError(f"field must be a MetricField, got {type(field).__name__}")
    path = check_tensor(path, "path", min_dim=2)
    check_same(field.anchors, "field.anchors", [("path", path)])
    if path.shape[-1] != field.m or path.shape[-2] < 2:
        raise ValueError(f"path must have shape [..., N, {field.m}] with N >= 2, got {shape_str(path)}")
    return path


def _piece_quads(path: Tensor, field: MetricField, quad_points: int) -> tuple[Tensor, Tensor]:
    r""":math:`\dot\gamma^\top G \dot\gamma` at the Gauss nodes of every piece, and the weights (inputs checked)."""
    path = _check_path(path, field)
    quad_points = check_int(quad_points, "quad_points", 1)
    dp = path[..., 1:, :] - path[..., :-1, :]  # (..., N-1, m)
    t, w = gauss_legendre(quad_points, path)
    nodes = path[..., :-1, None, :] + t[:, None] * dp.unsqueeze(-2)  # (..., N-1, Q, m)
    q = field.quad(nodes, dp.unsqueeze(-2).expand_as(nodes))  # (..., N-1, Q)
    return q, w


def path_length(path: Tensor, field: MetricField, quad_points: int = 4) -> Tensor:
    r"""Riemannian length of a polyline in a metric field.

    .. math:: L = \sum_{i=0}^{N-2} \int_0^1 \sqrt{\Delta_i^\top G(p_i + s \Delta_i) \Delta_i}\; ds,
              \qquad \Delta_i = p_{i+1} - p_i ,

    each piece by ``quad_points``-point Gauss--Legendre quadrature. The value
    does not depend on how the points are spaced along a given curve.

    Parameters
    ----------
    path : Tensor, shape [..., N, m]
        Polyline vertices, N >= 2.
    field : MetricField
    quad_points : int
        Gauss nodes per piece (>= 1).

    Returns
    -------
    Tensor, shape [...]
    """
    q, w = _piece_quads(path, field, quad_points)
    return (q.clamp_min(0).sqrt() * w).sum((-1, -2))


def path_energy(path: Tensor, field: MetricField, quad_points: int = 4) -> Tensor:
    r"""Discretised energy of a polyline traversed in unit time with equal time steps.

    .. math:: E = (N-1) \sum_{i=0}^{N-2} \int_0^1 \Delta_i^\top G(p_i + s \Delta_i) \Delta_i\; ds

    (the :math:`N-1` is :math:`1/\Delta t`). By Cauchy--Schwarz
    :math:`L^2 \le E`, with equality when every piece has the same length, so
    a minimiser of :math:`E` with fixed end points is a constant-speed
    approximation of a shortest path.

    Parameters
    ----------
    path, field, quad_points
        As in :func:`path_length`; the result has shape ``path.shape[:-2]``.
    """
    q, w = _piece_quads(path, field, quad_points)
    return (path.shape[-2] - 1) * (q * w).sum((-1, -2))


def straight_path(x: Tensor, y: Tensor, n_points: int) -> Tensor:
    r"""``n_points`` equally spaced points on the straight segment from ``x`` to ``y``.

    Equally spaced in the Euclidean sense; :func:`constant_speed` re-spaces
    them to equal Riemannian length in a metric field.

    Parameters
    ----------
    x, y : Tensor, shape [m]
        Start and end point (same dtype and device).
    n_points : int
        Number of points, end points included (>= 2).

    Returns
    -------
    Tensor, shape [n_points, m]
        Row ``k`` is :math:`(1 - t_k)\,x + t_k\,y` with
        :math:`t_k = k / (n_\text{points} - 1)`; the first row is ``x``, the
        last ``y``.
    """
    x, y = check_points(x, y)
    if x.dim() != 1 or y.dim() != 1:
        raise ValueError(f"x and y must be single points [m], got x {shape_str(x)} and y {shape_str(y)}")
    n_points = check_int(n_points, "n_points", 2)
    t = torch.linspace(0, 1, n_points, dtype=x.dtype, device=x.device).unsqueeze(-1)  # (N, 1)
    return (1 - t) * x + t * y


def constant_speed(path: Tensor, field: MetricField, n_points: int | None = None,
                   refine: int = 8, quad_points: int = 4) -> Tensor:
    """Re-space the vertices of a polyline so that all pieces have equal Riemannian length.

    The polyline is refined ``refine`` times, the cumulative length computed,
    and new vertices placed at equal arc length by linear interpolation of
    the fine vertices.

    Parameters
    ----------
    path : Tensor, shape [N, m]
    field : MetricField
    n_points : int, optional
        Number of output vertices (default: N).
    refine : int
        Sub-pieces per piece used to measure arc length (>= 1).
    quad_points : int

    Returns
    -------
    Tensor, shape [n_points, m]
    """
    path = _check_path(path, field)
    if path.dim() != 2:
        raise ValueError(f"path must be a single polyline [N, m], got {shape_str(path)}")
    refine = check_int(refine, "refine", 1)
    N, m = path.shape
    n_out = N if n_points is None else check_int(n_points, "n_points", 2)
    s = torch.linspace(0, 1, refine + 1, dtype=path.dtype, device=path.device)[:-1]  # (refine,)
    fine = path[:-1, None, :] + s[:, None] * (path[1:] - path[:-1])[:, None, :]  # (N-1, refine, m)
    fine = torch.cat([fine.reshape(-1, m), path[-1:]], dim=0)  # (F, m)
    q, w = _piece_quads(fine, field, quad_points)
    seg = (q.clamp_min(0).sqrt() * w).sum(-1)  # (F-1,)
    cum = torch.cat([seg.new_zeros(1), seg.cumsum(0)])  # (F,)
    target = torch.linspace(0, 1, n_out, dtype=path.dtype, device=path.device) * cum[-1]  # (n_out,)
    idx = torch.searchsorted(cum, target).clamp(1, cum.numel() - 1)  # (n_out,)
    c0, c1 = cum[idx - 1], cum[idx]
    frac = ((target - c0) / (c1 - c0).clamp_min(torch.finfo(path.dtype).tiny)).clamp(0, 1)
    out = fine[idx - 1] + frac.unsqueeze(-1) * (fine[idx] - fine[idx - 1])  # (n_out, m)
    out[0], out[-1] = path[0], path[-1]
    return out


def _minimise_energy(x: Tensor, y: Tensor, start: Tensor, field: MetricField, steps: int, method: str,
                     lr: float | None, quad_points: int) -> tuple[Tensor, int]:
    """Optimise the interior vertices of ``start`` [N, m] for the energy; returns (path, evaluations)."""
    inner = start[1:-1].detach().clone().requires_grad_(True)  # (N-2, m)
    n_evals = 0

    def full() -> Tensor:
        return torch.cat([x.unsqueeze(0), inner, y.unsqueeze(0)], dim=0)  # (N, m)

    def closure() -> Tensor:
        nonlocal n_evals
        n_evals += 1
        opt.zero_grad()
        E = path_energy(full(), field, quad_points)
        E.backward()
        return E

    with torch.enable_grad():
        if method == "lbfgs":
            opt = torch.optim.LBFGS([inner], lr=1.0 if lr is None else lr, max_iter=steps,
                                    max_eval=4 * steps, tolerance_grad=1e-12, tolerance_change=1e-15,
                                    history_size=20, line_search_fn="strong_wolfe")
            opt.step(closure)
        else:
            opt = torch.optim.Adam([inner], lr=1e-2 if lr is None else lr)
            for _ in range(steps):
                closure()
                opt.step()
    return full().detach(), n_evals


class ShortestPath(NamedTuple):
    """Result of :func:`shortest_path`.

    Parameters
    ----------
    path : Tensor, shape [n_points, m]
        The optimised polyline; its first and last rows are the end points.
    length : Tensor, shape []
        Its Riemannian length (:func:`path_length`): an upper bound on the
        geodesic distance, up to quadrature error.
    energy : Tensor, shape []
        Its discretised energy (:func:`path_energy`); ``length**2 <= energy``,
        with near equality when the path has constant speed.
    n_evals : int
        Number of energy evaluations spent, over all coarse-to-fine levels.
    """

    path: Tensor  #: shape [n_points, m], the optimised polyline (end points fixed)
    length: Tensor  #: scalar, its Riemannian length (:func:`path_length`)
    energy: Tensor  #: scalar, its discretised energy (:func:`path_energy`); length**2 <= energy
    n_evals: int  #: number of energy evaluations spent


def shortest_path(x: Tensor, y: Tensor, field: MetricField, n_points: int = 64, steps: int = 50, *,
                  method: str = "lbfgs", lr: float | None = None, quad_points: int = 4,
                  init: Tensor | None = None, coarse_to_fine: bool = True) -> ShortestPath:
    r"""Approximate a shortest path from ``x`` to ``y`` by minimising the discretised energy.

    The interior vertices of a polyline with ``n_points`` vertices are
    optimised (end points fixed) to minimise :func:`path_energy`. The
    minimiser of the energy is a constant-speed geodesic (a minimiser of the
    length, parametrised proportionally to arc length), so the returned
    ``length`` approximates the geodesic distance from above (up to the
    quadrature error of a polyline). The default start is the straight segment
    re-spaced to constant Riemannian speed (:func:`constant_speed`), whose
    energy equals its squared length; since the energy only decreases and
    :math:`L^2 \le E`, the result is never longer than the segment (up to
    round-off). Deterministic; nothing is printed.

    Parameters
    ----------
    x, y : Tensor, shape [m]
        End points.
    field : MetricField
    n_points : int
        Number of vertices, end points included (>= 3).
    steps : int
        LBFGS: maximum iterations per level; Adam: number of steps per level.
    method : {"lbfgs", "adam"}
    lr : float, optional
        Step size (default 1 for LBFGS with strong-Wolfe line search, 1e-2 for Adam).
    quad_points : int
        Gauss nodes per piece for length and energy.
    init : Tensor, shape [n_points, m], optional
        Starting polyline (its end points are replaced by ``x`` and ``y``); disables ``coarse_to_fine``.
    coarse_to_fine : bool
        Solve first with about 9 vertices, then repeatedly double the number of
        pieces (re-spacing the previous solution to constant speed) up to
        ``n_points``; ``steps`` applies to every level. The discrete energy is
        ill-conditioned (like a second difference, condition number
        :math:`\sim N^2`), and starting each level from the coarser solution
        needs far fewer iterations than starting the fine level from the segment.

    Returns
    -------
    ShortestPath
        ``(path [n_points, m], length [], energy [], n_evals)``.
    """
    x, y = check_points(x, y)
    if x.dim() != 1 or y.dim() != 1:
        raise ValueError(f"x and y must be single points [m], got x {shape_str(x)} and y {shape_str(y)}")
    if not isinstance(field, MetricField):
        raise ValueError(f"field must be a MetricField, got {type(field).__name__}")
    check_same(field.anchors, "field.anchors", [("x", x)])
    if x.shape[-1] != field.m:
        raise ValueError(f"x must have shape [{field.m}] (the field's dimension), got {shape_str(x)}")
    n_points = check_int(n_points, "n_points", 3)
    steps = check_int(steps, "steps", 1)
    if method not in ("lbfgs", "adam"):
        raise ValueError(f"method must be 'lbfgs' or 'adam', got {method!r}")
    if lr is not None and not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be a float > 0, got {lr!r}")
    if init is None:
        start = None  # set below
    else:
        init = check_tensor(init, "init", min_dim=2)
        check_same(x, "x", [("init", init)])
        if init.shape != (n_points, field.m):
            raise ValueError(f"init must have shape [{n_points}, {field.m}], got {shape_str(init)}")
        start = init.detach().clone()
        start[0], start[-1] = x, y
    if init is None and not coarse_to_fine:
        start = constant_speed(straight_path(x, y, n_points), field, quad_points=quad_points)
    x, y, field = x.detach(), y.detach(), field.detach()
    sizes = [n_points]
    if init is None and coarse_to_fine:
        while sizes[-1] > 9:
            sizes.append((sizes[-1] + 1) // 2 + 1)  # (n + 1)//2 + 1 vertices: about half the pieces
        sizes = sizes[::-1]
        start = constant_speed(straight_path(x, y, sizes[0]), field, quad_points=quad_points)
    n_evals, path = 0, start
    for level, size in enumerate(sizes):
        if level > 0:
            # the coarse solution, re-spaced to constant speed on the finer grid
            start = constant_speed(path, field, n_points=size, quad_points=quad_points)
        path, n = _minimise_energy(x, y, start, field, steps, method, lr, quad_points)
        n_evals += n
    with torch.no_grad():
        return ShortestPath(path, path_length(path, field, quad_points),
                            path_energy(path, field, quad_points), n_evals)
