r"""Which attention patterns a dot-product head cannot realise: certificates and a teacher (private).

A head of dimension :math:`d` that scores by dot products gives the weights
:math:`\mathrm{softmax}(Q K^\top)` with :math:`Q \in \mathbb R^{n_q\times d}`,
:math:`K \in \mathbb R^{n_k\times d}` (any scale is absorbed into :math:`Q`).
The softmax forgets a constant added to a row, so such a head realises a
row-stochastic target :math:`P` with positive entries exactly when

.. math::
    L = \log P = Q K^\top + c\,\mathbf 1^\top
    \quad\text{for some } Q, K \text{ and } c \in \mathbb R^{n_q}.

This is the low-rank bottleneck of heads :cite:`bhojanapalli2020lowrank`
("Low-Rank Bottleneck in Multi-head Attention Models", arXiv:2002.07028),
who show that a head of dimension below the sequence length cannot express
every attention pattern. Here the statement is made quantitative and
checkable for one given target:

- :func:`dot_head_logit_lower_bound` returns the exact minimum, over every
  dot-product head of dimension :math:`d`, of the distance between its
  log-weights and :math:`\log P` after the best shift of each row (an
  Eckart--Young certificate), and :func:`best_dot_head` a head that attains it;
- :func:`dot_head_kl_lower_bound` turns it into a lower bound on the
  row-averaged :math:`\mathrm{KL}(P\,\|\,P')` of every such head, with no
  condition on the head;
- :func:`metric_teacher` builds targets realised exactly by a key-side
  Riemannian head of dimension :math:`d` (the construction is the teacher
  itself) whose centred log-weights have rank up to Theorem 1's
  :math:`d(d+1)/2 + d + 1`
  (:func:`~riemannian_ref.geometry.rank_bounds.score_rank_bound`), so that the
  certificate is strictly positive for dot heads of dimension :math:`d` and
  beyond.

Everything is computed in float64, for single ``[n_q, n_k]`` matrices: tools
for analysis and tests, not for training.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .._checks import check_tensor, shape_str
from .rank_bounds import numerical_rank
from .scores import riemannian_scores

__all__: list[str] = []  # private module

F64 = torch.float64


class LogitCertificate(NamedTuple):
    """What :func:`dot_head_logit_lower_bound` returns."""

    bound: float
    """:math:`\\sqrt{\\sum_{t>d}\\sigma_t(LC)^2}`: the least row-shifted logit error of a dot head of dimension d."""
    singular_values: Tensor
    """All singular values of the centred log-weights :math:`LC`, descending, float64."""
    min_dot_dim: int
    """Numerical rank of :math:`LC`: the smallest dot-head dimension whose bound is (numerically) 0."""
    round_off: float
    """An estimate of the float64 round-off in ``bound`` (:math:`4\\max(n_q,n_k)\\,\\varepsilon\\,\\|LC\\|_F`)."""


class Teacher(NamedTuple):
    """What :func:`metric_teacher` returns (float64 throughout)."""

    q: Tensor
    """Queries, ``[n, d]``."""
    k: Tensor
    """Keys, ``[n, d]``."""
    U_k: Tensor
    """Per-key metric factors, ``[n, d, r]``: :math:`G_j = \\lambda I + U_j U_j^\\top`."""
    lam: float
    scale: float
    scores: Tensor
    """``riemannian_scores(q, k, None, U_k, lam=lam, scale=scale)``, ``[n, n]``."""
    weights: Tensor
    """``softmax(scores, -1)``, ``[n, n]``: the target attention pattern."""


def _check_dim(d, name: str = "d") -> int:
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"{name} must be a positive int, got {d!r}")
    return d


def _log_weights(target: Tensor, logits: bool) -> Tensor:
    """The target as float64 logits ``[n_q, n_k]``, after checking it."""
    if not isinstance(logits, bool):
        raise ValueError(f"logits must be a bool, got {logits!r}")
    name = "logits" if logits else "P"
    target = check_tensor(target, name)
    if target.dim() != 2 or target.shape[0] < 1 or target.shape[1] < 2:
        raise ValueError(f"{name} must be one [n_q, n_k] matrix with n_q >= 1 and n_k >= 2, got shape "
                         f"{shape_str(target)}")
    t = target.detach().to(F64)
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must be finite, got {int((~torch.isfinite(t)).sum())} non-finite entries")
    if logits:
        return t
    if not bool((t > 0).all()):
        raise ValueError(f"P must have positive entries (a zero weight has logit -inf, which no head with finite "
                         f"scores gives), got {int((t <= 0).sum())} entries <= 0")
    rows = t.sum(-1)
    tol = 1e-6 if target.dtype == F64 else 1e-3
    if not bool(((rows - 1).abs() <= tol).all()):
        raise ValueError(f"P must be row-stochastic (rows summing to 1 within {tol:g}), got row sums in "
                         f"[{rows.min().item():.6g}, {rows.max().item():.6g}]")
    return t.log()


def _centre(L: Tensor) -> Tensor:
    """:math:`LC` with :math:`C = I - \\mathbf 1\\mathbf 1^\\top/n_k`: every row minus its mean."""
    return L - L.mean(-1, keepdim=True)


def dot_head_logit_lower_bound(target: Tensor, d: int, *, logits: bool = False) -> LogitCertificate:
    r"""Certified minimum logit error of every dot-product head of dimension ``d`` on a target pattern.

    Statement. Let :math:`L \in \mathbb R^{n_q\times n_k}` be the target's
    log-weights (:math:`L = \log P`, or given logits), :math:`C = I -
    \mathbf 1\mathbf 1^\top/n_k` the centring projector and
    :math:`\sigma_1 \ge \sigma_2 \ge \dots` the singular values of
    :math:`LC`. Then

    .. math::
        \min_{Q \in \mathbb R^{n_q\times d},\,K \in \mathbb R^{n_k\times d},\,
              c \in \mathbb R^{n_q}}
        \big\| L - Q K^\top - c\,\mathbf 1^\top \big\|_F
        \;=\; \Big(\sum_{t > d} \sigma_t^2\Big)^{1/2} ,

    and the minimum is attained (:func:`best_dot_head`). The left side is
    the distance between :math:`L` and the log-weights of the closest
    dot-product head of dimension :math:`d` after the best shift of each row
    (a dot head's log-weights are :math:`QK^\top` minus its row
    log-normalisers, one of the shifts :math:`c`). So the bound is positive
    iff no dot head of dimension :math:`d` realises the target exactly, and
    ``min_dot_dim`` (the rank of :math:`LC`) is the smallest dimension that
    does. A dot head whose query projection has a bias (scores
    :math:`q_i^\top k_j + b_j`) has a term :math:`\mathbf 1 b^\top` of rank one
    more: it is covered by the bound for :math:`d + 1`.

    Proof. (:math:`\ge`) :math:`C` is an orthogonal projector and
    :math:`\mathbf 1^\top C = 0`, so for every :math:`Q, K, c`,
    :math:`\|L - QK^\top - c\mathbf 1^\top\|_F \ge
    \|(L - QK^\top - c\mathbf 1^\top)C\|_F = \|LC - QK^\top C\|_F`, and
    :math:`QK^\top C` has rank at most :math:`d`; by the Eckart--Young--Mirsky
    theorem no matrix of rank :math:`\le d` is closer to :math:`LC` than
    :math:`(\sum_{t>d}\sigma_t^2)^{1/2}`. (:math:`\le`) Take the truncated SVD
    :math:`X = U_d \Sigma_d V_d^\top` of :math:`LC`, :math:`Q = U_d\Sigma_d`,
    :math:`K = V_d` and :math:`c` the row means of :math:`L`: then
    :math:`L - c\mathbf 1^\top = LC` and the error is :math:`\|LC - X\|_F`,
    the bound. :math:`\square`

    Parameters
    ----------
    target : Tensor, shape [n_q, n_k]
        Attention weights :math:`P` (positive entries, rows summing to 1), or
        logits with ``logits=True`` (any finite matrix; a constant per row is
        irrelevant).
    d : int
        Head dimension of the dot-product heads, :math:`d \ge 1`.
    logits : bool
        Whether ``target`` holds logits rather than weights.

    Returns
    -------
    LogitCertificate
        ``bound``, ``singular_values`` (of :math:`LC`), ``min_dot_dim`` and
        ``round_off`` (a float64 round-off estimate: treat bounds below it
        as 0). Computed in float64.

    Notes
    -----
    An error in logits weighs every key alike, also those with negligible
    weight; :func:`dot_head_kl_lower_bound` converts it into a statement
    about the weights themselves.
    """
    d = _check_dim(d)
    LC = _centre(_log_weights(target, logits))
    sv = torch.linalg.svdvals(LC)
    bound = float(sv[d:].pow(2).sum().sqrt())
    round_off = 4 * max(LC.shape) * torch.finfo(F64).eps * float(sv.pow(2).sum().sqrt())
    return LogitCertificate(bound, sv, numerical_rank(LC), round_off)


def best_dot_head(target: Tensor, d: int, *, logits: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    r"""A dot-product head of dimension ``d`` whose row-shifted logit error equals the certified bound.

    Returns ``(Q, K, c)`` (float64, shapes ``[n_q, d]``, ``[n_k, d]``,
    ``[n_q]``) with :math:`\|L - QK^\top - c\mathbf 1^\top\|_F` equal to
    ``dot_head_logit_lower_bound(target, d).bound`` up to round-off:
    :math:`Q = U_d\Sigma_d`, :math:`K = V_d` from the SVD of :math:`LC` and
    :math:`c` the row means of :math:`L` (the proof of
    :func:`dot_head_logit_lower_bound`). With ``d`` above ``min(n_q, n_k)``
    the extra columns are 0. This head minimises the logit error, not the KL
    divergence of the weights.
    """
    d = _check_dim(d)
    L = _log_weights(target, logits)
    U, s, Vh = torch.linalg.svd(_centre(L), full_matrices=False)
    t = min(d, s.numel())
    Q, K = L.new_zeros(L.shape[0], d), L.new_zeros(L.shape[1], d)
    Q[:, :t] = U[:, :t] * s[:t]
    K[:, :t] = Vh[:t].T
    return Q, K, L.mean(-1)


def _binary_kl(a: float, b: float) -> float:
    """:math:`\\mathrm{KL}(\\mathrm{Bern}(a)\\,\\|\\,\\mathrm{Bern}(b))` for :math:`0 < b < a \\le 1`."""
    tail = 0.0 if a >= 1.0 else (1 - a) * (math.log1p(-a) - math.log1p(-b))
    return a * math.log(a / b) + tail


def _kl_bound_from(B: float, p: float) -> float:
    r"""Largest :math:`\min(\log(1 + e^{-M} p B^2/2),\ \mathrm{kl}(p \| p e^{-M}))` over :math:`M > 0`."""
    f1 = lambda M: math.log1p(0.5 * math.exp(-M) * p * B * B)  # noqa: E731  decreasing in M
    f2 = lambda M: _binary_kl(p, p * math.exp(-M))  # noqa: E731            increasing in M, 0 at M = 0
    lo, hi = 0.0, 1.0
    while f1(hi) > f2(hi):
        hi *= 2
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f1(mid) > f2(mid) else (lo, mid)
    return max(min(f1(M), f2(M)) for M in (lo, hi))  # any M gives a valid bound


def dot_head_kl_lower_bound(P: Tensor, d: int) -> float:
    r"""Lower bound on :math:`\frac1{n_q}\sum_i \mathrm{KL}(P_i \,\|\, P'_i)` for every dot head of dimension ``d``.

    Statement. For a set :math:`J` of keys let :math:`B_J` be the logit bound
    of :func:`dot_head_logit_lower_bound` for the columns :math:`J` of
    :math:`\log P` (centred over :math:`J`), and
    :math:`p_J = \min_{i,\,j\in J} P_{ij}`. For every dot-product head of
    dimension :math:`d`, with weights :math:`P' = \mathrm{softmax}(QK^\top)`
    (a softmax over all keys), and every :math:`M > 0`,

    .. math::
        \sum_i \mathrm{KL}(P_i \,\|\, P'_i) \;\ge\;
        \min\Big(\log\big(1 + \tfrac12 e^{-M} p_J B_J^2\big),\;
                  \mathrm{kl}\big(p_J \,\|\, p_J e^{-M}\big)\Big) ,

    with :math:`\mathrm{kl}` the divergence of two Bernoulli laws. The
    function takes :math:`J` among the sets of the :math:`t` keys with the
    largest column minima (:math:`t = d + 2, \dots, n_k`, each a valid
    choice), the best :math:`M` for each by bisection, and returns the
    largest bound divided by :math:`n_q`.

    Proof. Fix a row, drop its index, and let
    :math:`e_j = \log P_j - \log P'_j`, :math:`\bar e = \sum_j P_j e_j =
    \mathrm{KL}(P\|P')` and :math:`f = e - \bar e`. Since
    :math:`\sum_j P_j e^{-e_j} = \sum_j P'_j = 1`,
    :math:`\mathrm{KL} = \log \sum_j P_j e^{-f_j}`. Taylor's theorem gives
    :math:`e^{-x} \ge 1 - x + \tfrac12 e^{-M} x^2` for :math:`x \le M`, and
    :math:`e^{-x} \ge 1 - x` always; with :math:`\sum_j P_j f_j = 0`,

    - if :math:`f_j \le M` for every :math:`j \in J`:
      :math:`\mathrm{KL} \ge \log(1 + \tfrac12 e^{-M} \sum_{j\in J} P_j f_j^2)
      \ge \log(1 + \tfrac12 e^{-M} p_J \min_c \|e_J - c\mathbf 1\|^2)`;
    - otherwise some :math:`j \in J` has
      :math:`P'_j < P_j e^{-M}` (as :math:`\bar e \ge 0`), and merging the
      other keys (which cannot increase a divergence) gives
      :math:`\mathrm{KL} \ge \mathrm{kl}(P_j \| P_j e^{-M}) \ge
      \mathrm{kl}(p_J \| p_J e^{-M})`, the map
      :math:`a \mapsto \mathrm{kl}(a \| a e^{-M})` being increasing.

    So row :math:`i` contributes at least :math:`\min(\log(1 + \alpha x_i),
    \beta)` with :math:`x_i = \min_c\|e_{iJ} - c\mathbf 1\|^2`. The restriction of
    :math:`\log P'` to the columns :math:`J` is :math:`(QK^\top)_{:,J}` shifted
    per row, a dot head of dimension :math:`d` on those keys, so
    :math:`\sum_i x_i \ge B_J^2` (the logit certificate). A sum of concave
    increasing functions under :math:`\sum_i x_i \ge B_J^2` is smallest when
    one :math:`x_i` carries everything, which is the bound. :math:`\square`

    The certificate is rigorous and has no condition on the head, but it is
    loose: it lets the whole logit error sit in one row and weighs it by the
    smallest weight :math:`p_J`. It proves that the gap is not zero;
    training measures its size.

    Parameters
    ----------
    P : Tensor, shape [n_q, n_k]
        Target weights, positive, rows summing to 1.
    d : int
        Head dimension, :math:`d \ge 1`.

    Returns
    -------
    float
        The bound on the row-averaged KL (nats); 0 when no key set has a logit
        bound above its round-off.
    """
    d = _check_dim(d)
    L = _log_weights(P, False)
    n_q, n_k = L.shape
    order = torch.argsort(L.amin(0), descending=True)  # keys by their smallest weight, largest first
    best = 0.0
    for t in range(min(d + 2, n_k), n_k + 1):
        J = order[:t]
        cert = dot_head_logit_lower_bound(L[:, J], d, logits=True)
        B = cert.bound - cert.round_off  # the certificate's own float64 error, taken off first
        if B > 0:
            best = max(best, _kl_bound_from(B, math.exp(float(L[:, J].min()))))
    return best / n_q


def metric_teacher(n: int, d: int, r: int, generator: torch.Generator, *, lam: float = 0.5,
                   spread: float = 1.0) -> Teacher:
    r"""A target attention pattern that a key-side Riemannian head of dimension ``d`` realises exactly.

    Draws queries and keys :math:`q_i, k_j \sim \mathcal N(0, I_d)` and
    per-key factors :math:`U_j` with i.i.d. :math:`\mathcal N(0, 1/r)`
    entries, so :math:`G_j = \lambda I + U_j U_j^\top` has
    :math:`\mathbb E\,G_j = (\lambda + 1) I`; the scale is then set so that
    the centred scores have root-mean-square ``spread`` (the weights are
    neither uniform nor one-hot). The weights are
    :math:`P = \mathrm{softmax}(S)` with
    :math:`S_{ij} = -\tfrac{\text{scale}}{2}(q_i - k_j)^\top G_j (q_i - k_j)`:
    realised by construction. For generic draws and :math:`n > m`, the
    centred scores have rank :math:`m = d(d+1)/2 + d + 1`: Theorem 1 bounds
    the rank of :math:`S` by :math:`m`, and centring the rows does not lower
    it, since the key-side factor of Theorem 1 has no constant column. So a
    dot head needs dimension :math:`m` to realise the pattern; check a given
    draw with :func:`dot_head_logit_lower_bound` (``min_dot_dim``).

    Parameters
    ----------
    n : int
        Number of queries and of keys, :math:`n \ge 2`.
    d : int
        Head dimension, :math:`d \ge 1`.
    r : int
        Rank of each key's metric factor, :math:`r \ge 1`.
    generator : torch.Generator
        Source of every random draw (CPU).
    lam : float
        Isotropic part :math:`\lambda > 0`.
    spread : float
        Root-mean-square of the row-centred scores, :math:`> 0`.

    Returns
    -------
    Teacher
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an int >= 2, got {n!r}")
    d, r = _check_dim(d), _check_dim(r, "r")
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    for name, v in (("lam", lam), ("spread", spread)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a positive finite float, got {v!r}")
    q = torch.randn(n, d, generator=generator, dtype=F64)
    k = torch.randn(n, d, generator=generator, dtype=F64)
    U_k = torch.randn(n, d, r, generator=generator, dtype=F64) / math.sqrt(r)
    S1 = riemannian_scores(q, k, None, U_k, lam=float(lam), scale=1.0)
    scale = float(spread) / float(_centre(S1).pow(2).mean().sqrt())
    S = riemannian_scores(q, k, None, U_k, lam=float(lam), scale=scale)
    return Teacher(q, k, U_k, float(lam), scale, S, torch.softmax(S, -1))

