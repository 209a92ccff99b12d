"""Geometry of per-token metrics: the metrics, the scores they give, rank bounds, distances and geodesics.

- :mod:`~riemannian_ref.geometry.metric`: :class:`LowRankMetric` (Woodbury solve,
  log-determinant, ...), :class:`MetricNet` (token states to metric factors) and
  :class:`SubspaceFactors` (per-token factors in one shared subspace).
- :mod:`~riemannian_ref.geometry.scores`: the Riemannian score matrix, dense.
- :mod:`~riemannian_ref.geometry.rank_bounds`: Theorem 1's bounds and factors.
- :mod:`~riemannian_ref.geometry.geodesics`: pair distances and segment lengths.
- :mod:`~riemannian_ref.geometry.fields`: metric fields, curve lengths, shortest paths.
- :mod:`~riemannian_ref.geometry.transport`: the connections between token fibres
  (rotations, rates, angles, phases) that attention transports along.

``__all__`` holds what a user needs; the other functions of a module
(``transport.rotate_pairs``, ``fields.path_length``, ...) are reached through it.
"""
from .fields import *  # noqa: F401,F403
from .fields import __all__ as _fields
from .geodesics import *  # noqa: F401,F403
from .geodesics import __all__ as _geodesics
from .metric import *  # noqa: F401,F403
from .metric import __all__ as _metric
from .rank_bounds import *  # noqa: F401,F403
from .rank_bounds import __all__ as _rank_bounds
from .scores import *  # noqa: F401,F403
from .scores import __all__ as _scores
from .transport import *  # noqa: F401,F403
from .transport import __all__ as _transport

__all__ = [*_metric, *_scores, *_rank_bounds, *_geodesics, *_fields, *_transport]
