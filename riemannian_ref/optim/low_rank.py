"""Rank-``r`` matrices: the embedded fixed-rank manifold and the factored quotient, with geoopt's verbs.

* :class:`FixedRankEmbedded` -- the embedded submanifold of rank-``r`` matrices
  :math:`\\mathcal{M}_r \\subset \\mathbb{R}^{m \\times n}`; points are stored as
  a thin SVD ``(U, s, V)``, tangent vectors as ``(M, Up, Vp)`` with
  :math:`\\xi = U M V^\\top + U_p V^\\top + U V_p^\\top`, :math:`U^\\top U_p = 0`,
  :math:`V^\\top V_p = 0`; the retraction is the rank-``r`` truncated SVD of
  :math:`X + \\xi`, computed from a :math:`2r \\times 2r` core (Vandereycken
  2013).
* :class:`FactoredLowRank` -- rank-``r`` matrices written as :math:`W = A B^\\top`
  with :math:`A \\in \\mathbb{R}^{m \\times r}, B \\in \\mathbb{R}^{n \\times r}`.
  The factorisation is unique only up to :math:`(A, B) \\mapsto (A P, B
  P^{-\\top})`, :math:`P \\in GL(r)`. We use the quotient metric
  :math:`g_{(A,B)}((\\xi_A, \\xi_B), (\\eta_A, \\eta_B)) =
  \\operatorname{tr}(B^\\top B\\, \\xi_A^\\top \\eta_A) + \\operatorname{tr}(A^\\top
  A\\, \\xi_B^\\top \\eta_B)`, which is invariant under that group action (Mishra,
  Meyer, Bonnabel and Sepulchre 2014); its Riemannian gradient is the *scaled*
  gradient :math:`(G B (B^\\top B)^{-1}, G^\\top A (A^\\top A)^{-1})`. The
  retraction adds the step to the factors and then *balances* them
  (:math:`A^\\top A = B^\\top B`, a canonical representative of the orbit) without
  changing :math:`A B^\\top`.

Library code: nothing prints; every public function validates its inputs and
raises ``ValueError`` naming the argument.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .._checks import check_same, check_tensor, shape_str
from .manifolds import _same_shape, Stiefel

__all__ = ["FixedRankPoint", "FixedRankTangent", "FixedRankEmbedded", "FactoredLowRank"]


class FixedRankPoint(NamedTuple):
    """A rank-``r`` matrix :math:`X = U \\operatorname{diag}(s) V^\\top`.

    Parameters
    ----------
    U : Tensor, shape [..., m, r]   (orthonormal columns)
    s : Tensor, shape [..., r]      (positive singular values, descending)
    V : Tensor, shape [..., n, r]   (orthonormal columns)
    """

    U: Tensor
    s: Tensor
    V: Tensor


class FixedRankTangent(NamedTuple):
    """A tangent vector :math:`\\xi = U M V^\\top + U_p V^\\top + U V_p^\\top`.

    Parameters
    ----------
    M : Tensor, shape [..., r, r]
    Up : Tensor, shape [..., m, r]  (:math:`U^\\top U_p = 0`)
    Vp : Tensor, shape [..., n, r]  (:math:`V^\\top V_p = 0`)
    """

    M: Tensor
    Up: Tensor
    Vp: Tensor


class FixedRankEmbedded:
    """Rank-``r`` matrices as an embedded submanifold of :math:`\\mathbb{R}^{m \\times n}`.

    Metric: the Frobenius inner product of the ambient space. Tangent space at
    :math:`X = U \\Sigma V^\\top`:
    :math:`\\{U M V^\\top + U_p V^\\top + U V_p^\\top\\}` with :math:`U_p \\perp U`,
    :math:`V_p \\perp V`; the three parts are mutually orthogonal, so
    :math:`|\\xi|_F^2 = |M|_F^2 + |U_p|_F^2 + |V_p|_F^2`. The projection of an
    ambient ``Z`` needs only the sketches ``Z V`` and ``Z^T U`` (see
    :meth:`proju_sketch`), which a factored model can supply without forming
    ``Z``. Retraction: rank-``r`` truncated SVD of :math:`X + \\xi`, through a
    :math:`2r \\times 2r` core (Vandereycken 2013; Absil et al. 2008).
    """

    name = "FixedRankEmbedded(frobenius metric, truncated-SVD retraction)"

    # -- conversions ------------------------------------------------------
    def from_dense(self, x: Tensor, r: int) -> FixedRankPoint:
        """Rank-``r`` truncated SVD of ``x`` [..., m, n] as a point."""
        check_tensor(x, "x", min_dim=2)
        if not 1 <= r <= min(x.shape[-2:]):
            raise ValueError(f"r must be in [1, min(m, n)] = [1, {min(x.shape[-2:])}], got {r}")
        U, s, Vh = torch.linalg.svd(x, full_matrices=False)
        return FixedRankPoint(U[..., :r], s[..., :r], Vh[..., :r, :].transpose(-1, -2))

    def from_factors(self, A: Tensor, B: Tensor) -> FixedRankPoint:
        """The point :math:`A B^\\top` from factors ``A`` [..., m, r], ``B`` [..., n, r].

        Uses two thin QRs and an ``r x r`` SVD (no ``m x n`` matrix).
        """
        check_tensor(A, "A", min_dim=2)
        check_tensor(B, "B", min_dim=2)
        check_same(A, "A", [("B", B)])
        if A.shape[-1] != B.shape[-1] or A.shape[:-2] != B.shape[:-2]:
            raise ValueError(f"A [..., m, r] and B [..., n, r] must agree in r and batch, got {shape_str(A)} and {shape_str(B)}")
        Qa, Ra = torch.linalg.qr(A)  # (..., m, r), (..., r, r)
        Qb, Rb = torch.linalg.qr(B)  # (..., n, r), (..., r, r)
        Uc, s, Vch = torch.linalg.svd(Ra @ Rb.transpose(-1, -2))
        return FixedRankPoint(Qa @ Uc, s, Qb @ Vch.transpose(-1, -2))

    def to_dense(self, x: FixedRankPoint) -> Tensor:
        """The matrix :math:`U \\operatorname{diag}(s) V^\\top`, shape [..., m, n]."""
        return (x.U * x.s.unsqueeze(-2)) @ x.V.transpose(-1, -2)

    def tangent_to_dense(self, x: FixedRankPoint, t: FixedRankTangent) -> Tensor:
        """The ambient matrix of a tangent vector, shape [..., m, n]."""
        Vt = x.V.transpose(-1, -2)
        return x.U @ t.M @ Vt + t.Up @ Vt + x.U @ t.Vp.transpose(-1, -2)

    # -- projections ------------------------------------------------------
    def proju_sketch(self, x: FixedRankPoint, ZV: Tensor, ZtU: Tensor) -> FixedRankTangent:
        """Tangent projection of an ambient ``Z`` given only ``Z V`` and ``Z^T U``.

        Parameters
        ----------
        x : FixedRankPoint
        ZV : Tensor, shape [..., m, r]
        ZtU : Tensor, shape [..., n, r]

        Returns
        -------
        FixedRankTangent
            :math:`M = U^\\top Z V`, :math:`U_p = Z V - U M`,
            :math:`V_p = Z^\\top U - V M^\\top`.
        """
        _same_shape(x.U, "x.U", ZV, "ZV")
        _same_shape(x.V, "x.V", ZtU, "ZtU")
        M = x.U.transpose(-1, -2) @ ZV  # (..., r, r)
        Up = ZV - x.U @ M
        Vp = ZtU - x.V @ M.transpose(-1, -2)
        return FixedRankTangent(M, Up, Vp)

    def proju(self, x: FixedRankPoint, z: Tensor) -> FixedRankTangent:
        """Orthogonal projection of an ambient ``z`` [..., m, n] onto :math:`T_x\\mathcal{M}_r`."""
        check_tensor(z, "z", min_dim=2)
        m, n = x.U.shape[-2], x.V.shape[-2]
        if z.shape[-2:] != (m, n):
            raise ValueError(f"z must have shape [..., {m}, {n}], got {shape_str(z)}")
        return self.proju_sketch(x, z @ x.V, z.transpose(-1, -2) @ x.U)

    def egrad2rgrad(self, x: FixedRankPoint, g: Tensor) -> FixedRankTangent:
        """Riemannian gradient: the tangent projection of the Euclidean gradient ``g``."""
        return self.proju(x, g)

    def inner(self, x: FixedRankPoint, u: FixedRankTangent, v: FixedRankTangent | None = None) -> Tensor:
        """Frobenius inner product of two tangent vectors, shape [...]."""
        v = u if v is None else v
        return sum((a * b).sum(dim=(-1, -2)) for a, b in zip(u, v))

    def retr(self, x: FixedRankPoint, t: FixedRankTangent) -> FixedRankPoint:
        """Truncated-SVD retraction :math:`R_X(\\xi) = P_r(X + \\xi)`.

        :math:`X + \\xi = [U\\ Q_u] \\begin{bmatrix} \\Sigma + M & R_v^\\top \\\\ R_u & 0
        \\end{bmatrix} [V\\ Q_v]^\\top` with :math:`U_p = Q_u R_u`,
        :math:`V_p = Q_v R_v`; the SVD of the :math:`2r \\times 2r` core gives the
        best rank-``r`` approximation in :math:`O((m + n) r^2 + r^3)`.
        """
        r = x.s.shape[-1]
        Qu, Ru = torch.linalg.qr(t.Up)  # (..., m, r), (..., r, r)
        Qv, Rv = torch.linalg.qr(t.Vp)  # (..., n, r), (..., r, r)
        top = torch.cat([torch.diag_embed(x.s) + t.M, Rv.transpose(-1, -2)], dim=-1)  # (..., r, 2r)
        bot = torch.cat([Ru, torch.zeros_like(Ru)], dim=-1)  # (..., r, 2r)
        core = torch.cat([top, bot], dim=-2)  # (..., 2r, 2r)
        Uc, s, Vch = torch.linalg.svd(core)
        U = torch.cat([x.U, Qu], dim=-1) @ Uc[..., :r]  # (..., m, r)
        V = torch.cat([x.V, Qv], dim=-1) @ Vch[..., :r, :].transpose(-1, -2)  # (..., n, r)
        return FixedRankPoint(U, s[..., :r], V)

    def transp(self, x: FixedRankPoint, y: FixedRankPoint, t: FixedRankTangent) -> FixedRankTangent:
        """Vector transport by projecting the ambient tangent at ``x`` onto :math:`T_y`."""
        Vt = x.V.transpose(-1, -2)
        # ambient z = U M V^T + Up V^T + U Vp^T; its sketches against y without forming z
        ZV = x.U @ (t.M @ (Vt @ y.V)) + t.Up @ (Vt @ y.V) + x.U @ (t.Vp.transpose(-1, -2) @ y.V)
        Ut = x.U.transpose(-1, -2)
        ZtU = x.V @ (t.M.transpose(-1, -2) @ (Ut @ y.U)) + x.V @ (t.Up.transpose(-1, -2) @ y.U) + t.Vp @ (Ut @ y.U)
        return self.proju_sketch(y, ZV, ZtU)

    def random(self, *shape: int, r: int, generator: torch.Generator | None = None,
               dtype: torch.dtype | None = None) -> FixedRankPoint:
        """A random rank-``r`` point of shape ``(..., m, n)``: Haar frames, singular values in [1, 2]."""
        *batch, m, n = shape
        st = Stiefel()
        U = st.random(*batch, m, r, generator=generator, dtype=dtype)
        V = st.random(*batch, n, r, generator=generator, dtype=dtype)
        s = 1.0 + torch.rand(*batch, r, generator=generator, dtype=dtype)
        s = s.sort(dim=-1, descending=True).values
        return FixedRankPoint(U, s, V)

    def check_point(self, x: FixedRankPoint, *, atol: float | None = None) -> tuple[bool, str | None]:
        """Orthonormal ``U, V`` and positive ``s``? Returns ``(ok, reason)``."""
        st = Stiefel(atol)
        for name, f in (("U", x.U), ("V", x.V)):
            ok, why = st.check_point(f)
            if not ok:
                return False, f"{name}: {why}"
        if not (x.s > 0).all():
            return False, "singular values s must be > 0 (the rank would drop)"
        return True, None


# ---------------------------------------------------------------------------
# Factored geometry W = A B^T with the GL(r)-invariant quotient metric
# ---------------------------------------------------------------------------
class FactoredLowRank:
    """Rank-``r`` matrices :math:`W = A B^\\top` with a quotient (scaled) metric.

    Metric at ``(A, B)``:
    :math:`\\operatorname{tr}(B^\\top B\\, \\xi_A^\\top \\eta_A) +
    \\operatorname{tr}(A^\\top A\\, \\xi_B^\\top \\eta_B)`, invariant under
    :math:`(A, B) \\mapsto (A P, B P^{-\\top})` (Mishra et al. 2014). Given the
    Euclidean partial gradients :math:`g_A = G B`, :math:`g_B = G^\\top A`
    (what autograd returns for a model that uses ``A`` and ``B``), the
    Riemannian gradient is :math:`(g_A (B^\\top B)^{-1}, g_B (A^\\top A)^{-1})`.
    Retraction: :math:`(A + \\xi_A, B + \\xi_B)` followed by :meth:`balance`.

    Parameters
    ----------
    eps : float
        Relative ridge: :math:`\\epsilon \\operatorname{tr}(X^\\top X)/r` is added to
        :math:`X^\\top X` before inversion (default 1e-12; 0 for the exact metric).
    balance : bool
        Re-balance after each retraction (the canonical representative).
    """

    name = "FactoredLowRank(quotient metric, balanced retraction)"

    def __init__(self, eps: float = 1e-12, balance: bool = True):
        self.eps = eps
        self.balance_after_retr = balance

    def _check(self, A: Tensor, B: Tensor) -> None:
        check_tensor(A, "A", min_dim=2)
        check_tensor(B, "B", min_dim=2)
        check_same(A, "A", [("B", B)])
        if A.shape[-1] != B.shape[-1] or A.shape[:-2] != B.shape[:-2]:
            raise ValueError(f"A [..., m, r] and B [..., n, r] must agree in r and batch, got {shape_str(A)} and {shape_str(B)}")

    def to_dense(self, A: Tensor, B: Tensor) -> Tensor:
        """:math:`A B^\\top`, shape [..., m, n]."""
        self._check(A, B)
        return A @ B.transpose(-1, -2)

    def _gram_inv(self, X: Tensor, gX: Tensor) -> Tensor:
        r = X.shape[-1]
        gram = X.transpose(-1, -2) @ X
        if self.eps:
            ridge = self.eps * torch.diagonal(gram, dim1=-2, dim2=-1).mean(-1)  # (...)
            gram = gram + ridge[..., None, None] * torch.eye(r, dtype=X.dtype, device=X.device)
        # gX (X^T X)^{-1}, solved on the right
        return torch.linalg.solve(gram, gX.transpose(-1, -2)).transpose(-1, -2)

    def egrad2rgrad(self, A: Tensor, B: Tensor, gA: Tensor, gB: Tensor) -> tuple[Tensor, Tensor]:
        """Scaled gradient :math:`(g_A (B^\\top B)^{-1}, g_B (A^\\top A)^{-1})`.

        Parameters
        ----------
        A : Tensor, shape [..., m, r]
        B : Tensor, shape [..., n, r]
        gA : Tensor, shape [..., m, r]
        gB : Tensor, shape [..., n, r]

        Returns
        -------
        (Tensor [..., m, r], Tensor [..., n, r])
        """
        self._check(A, B)
        _same_shape(A, "A", gA, "gA")
        _same_shape(B, "B", gB, "gB")
        return self._gram_inv(B, gA), self._gram_inv(A, gB)

    def inner(self, A: Tensor, B: Tensor, u: tuple[Tensor, Tensor], v: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """The quotient metric of two tangent pairs, shape [...]."""
        v = u if v is None else v
        BtB = B.transpose(-1, -2) @ B
        AtA = A.transpose(-1, -2) @ A
        return ((u[0] @ BtB) * v[0]).sum(dim=(-1, -2)) + ((u[1] @ AtA) * v[1]).sum(dim=(-1, -2))

    def balance(self, A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
        """Balanced factors with the same product: :math:`A^\\top A = B^\\top B = \\Sigma`.

        :math:`A = Q_a R_a`, :math:`B = Q_b R_b`, :math:`R_a R_b^\\top = U_c \\Sigma V_c^\\top`;
        returns :math:`(Q_a U_c \\Sigma^{1/2}, Q_b V_c \\Sigma^{1/2})`.
        """
        self._check(A, B)
        Qa, Ra = torch.linalg.qr(A)
        Qb, Rb = torch.linalg.qr(B)
        Uc, s, Vch = torch.linalg.svd(Ra @ Rb.transpose(-1, -2))
        rs = s.clamp_min(0).sqrt().unsqueeze(-2)  # (..., 1, r)
        return (Qa @ Uc) * rs, (Qb @ Vch.transpose(-1, -2)) * rs

    def retr(self, A: Tensor, B: Tensor, uA: Tensor, uB: Tensor) -> tuple[Tensor, Tensor]:
        """:math:`(A + u_A, B + u_B)`, balanced if the geometry says so."""
        self._check(A, B)
        A2, B2 = A + uA, B + uB
        return self.balance(A2, B2) if self.balance_after_retr else (A2, B2)

    def random(self, *shape: int, r: int, generator: torch.Generator | None = None,
               dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """Gaussian factors of shape ``(..., m, r)`` and ``(..., n, r)``, scaled by ``1/sqrt(r)``, balanced."""
        *batch, m, n = shape
        A = torch.randn(*batch, m, r, generator=generator, dtype=dtype) / r ** 0.5
        B = torch.randn(*batch, n, r, generator=generator, dtype=dtype) / r ** 0.5
        return self.balance(A, B)

    def check_point(self, A: Tensor, B: Tensor, *, rcond: float = 1e-10) -> tuple[bool, str | None]:
        """Do ``A`` and ``B`` have full column rank ``r``? Returns ``(ok, reason)``."""
        for name, X in (("A", A), ("B", B)):
            s = torch.linalg.svdvals(X)
            ratio = (s[..., -1] / s[..., 0].clamp_min(torch.finfo(X.dtype).tiny)).min().item()
            if not ratio > rcond:
                return False, f"{name} is rank deficient: min sigma_r / sigma_1 = {ratio:.2e} <= {rcond:.0e}"
        return True, None


# ---------------------------------------------------------------------------
# Partial isometries W = U V^T
# ---------------------------------------------------------------------------
