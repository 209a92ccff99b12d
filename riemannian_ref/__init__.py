"""riemannian_ref: Riemannian attention, the Fiber Bundle Transformer and their diagnostics.

The reference package of the book *Riemannian Attention*. Public names are
re-exported here; each module is named after the mathematics it implements.
"""
from .metrics import *  # noqa: F401,F403
from .scores import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
from .theory import *  # noqa: F401,F403
from .geodesics import *  # noqa: F401,F403
from .connections import *  # noqa: F401,F403
from .model import *  # noqa: F401,F403
from .diagnostics import *  # noqa: F401,F403
from .stacks import *  # noqa: F401,F403
from .intrinsic import *  # noqa: F401,F403
from .manifolds import *  # noqa: F401,F403
from .optim import *  # noqa: F401,F403
from .tiny_transformer import *  # noqa: F401,F403
from .tasks import *  # noqa: F401,F403
from .training import *  # noqa: F401,F403
from .plotting import *  # noqa: F401,F403

from . import metrics, scores, attention, theory, geodesics, connections, model, diagnostics, stacks, intrinsic, manifolds, optim, tiny_transformer, tasks, training, plotting  # noqa: F401

__version__ = "0.1.0"
