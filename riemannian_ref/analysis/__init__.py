"""Measurements: rank collapse of token states, the geometry of connections, intrinsic query-key rank.

- :mod:`~riemannian_ref.analysis.measures`: residuals, stable and effective
  ranks, products of attention matrices, the token radius, collapse depths,
  attention entropies.
- :mod:`~riemannian_ref.analysis.bound`: the one-layer collapse bound of
  chapter 9 and the map it bounds.
- :mod:`~riemannian_ref.analysis.probes`: linear and two-layer perceptron
  probes that read labels from states.
- :mod:`~riemannian_ref.analysis.bundle`: holonomy, transport closure and
  metric-compatibility defects of a connection.
- :mod:`~riemannian_ref.analysis.intrinsic`: the linear-attention surrogate with a
  known intrinsic rank.

:mod:`~riemannian_ref.analysis.collapse` re-exports what the first three publish
under the name they had as one module. The other functions of a module
(``intrinsic.population_risk``, ``measures.residual_center``, ...) are reached
through it.
"""
from .bound import *  # noqa: F401,F403
from .bound import __all__ as _bound
from .bundle import *  # noqa: F401,F403
from .bundle import __all__ as _bundle
from .intrinsic import *  # noqa: F401,F403
from .intrinsic import __all__ as _intrinsic
from .measures import *  # noqa: F401,F403
from .measures import __all__ as _measures
from .probes import *  # noqa: F401,F403
from .probes import __all__ as _probes
from . import collapse  # noqa: F401  (the combined module, kept for existing imports)

__all__ = [*_measures, *_bound, *_probes, *_bundle, *_intrinsic]
