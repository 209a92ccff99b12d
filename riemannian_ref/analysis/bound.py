r"""The one-layer collapse bound of chapter 9, and the map it bounds.

Near consensus, token states are :math:`X = \mathbf 1 \bar x^\top + R` with
a small residual, measured by :math:`\rho(X) = \max_i |x_i - \bar x|`
(:func:`~riemannian_ref.analysis.measures.token_radius`). Chapter 9 proves
that one bidirectional attention layer maps it to
:math:`\rho(Y) \le C\,\rho(X)^p`, with :math:`p = 3` for dot products and for
metrics computed from the token states, and :math:`p = 2` for a metric field
over positions.

- :func:`collapse_bound`: the exponent :math:`p` and the explicit constant
  :math:`C` of a given :class:`~riemannian_ref.RiemannianAttention`
  (trivial connection, no mask).
- :func:`collapse_map`: the layer applied along one ray
  :math:`\mathbf 1 \bar x^\top + \varepsilon R`, returning
  :math:`\rho` in and out, so that the exponent and the constant can be
  measured and compared with the bound.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .._checks import check_tensor, shape_str
from .measures import token_radius

__all__ = ["collapse_bound", "collapse_map"]


def _attention_parts(attn):
    """Per head: the frames Q_h, K_h [D, d], the value-output maps M_h [D, D], and the scale."""
    from ..attention.layer import RiemannianAttention

    if not isinstance(attn, RiemannianAttention):
        raise ValueError(f"attn must be a RiemannianAttention, got {type(attn).__name__}")
    cfg = attn.config
    if cfg.cross_attention:
        raise ValueError("attn must be a self-attention module (cross_attention=False)")
    if cfg.connection_resolved != "trivial":
        raise ValueError(f"the collapse bound covers connection='trivial' only (a transport does not vanish "
                         f"with the residual), got connection={cfg.connection!r}")
    h, dv = cfg.n_heads, cfg.v_dim
    V = attn.v_proj.weight.view(h, dv, -1)  # (h, dv, D)
    O = attn.out_proj.weight.view(-1, h, dv).transpose(0, 1)  # (h, D, dv)
    M = O @ V  # value then output map of each head, acting on column vectors   (h, D, D)
    return attn.w_q, attn.w_k, M, 1.0 / math.sqrt(cfg.qk_dim)


def _spec(A: Tensor) -> Tensor:
    return torch.linalg.matrix_norm(A, ord=2)


@torch.no_grad()
def collapse_bound(attn, center: Tensor, radius: float, *, n: int | None = None) -> tuple[int, Tensor]:
    r"""The one-layer bound :math:`\rho(Y) \le C\,\rho(X)^p` of chapter 9 for one attention layer.

    For states :math:`X = \mathbf 1 \bar x^\top + R` with mean row
    :math:`\bar x` = ``center`` and :math:`\rho(X) \le \varepsilon` =
    ``radius`` (:func:`~riemannian_ref.analysis.measures.token_radius`),
    the output :math:`Y` of ``attn`` satisfies :math:`\rho(Y) \le C \rho(X)^p` with

    .. math::
        C = \sum_h 4\,\|M_h\|_2\,\kappa_h\, e^{2\kappa_h \varepsilon^2},\qquad p = 3,

    when the metrics are computed from the token states (Euclidean, distance,
    shared, per-token with or without bias, any side): :math:`M_h` is head
    :math:`h`'s value-then-output map and :math:`\kappa_h \varepsilon^2`
    bounds the :math:`i`-:math:`j` coupling of its scores,
    :math:`\kappa_h = \sigma\|W_Q^h \bar G_h W_K^{h\top}\| + \beta_h`
    (:math:`\sigma = 1/\sqrt d`, :math:`\bar G_h` the metric at ``center``,
    :math:`I` for dot products, :math:`\beta_h` the metric-variation term of
    the theorem, zero for a metric that does not depend on the state); all
    norms are spectral. For a metric field over positions
    (``metric="position"``) the coupling is first order,
    :math:`|e_{ij}| \le \kappa_{1,h}\varepsilon + \kappa_{2,h}\varepsilon^2`,
    and the bound is quadratic: :math:`p = 2`,
    :math:`C = \sum_h 4\|M_h\|(\kappa_{1,h} + \kappa_{2,h}\varepsilon)\,
    e^{2(\kappa_{1,h}\varepsilon + \kappa_{2,h}\varepsilon^2)}`.

    Parameters
    ----------
    attn : RiemannianAttention
        A self-attention module with the trivial connection and no mask
        (a layer with ``causal=True`` is refused: its map is linear), dot-product or with metrics of ``metric_form="factor"``
        (or rank 0); the bounded ``"gains"`` form (the default) is refused:
        its constant is not implemented.
    center : Tensor, shape [D]
        The mean token :math:`\bar x`.
    radius : float
        :math:`\varepsilon \ge \rho(X)`; the bound holds for every input with
        this mean and at most this radius.
    n : int, optional
        Sequence length; needed only for ``metric="position"`` (the
        positions ``0..n-1`` whose metrics enter the constant).

    Returns
    -------
    p : int
        3, or 2 for a metric field over positions.
    C : Tensor, shape []
        The constant, in ``center``'s dtype.
    """
    Q, K, M, sigma = _attention_parts(attn)
    cfg = attn.config
    if getattr(cfg, "causal", False):
        raise ValueError("collapse_bound assumes no mask, but this layer has causal=True: with a causal "
                         "mask the one-layer map is linear, not cubic (chapter 9, prop-causal); measure it "
                         "with collapse_map, or build the layer with causal=False")
    center = check_tensor(center, "center", min_dim=1)
    if center.shape != (cfg.d_model,):
        raise ValueError(f"center must have shape [{cfg.d_model}], got {shape_str(center)}")
    if isinstance(radius, bool) or not isinstance(radius, (int, float)) or not (radius >= 0 and math.isfinite(radius)):
        raise ValueError(f"radius must be a finite number >= 0, got {radius!r}")
    eps = float(radius)
    dt = center.dtype
    Q, K, M = Q.to(dt), K.to(dt), M.to(dt)
    q, k, m = _spec(Q), _spec(K), _spec(M)  # (h,) each
    if cfg.scores == "dot":
        kappa = sigma * _spec(Q @ K.transpose(-1, -2))  # e_ij = sigma r_i^T Q K^T r_j
        return 3, (4 * m * kappa * torch.exp(2 * kappa * eps ** 2)).sum()
    net = attn.metric
    h, d, r = cfg.n_heads, cfg.qk_dim, cfg.rank
    if r > 0 and net.form != "factor":
        raise ValueError(f"collapse_bound computes the constant of metrics in the factor form "
                         f"G = lam I + U U^T with U = W x + b; this layer has metric_form={net.form!r} "
                         f"(orthonormalised directions with bounded gains, whose Lipschitz constant is not "
                         f"implemented here): build it with metric_form='factor', or measure the map with "
                         f"collapse_map")
    t = attn.log_temp.exp().to(dt) if attn.log_temp is not None else torch.ones(h, dtype=dt)
    lam = net.lam().to(dt) * t  # (h,)
    c = torch.einsum("hDd,D->hd", Q - K, center).norm(dim=-1)  # |(Q - K)^T xbar|   (h,)
    side = cfg.metric_side
    if cfg.metric == "position":
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= net.n_positions:
            raise ValueError(f"n must be an int in [1, {net.n_positions}] for metric='position', got {n!r}")
        U = net.U_pos[:n].to(dt).transpose(0, 1) * t.sqrt().view(h, 1, 1, 1)  # (h, n, d, r)
        G = lam.view(h, 1, 1, 1) * torch.eye(d, dtype=dt) + U @ U.transpose(-1, -2)  # (h, n, d, d)
        g = _spec(Q.unsqueeze(1) @ G @ K.transpose(-1, -2).unsqueeze(1)).amax(-1)  # max_p |Q G_p K^T|
        phi = _spec(G - G.mean(1, keepdim=True)).amax(-1)  # max_p |G_p - G_ref|, G_ref the mean
        if side == "key":
            k1, k2 = sigma * phi * c * q, sigma * g + sigma / 2 * phi * q ** 2
        elif side == "query":
            k1, k2 = sigma * phi * c * k, sigma * g + sigma / 2 * phi * k ** 2
        else:
            k1 = sigma * phi * c * (q + k) / 2
            k2 = sigma * g + sigma / 4 * phi * (q ** 2 + k ** 2)
        eta = k1 * eps + k2 * eps ** 2
        return 2, (4 * m * (k1 + k2 * eps) * torch.exp(2 * eta)).sum()
    if cfg.metric == "shared" or r == 0:
        U = net.U.to(dt) if net.U is not None else torch.zeros(h, d, 0, dtype=dt)  # (h, d, r)
        Ubar, L_U = U * t.sqrt().view(h, 1, 1), torch.zeros(h, dtype=dt)
    else:
        proj = getattr(net, "proj", None)
        if not isinstance(proj, torch.nn.Linear):
            raise ValueError(
                "collapse_bound needs the metric network's factor map to be one linear layer "
                f"(MetricNet.proj, an nn.Linear), got {type(proj).__name__}: the certificate uses "
                "its weight's spectral norm as the Lipschitz constant of x -> U(x)")
        W = proj.weight.to(dt).view(h, d * r, -1)  # (h, d r, D)
        b = net.proj.bias.to(dt).view(h, d * r) if net.proj.bias is not None else torch.zeros(h, d * r, dtype=dt)
        Ubar = ((W @ center) + b).view(h, d, r) * t.sqrt().view(h, 1, 1)  # U(xbar)   (h, d, r)
        L_U = _spec(W) * t.sqrt()  # Lipschitz constant of x -> U_h(x), Frobenius to 2-norm
    u = _spec(Ubar)
    L_G = L_U * (2 * u + L_U * eps)  # |G(x) - G(xbar)| <= L_G |x - xbar| on the ball
    Gbar = lam.view(h, 1, 1) * torch.eye(d, dtype=dt) + Ubar @ Ubar.transpose(-1, -2)  # (h, d, d)
    QGK = _spec(Q @ Gbar @ K.transpose(-1, -2))  # (h,)
    beta_key = sigma / 2 * L_G * q * (2 * c + 2 * k * eps + q * eps)
    beta_query = sigma / 2 * L_G * k * (2 * c + 2 * q * eps + k * eps)
    beta = {"key": beta_key, "query": beta_query, "mean": (beta_key + beta_query) / 2}[side]
    kappa = sigma * QGK + beta
    return 3, (4 * m * kappa * torch.exp(2 * kappa * eps ** 2)).sum()


@torch.no_grad()
def collapse_map(attn, center: Tensor, direction: Tensor, eps: Tensor) -> tuple[Tensor, Tensor]:
    r"""One attention layer applied to :math:`X(\varepsilon) = \mathbf 1 \bar x^\top + \varepsilon R`.

    Parameters
    ----------
    attn : torch.nn.Module
        Self-attention: ``attn(X)`` returns ``(Y, weights)`` for ``X`` [B, n, D]
        (a :class:`~riemannian_ref.RiemannianAttention`).
    center : Tensor, shape [D]
        The mean token :math:`\bar x`.
    direction : Tensor, shape [n, D]
        The residual direction :math:`R`; it is centred (its mean row
        removed) and scaled to :math:`\rho(R) = 1`.
    eps : Tensor, shape [k]
        The radii :math:`\varepsilon`.

    Returns
    -------
    rho_in, rho_out : Tensor, shape [k]
        :func:`~riemannian_ref.analysis.measures.token_radius` of each input
        (equal to ``eps`` up to rounding) and of its output.
    """
    center = check_tensor(center, "center", min_dim=1)
    direction = check_tensor(direction, "direction", min_dim=2)
    eps = check_tensor(eps, "eps", min_dim=1)
    if center.dim() != 1 or direction.dim() != 2 or direction.shape[-1] != center.shape[0] or eps.dim() != 1:
        raise ValueError(f"center must be [D], direction [n, D] and eps [k], got {shape_str(center)}, "
                         f"{shape_str(direction)} and {shape_str(eps)}")
    R = direction - direction.mean(0, keepdim=True)
    scale = token_radius(R)
    if not scale > 0:
        raise ValueError("direction must have rows that are not all equal")
    X = center + eps.view(-1, 1, 1) * (R / scale)  # (k, n, D)
    Y = attn(X)[0]
    return token_radius(X), token_radius(Y)
