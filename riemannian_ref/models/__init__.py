"""Models built from the one attention module: the Fiber Bundle Transformer (and its presets), a recall head, budgets.

- :mod:`~riemannian_ref.models.config`: :class:`FiberBundleConfig` and its presets.
- :mod:`~riemannian_ref.models.transformer`: :class:`FiberBundleTransformer`.
- :mod:`~riemannian_ref.models.heads`: :class:`RecallHead`.
- :mod:`~riemannian_ref.models.budget`: parameter and FLOP counts, width matching.
"""
from .budget import *  # noqa: F401,F403
from .config import *  # noqa: F401,F403
from .config import __all__ as _config
from .budget import __all__ as _budget
from .heads import *  # noqa: F401,F403
from .heads import __all__ as _heads
from .transformer import *  # noqa: F401,F403
from .transformer import __all__ as _transformer

__all__ = [*_config, *_transformer, *_heads, *_budget]
