r"""Rank-collapse measures: how far a stack of token states is from rank one.

A sequence of :math:`n` token states of width :math:`D` is a matrix
:math:`X \in \mathbb{R}^{n\times D}` (one row per token). Dong, Cordonnier and
Loukas (2021) measure its distance to the matrices with identical rows,

.. math::
    \mathrm{res}(X) = X - \mathbf 1 x^\top ,

either with :math:`x` the column mean (the *mean form*, used in their plots)
or with :math:`x` the minimiser of the chosen norm of the residual (the
*argmin form*, used in their theorem). Their norm is the composite

.. math::
    \|X\|_{1,\infty} = \sqrt{\|X\|_1 \|X\|_\infty},

with :math:`\|X\|_1` the largest absolute column sum and :math:`\|X\|_\infty`
the largest absolute row sum. Besides the residual we report two spectral
ranks: the stable rank :math:`\|X\|_F^2/\|X\|_2^2` (Rudelson and Vershynin,
2007) and the energy effective rank, the exponential of the entropy of the
normalised *squared* singular values (Roy and Vetterli, 2007, normalise the
singular values themselves; the squared form is the one this project uses for
intrinsic rank as well).

For the collapse theorem of chapter 9 there are three more measures:
:func:`token_radius`, the largest distance of a token from the mean token;
:func:`collapse_depth`, the (interpolated) depth at which a residual curve
falls below a level; and :func:`attention_entropy`, the entropy of each
attention row, which the book matches across score functions. Products of
attention matrices along the depth are :func:`attention_path_products`.

The residual and rank functions take a batch ``X`` of shape ``[..., n, D]``
and return a tensor of shape ``[...]``; nothing is printed or plotted. The
one-layer bound is in :mod:`riemannian_ref.analysis.bound`, the probes that
read labels from states in :mod:`riemannian_ref.analysis.probes`.

Non-finite input is never read as collapse: a matrix of the batch with a NaN
or infinite entry gets NaN from :func:`relative_residual`,
:func:`stable_rank`, :func:`energy_effective_rank` and
:func:`composite_residual_lower_bound` (the other matrices of the batch are
unaffected), and :func:`composite_norm` propagates it (inf or NaN). Half
precision (float16, bfloat16) is computed in float32 and returned in the
input's dtype.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .._checks import check_tensor, shape_str

__all__ = [
    "composite_norm",
    "residual",
    "relative_residual",
    "stable_rank",
    "energy_effective_rank",
    "attention_path_products",
    "token_radius",
    "collapse_depth",
    "attention_entropy",
]

NORMS = ("composite", "fro")
CENTERS = ("mean", "argmin")


def _check_X(X, name: str = "X") -> Tensor:
    X = check_tensor(X, name, min_dim=2)
    if X.shape[-2] == 0 or X.shape[-1] == 0:
        raise ValueError(f"{name} must have shape [..., n, D] with n, D >= 1, got {shape_str(X)}")
    return X


_HALF = (torch.float16, torch.bfloat16)


def _upcast(X: Tensor) -> Tensor:
    """Half precision computed in float32 (sums of squares overflow float16; CPU SVD has no half kernels)."""
    return X.float() if X.dtype in _HALF else X


def _nan_where_nonfinite(value: Tensor, X: Tensor, dtype: torch.dtype) -> Tensor:
    """``value`` [...] with NaN for every matrix of ``X`` [..., n, D] holding a NaN or inf, in ``dtype``."""
    ok = torch.isfinite(X).flatten(-2).all(-1)  # (...)
    return torch.where(ok, value, torch.full_like(value, float("nan"))).to(dtype)


def _finite_or_zero(X: Tensor) -> Tensor:
    """``X`` with its non-finite matrices zeroed, so that an SVD of the batch does not fail on them."""
    ok = torch.isfinite(X).flatten(-2).all(-1)  # (...)
    return torch.where(ok[..., None, None], X, torch.zeros_like(X))


def _check_choice(value, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def composite_norm(X: Tensor) -> Tensor:
    r"""The composite norm :math:`\|X\|_{1,\infty} = \sqrt{\|X\|_1\,\|X\|_\infty}`.

    Parameters
    ----------
    X : Tensor, shape [..., n, D]
        A batch of matrices.

    Returns
    -------
    Tensor, shape [...]
        :math:`\|X\|_1 = \max_j \sum_i |X_{ij}|` (largest column sum) times
        :math:`\|X\|_\infty = \max_i \sum_j |X_{ij}|` (largest row sum), square-rooted.

    Notes
    -----
    It is not a matrix norm in the strict sense (the triangle inequality can
    fail), but it is absolutely homogeneous and zero only at zero, which is
    all the rank-collapse bounds use.
    """
    X = _check_X(X)
    dtype = X.dtype
    A = _upcast(X).abs()
    col = A.sum(-2).amax(-1)  # ||X||_1            (...)
    row = A.sum(-1).amax(-1)  # ||X||_inf          (...)
    return torch.sqrt(col * row).to(dtype)


def _norm(R: Tensor, norm: str) -> Tensor:
    if norm == "fro":
        return torch.linalg.matrix_norm(R, ord="fro")
    return composite_norm(R)


def composite_residual_lower_bound(X: Tensor) -> Tensor:
    r"""A certified lower bound on :math:`\min_x \|X - \mathbf 1 x^\top\|_{1,\infty}`.

    The column-sum factor :math:`A(x) = \max_j \sum_i |X_{ij} - x_j|` is
    minimised exactly by the column medians, with minimum
    :math:`A_* = \max_j m_j` where :math:`m_j = \min_{x_j} \sum_i |X_{ij}-x_j|`.
    The row-sum factor satisfies
    :math:`B(x) = \max_i \sum_j |X_{ij} - x_j| \ge \frac1n \sum_{ij} |X_{ij} - x_j| \ge \frac1n \sum_j m_j`.
    Hence :math:`\min_x \sqrt{A(x) B(x)} \ge \sqrt{A_* \sum_j m_j / n}`.

    Parameters
    ----------
    X : Tensor, shape [..., n, D]
        Token states, one row per token.

    Returns
    -------
    Tensor, shape [...]
        The bound, computed exactly from the column medians.
    """
    X = _check_X(X)
    dtype, X = X.dtype, _upcast(X)
    n = X.shape[-2]
    med = X.median(dim=-2, keepdim=True).values  # (..., 1, D)
    m = (X - med).abs().sum(-2)  # per-column minimal absolute deviation   (..., D)
    return _nan_where_nonfinite(torch.sqrt(m.amax(-1) * m.sum(-1) / n), X, dtype)


def residual_center(X: Tensor, norm: str = "composite", center: str = "mean", *,
                    n_iter: int = 200) -> Tensor:
    r"""The row :math:`x` subtracted in :math:`\mathrm{res}(X) = X - \mathbf 1 x^\top`.

    Parameters
    ----------
    X : Tensor, shape [..., n, D]
    norm : {"composite", "fro"}
        Norm whose residual ``center="argmin"`` minimises.
    center : {"mean", "argmin"}
        ``"mean"``: the column mean (the same for both norms).
        ``"argmin"``: a minimiser of the residual's norm. For ``"fro"`` this is
        exactly the column mean. For ``"composite"`` there is no closed form;
        see Notes.
    n_iter : int
        Subgradient steps for the composite argmin.

    Returns
    -------
    Tensor, shape [..., D]

    Notes
    -----
    Composite argmin: :math:`f(x) = \sqrt{A(x)B(x)}` with both :math:`A` (max
    column sum) and :math:`B` (max row sum) convex and piecewise linear in
    :math:`x`; their geometric mean need not be convex. We evaluate the column
    mean and the column medians (which minimise :math:`A` exactly), run
    ``n_iter`` normalised subgradient steps with a diminishing step from the
    better of the two, and return the best point seen. The value
    :math:`f(x)` at the returned point is therefore an *upper* bound on the true
    minimum, never larger than the mean form;
    :func:`composite_residual_lower_bound` gives a certified lower bound. In
    the tests the two brackets are within a factor 1.5 of each other on
    Gaussian matrices.
    """
    X = _check_X(X)
    _check_choice(norm, "norm", NORMS)
    _check_choice(center, "center", CENTERS)
    if isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 0:
        raise ValueError(f"n_iter must be an int >= 0, got {n_iter!r}")
    dtype, X = X.dtype, _upcast(X)
    mean = X.mean(-2)  # (..., D)
    if center == "mean" or norm == "fro":
        return mean.to(dtype)
    Xd = X.detach()
    med = Xd.median(dim=-2).values  # (..., D)
    f_mean = composite_norm(Xd - mean.detach().unsqueeze(-2))
    f_med = composite_norm(Xd - med.unsqueeze(-2))
    use_med = (f_med <= f_mean).unsqueeze(-1)
    best = torch.where(use_med, med, mean.detach())  # (..., D)
    best_f = torch.minimum(f_med, f_mean)  # (...)
    # Scale of the steps: the typical spread of a column.
    spread = (Xd - med.unsqueeze(-2)).abs().mean(-2).mean(-1, keepdim=True).clamp_min(1e-30)  # (..., 1)
    x = best.clone()
    with torch.enable_grad():
        for t in range(n_iter):
            x = x.detach().requires_grad_(True)
            f = composite_norm(Xd - x.unsqueeze(-2))  # (...)
            (g,) = torch.autograd.grad(f.sum(), x)
            with torch.no_grad():
                better = f < best_f
                best = torch.where(better.unsqueeze(-1), x, best)
                best_f = torch.where(better, f, best_f)
                gnorm = g.norm(dim=-1, keepdim=True).clamp_min(1e-30)
                step = 0.5 * spread / (1.0 + t) ** 0.5
                x = x - step * g / gnorm
    with torch.no_grad():
        f = composite_norm(Xd - x.unsqueeze(-2))
        best = torch.where((f < best_f).unsqueeze(-1), x, best)
    return best.detach().to(dtype)


def residual(X: Tensor, norm: str = "composite", center: str = "mean") -> Tensor:
    r"""The residual :math:`\mathrm{res}(X) = X - \mathbf 1 x^\top`.

    Parameters
    ----------
    X : Tensor, shape [..., n, D]
        Token states.
    norm, center
        As in :func:`residual_center`.

    Returns
    -------
    Tensor, shape [..., n, D]
        ``X`` minus the chosen centre row, in every row.
    """
    x = residual_center(X, norm, center)  # (..., D)
    return X - x.unsqueeze(-2)


def relative_residual(X: Tensor, norm: str = "composite", center: str = "mean") -> Tensor:
    r"""Relative distance to the identical-row matrices, :math:`\|\mathrm{res}(X)\| / \|X\|`.

    Parameters
    ----------
    X : Tensor, shape [..., n, D]
        Token states, one row per token.
    norm : {"composite", "fro"}
        :math:`\|\cdot\|_{1,\infty}` of Dong et al. or the Frobenius norm.
    center : {"mean", "argmin"}
        Subtract the column mean (their plots) or the norm's minimiser (their
        theorem); see :func:`residual_center` for how the composite argmin is
        computed and what it guarantees.

    Returns
    -------
    Tensor, shape [...]
        In :math:`[0, \infty)`; zero exactly when all rows are equal (rank one
        or zero). For ``X = 0`` the value is defined as 0; a matrix with a
        NaN or infinite entry gives NaN (not 0: that would read as collapse).
        Invariant under scaling ``X -> c X`` (``c != 0``).
    """
    X = _check_X(X)
    _check_choice(norm, "norm", NORMS)
    dtype, X = X.dtype, _upcast(X)
    R = residual(X, norm, center)
    num = _norm(R, norm)
    den = _norm(X, norm)
    out = torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))
    return _nan_where_nonfinite(out, X, dtype)


def stable_rank(X: Tensor) -> Tensor:
    r"""The stable rank :math:`\|X\|_F^2 / \|X\|_2^2 = \sum_k \sigma_k^2 / \sigma_1^2`.

    Parameters
    ----------
    X : Tensor, shape [..., n, D]
        Matrices whose spectrum is summarised.

    Returns
    -------
    Tensor, shape [...]
        Between 1 and :math:`\mathrm{rank}(X)`; equal to the rank when all
        non-zero singular values are equal. Defined as 0 for ``X = 0``; NaN
        for a matrix with a NaN or infinite entry.
    """
    X = _check_X(X)
    dtype, X = X.dtype, _upcast(X)
    s = torch.linalg.svdvals(_finite_or_zero(X))  # (..., min(n, D)), descending
    s2 = s * s
    top = s2[..., 0]
    out = torch.where(top > 0, s2.sum(-1) / torch.where(top > 0, top, torch.ones_like(top)), torch.zeros_like(top))
    return _nan_where_nonfinite(out, X, dtype)


def energy_effective_rank(X: Tensor) -> Tensor:
    r"""The energy effective rank :math:`\exp\big(-\sum_k p_k \log p_k\big)`, :math:`p_k = \sigma_k^2/\sum_l \sigma_l^2`.

    Parameters
    ----------
    X : Tensor, shape [..., n, D]
        Any batch of real matrices (for ``X = 0`` the result is defined as 0;
        a matrix with a NaN or infinite entry gives NaN).

    Returns
    -------
    Tensor, shape [...]
        :math:`k` when :math:`X` has :math:`k` equal non-zero singular values;
        in general between 1 and :math:`\mathrm{rank}(X)`.

    Notes
    -----
    Roy and Vetterli (2007) define the effective rank with
    :math:`p_k = \sigma_k / \sum_l \sigma_l`; squaring weights the spectrum by
    energy, so small singular values count for less. Both agree on matrices
    with equal non-zero singular values.
    """
    X = _check_X(X)
    dtype, X = X.dtype, _upcast(X)
    s = torch.linalg.svdvals(_finite_or_zero(X))  # (..., min(n, D))
    s2 = s * s
    tot = s2.sum(-1, keepdim=True)  # (..., 1)
    p = s2 / torch.where(tot > 0, tot, torch.ones_like(tot))
    plogp = torch.where(p > 0, p * torch.log(torch.where(p > 0, p, torch.ones_like(p))), torch.zeros_like(p))
    H = -plogp.sum(-1)
    return _nan_where_nonfinite(torch.where(tot.squeeze(-1) > 0, torch.exp(H), torch.zeros_like(H)), X, dtype)


def attention_path_products(weights: Tensor, heads: Tensor | None = None) -> Tensor:
    r"""Products of attention matrices along a path of heads, :math:`P_l = A_l^{(h_l)} \cdots A_1^{(h_1)}`.

    In the path decomposition of Dong et al. the output of a pure attention
    stack is a sum over paths (one head per layer) of such products applied to
    the input; a product of row-stochastic matrices is row-stochastic, and it
    tends to a matrix with identical rows (rank one).

    Parameters
    ----------
    weights : Tensor, shape [L, B, h, n, n]
        Per-layer attention weights, as returned by
        :class:`~riemannian_ref.models.transformer.FiberBundleTransformer` (``return_weights=True``).
    heads : Tensor of int, shape [L] or [L, B], optional
        The head taken at each layer (per batch element if 2-D); default head 0.

    Returns
    -------
    Tensor, shape [L, B, n, n]
        ``out[l-1]`` is the product of the first ``l`` layers.
    """
    weights = check_tensor(weights, "weights", min_dim=5)
    if weights.dim() != 5 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"weights must have shape [L, B, h, n, n], got {shape_str(weights)}")
    L, B, h, n, _ = weights.shape
    if heads is None:
        heads = torch.zeros(L, dtype=torch.long, device=weights.device)
    if not isinstance(heads, Tensor) or heads.dtype != torch.long or heads.shape not in ((L,), (L, B)):
        raise ValueError(f"heads must be a long tensor of shape [{L}] or [{L}, {B}], got "
                         f"{shape_str(heads) if isinstance(heads, Tensor) else type(heads).__name__}")
    if heads.numel() and (heads.min() < 0 or heads.max() >= h):
        raise ValueError(f"heads must lie in [0, {h}), got values in [{heads.min()}, {heads.max()}]")
    if heads.dim() == 1:
        heads = heads.unsqueeze(1).expand(L, B)  # (L, B)
    idx = heads.view(L, B, 1, 1, 1).expand(L, B, 1, n, n)
    A = weights.gather(2, idx).squeeze(2)  # (L, B, n, n)
    out, P = [], None
    for l in range(L):
        P = A[l] if P is None else A[l] @ P
        out.append(P)
    return torch.stack(out)  # (L, B, n, n)



def token_radius(X: Tensor) -> Tensor:
    r"""The largest distance of a token from the mean token, :math:`\rho(X) = \max_i |x_i - \bar x|_2`.

    The residual of the collapse theorem of chapter 9: with
    :math:`X = \mathbf 1 \bar x^\top + R`, :math:`\rho(X)` is the largest row
    norm of :math:`R`. It is within a factor :math:`\sqrt{nD}` of any other
    norm of :math:`R`, so the exponent of a power law in it does not depend
    on the choice.

    Parameters
    ----------
    X : Tensor, shape [..., n, D]
        A batch of sequences of token states (rows are tokens).

    Returns
    -------
    Tensor, shape [...]
        :math:`\rho` of every sequence of the batch: 0 for identical rows, and
        unchanged by adding one row vector to every token.
    """
    X = _check_X(X)
    return (X - X.mean(-2, keepdim=True)).norm(dim=-1).amax(-1)




def collapse_depth(log10_res, level: float = -6.0) -> Tensor:
    r"""The depth at which a residual curve first crosses ``level``, interpolated between layers.

    With :math:`u_l` the :math:`\log_{10}` residual at depth :math:`l` and
    :math:`l` the first depth with :math:`u_l < ` ``level``, the crossing is
    :math:`l - 1 + (u_{l-1} - \text{level})/(u_{l-1} - u_l)`: a continuous
    collapse depth, so that paired differences between seeds are not
    integers.

    Parameters
    ----------
    log10_res : Tensor or array, shape [..., L + 1]
        :math:`\log_{10}` residuals at depths ``0..L``.
    level : float
        The threshold (default :math:`-6`, a relative residual of
        :math:`10^{-6}`).

    Returns
    -------
    Tensor, shape [...], float64
        The interpolated depth; ``inf`` where the curve never crosses, 0 where
        it starts below ``level``.
    """
    u = torch.as_tensor(log10_res, dtype=torch.float64)
    if u.dim() < 1 or u.shape[-1] < 1:
        raise ValueError(f"log10_res must have shape [..., L + 1] with L + 1 >= 1, got {shape_str(u)}")
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not math.isfinite(level):
        raise ValueError(f"level must be a finite number, got {level!r}")
    below = u < level
    hit = below.any(-1)
    l = below.to(torch.int64).argmax(-1)  # first depth below level            (...)
    prev = u.gather(-1, (l - 1).clamp_min(0).unsqueeze(-1)).squeeze(-1)
    cur = u.gather(-1, l.unsqueeze(-1)).squeeze(-1)
    frac = (prev - level) / torch.where(prev > cur, prev - cur, torch.ones_like(cur))
    depth = torch.where(l > 0, (l - 1).to(u.dtype) + frac, torch.zeros_like(frac))
    return torch.where(hit, depth, torch.full_like(depth, math.inf))


def attention_entropy(weights: Tensor) -> Tensor:
    r"""The entropy :math:`-\sum_j A_{ij}\log A_{ij}` of every attention row, in nats.

    Parameters
    ----------
    weights : Tensor, shape [..., n_q, n_k]
        Rows that are probability vectors, e.g. the weights that
        :class:`~riemannian_ref.RiemannianAttention` returns
        with ``return_weights=True``.

    Returns
    -------
    Tensor, shape [..., n_q]
        Between 0 (one key) and :math:`\log n_k` (uniform attention).
    """
    A = check_tensor(weights, "weights", min_dim=1)
    plogp = torch.where(A > 0, A * torch.log(torch.where(A > 0, A, torch.ones_like(A))), torch.zeros_like(A))
    return -plogp.sum(-1)
