r"""Riemannian attention scores: the dense reference.

For query :math:`i` and key :math:`j`, with :math:`\Delta_{ij} = q_i - k_j`,

.. math::
    s_{ij} = -\frac{\text{scale}}{2}\, \Delta_{ij}^\top \bar G_{ij} \Delta_{ij},
    \qquad \bar G_{ij} \in \{G_j,\; G_i,\; (G_i + G_j)/2\}

for ``metric_side`` = ``"key"``, ``"query"``, ``"mean"``, with
:math:`G = \lambda I + U U^\top`. Expanding the square turns every term into a
matrix product, so no :math:`d\times d` matrix and no ``[n, n, d]``
difference tensor is ever formed:

.. math::
    \Delta^\top G_j \Delta = \lambda\big(|q_i|^2 + |k_j|^2 - 2 q_i\!\cdot\! k_j\big)
      + |U_j^\top q_i|^2 - 2\,(U_j^\top q_i)\!\cdot\!(U_j^\top k_j) + |U_j^\top k_j|^2 .

The pairwise products :math:`U_j^\top q_i` are one matmul of ``q`` with all
keys' factors side by side, ``r`` times the work of :math:`Q K^\top`. This
module materialises them (``[..., n_q, n_k, r]``); the blockwise operator in
:mod:`riemannian_ref.attention` does not.
"""
from __future__ import annotations

from torch import Tensor

from .._checks import check_score_inputs, shape_str

__all__ = ["riemannian_scores", "dot_product_form"]


def _lam_scores(lam: Tensor) -> Tensor:
    """lam of shape broadcastable to batch dims, made broadcastable to [..., n_q, n_k]."""
    return lam.unsqueeze(-1).unsqueeze(-1) if lam.dim() > 0 else lam


def _lowrank_term(q: Tensor, k: Tensor, U: Tensor, per_token: bool, side: str) -> Tensor:
    r""":math:`|U^\top (q_i - k_j)|^2` for every pair, shape [..., n_q, n_k]."""
    if not per_token:
        # One metric for all tokens: a Euclidean distance of projected vectors.
        qU = q @ U  # (..., n_q, r)
        kU = k @ U  # (..., n_k, r)
        return (qU * qU).sum(-1).unsqueeze(-1) + (kU * kU).sum(-1).unsqueeze(-2) - 2 * qU @ kU.transpose(-1, -2)
    r = U.shape[-1]
    if side == "key":
        n_k, d = U.shape[-3], U.shape[-2]
        a = (U * k.unsqueeze(-1)).sum(-2)  # U_j^T k_j                       (..., n_k, r)
        Uflat = U.transpose(-3, -2).reshape(*U.shape[:-3], d, n_k * r)  # (..., d, n_k r)
        P = (q @ Uflat).unflatten(-1, (n_k, r))  # U_j^T q_i                  (..., n_q, n_k, r)
        return (P * P).sum(-1) - 2 * (P * a.unsqueeze(-3)).sum(-1) + (a * a).sum(-1).unsqueeze(-2)
    n_q, d = U.shape[-3], U.shape[-2]
    b = (U * q.unsqueeze(-1)).sum(-2)  # U_i^T q_i                           (..., n_q, r)
    Uflat = U.transpose(-3, -2).reshape(*U.shape[:-3], d, n_q * r)  # (..., d, n_q r)
    P = (k @ Uflat).unflatten(-1, (n_q, r)).transpose(-3, -2)  # U_i^T k_j   (..., n_q, n_k, r)
    return (b * b).sum(-1).unsqueeze(-1) - 2 * (P * b.unsqueeze(-2)).sum(-1) + (P * P).sum(-1)


def riemannian_scores(q: Tensor, k: Tensor, U_q: Tensor | None = None, U_k: Tensor | None = None, *,
                      lam=1.0, metric_side: str = "key", scale: float | None = None) -> Tensor:
    r"""Riemannian attention scores :math:`s_{ij} = -\frac{\text{scale}}{2}\,(q_i-k_j)^\top \bar G_{ij} (q_i-k_j)`.

    Parameters
    ----------
    q : Tensor, shape [..., n_q, d]
        Queries.
    k : Tensor, shape [..., n_k, d]
        Keys.
    U_q : Tensor, shape [..., n_q, d, r] or [..., d, r], optional
        Metric factors of the queries (per token, or one shared metric), for
        ``metric_side`` ``"query"`` and ``"mean"``; None: no low-rank part.
    U_k : Tensor, shape [..., n_k, d, r] or [..., d, r], optional
        Metric factors of the keys, for ``"key"`` and ``"mean"``; None: no
        low-rank part (with no factor at all the metric is :math:`\lambda I`).
    lam : float or Tensor, shape broadcastable to ``q.shape[:-2]``
        Isotropic part :math:`\lambda > 0` (one per head, say).
    metric_side : {"key", "query", "mean"}
        Which metric measures the pair: :math:`G_j`, :math:`G_i` or
        :math:`(G_i + G_j)/2`.
    scale : float, optional
        Defaults to :math:`1/\sqrt{d}` (i.e. :math:`\tau = \sqrt d`).

    Returns
    -------
    Tensor, shape [..., n_q, n_k]
        Scores, to which masks are added before the softmax over keys.

    Notes
    -----
    Cost :math:`O(n_q n_k d (1 + r))` for one-sided metrics and
    :math:`O(n_q n_k d (1 + 2r))` for ``"mean"``; memory
    :math:`O(n_q n_k r)` for the pairwise rank products. The expansion of the
    square cancels terms when :math:`q_i \approx k_j`; use float64 where that
    matters.
    """
    lam_t, scale, per_q, per_k = check_score_inputs(q, k, U_q, U_k, lam, metric_side, scale)
    return scores_unchecked(q, k, U_q, U_k, lam_t, metric_side, scale, per_q, per_k)


def scores_unchecked(q: Tensor, k: Tensor, U_q: Tensor | None, U_k: Tensor | None, lam_t: Tensor,
                     metric_side: str, scale: float, per_q: bool, per_k: bool) -> Tensor:
    """:func:`riemannian_scores` of validated arguments (as ``_checks.check_score_inputs`` returns them), unchecked.

    For callers that validated the whole call once (the dense attention
    reference, every tile of the plain blockwise version).
    """
    qq = (q * q).sum(-1).unsqueeze(-1)  # (..., n_q, 1)
    kk = (k * k).sum(-1).unsqueeze(-2)  # (..., 1, n_k)
    euclid = qq + kk - 2 * q @ k.transpose(-1, -2)  # |q_i - k_j|^2          (..., n_q, n_k)
    dist2 = _lam_scores(lam_t) * euclid
    w = 0.5 if metric_side == "mean" else 1.0
    if U_k is not None:
        dist2 = dist2 + w * _lowrank_term(q, k, U_k, per_k, "key")
    if U_q is not None:
        dist2 = dist2 + w * _lowrank_term(q, k, U_q, per_q, "query")
    return -0.5 * scale * dist2


def dot_product_form(q: Tensor, k: Tensor, U: Tensor, *, lam=1.0, scale: float | None = None
                     ) -> tuple[Tensor, Tensor]:
    r"""Rewrite shared-metric Riemannian scores as dot-product scores plus a key bias.

    With one metric :math:`G = \lambda I + U U^\top` for all tokens,

    .. math::
        -\tfrac{\text{scale}}{2}(q_i-k_j)^\top G (q_i-k_j)
        = \text{scale}\,(G q_i)^\top k_j \;-\; \tfrac{\text{scale}}{2} k_j^\top G k_j
          \;-\; \tfrac{\text{scale}}{2} q_i^\top G q_i ,

    and the last term is constant along each softmax row, so it cancels.

    Parameters
    ----------
    q : Tensor, shape [..., n_q, d]
    k : Tensor, shape [..., n_k, d]
    U : Tensor, shape [..., d, r]
        The shared metric factor (no token axis).
    lam : float or Tensor, shape broadcastable to ``q.shape[:-2]``
    scale : float, optional
        Defaults to :math:`1/\sqrt d`.

    Returns
    -------
    Gq : Tensor, shape [..., n_q, d]
        The transformed queries :math:`G q_i`.
    key_bias : Tensor, shape [..., 1, n_k]
        :math:`-\tfrac{\text{scale}}{2} k_j^\top G k_j`, to add to
        ``scale * Gq @ k.T``; the result equals the Riemannian scores up to a
        per-row constant, hence gives the same softmax.
    """
    if not isinstance(U, Tensor):
        raise ValueError(f"U must be a shared metric factor [..., d, r], got {type(U).__name__}")
    lam_t, scale, _, per_k = check_score_inputs(q, k, None, U, lam, "key", scale)
    if per_k:
        raise ValueError(f"U must be a shared metric factor [..., d, r] (no token axis), got {shape_str(U)}")
    lam_v = lam_t.unsqueeze(-1).unsqueeze(-1) if lam_t.dim() > 0 else lam_t
    Gq = lam_v * q + (q @ U) @ U.transpose(-1, -2)  # (..., n_q, d)
    kU = k @ U  # (..., n_k, r)
    kGk = lam_t.unsqueeze(-1) * (k * k).sum(-1) + (kU * kU).sum(-1)  # (..., n_k)
    return Gq, (-0.5 * scale * kGk).unsqueeze(-2)
