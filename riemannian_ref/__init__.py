"""riemannian_ref: Riemannian attention, the Fiber Bundle Transformer and their diagnostics.

The reference package of the book *Riemannian Attention*. Public names are
re-exported here; each module is named after the mathematics it implements.
"""
from .metrics import *  # noqa: F401,F403
from .scores import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
from .connections import *  # noqa: F401,F403
from .model import *  # noqa: F401,F403
from .tasks import *  # noqa: F401,F403
from .training import *  # noqa: F401,F403

from . import metrics, scores, attention, connections, model, tasks, training  # noqa: F401

__version__ = "0.1.0"
