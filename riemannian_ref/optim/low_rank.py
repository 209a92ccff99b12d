"""Rank-``r`` matrices :math:`W = A B^\\top` held as a factor pair: the embedded and the factored geometry.

A model holds ``W`` as two parameters ``A`` [..., m, r] and ``B`` [..., n, r]
(a head's ``W_Q, W_K``), so a point is the pair ``(A, B)``: the manifold works
on the pair and returns new factors, stored *balanced*
(:math:`A^\\top A = B^\\top B`, the same :math:`A B^\\top`). Tangent vectors are
one tensor each:

* :class:`FixedRankEmbedded` -- the embedded submanifold of rank-``r``
  matrices with the Frobenius metric; a tangent vector is the ``m x n`` matrix
  :math:`U M V^\\top + U_p V^\\top + U V_p^\\top` (it does not depend on which
  factorisation holds the point); the retraction is the rank-``r`` truncated
  SVD of :math:`W + \\xi` through a :math:`2r \\times 2r` core (Vandereycken 2013).
* :class:`FixedRankFactored` -- the quotient geometry of :math:`(A, B) \\sim
  (A P, B P^{-\\top})` with the metric :math:`\\operatorname{tr}(B^\\top B\\,
  \\xi_A^\\top \\eta_A) + \\operatorname{tr}(A^\\top A\\, \\xi_B^\\top \\eta_B)` (Mishra,
  Meyer, Bonnabel and Sepulchre 2014); a tangent vector is the stacked pair
  :math:`[\\xi_A; \\xi_B]` of shape ``[..., m + n, r]``; the retraction adds the
  step to the factors and balances them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_number, check_same, check_tensor, shape_str
from .manifold import Manifold, _same_shape, _shape
from .stiefel import Stiefel

__all__ = ["FixedRankEmbedded", "FixedRankFactored"]


def _balance(A: Tensor, B: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Balanced factors ``A P``, ``B P^{-T}`` with the same product, and ``P``, ``P^{-T}`` ([..., r, r]).

    :math:`A = Q_a R_a`, :math:`B = Q_b R_b`, :math:`R_a R_b^\\top = U_c \\Sigma V_c^\\top`:
    :math:`A P = Q_a U_c \\Sigma^{1/2}`, :math:`B P^{-\\top} = Q_b V_c \\Sigma^{1/2}`.
    """
    Qa, Ra = torch.linalg.qr(A)
    Qb, Rb = torch.linalg.qr(B)
    Uc, s, Vch = torch.linalg.svd(Ra @ Rb.transpose(-1, -2))
    rs = s.clamp_min(torch.finfo(s.dtype).tiny).sqrt().unsqueeze(-2)  # (..., 1, r)
    Vc = Vch.transpose(-1, -2)
    P = torch.linalg.solve_triangular(Ra, Uc * rs, upper=True)
    Pit = torch.linalg.solve_triangular(Rb, Vc * rs, upper=True)
    return (Qa @ Uc) * rs, (Qb @ Vc) * rs, P, Pit


class _FactorPair(Manifold):
    """What both geometries share: the pair's checks, balancing, sampling and :meth:`to_dense`."""

    n_tensors = 2

    @staticmethod
    def _pair(x, name: str = "x") -> tuple[Tensor, Tensor]:
        if not (isinstance(x, (tuple, list)) and len(x) == 2):
            raise ValueError(f"{name} must be a factor pair (A, B), got {type(x).__name__}")
        A, B = x
        check_tensor(A, f"{name}[0] (A)", min_dim=2)
        check_tensor(B, f"{name}[1] (B)", min_dim=2)
        check_same(A, f"{name}[0] (A)", [(f"{name}[1] (B)", B)])
        if A.shape[-1] != B.shape[-1] or A.shape[:-2] != B.shape[:-2]:
            raise ValueError(f"{name}: A [..., m, r] and B [..., n, r] must agree in batch and r, got "
                             f"{shape_str(A)} and {shape_str(B)}")
        return A, B

    def to_dense(self, x) -> Tensor:
        """:math:`A B^\\top`, shape [..., m, n]."""
        A, B = self._pair(x)
        return A @ B.transpose(-1, -2)

    def projx(self, x) -> tuple[Tensor, Tensor]:
        """The balanced representative of the pair (same :math:`A B^\\top`)."""
        A, B = self._pair(x)
        return _balance(A, B)[:2]

    def check_point(self, x, *, atol: float | None = None) -> None:
        """Raise ``ValueError`` unless ``A``, ``B`` are finite and of full column rank ``r <= min(m, n)``.

        A factor counts as rank deficient when its smallest singular value is at
        most ``atol`` times its largest (default: rows times the dtype's epsilon).
        """
        A, B = self._pair(x)
        for name, F in (("A", A), ("B", B)):
            what = f"factor {name} {shape_str(F)}"
            if not bool(torch.isfinite(F).all()):
                raise ValueError(f"{what} has non-finite entries")
            if F.shape[-1] > F.shape[-2]:
                raise ValueError(f"{what} has {F.shape[-1]} columns but only {F.shape[-2]} rows, so W = A B^T has "
                                 f"rank below r = {F.shape[-1]}; a rank-r pair needs r <= min(m, n)")
            if F.shape[-1] and F.numel():
                s = torch.linalg.svdvals(F.detach())  # (..., r), descending
                rel = atol if atol is not None else F.shape[-2] * torch.finfo(F.dtype).eps
                if bool((s[..., -1] <= rel * s[..., 0]).any()):
                    raise ValueError(
                        f"{what} has rank below r = {F.shape[-1]} (smallest singular value "
                        f"{float(s[..., -1].min()):.3g}), so W = A B^T is not a point of the rank-r manifold; a zero "
                        "factor (LoRA's B = 0 at init) is not one: initialise both with full column rank")

    def _check_grad(self, x, g) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        A, B = self._pair(x)
        gA, gB = self._pair(g, "g")
        _same_shape(A, "A", gA, "g[0]")
        _same_shape(B, "B", gB, "g[1]")
        return A, B, gA, gB

    def random(self, *shape: int, generator: torch.Generator | None = None,
               dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """A random balanced pair for ``shape = (..., m, n, r)``: Haar singular vectors, singular values in [1, 2]."""
        shape = _shape(shape, "(..., m, n, r) with 1 <= r <= min(m, n)")
        if len(shape) < 3 or not 1 <= shape[-1] <= min(shape[-3:-1]):
            raise ValueError(f"shape must be ints (..., m, n, r) with 1 <= r <= min(m, n), got {shape}")
        *batch, m, n, r = shape
        st = Stiefel()
        U = st.random(*batch, m, r, generator=generator, dtype=dtype)
        V = st.random(*batch, n, r, generator=generator, dtype=dtype)
        s = (1.0 + torch.rand(*batch, 1, r, generator=generator, dtype=dtype)).sqrt()
        return U * s, V * s


class FixedRankEmbedded(_FactorPair):
    """Rank-``r`` matrices as an embedded submanifold of :math:`\\mathbb{R}^{m \\times n}`, on factor pairs.

    Tangent space at :math:`W = U \\Sigma V^\\top`: :math:`\\{U M V^\\top + U_p V^\\top
    + U V_p^\\top\\}` with :math:`U_p \\perp U`, :math:`V_p \\perp V`; a tangent
    vector is that ``m x n`` matrix, so it keeps its meaning when the factors'
    SVD basis changes between steps. The Riemannian gradient is the projection
    of the Euclidean gradient ``G`` of ``W``, computed from what autograd gives
    for the factors, :math:`g_A = G B` and :math:`g_B = G^\\top A`
    (:math:`G V = g_A B^{+} V`). Retraction: rank-``r`` truncated SVD of
    :math:`W + \\xi`; transport: projection.
    """

    name = "FixedRankEmbedded(frobenius metric, truncated-SVD retraction)"

    def _svd(self, A: Tensor, B: Tensor):
        """:math:`A B^\\top = U \\operatorname{diag}(s) V^\\top` from two thin QRs and an ``r x r`` SVD."""
        Qa, Ra = torch.linalg.qr(A)
        Qb, Rb = torch.linalg.qr(B)
        Uc, s, Vch = torch.linalg.svd(Ra @ Rb.transpose(-1, -2))
        Vc = Vch.transpose(-1, -2)
        return Qa @ Uc, s, Qb @ Vc, (Ra, Rb, Uc, Vc)

    @staticmethod
    def _parts(U: Tensor, V: Tensor, ZV: Tensor, ZtU: Tensor):
        """:math:`(M, U_p, V_p)` of the projection of a ``Z`` known by its sketches ``Z V``, ``Z^T U``."""
        M = U.transpose(-1, -2) @ ZV  # (..., r, r)
        return M, ZV - U @ M, ZtU - V @ M.transpose(-1, -2)

    @staticmethod
    def _dense(U: Tensor, V: Tensor, M: Tensor, Up: Tensor, Vp: Tensor) -> Tensor:
        Vt = V.transpose(-1, -2)
        return U @ M @ Vt + Up @ Vt + U @ Vp.transpose(-1, -2)

    def _ambient(self, x, u: Tensor) -> tuple[Tensor, Tensor]:
        A, B = self._pair(x)
        check_tensor(u, "u", min_dim=2)
        check_same(A, "A", [("u", u)])
        want = (*A.shape[:-1], B.shape[-2])
        if tuple(u.shape) != want:
            raise ValueError(f"u must be an m x n matrix of shape {list(want)}, got {shape_str(u)}")
        return A, B

    def proju(self, x, u: Tensor) -> Tensor:
        """:math:`P_U u + u P_V - P_U u P_V` for ``u`` of shape [..., m, n]."""
        A, B = self._ambient(x, u)
        U, _, V, _ = self._svd(A, B)
        return self._dense(U, V, *self._parts(U, V, u @ V, u.transpose(-1, -2) @ U))

    def egrad2rgrad(self, x, g) -> Tensor:
        """The projection of ``G`` from the factor gradients ``g = (G B, G^T A)``; shape [..., m, n]."""
        A, B, gA, gB = self._check_grad(x, g)
        U, _, V, (Ra, Rb, Uc, Vc) = self._svd(A, B)
        ZV = gA @ torch.linalg.solve_triangular(Rb, Vc, upper=True)  # G V = g_A R_b^{-1} V_c
        ZtU = gB @ torch.linalg.solve_triangular(Ra, Uc, upper=True)
        return self._dense(U, V, *self._parts(U, V, ZV, ZtU))

    def inner(self, x, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False) -> Tensor:
        """Frobenius inner product per matrix: shape [...] ([..., 1, 1] with ``keepdim``)."""
        self._ambient(x, u)
        v = u if v is None else v
        self._ambient(x, v)
        return (u * v).sum(dim=(-1, -2), keepdim=keepdim)

    def retr(self, x, u: Tensor) -> tuple[Tensor, Tensor]:
        """Balanced factors of the rank-``r`` truncated SVD of :math:`A B^\\top + u` (``u`` tangent).

        :math:`W + \\xi = [U\\ Q_u] \\begin{bmatrix} \\Sigma + M & R_v^\\top \\\\ R_u & 0
        \\end{bmatrix} [V\\ Q_v]^\\top` with :math:`U_p = Q_u R_u`, :math:`V_p = Q_v R_v`:
        an SVD of the :math:`2r \\times 2r` core, :math:`O((m + n) r^2 + r^3)` after the sketches.
        """
        A, B = self._ambient(x, u)
        U, s, V, _ = self._svd(A, B)
        M, Up, Vp = self._parts(U, V, u @ V, u.transpose(-1, -2) @ U)
        r = s.shape[-1]
        Qu, Ru = torch.linalg.qr(Up)
        Qv, Rv = torch.linalg.qr(Vp)
        top = torch.cat([torch.diag_embed(s) + M, Rv.transpose(-1, -2)], dim=-1)  # (..., r, 2r)
        core = torch.cat([top, torch.cat([Ru, torch.zeros_like(Ru)], dim=-1)], dim=-2)  # (..., 2r, 2r)
        Uc, s2, Vch = torch.linalg.svd(core)
        rs = s2[..., :r].clamp_min(0).sqrt().unsqueeze(-2)
        U2 = torch.cat([U, Qu], dim=-1) @ Uc[..., :r]
        V2 = torch.cat([V, Qv], dim=-1) @ Vch[..., :r, :].transpose(-1, -2)
        return U2 * rs, V2 * rs


class FixedRankFactored(_FactorPair):
    """Rank-``r`` matrices :math:`W = A B^\\top` with the quotient (scaled) metric, on factor pairs.

    Metric :math:`\\operatorname{tr}(B^\\top B\\, \\xi_A^\\top \\eta_A) +
    \\operatorname{tr}(A^\\top A\\, \\xi_B^\\top \\eta_B)`, invariant under
    :math:`(A, B) \\mapsto (A P, B P^{-\\top})`, so the step on ``W`` does not
    depend on which factorisation the parameters hold. Riemannian gradient: the
    scaled gradient :math:`(g_A (B^\\top B)^{-1}, g_B (A^\\top A)^{-1})`. Tangent
    vectors ``[..., m + n, r]`` (every pair is tangent: ``proju`` and
    ``transp`` are the identity). Retraction: :math:`(A + \\xi_A, B + \\xi_B)`
    balanced, and :meth:`retr_transp` carries a tangent vector by the same
    change of basis :math:`(\\eta_A P, \\eta_B P^{-\\top})`.

    Parameters
    ----------
    eps : float
        Relative ridge :math:`\\epsilon \\operatorname{tr}(X^\\top X)/r` added to
        :math:`X^\\top X` before inverting (default 1e-12; 0 for the exact metric).
    """

    name = "FixedRankFactored(quotient metric, balanced retraction)"

    def __init__(self, eps: float = 1e-12):
        check_number(eps, "eps", low=0.0)
        self.eps = eps

    def _split(self, x, u: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        A, B = self._pair(x)
        check_tensor(u, "u", min_dim=2)
        check_same(A, "A", [("u", u)])
        m = A.shape[-2]
        want = (*A.shape[:-2], m + B.shape[-2], A.shape[-1])
        if tuple(u.shape) != want:
            raise ValueError(f"u must be a stacked pair [u_A; u_B] of shape {list(want)}, got {shape_str(u)}")
        return A, B, u[..., :m, :], u[..., m:, :]

    def proju(self, x, u: Tensor) -> Tensor:
        """``u`` itself ([..., m + n, r]): every pair of factor directions is tangent."""
        self._split(x, u)
        return u

    def _gram_inv(self, X: Tensor, gX: Tensor) -> Tensor:
        gram = X.transpose(-1, -2) @ X
        if self.eps:
            ridge = self.eps * torch.diagonal(gram, dim1=-2, dim2=-1).mean(-1)  # (...)
            gram = gram + ridge[..., None, None] * torch.eye(X.shape[-1], dtype=X.dtype, device=X.device)
        return torch.linalg.solve(gram, gX.transpose(-1, -2)).transpose(-1, -2)  # gX (X^T X)^{-1}

    def egrad2rgrad(self, x, g) -> Tensor:
        """The scaled gradient, stacked: :math:`[g_A (B^\\top B)^{-1}; g_B (A^\\top A)^{-1}]`."""
        A, B, gA, gB = self._check_grad(x, g)
        return torch.cat([self._gram_inv(B, gA), self._gram_inv(A, gB)], dim=-2)

    def inner(self, x, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False) -> Tensor:
        """The quotient metric per matrix: shape [...] ([..., 1, 1] with ``keepdim``)."""
        A, B, uA, uB = self._split(x, u)
        _, _, vA, vB = self._split(x, u if v is None else v)
        out = ((uA @ (B.transpose(-1, -2) @ B)) * vA).sum(dim=(-1, -2), keepdim=keepdim)
        return out + ((uB @ (A.transpose(-1, -2) @ A)) * vB).sum(dim=(-1, -2), keepdim=keepdim)

    def retr(self, x, u: Tensor) -> tuple[Tensor, Tensor]:
        """:math:`(A + u_A, B + u_B)`, balanced."""
        return self.retr_transp(x, u, u)[0]

    def retr_transp(self, x, u: Tensor, v: Tensor):
        """The retraction, and ``v`` carried by its change of basis: :math:`[v_A P; v_B P^{-\\top}]`."""
        A, B, uA, uB = self._split(x, u)
        _, _, vA, vB = self._split(x, v)
        A2, B2, P, Pit = _balance(A + uA, B + uB)
        return (A2, B2), torch.cat([vA @ P, vB @ Pit], dim=-2)
