"""Measurements: rank collapse of token states, the geometry of connections, intrinsic query-key rank.

- :mod:`~riemannian_ref.analysis.collapse`: residuals, stable and effective ranks,
  products of attention matrices.
- :mod:`~riemannian_ref.analysis.bundle`: holonomy, transport closure and
  metric-compatibility defects of a connection.
- :mod:`~riemannian_ref.analysis.intrinsic`: the linear-attention surrogate with a
  known intrinsic rank.
"""
from .bundle import *  # noqa: F401,F403
from .bundle import __all__ as _bundle
from .collapse import *  # noqa: F401,F403
from .collapse import __all__ as _collapse
from .intrinsic import *  # noqa: F401,F403
from .intrinsic import __all__ as _intrinsic

__all__ = [*_collapse, *_bundle, *_intrinsic]
