r"""Drawing 2-D metrics: unit balls as ellipses, metric fields, paths.

The unit ball of a metric :math:`G` on :math:`\mathbb{R}^2`,
:math:`\{v : v^\top G v \le 1\}`, is an ellipse whose semi-axes point along
the eigenvectors of :math:`G` with lengths :math:`1/\sqrt{\mu_i}` for the
eigenvalues :math:`\mu_i`: a direction in which the metric measures vectors
as long is a direction in which the unit ball is short.

matplotlib is imported inside the functions that draw, so the package does
not depend on it; every helper returns what it drew (artists or a figure)
and never calls ``plt.show()``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .geometry.metric import LowRankMetric

__all__ = ["draw_metric_field", "draw_path"]


def _as_dense_2x2(G) -> Tensor:
    if isinstance(G, LowRankMetric):
        G = G.dense()
    G = torch.as_tensor(G).detach().to("cpu", torch.float64)
    if G.shape[-2:] != (2, 2):
        raise ValueError(f"G must be a 2 x 2 metric (or a batch [..., 2, 2]), got shape {list(G.shape)}")
    return G


def ellipse_params(G, scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    r"""Width, height and angle of the ellipse :math:`\{v : v^\top G v \le \mathrm{scale}^2\}`.

    Parameters
    ----------
    G : Tensor or array, shape [..., 2, 2], or LowRankMetric with d = 2
        Symmetric positive-definite.
    scale : float
        Radius of the ball (1 for the unit ball).

    Returns
    -------
    width : Tensor, shape [...]
        Full length of the axis along the first eigenvector (smallest eigenvalue):
        :math:`2\,\mathrm{scale}/\sqrt{\mu_{\min}}`.
    height : Tensor, shape [...]
        :math:`2\,\mathrm{scale}/\sqrt{\mu_{\max}}`.
    angle : Tensor, shape [...]
        Angle of the first eigenvector from the x-axis, in degrees (matplotlib's convention).
    """
    G = _as_dense_2x2(G)
    G = 0.5 * (G + G.transpose(-1, -2))
    mu, V = torch.linalg.eigh(G)  # ascending eigenvalues   (..., 2), (..., 2, 2)
    if not (mu > 0).all():
        raise ValueError(f"G must be positive definite, got eigenvalues as small as {mu.min().item():.3g}")
    width = 2 * scale / mu[..., 0].sqrt()
    height = 2 * scale / mu[..., 1].sqrt()
    angle = torch.rad2deg(torch.atan2(V[..., 1, 0], V[..., 0, 0]))
    return width, height, angle


def metric_ellipse(ax, center, G, scale: float = 1.0, **kwargs):
    r"""Add the ellipse :math:`\{c + v : v^\top G v \le \mathrm{scale}^2\}` to ``ax``.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    center : sequence of 2 floats or Tensor [2]
    G : Tensor or array [2, 2], or LowRankMetric with d = 2
    scale : float
    **kwargs
        Passed to :class:`matplotlib.patches.Ellipse` (default: unfilled, dark edge).

    Returns
    -------
    matplotlib.patches.Ellipse
    """
    from matplotlib.patches import Ellipse

    G = _as_dense_2x2(G)
    if G.dim() != 2:
        raise ValueError(f"G must be a single 2 x 2 metric, got shape {list(G.shape)}")
    c = torch.as_tensor(center).detach().to("cpu", torch.float64).flatten()
    if c.numel() != 2:
        raise ValueError(f"center must have 2 coordinates, got {c.numel()}")
    w, h, a = ellipse_params(G, scale)
    style = {"fill": False, "edgecolor": "k", "linewidth": 1.0}
    style.update(kwargs)
    patch = Ellipse((float(c[0]), float(c[1])), float(w), float(h), angle=float(a), **style)
    ax.add_patch(patch)
    return patch


def draw_metric_field(ax, points, metrics, scale: float = 1.0, color=None, **kwargs) -> list:
    r"""Draw one metric ellipse per point.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    points : Tensor or array, shape [n, 2]
    metrics : Tensor or array [n, 2, 2], or LowRankMetric with batch [n] and d = 2
    scale : float
        Radius of the drawn balls (choose it so that neighbouring ellipses do not overlap).
    color : str or sequence of n colours, optional
        Edge colour: one matplotlib colour string for all, or one colour per point.
    **kwargs
        Passed to :func:`metric_ellipse`.

    Returns
    -------
    list of matplotlib.patches.Ellipse
    """
    P = torch.as_tensor(points).detach().to("cpu", torch.float64)
    G = _as_dense_2x2(metrics)
    if P.dim() != 2 or P.shape[-1] != 2:
        raise ValueError(f"points must have shape [n, 2], got {list(P.shape)}")
    if G.shape[:-2] != P.shape[:1]:
        raise ValueError(f"metrics must have shape [n, 2, 2] with n = {P.shape[0]}, got {list(G.shape)}")
    n = P.shape[0]
    if color is None or isinstance(color, str):
        colors = [color] * n
    else:
        colors = list(color)
        if len(colors) != n:
            raise ValueError(f"color must be one colour or n = {n} colours, got {len(colors)}")
    out = []
    for i in range(n):
        kw = dict(kwargs)
        if colors[i] is not None:
            kw["edgecolor"] = colors[i]
        out.append(metric_ellipse(ax, P[i], G[i], scale, **kw))
    ax.update_datalim(P.numpy())
    ax.autoscale_view()
    return out


def draw_path(ax, path, **kwargs):
    """Plot a polyline through the rows of ``path`` on ``ax``.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    path : Tensor or array, shape [N, 2]
        Vertices in order (e.g. ``shortest_path(...).path``); detached and
        copied to the CPU for drawing.
    **kwargs
        Passed to :meth:`matplotlib.axes.Axes.plot` (colour, line style, markers, label).

    Returns
    -------
    matplotlib.lines.Line2D
        The drawn line.
    """
    P = torch.as_tensor(path).detach().to("cpu", torch.float64)
    if P.dim() != 2 or P.shape[-1] != 2:
        raise ValueError(f"path must have shape [N, 2], got {list(P.shape)}")
    (line,) = ax.plot(P[:, 0].numpy(), P[:, 1].numpy(), **kwargs)
    return line
