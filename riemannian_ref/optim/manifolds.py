"""Orthonormal frames: the Stiefel manifold and rank-``r`` partial isometries, with geoopt's verbs.

* :class:`Stiefel` -- orthonormal frames :math:`\\mathrm{St}(n, p) = \\{W \\in
  \\mathbb{R}^{n \\times p} : W^\\top W = I_p\\}` with the metric inherited from
  the embedding (the *Euclidean* metric :math:`\\langle \\xi, \\eta \\rangle =
  \\operatorname{tr}(\\xi^\\top \\eta)`), tangent projection
  :math:`\\xi = g - W \\operatorname{sym}(W^\\top g)` and the polar retraction
  :math:`R_W(\\xi) = \\operatorname{polar}(W + \\xi)` (Edelman, Arias and Smith
  1998; Absil, Mahony and Sepulchre 2008, section 4.1).
* :class:`PartialIsometry` -- rank-``r`` partial isometries :math:`W = U V^\\top`
  with ``U, V`` Stiefel frames: the product geometry
  :math:`\\mathrm{St}(m, r) \\times \\mathrm{St}(n, r)` (the :math:`O(r)`
  ambiguity :math:`(U Q, V Q)` is left in the representation).

The low-rank geometries are in :mod:`riemannian_ref.optim.low_rank`. Library
code: nothing prints; every public function validates its inputs and raises
``ValueError`` naming the argument.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_number, check_same, check_tensor, shape_str

__all__ = ["sym", "polar", "Stiefel", "PartialIsometry"]


# ---------------------------------------------------------------------------
# small linear algebra
# ---------------------------------------------------------------------------
def sym(a: Tensor) -> Tensor:
    """Symmetric part :math:`(A + A^\\top)/2` of the last two dimensions.

    Parameters
    ----------
    a : Tensor, shape [..., p, p]

    Returns
    -------
    Tensor, shape [..., p, p]
    """
    return 0.5 * (a + a.transpose(-1, -2))


def polar(x: Tensor) -> Tensor:
    """Orthonormal polar factor :math:`U V^\\top` of :math:`x = U \\Sigma V^\\top`.

    The closest matrix with orthonormal columns to ``x`` in the Frobenius norm
    (for ``x`` of full column rank), computed from a thin SVD.

    Parameters
    ----------
    x : Tensor, shape [..., n, p], n >= p

    Returns
    -------
    Tensor, shape [..., n, p]
    """
    check_tensor(x, "x", min_dim=2)
    if x.shape[-2] < x.shape[-1]:
        raise ValueError(f"x must have shape [..., n, p] with n >= p, got {shape_str(x)}")
    if not bool(torch.isfinite(x).all()):  # the SVD would fail with a LinAlgError
        raise ValueError(f"x must be finite, got {int((~torch.isfinite(x)).sum())} NaN/inf entries")
    U, _, Vh = torch.linalg.svd(x, full_matrices=False)  # (..., n, p), (..., p, p)
    return U @ Vh


def _frame_dims(x: Tensor, name: str) -> tuple[int, int]:
    check_tensor(x, name, min_dim=2)
    n, p = x.shape[-2:]
    if n < p:
        raise ValueError(f"{name} must be a frame [..., n, p] with n >= p, got {shape_str(x)}")
    return n, p


def _same_shape(a: Tensor, a_name: str, b: Tensor, b_name: str) -> None:
    check_tensor(b, b_name)
    check_same(a, a_name, [(b_name, b)])
    if a.shape != b.shape:
        raise ValueError(
            f"{b_name} must have the shape of {a_name} {shape_str(a)}, got {shape_str(b)}"
        )


def _default_tol(dtype: torch.dtype) -> float:
    """Orthonormality tolerance of a dtype: 1e-10 in float64, 1e-4 in float32, and twice the unit round-off
    in float16 and bfloat16, where a float32 frame cast to half precision has max |W^T W - I| up to about
    half of it (the diagonal's rounding, whatever the size)."""
    if dtype == torch.float64:
        return 1e-10
    if dtype in (torch.float16, torch.bfloat16):
        return 2.0 * torch.finfo(dtype).eps
    return 1e-4


# ---------------------------------------------------------------------------
# Stiefel
# ---------------------------------------------------------------------------
class Stiefel:
    """The Stiefel manifold :math:`\\mathrm{St}(n, p)` with the embedded (Euclidean) metric.

    Points are frames ``W`` of shape ``[..., n, p]`` with :math:`W^\\top W = I_p`;
    every leading index is an independent frame (e.g. ``[h, D, d]`` holds ``h``
    frames of shape ``[D, d]``). The verbs follow geoopt's ``EuclideanStiefel``
    (same metric and tangent projection); the retraction here is the *polar*
    one, which geoopt offers as ``projx(x + u)`` (its own ``retr`` is a QR
    retraction).

    Parameters
    ----------
    atol : float, optional
        Tolerance of :meth:`check_point` on :math:`|W^\\top W - I|_\\infty`;
        default ``1e-10`` in float64, ``1e-4`` in float32 and twice the unit
        round-off in float16 and bfloat16 (a float32 frame cast to half
        precision passes).
    """

    name = "Stiefel(euclidean metric, polar retraction)"
    ndim = 2

    def __init__(self, atol: float | None = None):
        if atol is not None:
            check_number(atol, "atol", low=0.0, low_open=True)
        self.atol = atol

    # -- projections ------------------------------------------------------
    def proju(self, x: Tensor, u: Tensor) -> Tensor:
        """Orthogonal projection onto the tangent space :math:`T_x\\mathrm{St}`.

        :math:`\\mathrm{proj}_x(u) = u - x \\operatorname{sym}(x^\\top u)`.

        Parameters
        ----------
        x : Tensor, shape [..., n, p]
            A point.
        u : Tensor, shape [..., n, p]
            An ambient matrix.

        Returns
        -------
        Tensor, shape [..., n, p]
            The tangent vector; :math:`x^\\top \\xi` is skew-symmetric.
        """
        _frame_dims(x, "x")
        _same_shape(x, "x", u, "u")
        return u - x @ sym(x.transpose(-1, -2) @ u)

    def egrad2rgrad(self, x: Tensor, g: Tensor) -> Tensor:
        """Riemannian gradient from the Euclidean one: the tangent projection.

        With the embedded metric the Riemannian gradient is the projection of
        the Euclidean gradient, so a loss's steepest-descent direction on the
        manifold is :math:`-\\mathrm{proj}_x(g)/|\\mathrm{proj}_x(g)|_F`.
        ``x`` (a point) and ``g`` (a Euclidean gradient) have shape
        ``[..., n, p]``, and so has the result.
        """
        return self.proju(x, g)

    def projx(self, x: Tensor) -> Tensor:
        """Closest point on the manifold: the orthonormal polar factor of ``x`` ([..., n, p], full column rank)."""
        _frame_dims(x, "x")
        return polar(x)

    def retr(self, x: Tensor, u: Tensor) -> Tensor:
        """Polar retraction :math:`R_x(u) = \\operatorname{polar}(x + u)`.

        For a tangent ``u``, :math:`(x + u)^\\top (x + u) = I + u^\\top u` is
        well conditioned (singular values of :math:`x + u` are at least 1), so
        the SVD is accurate and the result is orthonormal to round-off. The
        point ``x``, the step ``u`` and the result have shape ``[..., n, p]``.
        """
        _frame_dims(x, "x")
        _same_shape(x, "x", u, "u")
        return polar(x + u)

    def transp(self, x: Tensor, y: Tensor, v: Tensor) -> Tensor:
        """Vector transport by projection: :math:`\\mathrm{proj}_y(v)` (``x`` unused).

        Parameters
        ----------
        x, y : Tensor, shape [..., n, p]
            Old and new points.
        v : Tensor, shape [..., n, p]
            Tangent at ``x``.

        Returns
        -------
        Tensor, shape [..., n, p]
        """
        return self.proju(y, v)

    # -- metric -----------------------------------------------------------
    def inner(self, x: Tensor, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False) -> Tensor:
        """Embedded metric :math:`\\operatorname{tr}(u^\\top v)` per frame.

        Parameters
        ----------
        x : Tensor, shape [..., n, p]
        u : Tensor, shape [..., n, p]
        v : Tensor, shape [..., n, p], optional
            Defaults to ``u`` (squared norm).
        keepdim : bool
            Keep the last two dimensions as size one.

        Returns
        -------
        Tensor, shape [...] (or [..., 1, 1] with ``keepdim``)
        """
        _frame_dims(x, "x")
        _same_shape(x, "x", u, "u")
        if v is None:
            v = u
        _same_shape(x, "x", v, "v")
        return (u * v).sum(dim=(-1, -2), keepdim=keepdim)

    def norm(self, x: Tensor, u: Tensor, *, keepdim: bool = False) -> Tensor:
        """Frobenius norm of a tangent vector per frame, shape [...]."""
        return self.inner(x, u, keepdim=keepdim).clamp_min(0).sqrt()

    # -- sampling and checks ---------------------------------------------
    def random(
        self,
        *shape: int,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """Haar-distributed frames: the polar factor of a Gaussian matrix.

        Drawn on the generator's device (the CPU generator by default), then
        moved to ``device``, so the same seed gives the same frames everywhere.

        Parameters
        ----------
        *shape : int
            ``(..., n, p)`` with ``n >= p``.
        generator : torch.Generator, optional
        dtype : torch.dtype, optional
            Default: torch's default dtype.
        device : torch.device or str, optional

        Returns
        -------
        Tensor, shape [..., n, p]
        """
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        if len(shape) < 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in shape) \
                or shape[-2] < shape[-1]:
            raise ValueError(f"shape must be ints (..., n, p) >= 0 with n >= p, got {tuple(shape)}")
        z = torch.randn(*shape, generator=generator, dtype=dtype)
        return polar(z).to(device) if device is not None else polar(z)

    def check_point(self, x: Tensor, *, atol: float | None = None) -> tuple[bool, str | None]:
        """Does ``x`` lie on the manifold? Returns ``(ok, reason)``.

        Parameters
        ----------
        x : Tensor, shape [..., n, p]
        atol : float, optional
            Tolerance on :math:`\\max |x^\\top x - I|`; defaults to the
            manifold's ``atol`` or a dtype-dependent value.

        Returns
        -------
        ok : bool
        reason : str or None
            Why not, when ``ok`` is False.
        """
        if not isinstance(x, Tensor) or x.dim() < 2:
            return False, f"expected a tensor of shape [..., n, p], got {getattr(x, 'shape', type(x))}"
        n, p = x.shape[-2:]
        if n < p:
            return False, f"a frame needs n >= p, got shape {shape_str(x)}"
        tol = atol if atol is not None else (self.atol if self.atol is not None else _default_tol(x.dtype))
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()  # the Gram matrix of half-precision frames, accumulated in float32
        eye = torch.eye(p, dtype=x.dtype, device=x.device)
        err = (x.transpose(-1, -2) @ x - eye).abs().max().item() if x.numel() else 0.0
        if not err <= tol:
            return False, f"max |x^T x - I| = {err:.3e} > atol = {tol:.1e}"
        return True, None

    def check_vector(self, x: Tensor, u: Tensor, *, atol: float | None = None) -> tuple[bool, str | None]:
        """Is ``u`` tangent at ``x`` (:math:`x^\\top u` skew)? Returns ``(ok, reason)``."""
        tol = atol if atol is not None else (self.atol if self.atol is not None else _default_tol(x.dtype))
        a = x.transpose(-1, -2) @ u
        err = (a + a.transpose(-1, -2)).abs().max().item() if a.numel() else 0.0
        scale = max(1.0, u.abs().max().item() if u.numel() else 1.0)
        if not err <= tol * scale:
            return False, f"max |x^T u + u^T x| = {err:.3e} > atol = {tol * scale:.1e}"
        return True, None


# ---------------------------------------------------------------------------
# Fixed-rank matrices, embedded geometry
# ---------------------------------------------------------------------------


class PartialIsometry:
    """Rank-``r`` partial isometries :math:`W = U V^\\top`, product geometry on two Stiefels.

    A tangent vector is a pair :math:`(\\xi_U, \\xi_V)` of Stiefel tangents; an
    ambient gradient ``G`` of :math:`f(U V^\\top)` has partial gradients
    :math:`(G V, G^\\top U)`, projected factor by factor; the retraction is polar
    on each factor. A Stiefel-constrained query/key pair ``(W_Q, W_K)`` of one
    head is exactly such a point, with bilinear form :math:`W_Q W_K^\\top`.

    Parameters
    ----------
    atol : float, optional
        Tolerance of the Stiefel membership checks of each factor (see
        :class:`Stiefel`).
    """

    name = "PartialIsometry(product of embedded Stiefel metrics)"

    def __init__(self, atol: float | None = None):
        self.st = Stiefel(atol)

    def to_dense(self, U: Tensor, V: Tensor) -> Tensor:
        """:math:`U V^\\top`, shape [..., m, n]."""
        return U @ V.transpose(-1, -2)

    def egrad2rgrad(self, U: Tensor, V: Tensor, gU: Tensor, gV: Tensor) -> tuple[Tensor, Tensor]:
        """Project the partial gradients onto each factor's tangent space."""
        return self.st.proju(U, gU), self.st.proju(V, gV)

    proju = egrad2rgrad

    def retr(self, U: Tensor, V: Tensor, uU: Tensor, uV: Tensor) -> tuple[Tensor, Tensor]:
        """Polar retraction on each factor."""
        return self.st.retr(U, uU), self.st.retr(V, uV)

    def inner(self, U: Tensor, V: Tensor, u: tuple[Tensor, Tensor], v: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Sum of the two embedded metrics, shape [...]."""
        v = u if v is None else v
        return self.st.inner(U, u[0], v[0]) + self.st.inner(V, u[1], v[1])

    def random(self, *shape: int, r: int, generator: torch.Generator | None = None,
               dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """Haar frames ``U`` [..., m, r], ``V`` [..., n, r]."""
        *batch, m, n = shape
        return (self.st.random(*batch, m, r, generator=generator, dtype=dtype),
                self.st.random(*batch, n, r, generator=generator, dtype=dtype))

    def check_point(self, U: Tensor, V: Tensor) -> tuple[bool, str | None]:
        """Both factors orthonormal? Returns ``(ok, reason)``."""
        for name, f in (("U", U), ("V", V)):
            ok, why = self.st.check_point(f)
            if not ok:
                return False, f"{name}: {why}"
        return True, None
