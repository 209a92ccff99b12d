"""Riemannian optimisation: one manifold interface (geoopt's verbs) and one Adam over any manifold.

- :mod:`~riemannian_ref.optim.manifold`: :class:`Manifold`, :class:`Euclidean`,
  :class:`ManifoldParameter` and :func:`constrain_` (tag a model's parameters).
- :mod:`~riemannian_ref.optim.stiefel`: :class:`Stiefel` (orthonormal frames).
- :mod:`~riemannian_ref.optim.low_rank`: rank-``r`` matrices on factor pairs,
  :class:`FixedRankEmbedded` and :class:`FixedRankFactored`.
- :mod:`~riemannian_ref.optim.adam`: :class:`RiemannianAdam`.
"""
from .adam import RiemannianAdam
from .low_rank import FixedRankEmbedded, FixedRankFactored
from .manifold import Euclidean, Manifold, ManifoldParameter, constrain_
from .stiefel import Stiefel

__all__ = ["Manifold", "Euclidean", "Stiefel", "FixedRankEmbedded", "FixedRankFactored",
           "ManifoldParameter", "constrain_", "RiemannianAdam"]
