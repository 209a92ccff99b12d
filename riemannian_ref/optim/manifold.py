"""One interface for every geometry (geoopt's verbs), the Euclidean space, and parameters tagged by their manifold.

A *point* is one tensor, or, for rank-``r`` matrices :math:`W = A B^\\top` kept as two
parameters (a head's ``W_Q, W_K``), the pair ``(A, B)``: the model keeps its two
parameters and one manifold instance belongs to one pair (:func:`constrain_`). A
*tangent vector* is always one tensor, of the shape the manifold gives it, so an
optimiser's moments are plain tensors whatever the geometry.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from .._checks import check_bool, check_same, check_tensor, shape_str

__all__ = ["Manifold", "Euclidean", "ManifoldParameter", "constrain_"]


def _same_shape(a: Tensor, a_name: str, b: Tensor, b_name: str) -> None:
    check_tensor(b, b_name)
    check_same(a, a_name, [(b_name, b)])
    if a.shape != b.shape:
        raise ValueError(f"{b_name} must have the shape of {a_name} {shape_str(a)}, got {shape_str(b)}")


def _default_tol(dtype: torch.dtype) -> float:
    """Tolerance of the membership checks: 1e-10 in float64, 1e-4 in float32, and twice the unit round-off in
    float16 and bfloat16 (a float32 frame cast to half precision is orthonormal to about half of it)."""
    if dtype == torch.float64:
        return 1e-10
    if dtype in (torch.float16, torch.bfloat16):
        return 2.0 * torch.finfo(dtype).eps
    return 1e-4


def _shape(shape: tuple, what: str) -> tuple[int, ...]:
    """``random``'s shape, given as ints or as one tuple."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in shape):
        raise ValueError(f"shape must be ints >= 0 {what}, got {tuple(shape)}")
    return tuple(shape)


class Manifold:
    """A Riemannian manifold with geoopt's verbs; subclasses define the geometry.

    Every verb takes the point ``x`` first. ``u``, ``v`` are tangent vectors,
    ``g`` a Euclidean gradient (shaped like the point). Subclasses implement
    ``proju``, ``retr``, ``inner``, ``projx``, ``check_point`` and ``random``;
    the Riemannian gradient is the tangent projection (embedded metric) and
    the vector transport is projection onto the new tangent space unless a
    subclass says otherwise. ``check_point`` and ``check_vector`` raise
    ``ValueError`` saying what is wrong.
    """

    name = "Manifold"
    #: tensors per point: 2 for a factor pair ``(A, B)``
    n_tensors = 1
    #: dtypes its retraction supports (None: any floating dtype)
    dtypes: tuple | None = (torch.float32, torch.float64)

    def proju(self, x, u: Tensor) -> Tensor:
        """Orthogonal projection of an ambient ``u`` onto the tangent space at ``x``."""
        raise NotImplementedError

    def egrad2rgrad(self, x, g) -> Tensor:
        """Riemannian gradient from the Euclidean gradient ``g`` (shaped like ``x``)."""
        return self.proju(x, g)

    def retr(self, x, u: Tensor):
        """Retraction: the point reached from ``x`` along the tangent ``u`` (first order)."""
        raise NotImplementedError

    def transp(self, x, y, v: Tensor) -> Tensor:
        """Vector transport of ``v`` (tangent at ``x``) to ``y``: the projection onto ``T_y``."""
        return self.proju(y, v)

    def retr_transp(self, x, u: Tensor, v: Tensor):
        """``(retr(x, u), transp(x, retr(x, u), v))`` in one call (what an optimiser step needs)."""
        y = self.retr(x, u)
        return y, self.transp(x, y, v)

    def inner(self, x, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False) -> Tensor:
        """Metric of two tangent vectors at ``x`` (``v`` defaults to ``u``), one value per point."""
        raise NotImplementedError

    def component_inner(self, x, u: Tensor, v: Tensor | None = None) -> Tensor:
        """The metric per component, broadcastable against ``u``: what Adam's second moment averages."""
        return self.inner(x, u, v, keepdim=True)

    def norm(self, x, u: Tensor, *, keepdim: bool = False) -> Tensor:
        """Norm of a tangent vector, one value per point."""
        return self.inner(x, u, keepdim=keepdim).clamp_min(0).sqrt()

    def projx(self, x):
        """The closest point of the manifold (or a canonical representative)."""
        raise NotImplementedError

    def check_point(self, x, *, atol: float | None = None) -> None:
        """Raise ``ValueError`` unless ``x`` is a point of the manifold."""
        raise NotImplementedError

    def check_vector(self, x, u: Tensor, *, atol: float | None = None) -> None:
        """Raise ``ValueError`` unless ``u`` is tangent at ``x``: ``proju(x, u) = u`` to ``atol``.

        The tolerance is relative to ``max(1, max |u|)``; by default it depends on
        the dtype (1e-10 in float64, 1e-4 in float32).
        """
        w = self.proju(x, u)
        tol = (_default_tol(u.dtype) if atol is None else atol) * max(1.0, u.abs().max().item() if u.numel() else 1.0)
        err = (u - w).abs().max().item() if u.numel() else 0.0
        if not err <= tol:
            raise ValueError(f"u is not tangent at x on {self.name}: max |u - proju(x, u)| = {err:.3e} > {tol:.1e}")

    def random(self, *shape: int, generator: torch.Generator | None = None, dtype: torch.dtype | None = None):
        """A random point (for tests and initialisation)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class Euclidean(Manifold):
    """The Euclidean space of a tensor's shape: the manifold of every untagged parameter.

    ``retr(x, u) = x + u``, transport is the identity, and the metric is the
    Frobenius one; ``component_inner`` is per entry, so
    :class:`~riemannian_ref.optim.adam.RiemannianAdam` on it is Adam(W).
    """

    name = "Euclidean"
    dtypes = None

    def proju(self, x: Tensor, u: Tensor) -> Tensor:
        """``u`` itself (every vector is tangent); ``x`` and ``u`` share one shape."""
        _same_shape(x, "x", u, "u")
        return u

    def retr(self, x: Tensor, u: Tensor) -> Tensor:
        """``x + u``."""
        _same_shape(x, "x", u, "u")
        return x + u

    def inner(self, x: Tensor, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False) -> Tensor:
        """Frobenius inner product over every dimension (a scalar, or all-ones shape with ``keepdim``)."""
        _same_shape(x, "x", u, "u")
        v = u if v is None else v
        _same_shape(x, "x", v, "v")
        return (u * v).sum(dim=tuple(range(u.dim())), keepdim=keepdim)

    def component_inner(self, x: Tensor, u: Tensor, v: Tensor | None = None) -> Tensor:
        """``u * v`` entry by entry: Adam's per-entry second moment."""
        return u * (u if v is None else v)

    def projx(self, x: Tensor) -> Tensor:
        """``x`` itself."""
        return check_tensor(x, "x")

    def check_point(self, x: Tensor, *, atol: float | None = None) -> None:
        """Any floating-point tensor is a point."""
        check_tensor(x, "x")

    def random(self, *shape: int, generator: torch.Generator | None = None,
               dtype: torch.dtype | None = None) -> Tensor:
        """Standard Gaussian entries of the given shape."""
        return torch.randn(_shape(shape, ""), generator=generator, dtype=dtype)


class ManifoldParameter(nn.Parameter):
    """An ``nn.Parameter`` that carries its manifold (geoopt's ``ManifoldParameter``).

    ``.manifold`` survives ``copy.deepcopy`` and pickling (a deep-copied model's
    factor pairs keep one shared manifold each), and ``module.to()`` keeps the
    object; ``state_dict`` holds the plain values.

    Parameters
    ----------
    data : Tensor
        A point of ``manifold`` (checked); for a factor-pair manifold, one factor.
    manifold : Manifold, optional
        Default :class:`Euclidean`.
    requires_grad : bool
        As for ``nn.Parameter`` (default True).
    """

    manifold: Manifold

    def __new__(cls, data: Tensor | None = None, manifold: Manifold | None = None, requires_grad: bool = True):
        manifold = Euclidean() if manifold is None else manifold
        if not isinstance(manifold, Manifold):
            raise ValueError(f"manifold must be a riemannian_ref.optim.Manifold, got {type(manifold).__name__}")
        data = torch.empty(0) if data is None else check_tensor(data, "data")
        check_bool(requires_grad, "requires_grad")
        if manifold.n_tensors == 1:
            manifold.check_point(data.detach())
        p = super().__new__(cls, data, requires_grad)
        p.manifold = manifold
        return p

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = ManifoldParameter._make(
                self.data.clone(memory_format=torch.preserve_format),
                copy.deepcopy(self.manifold, memo), self.requires_grad)
        return memo[id(self)]

    def __reduce_ex__(self, proto):
        return ManifoldParameter._make, (self.data, self.manifold, self.requires_grad)

    @staticmethod
    def _make(data: Tensor, manifold: Manifold, requires_grad: bool) -> "ManifoldParameter":
        """Rebuild without the point check (a copy of a parameter, or one factor of a pair)."""
        p = nn.Parameter.__new__(ManifoldParameter, data, requires_grad)
        p.manifold = manifold
        return p

    def __repr__(self) -> str:
        return f"ManifoldParameter on {self.manifold}:\n{torch.Tensor.__repr__(self.data)}"


def constrain_(manifold: Manifold, *params: nn.Parameter) -> tuple[ManifoldParameter, ...]:
    """Put existing parameters on ``manifold`` in place: the model keeps the same objects.

    Each parameter becomes a :class:`ManifoldParameter` carrying ``manifold``
    (its values are not changed; they must already be a point). For a factor
    pair manifold (``n_tensors == 2``) pass exactly one pair ``A, B``, with an
    instance of its own: the instance identifies the pair to the optimiser.

    Parameters
    ----------
    manifold : Manifold
    *params : nn.Parameter
        One-tensor manifold: any number of points. Factor pair: ``A, B``.

    Returns
    -------
    tuple of ManifoldParameter
        The same objects.
    """
    if not isinstance(manifold, Manifold):
        raise ValueError(f"manifold must be a riemannian_ref.optim.Manifold, got {type(manifold).__name__}")
    for i, p in enumerate(params):
        if not isinstance(p, nn.Parameter):
            raise ValueError(f"params[{i}] must be an nn.Parameter, got {type(p).__name__}")
    if manifold.n_tensors == 1:
        for i, p in enumerate(params):
            try:
                manifold.check_point(p.detach())
            except ValueError as exc:
                raise ValueError(f"params[{i}] (shape {list(p.shape)}): {exc}") from None
    else:
        if len(params) != manifold.n_tensors:
            raise ValueError(f"{manifold.name} takes one pair of parameters (A, B), got {len(params)}")
        manifold.check_point(tuple(p.detach() for p in params))
    for p in params:  # every check passed: now tag them all
        p.__class__ = ManifoldParameter
        p.manifold = manifold
    return params
