"""Checks and quadrature shared by the two-point forms (``geodesics``) and metric fields (``fields``) (private).

A metric argument is a :class:`~riemannian_ref.geometry.metric.LowRankMetric`
or a dense SPD tensor ``[..., d, d]``; points are ``[..., d]``.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .._checks import broadcast_batch, check_same, check_tensor, shape_str
from .metric import LowRankMetric

__all__: list[str] = []


def check_metric(metric, name: str, d: int, like: Tensor):
    """Validate a metric argument: LowRankMetric or dense [..., d, d] tensor."""
    if isinstance(metric, LowRankMetric):
        check_same(like, "x", [(f"{name}.U", metric.U)])
        if metric.d != d:
            raise ValueError(f"{name} must be a metric on R^{d}, got a LowRankMetric with d = {metric.d}")
        return metric
    if isinstance(metric, Tensor):
        check_tensor(metric, name, min_dim=2)
        check_same(like, "x", [(name, metric)])
        if metric.shape[-2:] != (d, d):
            raise ValueError(f"{name} must have shape [..., {d}, {d}], got {shape_str(metric)}")
        return metric
    raise ValueError(f"{name} must be a LowRankMetric or a dense tensor [..., d, d], got {type(metric).__name__}")


def metric_batch(metric) -> torch.Size:
    return metric.batch_shape if isinstance(metric, LowRankMetric) else metric.shape[:-2]


def quad(metric, v: Tensor) -> Tensor:
    r""":math:`v^\top G v` for a LowRankMetric or a dense [..., d, d] tensor."""
    if isinstance(metric, LowRankMetric):
        return metric.quad(v)
    return torch.einsum("...i,...ij,...j->...", v, metric, v)


def check_points(x, y):
    x = check_tensor(x, "x", min_dim=1)
    y = check_tensor(y, "y", min_dim=1)
    check_same(x, "x", [("y", y)])
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"x and y must have the same last dimension d, got x {shape_str(x)} and y {shape_str(y)}")
    broadcast_batch({"x.shape[:-1]": x.shape[:-1], "y.shape[:-1]": y.shape[:-1]})
    return x, y


def gauss_legendre(n: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """Nodes and weights of n-point Gauss--Legendre quadrature on [0, 1]."""
    t, w = np.polynomial.legendre.leggauss(n)
    t = torch.as_tensor((t + 1.0) / 2.0, dtype=like.dtype, device=like.device)
    w = torch.as_tensor(w / 2.0, dtype=like.dtype, device=like.device)
    return t, w
