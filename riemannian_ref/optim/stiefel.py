"""The Stiefel manifold of orthonormal frames, with the embedded metric and the polar retraction.

:math:`\\mathrm{St}(n, p) = \\{W \\in \\mathbb{R}^{n \\times p} : W^\\top W = I_p\\}`
with the metric :math:`\\operatorname{tr}(\\xi^\\top \\eta)` of the embedding,
tangent projection :math:`\\xi = g - W \\operatorname{sym}(W^\\top g)` and polar
retraction :math:`R_W(\\xi) = \\operatorname{polar}(W + \\xi)` (Edelman, Arias
and Smith 1998; Absil, Mahony and Sepulchre 2008, section 4.1). A pair of
frames ``(U, V)`` (a partial isometry :math:`U V^\\top`) is two parameters on
this manifold.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_number, check_tensor, shape_str
from .manifold import Manifold, _default_tol, _same_shape, _shape

__all__ = ["Stiefel"]


def sym(a: Tensor) -> Tensor:
    """Symmetric part :math:`(A + A^\\top)/2` of the last two dimensions, shape [..., p, p]."""
    return 0.5 * (a + a.transpose(-1, -2))


def polar(x: Tensor) -> Tensor:
    """Orthonormal polar factor :math:`U V^\\top` of :math:`x = U \\Sigma V^\\top` ([..., n, p], n >= p).

    The closest matrix with orthonormal columns to ``x`` in the Frobenius norm
    (for ``x`` of full column rank), from a thin SVD.
    """
    check_tensor(x, "x", min_dim=2)
    if x.shape[-2] < x.shape[-1]:
        raise ValueError(f"x must have shape [..., n, p] with n >= p, got {shape_str(x)}")
    if not bool(torch.isfinite(x).all()):  # the SVD would fail with a LinAlgError
        raise ValueError(f"x must be finite, got {int((~torch.isfinite(x)).sum())} NaN/inf entries")
    U, _, Vh = torch.linalg.svd(x, full_matrices=False)  # (..., n, p), (..., p, p)
    return U @ Vh


def _frame_dims(x: Tensor, name: str) -> None:
    check_tensor(x, name, min_dim=2)
    if x.shape[-2] < x.shape[-1]:
        raise ValueError(f"{name} must be a frame [..., n, p] with n >= p, got {shape_str(x)}")


class Stiefel(Manifold):
    """The Stiefel manifold :math:`\\mathrm{St}(n, p)` with the embedded (Euclidean) metric.

    Points are frames ``W`` of shape ``[..., n, p]`` with :math:`W^\\top W = I_p`;
    every leading index is an independent frame (``[h, D, d]`` holds ``h``
    frames), with its own metric value and its own Adam second moment. Same
    metric and projection as geoopt's ``EuclideanStiefel``; the retraction is
    the polar one (geoopt's ``projx(x + u)``; its ``retr`` is a QR retraction).

    Parameters
    ----------
    atol : float, optional
        Tolerance of :meth:`check_point` on :math:`\\max |W^\\top W - I|`;
        default 1e-10 in float64, 1e-4 in float32, twice the unit round-off in
        float16 and bfloat16 (a float32 frame cast to half precision passes).
    """

    name = "Stiefel(euclidean metric, polar retraction)"

    def __init__(self, atol: float | None = None):
        if atol is not None:
            check_number(atol, "atol", low=0.0, low_open=True)
        self.atol = atol

    def proju(self, x: Tensor, u: Tensor) -> Tensor:
        """:math:`u - x \\operatorname{sym}(x^\\top u)`; ``x``, ``u`` and the result are [..., n, p]."""
        _frame_dims(x, "x")
        _same_shape(x, "x", u, "u")
        return u - x @ sym(x.transpose(-1, -2) @ u)

    def projx(self, x: Tensor) -> Tensor:
        """The closest frame: the polar factor of ``x`` ([..., n, p], full column rank)."""
        _frame_dims(x, "x")
        return polar(x)

    def retr(self, x: Tensor, u: Tensor) -> Tensor:
        """:math:`\\operatorname{polar}(x + u)`, [..., n, p].

        For a tangent ``u`` the singular values of :math:`x + u` are at least 1,
        so the SVD is accurate and the result orthonormal to round-off.
        """
        _frame_dims(x, "x")
        _same_shape(x, "x", u, "u")
        return polar(x + u)

    def inner(self, x: Tensor, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False) -> Tensor:
        """:math:`\\operatorname{tr}(u^\\top v)` per frame: shape [...] ([..., 1, 1] with ``keepdim``)."""
        _frame_dims(x, "x")
        _same_shape(x, "x", u, "u")
        v = u if v is None else v
        _same_shape(x, "x", v, "v")
        return (u * v).sum(dim=(-1, -2), keepdim=keepdim)

    def random(self, *shape: int, generator: torch.Generator | None = None, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> Tensor:
        """Haar-distributed frames of shape ``(..., n, p)``: the polar factor of a Gaussian matrix.

        Drawn on the CPU generator, then moved to ``device``, so one seed gives
        the same frames everywhere.
        """
        shape = _shape(shape, "(..., n, p) with n >= p")
        if len(shape) < 2 or shape[-2] < shape[-1]:
            raise ValueError(f"shape must be ints (..., n, p) >= 0 with n >= p, got {shape}")
        z = polar(torch.randn(*shape, generator=generator, dtype=dtype))
        return z.to(device) if device is not None else z

    def check_point(self, x: Tensor, *, atol: float | None = None) -> None:
        """Raise ``ValueError`` unless ``x`` [..., n, p] has orthonormal columns to ``atol``."""
        _frame_dims(x, "x")
        tol = atol if atol is not None else (self.atol if self.atol is not None else _default_tol(x.dtype))
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()  # the Gram matrix of half-precision frames, accumulated in float32
        eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
        err = (x.transpose(-1, -2) @ x - eye).abs().max().item() if x.numel() else 0.0
        if not err <= tol:
            raise ValueError(f"x is not a stack of orthonormal frames: max |x^T x - I| = {err:.3e} > atol = "
                             f"{tol:.1e} (initialise it with Stiefel.random or Stiefel.projx)")
