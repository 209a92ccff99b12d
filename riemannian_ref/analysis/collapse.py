r"""Rank-collapse diagnostics: how far a stack of token states is from rank one.

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

Every function takes a batch ``X`` of shape ``[..., n, D]`` and returns a
tensor of shape ``[...]``; nothing is printed or plotted.

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
    "residual_center",
    "relative_residual",
    "composite_residual_lower_bound",
    "stable_rank",
    "energy_effective_rank",
    "attention_path_products",
    "token_radius",
    "collapse_bound",
    "collapse_map",
    "collapse_depth",
    "attention_entropy",
    "linear_probe_accuracy",
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


# ---------------------------------------------------------------------------
# The one-layer collapse map near identical rows (chapter 9 of the book)


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


def _attention_parts(attn):
    """Per head: the frames Q_h, K_h [D, d], the value-output maps M_h [D, D], and the scale."""
    from ..attention.layer import RiemannianAttention

    if not isinstance(attn, RiemannianAttention):
        raise ValueError(f"attn must be a RiemannianAttention, got {type(attn).__name__}")
    cfg = attn.config
    if cfg.cross_attention:
        raise ValueError("attn must be a self-attention module (cross_attention=False)")
    if cfg.connection != "trivial":
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
    ``radius`` (:func:`token_radius`), the output :math:`Y` of ``attn``
    satisfies :math:`\rho(Y) \le C \rho(X)^p` with

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
        A self-attention module with the trivial connection (no mask is
        assumed), dot-product or with metrics of ``metric_form="factor"``
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
        W = net.proj.weight.to(dt).view(h, d * r, -1)  # (h, d r, D)
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
        (a :class:`~riemannian_ref.attention.layer.RiemannianAttention`).
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
        :func:`token_radius` of each input (equal to ``eps`` up to rounding)
        and of its output.
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
        :class:`~riemannian_ref.attention.layer.RiemannianAttention` returns
        with ``return_weights=True``.

    Returns
    -------
    Tensor, shape [..., n_q]
        Between 0 (one key) and :math:`\log n_k` (uniform attention).
    """
    A = check_tensor(weights, "weights", min_dim=1)
    plogp = torch.where(A > 0, A * torch.log(torch.where(A > 0, A, torch.ones_like(A))), torch.zeros_like(A))
    return -plogp.sum(-1)


@torch.no_grad()
def linear_probe_accuracy(train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor, *,
                          rel_tol: float = 1e-6, ridge: float = 1e-3) -> float:
    r"""Test accuracy of a linear read-out of labels from features, at a stated precision.

    The features are centred; only principal directions whose amplitude
    (singular value over :math:`\sqrt N`) exceeds ``rel_tol`` times the
    root-mean-square norm of the *uncentred* features are kept, whitened,
    and mapped to one-hot labels by ridge regression; the prediction is the
    arg max. So a signal smaller than ``rel_tol`` of the states themselves
    (for example a residual that has collapsed below float32 resolution)
    carries no information for this probe, however cleanly it would
    separate the classes in exact arithmetic.

    Parameters
    ----------
    train_x, test_x : Tensor, shape [N, F] and [N', F]
        Features (e.g. hidden states of a deep layer, one row per token).
    train_y, test_y : Tensor of int, shape [N] and [N']
        Labels in ``0..K-1``.
    rel_tol : float
        Relative amplitude below which a direction is discarded.
    ridge : float
        Ridge penalty on the whitened features (unit variance per direction).

    Returns
    -------
    float
        The fraction of ``test_y`` predicted correctly.
    """
    for name, x in (("train_x", train_x), ("test_x", test_x)):
        check_tensor(x, name, min_dim=2)
        if x.dim() != 2:
            raise ValueError(f"{name} must have shape [N, F], got {shape_str(x)}")
    for name, y, x in (("train_y", train_y, train_x), ("test_y", test_y, test_x)):
        if not isinstance(y, Tensor) or y.dtype != torch.long or y.shape != x.shape[:1]:
            raise ValueError(f"{name} must be a long tensor of shape [{x.shape[0]}], got "
                             f"{shape_str(y) if isinstance(y, Tensor) else type(y).__name__}")
    if test_x.shape[1] != train_x.shape[1]:
        raise ValueError(f"test_x must have {train_x.shape[1]} features like train_x, got {shape_str(test_x)}")
    for name, v in (("rel_tol", rel_tol), ("ridge", ridge)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    X, Xt = train_x.double(), test_x.double()
    N = X.shape[0]
    mu = X.mean(0)
    scale = X.pow(2).sum(-1).mean().sqrt()  # rms norm of the uncentred features
    _, S, Vh = torch.linalg.svd(X - mu, full_matrices=False)
    keep = S / math.sqrt(N) > rel_tol * scale
    n_cls = int(max(train_y.max(), test_y.max())) + 1
    if not keep.any():
        Z, Zt = X.new_zeros(N, 0), X.new_zeros(Xt.shape[0], 0)
    else:
        P = Vh[keep].T / (S[keep] / math.sqrt(N))  # project and whiten      (F, k)
        Z, Zt = (X - mu) @ P, (Xt - mu) @ P
    Z1 = torch.cat([Z, torch.ones(N, 1, dtype=Z.dtype)], 1)  # with an intercept
    Y = torch.nn.functional.one_hot(train_y, n_cls).to(Z.dtype)
    reg = ridge * N * torch.eye(Z1.shape[1], dtype=Z.dtype)
    reg[-1, -1] = 0.0  # no penalty on the intercept
    B = torch.linalg.solve(Z1.T @ Z1 + reg, Z1.T @ Y)
    pred = (torch.cat([Zt, torch.ones(Zt.shape[0], 1, dtype=Z.dtype)], 1) @ B).argmax(-1)
    return float((pred == test_y).double().mean())
