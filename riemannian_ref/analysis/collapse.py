"""Rank collapse: the measures, the one-layer bound and the probes, under one name.

The functions live in three modules by purpose:

- :mod:`riemannian_ref.analysis.measures`: residuals, stable and effective
  ranks, products of attention matrices, the token radius, collapse depths
  and attention entropies;
- :mod:`riemannian_ref.analysis.bound`: the one-layer collapse bound of
  chapter 9 (:func:`~riemannian_ref.analysis.bound.collapse_bound`) and the
  map it bounds (:func:`~riemannian_ref.analysis.bound.collapse_map`);
- :mod:`riemannian_ref.analysis.probes`: linear and two-layer perceptron
  probes that read labels from states.

This module re-exports what they publish, so that ``from
riemannian_ref.analysis.collapse import relative_residual`` keeps working; every
such name is also exported by :mod:`riemannian_ref.analysis`.
"""
from __future__ import annotations

from .bound import *  # noqa: F401,F403
from .bound import __all__ as _bound
from .measures import *  # noqa: F401,F403
from .measures import __all__ as _measures
from .probes import *  # noqa: F401,F403
from .probes import __all__ as _probes

__all__ = [*_measures, *_bound, *_probes]
