"""Riemannian attention: the function, its references, connections and the one attention module.

- :mod:`~riemannian_ref.attention.functional`: :func:`riemannian_attention`, the
  fast blockwise operator with the signature of SDPA.
- :mod:`~riemannian_ref.attention.reference`: the dense definition and the plain
  blockwise algorithm (oracles and reading).
- :mod:`~riemannian_ref.attention.connections`: :func:`connection_attention`,
  attention along a connection (the transports themselves are geometry:
  :mod:`riemannian_ref.geometry.transport`).
- :mod:`~riemannian_ref.attention.layer`: :class:`RiemannianAttention`, the module
  every model uses.
"""
from .connections import *  # noqa: F401,F403
from .connections import __all__ as _connections
from .functional import *  # noqa: F401,F403
from .functional import __all__ as _functional
from .layer import *  # noqa: F401,F403
from .layer import __all__ as _layer
from .reference import *  # noqa: F401,F403
from .reference import __all__ as _reference

__all__ = [*_functional, *_reference, *_connections, *_layer]
