"""Riemannian optimisation of attention weights: matrix manifolds (geoopt's verbs) and Adam on them.

- :mod:`~riemannian_ref.optim.manifolds`: the Stiefel manifold and partial isometries.
- :mod:`~riemannian_ref.optim.low_rank`: fixed-rank matrices, embedded and factored.
- :mod:`~riemannian_ref.optim.adam`: :class:`StiefelAdam`, :class:`LowRankAdam`.
"""
from .adam import *  # noqa: F401,F403
from .adam import __all__ as _adam
from .low_rank import *  # noqa: F401,F403
from .low_rank import __all__ as _low_rank
from .manifolds import *  # noqa: F401,F403
from .manifolds import __all__ as _manifolds

__all__ = [*_manifolds, *_low_rank, *_adam]
