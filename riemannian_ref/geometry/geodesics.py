r"""Distances, curve lengths and geodesics for per-token metrics.

With one metric per token, "the distance between a query and a key" is a
modelling choice. This module computes three candidates for two points
:math:`x, y \in \mathbb{R}^m` carrying metrics :math:`G_x, G_y`:

* the **pair-metric distance** used by Riemannian attention,
  :math:`\sqrt{\delta^\top \bar G \delta}` with :math:`\delta = x - y` and
  :math:`\bar G` one of :math:`G_x`, :math:`G_y`, :math:`(G_x + G_y)/2`
  (:func:`pair_distance`);
* the **length of the straight segment** from :math:`y` to :math:`x` when the
  metric is interpolated linearly along it, :math:`G(t) = (1-t) G_y + t G_x`,

  .. math:: L_{\mathrm{seg}} = \int_0^1 \sqrt{\delta^\top G(t)\, \delta}\; dt

  (:func:`segment_length`, closed form or Gauss--Legendre quadrature);
* the **geodesic distance** of a metric field :math:`G(p)` over the whole
  space, the infimum of curve lengths
  :math:`\int_0^1 \sqrt{\dot\gamma^\top G(\gamma)\dot\gamma}\,dt` over curves
  with the given endpoints (:mod:`riemannian_ref.geometry.fields`:
  :class:`~riemannian_ref.geometry.fields.MetricField` and
  :func:`~riemannian_ref.geometry.fields.shortest_path`).

Because :math:`\sqrt{\cdot}` is concave and :math:`\delta^\top G(t)\delta` is
affine in :math:`t`, Jensen's inequality gives
:math:`L_{\mathrm{seg}} \le \sqrt{\delta^\top \tfrac{G_x+G_y}{2}\delta}`; and
the geodesic is at most as long as any curve, the segment included.

A metric argument is either a :class:`~riemannian_ref.geometry.metric.LowRankMetric`
or a dense SPD tensor of shape ``[..., m, m]``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._checks import METRIC_SIDES, broadcast_batch, check_int
from ._paths import check_metric, check_points, gauss_legendre, metric_batch, quad

__all__ = ["pair_distance", "segment_length"]



# ------------------------------------------------------------ two-point forms
def _pair(x, y, metric_x, metric_y):
    """Checked points and metrics: ``(x - y, metric_x, metric_y)``, batch dimensions broadcasting."""
    x, y = check_points(x, y)
    d = x.shape[-1]
    metric_x = check_metric(metric_x, "metric_x", d, x)
    metric_y = check_metric(metric_y, "metric_y", d, x)
    broadcast_batch({"x.shape[:-1]": x.shape[:-1], "y.shape[:-1]": y.shape[:-1],
                     "metric_x batch": metric_batch(metric_x), "metric_y batch": metric_batch(metric_y)})
    return x - y, metric_x, metric_y  # delta: (..., d)


def pair_distance(x: Tensor, y: Tensor, metric_x, metric_y, metric_side: str = "mean") -> Tensor:
    r"""The pair-metric distance :math:`\sqrt{\delta^\top \bar G \delta}` of Riemannian attention.

    Parameters
    ----------
    x : Tensor, shape [..., d]
        The query point (plays :math:`q_i`).
    y : Tensor, shape [..., d]
        The key point (plays :math:`k_j`).
    metric_x, metric_y : LowRankMetric or Tensor of shape [..., d, d]
        Metrics carried by ``x`` and ``y``; batch shapes broadcast with the points'.
    metric_side : {"mean", "query", "key"}
        :math:`\bar G = (G_x + G_y)/2`, :math:`G_x` or :math:`G_y`.

    Returns
    -------
    Tensor, shape [...]
        :math:`\sqrt{\delta^\top \bar G \delta}` with :math:`\delta = x - y`.
    """
    if metric_side not in METRIC_SIDES:
        raise ValueError(f"metric_side must be one of {METRIC_SIDES}, got {metric_side!r}")
    delta, metric_x, metric_y = _pair(x, y, metric_x, metric_y)
    if metric_side == "query":
        q2 = quad(metric_x, delta)
    elif metric_side == "key":
        q2 = quad(metric_y, delta)
    else:
        q2 = 0.5 * (quad(metric_x, delta) + quad(metric_y, delta))
    return q2.clamp_min(0).sqrt()


def segment_length(x: Tensor, y: Tensor, metric_x, metric_y, method: str = "closed_form",
                   n_points: int = 64) -> Tensor:
    r"""Length of the straight segment from ``y`` to ``x`` under the linearly interpolated metric.

    .. math::
        L_{\mathrm{seg}} = \int_0^1 \sqrt{\delta^\top \big((1-t) G_y + t G_x\big) \delta}\; dt,
        \qquad \delta = x - y .

    The squared speed :math:`f(t) = (1-t)a + tb` with :math:`a = \delta^\top G_y \delta`,
    :math:`b = \delta^\top G_x \delta` is affine, so the integral has the closed form

    .. math::
        L_{\mathrm{seg}} = \tfrac23\,\frac{b^{3/2} - a^{3/2}}{b - a}
        = \tfrac23\,\frac{a + \sqrt{ab} + b}{\sqrt a + \sqrt b},

    the second form free of cancellation when :math:`a \approx b`. The quantity
    is symmetric in the pair and, by Jensen's inequality, at most
    ``pair_distance(x, y, metric_x, metric_y, "mean")``.

    Parameters
    ----------
    x, y : Tensor, shape [..., d]
        End points (query and key).
    metric_x, metric_y : LowRankMetric or Tensor of shape [..., d, d]
        Metrics at the end points.
    method : {"closed_form", "quadrature"}
        The closed form above, or ``n_points``-point Gauss--Legendre
        quadrature of the integral (a check; it converges slowly when
        :math:`\min(a, b) \ll \max(a, b)`, where the integrand behaves like
        :math:`\sqrt t` at one end).
    n_points : int
        Quadrature nodes (>= 1), for ``method="quadrature"``.

    Returns
    -------
    Tensor, shape [...]
    """
    if method not in ("closed_form", "quadrature"):
        raise ValueError(f"method must be 'closed_form' or 'quadrature', got {method!r}")
    n_points = check_int(n_points, "n_points", 1)
    delta, metric_x, metric_y = _pair(x, y, metric_x, metric_y)
    a = quad(metric_y, delta).clamp_min(0)  # squared speed at t = 0   (...)
    b = quad(metric_x, delta).clamp_min(0)  # squared speed at t = 1   (...)
    if method == "closed_form":
        sa, sb = a.sqrt(), b.sqrt()
        den = sa + sb
        # 0/0 only when delta = 0 (then the length is 0)
        return torch.where(den > 0, (2.0 / 3.0) * (a + sa * sb + b) / den.clamp_min(torch.finfo(x.dtype).tiny),
                           torch.zeros_like(den))
    t, w = gauss_legendre(n_points, x)
    vals = ((1 - t) * a.unsqueeze(-1) + t * b.unsqueeze(-1)).clamp_min(0).sqrt()  # (..., n_points)
    return (vals * w).sum(-1)
