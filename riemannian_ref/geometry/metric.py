r"""Per-token low-rank metrics and their cheap geometry.

A metric on a head space :math:`\mathbb{R}^d` is a symmetric positive-definite
matrix. We use

.. math:: G = \lambda I_d + U U^\top \quad\text{or}\quad G = \mathrm{diag}(\delta) + U U^\top,

with :math:`U \in \mathbb{R}^{d\times r}` and small rank :math:`r`. Every
operation below costs :math:`O(d r^2 + r^3)` (factor) or :math:`O(d r)` (apply)
per token: the Woodbury identity for :math:`G^{-1}` and the matrix determinant
lemma for :math:`\log\det G`; a dense :math:`d\times d` matrix is only formed
by :meth:`LowRankMetric.dense`, for checking.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .._checks import F32_MAX, as_positive, broadcast_batch, check_bool, check_gains_rank, check_same, check_tensor, shape_str

__all__ = ["LowRankMetric", "MetricNet", "SubspaceFactors"]

#: Default floor :math:`\lambda_{\min}` of every learned isotropic part: with
#: :math:`\lambda = \mathrm{softplus}(\rho) + \lambda_{\min}` the metric
#: :math:`G = \lambda I + U U^\top` is uniformly positive definite.
LAM_MIN = 1e-3



def lam_from_raw(rho: Tensor, lam_min: float = LAM_MIN) -> Tensor:
    r"""The package's one rule for a learned :math:`\lambda`: :math:`\mathrm{softplus}(\rho) + \lambda_{\min}`.

    Parameters
    ----------
    rho : Tensor, any shape
        The unconstrained parameter.
    lam_min : float
        The floor :math:`\lambda_{\min} > 0`.

    Returns
    -------
    Tensor, the shape of ``rho``
    """
    return nn.functional.softplus(rho) + lam_min


def raw_from_lam(lam_init: float, lam_min: float = LAM_MIN, *, name: str = "lam_init") -> float:
    r"""The :math:`\rho` with :func:`lam_from_raw` equal to ``lam_init``: :math:`\log(e^{\lambda - \lambda_{\min}} - 1)`.

    Parameters
    ----------
    lam_init : float
        The wanted :math:`\lambda`, finite, above ``lam_min`` and at most the
        largest float32 (about 3.4e38), so that :math:`\rho` fits the
        parameter it initialises.
    lam_min : float
        The floor, finite and :math:`> 0`.
    name : str
        The argument name used in error messages.

    Returns
    -------
    float

    Raises
    ------
    ValueError
        Naming ``name`` if ``lam_init`` is not a finite number in
        ``(lam_min, 3.4e38]`` or ``lam_min`` is not a finite positive number.
    """
    for nm, val in (("lam_min", lam_min), (name, lam_init)):
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
            raise ValueError(f"{nm} must be a finite number, got {val!r}")
    if not lam_min > 0:
        raise ValueError(f"lam_min must be > 0, got {lam_min!r}")
    if not lam_init > lam_min:
        raise ValueError(f"{name} must be > lam_min = {lam_min:g} (the floor of lambda), got {lam_init!r}")
    if lam_init > F32_MAX:  # rho ~ lam_init would overflow a float32 parameter
        raise ValueError(f"{name} must be at most {F32_MAX:.4g} (its raw parameter is a float32), got {lam_init!r}")
    x = float(lam_init) - float(lam_min)
    # log(expm1(x)) = x + log(1 - exp(-x)): no overflow for large x
    return x + math.log(-math.expm1(-x))


class LowRankMetric:
    r"""A batch of metrics :math:`G = \lambda I + U U^\top` (or :math:`\mathrm{diag}(\delta) + U U^\top`).

    Parameters
    ----------
    lam : float or Tensor, shape broadcastable to ``U.shape[:-2]``
        The isotropic part :math:`\lambda > 0`. Must be ``None`` when ``delta``
        is given.
    U : Tensor, shape [..., d, r]
        Low-rank factor; ``r = 0`` is allowed (then :math:`G = \lambda I`).
    delta : Tensor, shape [..., d], optional
        Diagonal part :math:`\delta > 0` for the diagonal-plus-low-rank form;
        its batch dimensions broadcast against ``U.shape[:-2]``.

    Notes
    -----
    Internally both forms are written :math:`G = D + U U^\top` with
    :math:`D` diagonal, and the :math:`r\times r` *capacitance* matrix
    :math:`C = I_r + U^\top D^{-1} U` (SPD, eigenvalues :math:`\ge 1`) is
    Cholesky-factored once, lazily, and cached. The cache remembers the
    tensors ``U``, ``lam`` / ``delta`` and their version counters: changing
    one of them in place (``U.add_(...)``, ``U[0] = ...``) or assigning a new
    tensor to the attribute refactors at the next use, so answers are never
    stale. (Inference-mode tensors have no version counter: for them nothing
    is cached.) The positivity of ``lam`` / ``delta`` is checked at
    construction only. Then

    .. math::
        G^{-1} w = D^{-1} w - D^{-1} U C^{-1} U^\top D^{-1} w,

        \log\det G = \textstyle\sum_a \log D_{aa} + \log\det C .
    """

    def __init__(self, lam, U: Tensor, delta: Tensor | None = None):
        U = check_tensor(U, "U", min_dim=2)
        self.U = U
        d = U.shape[-2]
        if delta is None:
            if lam is None:
                raise ValueError("lam must be given (a float or tensor > 0) when delta is None")
            lam_t = as_positive(lam, "lam", U)
            broadcast_batch({"lam": lam_t.shape, "U.shape[:-2]": U.shape[:-2]})
            self.lam = lam_t
            self.delta = None
        else:
            if lam is not None:
                raise ValueError(
                    "give either lam (G = lam I + U U^T) or delta (G = diag(delta) + U U^T), not both"
                )
            delta = check_tensor(delta, "delta", min_dim=1)
            check_same(U, "U", [("delta", delta)])
            if delta.shape[-1] != d:
                raise ValueError(
                    f"delta must have shape [..., d] with d = {d} (from U {shape_str(U)}), "
                    f"got {shape_str(delta)}"
                )
            as_positive(delta, "delta", U)
            broadcast_batch({"delta.shape[:-1]": delta.shape[:-1], "U.shape[:-2]": U.shape[:-2]})
            self.lam = None
            self.delta = delta
        self._chol: Tensor | None = None
        self._chol_key: tuple | None = None  # what the cached factor was computed from

    # ------------------------------------------------------------------ shapes
    @property
    def d(self) -> int:
        return self.U.shape[-2]

    @property
    def r(self) -> int:
        return self.U.shape[-1]

    @property
    def batch_shape(self) -> torch.Size:
        extra = self.lam.shape if self.delta is None else self.delta.shape[:-1]
        return torch.broadcast_shapes(self.U.shape[:-2], extra)

    def __repr__(self) -> str:
        form = "lam I" if self.delta is None else "diag(delta)"
        return f"LowRankMetric({form} + U U^T, batch={list(self.batch_shape)}, d={self.d}, r={self.r})"

    # ------------------------------------------------------------ internals
    def _dinv(self) -> Tensor:
        """:math:`D^{-1}` as a tensor broadcastable to [..., d]."""
        if self.delta is None:
            return (1.0 / self.lam).unsqueeze(-1)
        return 1.0 / self.delta

    def _dvec(self) -> Tensor:
        if self.delta is None:
            return self.lam.unsqueeze(-1)
        return self.delta

    def capacitance(self) -> Tensor:
        r"""The :math:`r\times r` matrix :math:`C = I_r + U^\top D^{-1} U`, shape [..., r, r]."""
        U = self.U
        DU = U * self._dinv().unsqueeze(-1)  # (..., d, r)
        C = U.transpose(-1, -2) @ DU  # (..., r, r)
        eye = torch.eye(self.r, dtype=U.dtype, device=U.device)
        return C + eye

    def _cache_key(self) -> tuple | None:
        """The tensors the factorisation reads, with their version counters (None: cannot tell, do not cache)."""
        ts = (self.U, self.lam, self.delta)
        try:
            return tuple((t, t._version) for t in ts if t is not None)
        except RuntimeError:  # inference tensors carry no version counter
            return None

    def _cholesky(self) -> Tensor:
        key = self._cache_key()
        old = self._chol_key
        fresh = (self._chol is not None and key is not None and old is not None and len(key) == len(old)
                 and all(a is b and va == vb for (a, va), (b, vb) in zip(key, old)))
        if not fresh:
            self._chol = torch.linalg.cholesky(self.capacitance())  # (..., r, r)
            self._chol_key = key
        return self._chol

    def _check_vec(self, v: Tensor, name: str) -> Tensor:
        v = check_tensor(v, name, min_dim=1)
        check_same(self.U, "U", [(name, v)])
        if v.shape[-1] != self.d:
            raise ValueError(f"{name} must have shape [..., d] with d = {self.d}, got {shape_str(v)}")
        broadcast_batch({f"{name}.shape[:-1]": v.shape[:-1], "metric batch": self.batch_shape})
        return v

    # ------------------------------------------------------------- geometry
    def matvec(self, v: Tensor) -> Tensor:
        r""":math:`G v` in :math:`O(d r)`.

        Parameters
        ----------
        v : Tensor, shape [..., d]

        Returns
        -------
        Tensor, shape [..., d] (batch dimensions broadcast with the metric's)
        """
        v = self._check_vec(v, "v")
        Utv = (self.U * v.unsqueeze(-1)).sum(-2)  # (..., r)
        return self._dvec() * v + (self.U @ Utv.unsqueeze(-1)).squeeze(-1)

    def quad(self, v: Tensor) -> Tensor:
        r"""Squared length :math:`v^\top G v = \lambda |v|^2 + |U^\top v|^2` in :math:`O(d r)`.

        Parameters
        ----------
        v : Tensor, shape [..., d]

        Returns
        -------
        Tensor, shape [...]
        """
        v = self._check_vec(v, "v")
        Utv = (self.U * v.unsqueeze(-1)).sum(-2)  # (..., r)
        return (self._dvec() * v * v).sum(-1) + (Utv * Utv).sum(-1)

    def inner(self, u: Tensor, v: Tensor) -> Tensor:
        r""":math:`u^\top G v`, shape [...], for ``u``, ``v`` of shape [..., d]."""
        u = self._check_vec(u, "u")
        return (u * self.matvec(v)).sum(-1)

    def solve(self, w: Tensor) -> Tensor:
        r""":math:`G^{-1} w` by the Woodbury identity.

        Factoring costs :math:`O(d r^2 + r^3)` once per metric (cached), each
        solve :math:`O(d r)`. ``w`` has shape [..., d], and so has the result
        (batch dimensions broadcast with the metric's).
        """
        w = self._check_vec(w, "w")
        dinv = self._dinv()
        y = dinv * w  # D^{-1} w                                   (..., d)
        Uty = (self.U * y.unsqueeze(-1)).sum(-2, keepdim=False)  # (..., r)
        if self.r > 0:
            z = torch.cholesky_solve(Uty.unsqueeze(-1), self._cholesky()).squeeze(-1)  # (..., r)
            y = y - dinv * (self.U @ z.unsqueeze(-1)).squeeze(-1)
        return y

    def logdet(self) -> Tensor:
        r""":math:`\log\det G = \sum_a \log D_{aa} + \log\det(I_r + U^\top D^{-1} U)`.

        Returns
        -------
        Tensor, shape [...] (the metric's batch shape)
        """
        if self.delta is None:
            base = self.d * torch.log(self.lam)
        else:
            base = torch.log(self.delta).sum(-1)
        if self.r == 0:
            return base.expand(self.batch_shape)
        L = self._cholesky()
        lowrank = 2.0 * torch.log(torch.diagonal(L, dim1=-2, dim2=-1)).sum(-1)
        return (base + lowrank).expand(self.batch_shape)

    def dense(self) -> Tensor:
        """The dense matrix :math:`G`, shape [..., d, d] (for checking and plots)."""
        D = torch.diag_embed(self._dvec().expand(*self.batch_shape, self.d))
        return D + self.U @ self.U.transpose(-1, -2)

    def inverse_dense(self) -> Tensor:
        r"""The dense inverse :math:`G^{-1}`, shape [..., d, d], via Woodbury in :math:`O(d^2 r)`."""
        dinv = self._dinv().expand(*self.batch_shape, self.d)
        out = torch.diag_embed(dinv)
        if self.r == 0:
            return out
        DU = self.U * dinv.unsqueeze(-1)  # D^{-1} U        (..., d, r)
        Z = torch.cholesky_solve(DU.transpose(-1, -2), self._cholesky())  # C^{-1} U^T D^{-1}   (..., r, d)
        return out - DU @ Z

    def average(self, other: "LowRankMetric") -> "LowRankMetric":
        r"""The metric :math:`(G + G')/2` as a low-rank metric of rank :math:`r + r'`.

        :math:`(G+G')/2 = \tfrac{D+D'}{2} + [U, U'] [U, U']^\top / 2`, so the
        "mean" pair metric of Riemannian attention stays in the family.
        """
        if not isinstance(other, LowRankMetric):
            raise ValueError(f"other must be a LowRankMetric, got {type(other).__name__}")
        check_same(self.U, "U", [("other.U", other.U)])
        if other.d != self.d:
            raise ValueError(f"other has d = {other.d}, expected d = {self.d}")
        batch = broadcast_batch({"self": self.batch_shape, "other": other.batch_shape})
        U = torch.cat(
            [self.U.expand(*batch, self.d, self.r), other.U.expand(*batch, other.d, other.r)], dim=-1
        ) / math.sqrt(2.0)
        if self.delta is None and other.delta is None:
            return LowRankMetric((self.lam + other.lam) / 2, U)
        delta = (self._dvec() + other._dvec()) / 2
        return LowRankMetric(None, U, delta=delta.expand(*batch, self.d))


class SubspaceFactors(NamedTuple):
    r"""Per-token metric factors that share one subspace per head: :math:`U_j = B\,C_j`.

    The metric of token :math:`j` is
    :math:`G_j = \lambda I + B\,C_j C_j^\top B^\top`: heterogeneous (every
    token has its own :math:`C_j`), but every token's low-rank part lives in
    the column space of one basis :math:`B` of :math:`m` columns. Pass it to
    :func:`~riemannian_ref.attention.functional.riemannian_attention` as
    ``U_k`` (or ``U_q``) where the per-token tensor ``B C`` would go: the
    scores are then one dot product of width :math:`d + m(m+1)/2 + 1`
    (chapter 6), and the call runs on ``scaled_dot_product_attention``,
    forward and backward. :class:`MetricNet` with ``subspace=m`` returns
    this type.

    Parameters
    ----------
    basis : Tensor, shape [..., d, m]
        :math:`B`, laid out as a shared factor (e.g. ``[1, h, d, m]``: one
        basis per head), :math:`m \ge 1`.
    coef : Tensor, shape [..., n, m, r]
        :math:`C_j` of every token, laid out as per-token factors with
        :math:`m` in place of :math:`d`; its batch dimensions broadcast
        against ``basis``'s. ``r = 0`` is allowed (then :math:`G = \lambda I`).
    """

    basis: Tensor
    coef: Tensor

    def dense(self) -> Tensor:
        """The per-token factors :math:`U_j = B C_j` as one tensor, shape [..., n, d, r].

        One product of the basis with every token's coefficients (the basis is
        not copied per token).
        """
        return torch.einsum("...dm,...nmr->...ndr", self.basis, self.coef)


#: Metric parameterisations of :class:`MetricNet`: ``"gains"`` (bounded, the default) and ``"factor"``.
METRIC_FORMS = ("gains", "factor")


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta, ...)
        return False


def _orthonormal_columns(V: Tensor, gram: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    r"""Gram-Schmidt on the columns of ``V [..., k, r]`` (differentiable); ``gram``: the inner product.

    With ``gram`` = :math:`K` (``[..., k, k]``, broadcasting against ``V``'s
    batch) the columns are orthonormalised for :math:`\langle a, b\rangle = a^\top K b`,
    so that :math:`B\,V` has orthonormal columns when :math:`K = B^\top B`. Every
    column :math:`v` is divided by :math:`\sqrt{|v|^2 + \epsilon^2}`: its norm is
    below 1 (1 up to :math:`\epsilon^2/|v|^2` unless the column is nearly 0 or
    dependent on the earlier ones), and the map is smooth at :math:`v = 0`. Half
    precision is computed in float32 and returned in the input dtype.
    """
    dtype = V.dtype
    V = V.float() if dtype in (torch.float16, torch.bfloat16) else V
    K = None if gram is None else gram.to(V.dtype)

    def inner(a: Tensor, b: Tensor) -> Tensor:
        if K is None:
            return (a * b).sum(-1)
        return (a * (K @ b.unsqueeze(-1)).squeeze(-1)).sum(-1)

    cols: list[Tensor] = []
    for t in range(V.shape[-1]):
        v = V[..., t]
        for u in cols:
            v = v - inner(u, v).unsqueeze(-1) * u
        cols.append(v / (inner(v, v).clamp_min(0) + eps * eps).sqrt().unsqueeze(-1))  # smooth at v = 0
    return torch.stack(cols, -1).to(dtype) if cols else V.to(dtype)


class MetricNet(nn.Module):
    r"""A metric network: token states to per-head metric factors.

    Produces, for every token and head, the factor :math:`U_i \in \mathbb{R}^{d\times r}`
    of a metric :math:`G_i = \lambda I + U_i U_i^\top`, with a learned per-head
    :math:`\lambda = \mathrm{softplus}(\rho) + \lambda_{\min}`
    (:func:`lam_from_raw`). A linear map of the token state gives a raw
    factor :math:`V_i`; ``form`` says how it becomes :math:`U_i`:

    * ``"gains"`` (default): :math:`G_i = \lambda\,(I + \sum_t \gamma_{ti}\,
      u_{ti} u_{ti}^\top)` with the columns :math:`u_{ti}` of :math:`V_i`
      orthonormalised (Gram-Schmidt) and per-token gains
      :math:`\gamma_{ti} = g_{\max}\,\mathrm{sigmoid}(a_{ti})` from a second
      linear map, :math:`a_i = W_a x_i + b_a`, whose bias starts at
      ``gain_bias``. So :math:`U_i = \sqrt{\lambda \gamma_{i}}\,u_{i}`, and every
      eigenvalue of :math:`G_i` lies in :math:`[\lambda, \lambda(1 + g_{\max})]`
      (``max_gain``): the metric's shape (directions and gains) cannot sharpen
      attention beyond a factor :math:`1 + g_{\max}`, and its overall
      sharpness is the per-head :math:`\lambda` alone. Chapter 13 of the book
      shows why this matters: with ``"factor"`` the size of :math:`U_i` grows
      freely in training and multiplies the temperature, and the attention
      of a language model's later layers collapses to one key.
    * ``"factor"``: :math:`U_i = V_i` (the form of package versions up to
      0.3), unbounded.

    With ``shared=True`` the raw factor is one learned parameter per head
    instead, :math:`V_h \in \mathbb{R}^{d\times r}` (and the gain logits one
    per head and direction), the same for every token (a shared metric).

    The linear map is initialised with standard deviation
    ``strength / sqrt(D r)``, so that for unit-variance token states every
    entry of :math:`U_i` has variance ``strength**2 / r`` and
    :math:`\mathbb{E}\,\|U_i^\top v\|^2 = \mathrm{strength}^2 \|v\|^2`
    whatever the rank: at init the metric is :math:`\lambda I` plus a
    perturbation of comparable size, and ``strength`` sweeps its heterogeneity.
    A shared factor gets entries of the same variance. (These are the raw
    factors :math:`V_i`; with ``form="gains"`` they set only the directions,
    and the gain map :math:`W_a` starts with standard deviation
    ``strength / sqrt(D)``, so ``strength`` sweeps how much the gains vary
    from token to token; ``strength=0`` gives :math:`V_i = 0`, no directions,
    and :math:`G_i = \lambda I` at init, a stationary point as in the
    factor form, since the scores depend on :math:`U_i U_i^\top`.)

    Parameters
    ----------
    d_model : int
        Width :math:`D` of the token states.
    n_heads : int
        Number of heads :math:`h`.
    head_dim : int
        Head dimension :math:`d`.
    rank : int
        Metric rank :math:`r \ge 0`.
    lam_init : float
        Initial :math:`\lambda` (default 1).
    lam_min : float
        Floor :math:`\lambda_{\min} > 0` that keeps :math:`G` uniformly SPD.
    strength : float
        Multiplies the initial weights: 0 gives :math:`U = 0` at init.
    shared : bool
        One learned factor per head (a parameter ``[h, d, r]``) instead of per-token
        factors computed from the states.
    diagonal : bool
        Also learn a per-token diagonal (:meth:`delta`) for the
        diagonal-plus-low-rank form :math:`G = \mathrm{diag}(\delta) + U U^\top`.
    bias : bool
        An affine network, :math:`U_i = W x_i + b`, with :math:`b` (one per
        head) drawn at init with the variance of a shared factor, so that the
        metric has a part that does not depend on the state. It is still
        Lipschitz in the state with the constant of :math:`W`.
    n_positions : int or None
        A metric field over positions instead of a network: one learned factor
        per position and head, :math:`U_p` (a parameter ``[n_positions, h, d, r]``,
        entries of the shared factor's variance); the token at position
        :math:`p` (``0..n-1``) gets :math:`U_p` whatever its state.
    form : {"gains", "factor"}, default "gains"
        The parameterisation (above): orthonormal directions with bounded
        per-token gains, or the raw factor.
    max_gain : float, default 4.0
        ``form="gains"``: the largest gain :math:`g_{\max} > 0`; the metric's
        eigenvalues lie in :math:`[\lambda, \lambda(1+g_{\max})]`.
    gain_bias : float, default -2.0
        ``form="gains"``: the initial bias of the gain logits; a token with
        :math:`W_a x = 0` starts with gains :math:`g_{\max}\,\mathrm{sigmoid}(b)`
        (0.48 for the defaults: the metric starts within a factor 1.5 of
        isotropic, and with ``strength > 0`` not at the stationary point
        :math:`U = 0`). The defaults were tuned on a split of the training
        text apart from every evaluation (chapter 13 of the book).
    subspace : int or None
        Per-token factors that share one learned subspace per head,
        :math:`U_i = B\,C_i` with a basis :math:`B` (a parameter ``[h, d, m]``,
        :math:`m` = ``subspace`` :math:`\le d`) and :math:`C_i = W x_i`
        (``[m, r]``, ``+ b`` with ``bias``): ``forward`` returns a
        :class:`SubspaceFactors`, on which attention runs as one dot product
        of width :math:`d + m(m+1)/2 + 1` (SDPA's kernels) instead of the
        per-token operator. :math:`B` starts with orthonormal columns times
        :math:`\sqrt{d/m}` and :math:`C_i` with the variance of a per-token
        factor, so :math:`\mathbb{E}\,\|U_i^\top v\|^2 = \mathrm{strength}^2 \|v\|^2`
        (on average over the basis) as without it. Needs ``rank >= 1`` and
        per-token metrics computed from the states.

    Notes
    -----
    Rank collapse (chapter 9 of the book): a metric computed by a Lipschitz
    network from the state (``shared``, or per token with or without ``bias``)
    differs between two tokens by at most a constant times their distance,
    so it homogenises when the tokens do; a metric indexed by position
    (``n_positions``) does not.
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, rank: int, *,
                 lam_init: float = 1.0, lam_min: float = LAM_MIN, strength: float = 1.0,
                 shared: bool = False, diagonal: bool = False, bias: bool = False,
                 n_positions: int | None = None, subspace: int | None = None,
                 form: str = "gains", max_gain: float = 4.0, gain_bias: float = -2.0):
        super().__init__()
        if not isinstance(form, str) or form not in METRIC_FORMS:
            raise ValueError(f"form must be one of {METRIC_FORMS}, got {form!r}")
        for name, val in (("max_gain", max_gain), ("gain_bias", gain_bias)):
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
                raise ValueError(f"{name} must be a finite number, got {val!r}")
        if max_gain <= 0:
            raise ValueError(f"max_gain must be > 0, got {max_gain!r}")
        for name, val in (("d_model", d_model), ("n_heads", n_heads), ("head_dim", head_dim)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {rank!r}")
        if isinstance(strength, bool) or not isinstance(strength, (int, float)) \
                or not (math.isfinite(strength) and strength >= 0):
            raise ValueError(f"strength must be a finite number >= 0, got {strength!r}")
        check_bool(shared, "shared")
        check_bool(diagonal, "diagonal")
        if diagonal and shared:
            raise ValueError("diagonal=True needs per-token metrics (shared=False)")
        if n_positions is not None:
            if isinstance(n_positions, bool) or not isinstance(n_positions, int) or n_positions <= 0:
                raise ValueError(f"n_positions must be a positive int or None, got {n_positions!r}")
            if shared or diagonal:
                raise ValueError("n_positions (a metric per position) excludes shared=True and diagonal=True")
        if bias and (shared or n_positions is not None):
            raise ValueError("bias=True needs metrics computed from the states (shared=False, n_positions=None)")
        if subspace is not None:
            if isinstance(subspace, bool) or not isinstance(subspace, int) or not 1 <= subspace <= head_dim:
                raise ValueError(f"subspace must be an int in [1, head_dim = {head_dim}] or None, got {subspace!r}")
            if shared or diagonal or n_positions is not None:
                raise ValueError("subspace (per-token factors in a shared subspace) needs per-token metrics "
                                 "computed from the states: shared=False, diagonal=False, n_positions=None")
            if rank == 0:
                raise ValueError("subspace needs rank >= 1 (with rank 0 there is no factor to place)")
        check_gains_rank(form, rank, head_dim if subspace is None else subspace, subspace is not None)
        rho = raw_from_lam(lam_init, lam_min)
        self.d_model, self.n_heads, self.head_dim, self.rank = d_model, n_heads, head_dim, rank
        self.lam_min, self.shared, self.diagonal = lam_min, shared, diagonal
        self.n_positions, self.subspace = n_positions, subspace
        self.form, self.max_gain, self.gain_bias = form, float(max_gain), float(gain_bias)
        h, d, r = n_heads, head_dim, rank
        self.rho = nn.Parameter(torch.full((h,), rho))
        self.proj = self.U = self.U_pos = self.basis = None
        std_shared = strength / math.sqrt(max(r, 1))  # entries of a factor not computed from the state
        if subspace is not None:
            m = subspace
            Q, R = torch.linalg.qr(torch.randn(h, d, m))  # orthonormal columns (Haar), times sqrt(d/m)
            Q = Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)
            self.basis = nn.Parameter((Q * math.sqrt(d / m)).contiguous())  # (h, d, m); QR gives column-major
            self.proj = nn.Linear(d_model, h * m * r, bias=bias)  # C_i = W x_i (+ b), (m, r) per head
            nn.init.normal_(self.proj.weight, std=strength / math.sqrt(d_model * r))
            if bias:
                nn.init.normal_(self.proj.bias, std=std_shared)
        elif shared:
            self.U = nn.Parameter(torch.randn(h, d, r) * std_shared)  # (h, d, r)
        elif n_positions is not None:
            self.U_pos = nn.Parameter(torch.randn(n_positions, h, d, r) * std_shared)  # (P, h, d, r)
        elif r > 0:
            self.proj = nn.Linear(d_model, h * d * r, bias=bias)
            nn.init.normal_(self.proj.weight, std=strength / math.sqrt(d_model * r))
            if bias:
                nn.init.normal_(self.proj.bias, std=std_shared)
        # form="gains": the gain logits a = W_a x + b_a (per token), or one per head (shared) or position
        self.gain = self.gain_shared = None
        if form == "gains" and r > 0:
            if shared:
                self.gain_shared = nn.Parameter(torch.full((h, r), float(gain_bias)))
            elif n_positions is not None:
                self.gain_shared = nn.Parameter(torch.full((n_positions, h, r), float(gain_bias)))
            else:
                self.gain = nn.Linear(d_model, h * r)
                nn.init.normal_(self.gain.weight, std=strength / math.sqrt(d_model))
                nn.init.constant_(self.gain.bias, float(gain_bias))
        self.diag_proj = None
        if diagonal:
            self.diag_proj = nn.Linear(d_model, h * d)
            nn.init.zeros_(self.diag_proj.weight)
            nn.init.zeros_(self.diag_proj.bias)

    def lam(self) -> Tensor:
        """Per-head :math:`\\lambda`, shape [h]."""
        return lam_from_raw(self.rho, self.lam_min)

    def _check_x(self, x: Tensor) -> Tensor:
        x = check_tensor(x, "x", min_dim=3)
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape [B, n, {self.d_model}], got {shape_str(x)}")
        return x

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | SubspaceFactors]:
        """Metric factors for every token and head.

        Parameters
        ----------
        x : Tensor, shape [B, n, D]

        Returns
        -------
        lam : Tensor, shape [h]
            Broadcasts against the ``[B, h]`` batch of queries and keys.
        U : Tensor, shape [B, h, n, d, r], or [1, h, d, r] when ``shared``
            (a shared factor broadcasts against the batch of queries and keys),
            or [1, h, n, d, r] with ``n_positions`` (the factors of positions
            ``0..n-1``, the same for every sequence); with ``subspace`` a
            :class:`SubspaceFactors` of ``basis`` [1, h, d, m] and ``coef``
            [B, h, n, m, r] (``U.dense()`` is the [B, h, n, d, r] tensor).
        """
        if self.form == "gains" and self.rank > 0 and isinstance(x, Tensor) and _autocast_on(x.device.type):
            # Normalising the directions projects the factor's gradient onto the directions' complement,
            # a difference of nearly equal terms: in float16 it loses most of its digits (measured: 20%
            # error on the direction weights' gradient). The metric network is small: it runs in float32
            # (or the states' wider dtype), and attention takes float32 factors under autocast.
            with torch.autocast(x.device.type, enabled=False):
                return self._forward(x.float() if x.dtype in (torch.float16, torch.bfloat16) else x)
        return self._forward(x)

    def _forward(self, x: Tensor) -> tuple[Tensor, Tensor | SubspaceFactors]:
        """The computation of :meth:`forward`."""
        x = self._check_x(x)
        B, n, _ = x.shape
        h, d, r = self.n_heads, self.head_dim, self.rank
        lam = self.lam().to(x.dtype)
        if self.basis is not None:
            m = self.subspace
            C = self.proj(x).view(B, n, h, m, r).permute(0, 2, 1, 3, 4)  # (B, h, n, m, r)
            basis = self.basis.to(x.dtype).unsqueeze(0)  # (1, h, d, m)
            if self.form == "gains":  # orthonormal in the basis' inner product, so B C has orthonormal columns
                C = self._scale(_orthonormal_columns(C, gram=(basis.mT @ basis).unsqueeze(2)), lam, x)
            return lam, SubspaceFactors(basis, C)
        if self.shared:
            U = self.U.to(x.dtype).unsqueeze(0)  # (1, h, d, r)
        elif self.U_pos is not None:
            if n > self.n_positions:
                raise ValueError(f"x has n = {n} tokens but the metric field covers n_positions = "
                                 f"{self.n_positions} positions")
            U = self.U_pos[:n].to(x.dtype).transpose(0, 1).unsqueeze(0)  # (1, h, n, d, r)
        elif self.proj is None:
            return lam, x.new_zeros(B, h, n, d, 0)
        else:
            U = self.proj(x).view(B, n, h, d, r).permute(0, 2, 1, 3, 4)  # (B, h, n, d, r)
        if self.form == "gains" and r > 0:
            U = self._scale(_orthonormal_columns(U), lam, x)
        return lam, U

    def gains(self, x: Tensor) -> Tensor:
        r"""The gains :math:`\gamma = g_{\max}\,\mathrm{sigmoid}(a)` of ``form="gains"``.

        Takes the states ``x`` [B, n, D]; returns [B, h, n, r] (per token),
        [1, h, r] (``shared``) or [1, h, n, r] (``n_positions``).
        """
        return self.max_gain * torch.sigmoid(self._gain_logits(x))

    def _gain_logits(self, x: Tensor) -> Tensor:
        if self.form != "gains" or self.rank == 0:
            raise ValueError(f"gains() needs form='gains' and rank >= 1, got form={self.form!r}, rank={self.rank}")
        x = self._check_x(x)
        B, n, _ = x.shape
        h, r = self.n_heads, self.rank
        if self.gain is not None:
            return self.gain(x).view(B, n, h, r).transpose(1, 2)  # (B, h, n, r)
        if self.shared:
            return self.gain_shared.to(x.dtype).unsqueeze(0)  # (1, h, r)
        return self.gain_shared[:n].to(x.dtype).transpose(0, 1).unsqueeze(0)  # (1, h, n, r)

    def _scale(self, U: Tensor, lam: Tensor, x: Tensor) -> Tensor:
        r"""Orthonormal directions ``U [..., k, r]`` times :math:`\sqrt{\lambda\gamma}` per column."""
        a = self._gain_logits(x)
        # sqrt(gamma) = sqrt(g_max) exp(logsigmoid(a) / 2): smooth where sigmoid(a) underflows to 0
        root = math.sqrt(self.max_gain) * torch.exp(0.5 * nn.functional.logsigmoid(a))
        root = root * lam.sqrt().view((-1,) + (1,) * (a.dim() - 2))  # lam per head: dim 1 of every layout
        return U * root.unsqueeze(-2)

    def delta(self, x: Tensor) -> Tensor:
        r"""Per-token diagonal :math:`\delta_i = \lambda\,\mathrm{softplus}(W x_i)/\log 2 + \lambda_{\min}`.

        Equal to :math:`\lambda + \lambda_{\min}` at init (zero weights). Takes
        the states ``x`` [B, n, D] and returns the diagonals, shape [B, h, n, d].
        """
        if self.diag_proj is None:
            raise ValueError("delta() needs a MetricNet built with diagonal=True")
        x = self._check_x(x)
        B, n, _ = x.shape
        h, d = self.n_heads, self.head_dim
        raw = self.diag_proj(x).view(B, n, h, d).transpose(1, 2)  # (B, h, n, d)
        return self.lam().view(h, 1, 1) * nn.functional.softplus(raw) / math.log(2.0) + self.lam_min
