r"""Intrinsic query-key rank: a linear-attention surrogate with a known answer.

A single attention head whose queries :math:`x_i` read a context of
:math:`n` tokens :math:`c_j`, with values equal to the context tokens, outputs

.. math::
    y_i = \sum_j a(x_i, c_j)\, c_j,

    a_{\text{lin}}(x_i, c_j) = \tfrac1n\, x_i^\top W c_j, \qquad
    a_{\text{soft}} = \mathrm{softmax}_j\big(x_i^\top W c_j / \sqrt d\big),

where :math:`W = W_Q W_K^\top` is the query-key kernel. A *teacher* kernel
:math:`W^\star` of rank :math:`r^\star` defines a task whose intrinsic rank
is :math:`r^\star` by construction; a student :math:`W = A B^\top` of rank
:math:`r` is trained to imitate it.

For the linear head everything is explicit. Writing
:math:`C = \tfrac1n \sum_j c_j c_j^\top`, the output is
:math:`y_i = C W^\top x_i`, and for independent Gaussian queries and context
tokens (:math:`N(0, I_d)`) the population risk of a student is

.. math::
    R(W) = \mathbb{E}\,\|C (W - W^\star)^\top x\|^2
         = \Big(1 + \frac{d + 1}{n}\Big)\, \|W - W^\star\|_F^2 ,

because :math:`\mathbb{E}[C^2] = (1 + (d+1)/n) I` for a Wishart matrix
independent of the query. (Were the queries part of the context, the
dependence would add terms in the symmetric part of :math:`W - W^\star`,
and Eckart-Young would no longer give the optimum.) By
Eckart-Young, the best rank-:math:`r` student therefore has excess risk
:math:`(1 + (d+1)/n)\sum_{k > r} \sigma_k(W^\star)^2`: positive below
:math:`r^\star`, zero from :math:`r^\star` on. These are the *deficiency*
and *achievability* halves of the Entropic Bound in this surrogate (see the
intrinsic-rank paper cited in the book); :func:`fit_low_rank_kernel` shows the third,
*recovery* by gradient descent (a full-batch least-squares fit of the
surrogate's two factors, not a model training loop).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .._checks import check_choice, check_int, check_number, check_tensor, shape_str
from .measures import energy_effective_rank

__all__ = ["teacher_kernel", "kernel_attention", "fit_low_rank_kernel"]

_KINDS = ("linear", "softmax")


def _check_kind(kind: str) -> None:
    if kind not in _KINDS:
        raise ValueError(f"attention must be one of {_KINDS}, got {kind!r}")


def teacher_kernel(d: int, r_star: int, *, spectrum: str = "flat", scale: float = 1.0,
                   generator: torch.Generator | None = None, dtype=torch.float64) -> Tensor:
    r"""A random query-key kernel :math:`W^\star = P\,\mathrm{diag}(\sigma)\,Q^\top` of rank ``r_star``.

    Parameters
    ----------
    d : int
        Head dimension.
    r_star : int
        Rank, ``0 <= r_star <= d``.
    spectrum : {"flat", "decaying"}
        ``"flat"``: all nonzero singular values equal ``scale``;
        ``"decaying"``: :math:`\sigma_k = \text{scale}\cdot 2^{-(k-1)/2}`.
    scale : float
        Size of the largest singular value, finite and > 0.
    generator : torch.Generator, optional
        CPU generator for the random orthonormal frames.

    Returns
    -------
    Tensor, shape [d, d]
    """
    check_int(d, "d", 1)
    if isinstance(r_star, bool) or not isinstance(r_star, int) or not 0 <= r_star <= d:
        raise ValueError(f"r_star must be an int in [0, d] = [0, {d}], got {r_star!r}")
    check_choice(spectrum, "spectrum", ("flat", "decaying"))
    check_number(scale, "scale", low=0.0, low_open=True)
    P, _ = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=dtype))
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=dtype))
    k = torch.arange(r_star, dtype=dtype)
    sigma = torch.full((r_star,), scale, dtype=dtype) if spectrum == "flat" else scale * 2.0 ** (-k / 2)
    return (P[:, :r_star] * sigma) @ Q[:, :r_star].T


def _check_pair(Xq: Tensor, Xc: Tensor) -> None:
    check_tensor(Xq, "Xq", min_dim=2)
    check_tensor(Xc, "Xc", min_dim=2)
    if Xq.dim() != Xc.dim() or Xq.shape[:-2] != Xc.shape[:-2] or Xq.shape[-1] != Xc.shape[-1]:
        raise ValueError(
            f"Xq [..., m, d] and Xc [..., n, d] must share batch dims and d, got {shape_str(Xq)} and {shape_str(Xc)}"
        )
    if Xq.dtype != Xc.dtype or Xq.device != Xc.device:
        raise ValueError(f"Xc ({Xc.dtype}, {Xc.device}) must match Xq ({Xq.dtype}, {Xq.device})")


def kernel_attention(Xq: Tensor, Xc: Tensor, W: Tensor, *, attention: str = "linear") -> Tensor:
    r"""One head with query-key kernel ``W``; queries read a context, values are the context.

    Parameters
    ----------
    Xq : Tensor, shape [..., m, d]
        Query tokens.
    Xc : Tensor, shape [..., n, d]
        Context tokens (keys and values).
    W : Tensor, shape [d, d]
        Query-key kernel :math:`W_Q W_K^\top`.
    attention : {"linear", "softmax"}
        Linear: weights :math:`x_i^\top W c_j / n`; softmax: row softmax of
        :math:`x_i^\top W c_j/\sqrt d`.

    Returns
    -------
    Tensor, shape [..., m, d]
    """
    _check_kind(attention)
    _check_pair(Xq, Xc)
    W = check_tensor(W, "W", min_dim=2)
    d = Xq.shape[-1]
    if W.shape != (d, d):
        raise ValueError(f"W must have shape [d, d] = [{d}, {d}] to match Xq {shape_str(Xq)}, got {shape_str(W)}")
    if W.dtype != Xq.dtype or W.device != Xq.device:
        raise ValueError(f"W ({W.dtype}, {W.device}) must match Xq ({Xq.dtype}, {Xq.device})")
    S = Xq @ W @ Xc.transpose(-1, -2)  # (..., m, n)
    if attention == "linear":
        A = S / Xc.shape[-2]
    else:
        A = torch.softmax(S / math.sqrt(d), dim=-1)
    return A @ Xc


def population_risk(W: Tensor, W_star: Tensor, n: int) -> Tensor:
    r"""Exact population risk of a linear head for Gaussian tokens.

    :math:`R(W) = (1 + (d+1)/n)\,\|W - W^\star\|_F^2` (per query token, summed
    over output coordinates).

    Parameters
    ----------
    W, W_star : Tensor, shape [d, d]
    n : int
        Sequence length.

    Returns
    -------
    Tensor, shape []
    """
    if W.shape != W_star.shape or W.dim() != 2 or W.shape[0] != W.shape[1]:
        raise ValueError(f"W and W_star must both have shape [d, d], got {shape_str(W)} and {shape_str(W_star)}")
    d = W.shape[-1]
    return (1.0 + (d + 1) / n) * ((W - W_star) ** 2).sum()


def best_rank_risk(W_star: Tensor, r: int, n: int) -> Tensor:
    r"""Smallest population risk of any rank-``r`` linear head (Eckart-Young).

    :math:`(1 + (d+1)/n)\sum_{k>r}\sigma_k(W^\star)^2`; zero for
    :math:`r \ge \mathrm{rank}\,W^\star`.

    Parameters
    ----------
    W_star : Tensor, shape [d, d]
    r : int
        Student rank, ``r >= 0``.
    n : int
        Sequence length.

    Returns
    -------
    Tensor, shape []
    """
    if not isinstance(r, int) or r < 0:
        raise ValueError(f"r must be an int >= 0, got {r!r}")
    d = W_star.shape[-1]
    s = torch.linalg.svdvals(W_star)
    return (1.0 + (d + 1) / n) * (s[r:] ** 2).sum()


def kernel_statistic(Xq: Tensor, Xc: Tensor, Y: Tensor) -> Tensor:
    r"""A data-only estimate of the query-key kernel, before any training.

    For a linear head, :math:`C^{-1} y_i = W^{\star\top} x_i` exactly, where
    :math:`C` is the context's own second-moment matrix. Regressing
    :math:`C^{-1} y_i` on :math:`x_i` by least squares over all queries
    returns :math:`W^\star` exactly (without noise). For a softmax head the
    same statistic is a distorted, input-conditioned summary of the kernel;
    that is where data-only estimation becomes partial.

    Parameters
    ----------
    Xq : Tensor, shape [B, m, d]
        Queries.
    Xc : Tensor, shape [B, n, d]
        Contexts (``n >= d`` so that every :math:`C` is invertible).
    Y : Tensor, shape [B, m, d]
        The head's outputs.

    Returns
    -------
    Tensor, shape [d, d]
        The estimate :math:`\widehat W` (same orientation as ``W``).
    """
    _check_pair(Xq, Xc)
    Y = check_tensor(Y, "Y", min_dim=3)
    if Xq.dim() != 3 or Y.shape != Xq.shape:
        raise ValueError(f"Xq and Y must both have shape [B, m, d], got {shape_str(Xq)} and {shape_str(Y)}")
    B, m, d = Xq.shape
    n = Xc.shape[-2]
    if n < d:
        raise ValueError(f"need context length n >= d for invertible C, got n = {n}, d = {d}")
    C = Xc.transpose(-1, -2) @ Xc / n  # (B, d, d)
    Z = torch.linalg.solve(C, Y.transpose(-1, -2)).transpose(-1, -2)  # C^{-1} y_i   (B, m, d)
    # rows z_i^T = x_i^T W: least squares for W over all B * m queries
    return torch.linalg.lstsq(Xq.reshape(B * m, d), Z.reshape(B * m, d)).solution


@dataclass
class FitConfig:
    r"""Training settings for :func:`fit_low_rank_kernel`.

    Parameters
    ----------
    steps : int, default 400
        Number of full-batch Adam updates (the loss is evaluated once more
        after the last one).
    lr : float, default 0.05
        Adam learning rate.
    init_scale : float, default 1e-3
        Standard deviation of the Gaussian entries of the initial factors
        :math:`A, B`, so that :math:`W = A B^\top` starts near zero: the
        small-initialisation regime in which gradient descent is biased
        towards low rank.
    log_every : int, default 20
        Record the training loss and the energy effective rank of :math:`W`
        every this many steps (and at the last step).
    attention : {"linear", "softmax"}, default "linear"
        The head the student is trained in (see :func:`kernel_attention`).
    """

    steps: int = 400  # full-batch optimiser steps
    lr: float = 0.05  # Adam learning rate
    init_scale: float = 1e-3  # small init: the regime of low-rank implicit bias
    log_every: int = 20  # record loss and effective rank every this many steps
    attention: str = "linear"  # "linear" or "softmax"


def fit_low_rank_kernel(Xq: Tensor, Xc: Tensor, Y: Tensor, r: int, config: FitConfig | None = None, *,
                        generator: torch.Generator | None = None) -> dict:
    r"""Fit a rank-``r`` kernel :math:`W = A B^\top` to a head's outputs by Adam.

    Parameters
    ----------
    Xq : Tensor, shape [B, m, d]
        Queries.
    Xc : Tensor, shape [B, n, d]
        Contexts.
    Y : Tensor, shape [B, m, d]
        Targets (a teacher head's outputs).
    r : int
        Student rank, ``1 <= r <= d``.
    config : FitConfig, optional
    generator : torch.Generator, optional
        CPU generator for the initial factors.

    Returns
    -------
    dict
        ``W`` (final kernel, [d, d]), ``steps`` (list of logged steps),
        ``loss`` (training MSE per token, list), ``erank`` (energy effective
        rank of ``W`` at those steps, list).
    """
    cfg = config or FitConfig()
    _check_kind(cfg.attention)
    _check_pair(Xq, Xc)
    if Y.shape != Xq.shape:
        raise ValueError(f"Y must have the shape of Xq {shape_str(Xq)}, got {shape_str(Y)}")
    X = Xq
    d = X.shape[-1]
    if not isinstance(r, int) or not 1 <= r <= d:
        raise ValueError(f"r must be an int in [1, d] = [1, {d}], got {r!r}")
    A = nn.Parameter(cfg.init_scale * torch.randn(d, r, generator=generator, dtype=X.dtype).to(X.device))
    Bf = nn.Parameter(cfg.init_scale * torch.randn(d, r, generator=generator, dtype=X.dtype).to(X.device))
    opt = torch.optim.Adam([A, Bf], lr=cfg.lr)
    hist = {"steps": [], "loss": [], "erank": []}
    for step in range(cfg.steps + 1):
        W = A @ Bf.T
        loss = ((kernel_attention(Xq, Xc, W, attention=cfg.attention) - Y) ** 2).sum(-1).mean()
        if step % cfg.log_every == 0 or step == cfg.steps:
            hist["steps"].append(step)
            hist["loss"].append(float(loss.detach()))
            hist["erank"].append(float(energy_effective_rank(W.detach())))
        if step == cfg.steps:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    hist["W"] = (A @ Bf.T).detach()
    return hist
