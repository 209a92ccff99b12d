r"""Rank bounds of Riemannian score matrices: Theorem 1 made checkable.

The score of query :math:`i` and key :math:`j` is
:math:`s_{ij} = -\frac{\text{scale}}{2}(q_i-k_j)^\top \bar G_{ij}(q_i-k_j)`
(see :mod:`riemannian_ref.geometry.scores`). Expanding the square writes the whole
matrix :math:`S` as a product :math:`S = L R^\top` with an inner dimension
:math:`m` that depends only on :math:`d` and on how the metric varies:

- one shared metric :math:`G`: :math:`m = d + 2`
  (:math:`-2 q_i^\top G k_j` plus a function of :math:`i` plus a function of :math:`j`);
- per-token metrics on one side (``"key"`` or ``"query"``):
  :math:`m = d(d+1)/2 + d + 1`, because
  :math:`q_i^\top G_j q_i = \langle q_i q_i^\top, G_j\rangle_F` is an inner
  product of two symmetric matrices, i.e. of two vectors of length
  :math:`d(d+1)/2`;
- per-token metrics on both sides (``"mean"``): the sum of the two one-sided
  factorisations, :math:`m = d(d+1) + 2d + 2`.

:func:`non_gram_factors` builds these factors explicitly (the proof, as code),
:func:`score_rank_bound` returns :math:`m`, and :func:`numerical_rank` measures
the rank of a float matrix with a stated tolerance, so that the bounds can be
shown to be attained.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._checks import METRIC_SIDES, broadcast_batch, check_score_inputs, check_tensor

__all__ = ["score_rank_bound", "numerical_rank", "non_gram_factors"]


def score_rank_bound(d: int, metric_side: str = "key", shared: bool = False) -> int:
    r"""The inner dimension :math:`m` of Theorem 1: :math:`\operatorname{rank} S \le m`.

    Parameters
    ----------
    d : int
        Head dimension, :math:`d \ge 1`.
    metric_side : {"key", "query", "mean"}
        Which metric measures a pair (see :func:`riemannian_ref.riemannian_scores`).
    shared : bool
        True if every token uses the same metric :math:`G` (for ``"mean"``:
        both sides shared, so :math:`\bar G = (G_q + G_k)/2` is one matrix).

    Returns
    -------
    int
        :math:`d + 2` if ``shared``; otherwise :math:`d(d+1)/2 + d + 1` for
        ``"key"``/``"query"`` and :math:`d(d+1) + 2d + 2` for ``"mean"``.

    Notes
    -----
    Of course also :math:`\operatorname{rank} S \le \min(n_q, n_k)`; the bound
    says something only when there are more tokens than :math:`m`. The bound
    does not depend on the metric rank :math:`r`; with :math:`r = 0` the metric
    is :math:`\lambda I`, a shared metric, and ``shared=True`` applies.
    """
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"d must be a positive int, got {d!r}")
    if metric_side not in METRIC_SIDES:
        raise ValueError(f"metric_side must be one of {METRIC_SIDES}, got {metric_side!r}")
    if not isinstance(shared, bool):
        raise ValueError(f"shared must be a bool, got {shared!r}")
    if shared:
        return d + 2
    one_sided = d * (d + 1) // 2 + d + 1
    return 2 * one_sided if metric_side == "mean" else one_sided


def numerical_rank(S: Tensor, rtol: float | None = None) -> int | Tensor:
    r"""Numerical rank: the number of singular values above ``rtol * sigma_max``.

    Parameters
    ----------
    S : Tensor, shape [..., n, m]
        A floating-point matrix or a batch of them.
    rtol : float, optional
        Relative tolerance. Default :math:`\max(n, m)\,\varepsilon`, with
        :math:`\varepsilon` the machine epsilon of ``S.dtype`` (the choice of
        NumPy's ``matrix_rank``): a backward-stable SVD computes singular
        values with absolute errors of about :math:`\max(n,m)\,\varepsilon\,\sigma_{\max}`,
        so anything below that threshold is indistinguishable from zero.

    Returns
    -------
    int or Tensor
        A Python ``int`` for a single matrix, else a ``torch.long`` tensor of
        shape ``S.shape[:-2]``. A zero matrix has rank 0.
    """
    S = check_tensor(S, "S", min_dim=2)
    n, m = S.shape[-2], S.shape[-1]
    if rtol is None:
        rtol = max(n, m) * torch.finfo(S.dtype).eps
    elif isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0 <= rtol < 1:
        raise ValueError(f"rtol must be a float in [0, 1) or None, got {rtol!r}")
    if not bool(torch.isfinite(S).all()):
        raise ValueError(f"S must be finite (a rank of NaN/inf entries is undefined), got "
                         f"{int((~torch.isfinite(S)).sum())} non-finite entries")
    if n == 0 or m == 0:
        ranks = torch.zeros(S.shape[:-2], dtype=torch.long, device=S.device)
    else:
        sv = torch.linalg.svdvals(S)  # (..., min(n, m)), descending
        tol = rtol * sv[..., :1]  # (..., 1)
        ranks = ((sv > tol) & (sv > 0)).sum(-1)
    return int(ranks) if S.dim() == 2 else ranks


def _lift_matrix(M: Tensor) -> Tensor:
    """Upper-triangular entries of a batch of d x d matrices, shape [..., d(d+1)/2]."""
    d = M.shape[-1]
    ia, ib = torch.triu_indices(d, d, device=M.device)
    return M[..., ia, ib]


def _lift_vector(x: Tensor) -> Tensor:
    r"""Weighted upper-triangular coordinates of :math:`x x^\top`, shape [..., d(d+1)/2]."""
    d = x.shape[-1]
    ia, ib = torch.triu_indices(d, d, device=x.device)
    w = torch.where(ia == ib, 1.0, 2.0).to(dtype=x.dtype)
    return x[..., ia] * x[..., ib] * w


def _dense_metrics(U: Tensor, lam: Tensor, per_token: bool) -> Tensor:
    r""":math:`G = \lambda I + U U^\top`, shape [..., (n,) d, d]."""
    d = U.shape[-2]
    lam_v = lam.reshape(*lam.shape, *((1,) * (3 if per_token else 2)))  # (..., (1,) 1, 1)
    eye = torch.eye(d, dtype=U.dtype, device=U.device)
    return lam_v * eye + U @ U.transpose(-1, -2)


def _one_sided(x: Tensor, y: Tensor, G: Tensor, per_token: bool) -> tuple[Tensor, Tensor]:
    r"""Factors of :math:`D_{ij} = (x_i - y_j)^\top G_j (x_i - y_j)` with the metric on the y side.

    ``G`` has shape [..., n_y, d, d] (per token) or [..., d, d] (shared).
    Returns ``Lx`` [..., n_x, m], ``Ry`` [..., n_y, m] with ``D = Lx @ Ry^T``.
    """
    if not per_token:
        Gx = x @ G  # G symmetric: rows are (G x_i)^T                      (..., n_x, d)
        xGx = (Gx * x).sum(-1, keepdim=True)  # (..., n_x, 1)
        yGy = ((y @ G) * y).sum(-1, keepdim=True)  # (..., n_y, 1)
        ones_x = torch.ones_like(xGx)
        ones_y = torch.ones_like(yGy)
        Lx = torch.cat([xGx, -2 * Gx, ones_x], dim=-1)  # (..., n_x, d + 2)
        Ry = torch.cat([ones_y, y, yGy], dim=-1)  # (..., n_y, d + 2)
        return Lx, Ry
    Gy = (G @ y.unsqueeze(-1)).squeeze(-1)  # G_j y_j                         (..., n_y, d)
    yGy = (Gy * y).sum(-1, keepdim=True)  # (..., n_y, 1)
    Lx = torch.cat([_lift_vector(x), -2 * x, torch.ones_like(x[..., :1])], dim=-1)  # (..., n_x, m)
    Ry = torch.cat([_lift_matrix(G), Gy, yGy], dim=-1)  # (..., n_y, m)
    return Lx, Ry


def non_gram_factors(q: Tensor, k: Tensor, U_q: Tensor | None = None, U_k: Tensor | None = None, *,
                     lam=1.0, metric_side: str = "key", scale: float | None = None
                     ) -> tuple[Tensor, Tensor]:
    r"""Explicit factors :math:`S = L R^\top` of Riemannian scores (the proof of Theorem 1).

    Key side with per-token metrics :math:`G_j = \lambda I + U_j U_j^\top`:

    .. math::
        (q_i - k_j)^\top G_j (q_i - k_j)
        = \big\langle \mathrm{lift}_w(q_i), \mathrm{lift}(G_j)\big\rangle
          - 2\, q_i^\top (G_j k_j) + k_j^\top G_j k_j ,

    so row :math:`i` of :math:`L` is
    :math:`-\tfrac{\text{scale}}{2}\,[\mathrm{lift}_w(q_i),\, -2 q_i,\, 1]` and
    row :math:`j` of :math:`R` is
    :math:`[\mathrm{lift}(G_j),\, G_j k_j,\, k_j^\top G_j k_j]`
    (:math:`\mathrm{lift}` takes the :math:`d(d+1)/2` upper-triangular entries;
    ``lift_w`` doubles the off-diagonal ones). The query side is the mirror
    image; ``"mean"`` concatenates half of each; a shared metric gives
    :math:`L_i = -\tfrac{\text{scale}}{2}[q_i^\top G q_i,\, -2 G q_i,\, 1]`,
    :math:`R_j = [1,\, k_j,\, k_j^\top G k_j]`.

    Parameters
    ----------
    q : Tensor, shape [..., n_q, d]
    k : Tensor, shape [..., n_k, d]
    U_q : Tensor, shape [..., n_q, d, r] or [..., d, r], optional
        As in :func:`riemannian_ref.riemannian_scores`.
    U_k : Tensor, shape [..., n_k, d, r] or [..., d, r], optional
    lam : float or Tensor, shape broadcastable to ``q.shape[:-2]``
    metric_side : {"key", "query", "mean"}
    scale : float, optional
        Defaults to :math:`1/\sqrt d`.

    Returns
    -------
    L : Tensor, shape [..., n_q, m]
    R : Tensor, shape [..., n_k, m]
        With ``L @ R.transpose(-1, -2)`` equal to the scores up to round-off,
        and batch dimensions broadcast over all inputs. ``m`` equals
        :func:`score_rank_bound` when the metrics are all per-token or all
        shared (``"mean"`` with both shared uses :math:`(G_q + G_k)/2`). For
        ``"mean"`` with one side shared and one per-token the factorisation is
        the plain concatenation, :math:`m = d(d+1)/2 + 2d + 3`, valid but not
        minimal.

    Notes
    -----
    Forms every :math:`d\times d` metric and a ``d(d+1)/2`` lift per token:
    :math:`O(n d^2 (r + 1))` memory and time. A tool for analysis at small
    :math:`d`, not an attention kernel.
    """
    lam_t, scale, per_q, per_k = check_score_inputs(q, k, U_q, U_k, lam, metric_side, scale)
    # a side the metric uses but with no factor: G = lam I, a shared factor of rank 0
    if metric_side in ("key", "mean") and U_k is None:
        U_k = q.new_zeros(q.shape[-1], 0)
    if metric_side in ("query", "mean") and U_q is None:
        U_q = q.new_zeros(q.shape[-1], 0)
    # every factor is expanded to the common batch shape of all inputs
    batch = broadcast_batch({
        "q.shape[:-2]": q.shape[:-2], "k.shape[:-2]": k.shape[:-2], "lam": lam_t.shape,
        **({"U_q batch": U_q.shape[:-3] if per_q else U_q.shape[:-2]} if U_q is not None else {}),
        **({"U_k batch": U_k.shape[:-3] if per_k else U_k.shape[:-2]} if U_k is not None else {}),
    })
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    q = q.expand(*batch, n_q, d)
    k = k.expand(*batch, n_k, d)
    lam_b = lam_t.expand(batch) if lam_t.dim() > 0 else lam_t

    def metrics(U, per_token, n):
        U = U.expand(*batch, *((n,) if per_token else ()), d, U.shape[-1])
        return _dense_metrics(U, lam_b, per_token)

    if metric_side == "key":
        Lq, Rk = _one_sided(q, k, metrics(U_k, per_k, n_k), per_k)
    elif metric_side == "query":
        # (q_i - k_j)^T G_i (q_i - k_j): the key-side construction with roles swapped
        Rk, Lq = _one_sided(k, q, metrics(U_q, per_q, n_q), per_q)
    elif not per_q and not per_k:
        G = 0.5 * (metrics(U_q, False, n_q) + metrics(U_k, False, n_k))  # one shared metric
        Lq, Rk = _one_sided(q, k, G, False)
    else:
        Lq1, Rk1 = _one_sided(q, k, metrics(U_k, per_k, n_k), per_k)
        Rk2, Lq2 = _one_sided(k, q, metrics(U_q, per_q, n_q), per_q)
        Lq = 0.5 * torch.cat([Lq1, Lq2], dim=-1)  # (..., n_q, m1 + m2)
        Rk = torch.cat([Rk1, Rk2], dim=-1)  # (..., n_k, m1 + m2)
    return -0.5 * scale * Lq, Rk
