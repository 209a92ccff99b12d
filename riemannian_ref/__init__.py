"""riemannian_ref: Riemannian attention, the Fiber Bundle Transformer and their diagnostics.

The reference package of the book *Riemannian Attention*. The names a user
needs are here (``rr.riemannian_attention``, ``rr.FiberBundleTransformer``,
...); everything else lives in the subpackage named after its concept:

==========================  ===============================================================
``riemannian_ref.geometry``   metrics, scores, rank bounds, distances, geodesics
``riemannian_ref.attention``  the attention function, its references, connections, the module
``riemannian_ref.models``     the Fiber Bundle Transformer and its presets, a recall head, budgets
``riemannian_ref.analysis``   rank collapse, connection diagnostics, intrinsic rank
``riemannian_ref.optim``      matrix manifolds and Riemannian Adam
``riemannian_ref.data``       every task the book trains on
``riemannian_ref.training``   the training loop
``riemannian_ref.protocol``   the comparison protocol of every learning experiment
``riemannian_ref.plotting``   drawing 2-D metrics and paths (needs matplotlib)
==========================  ===============================================================
"""
from . import analysis, attention, data, geometry, models, optim, plotting, protocol, training  # noqa: F401
from .analysis import (attention_path_products, composite_norm, energy_effective_rank, fit_low_rank_kernel,
                       holonomy_defect, kernel_attention, metric_compatibility_defect, relative_residual, residual,
                       stable_rank, teacher_kernel, transport_closure_defect)
from .attention import (AttentionConfig, RiemannianAttention, blockwise_attention, connection_attention,
                        riemannian_attention, riemannian_attention_reference)
from .data import TaskData, associative_recall, char_lm, counting, modular_arithmetic, pair_lookup
from .geometry import (LowRankMetric, MetricField, MetricNet, SubspaceFactors, dot_product_form, non_gram_factors,
                       numerical_rank, pair_distance, riemannian_scores, score_rank_bound, segment_length,
                       shortest_path)
from .models import (FiberBundleConfig, FiberBundleTransformer, RecallHead, count_parameters, estimate_cost,
                     match_width)
from .optim import ManifoldParameter, RiemannianAdam, Stiefel
from .protocol import compare
from .training import TrainConfig, TrainResult, evaluate, train

__version__ = "0.2.0"

__all__ = [
    # geometry
    "LowRankMetric", "MetricNet", "SubspaceFactors", "riemannian_scores", "dot_product_form", "score_rank_bound",
    "non_gram_factors", "numerical_rank", "pair_distance", "segment_length", "MetricField", "shortest_path",
    # attention
    "riemannian_attention", "riemannian_attention_reference", "blockwise_attention", "connection_attention",
    "AttentionConfig", "RiemannianAttention",
    # models
    "FiberBundleConfig", "FiberBundleTransformer", "RecallHead", "count_parameters", "estimate_cost",
    "match_width",
    # analysis
    "relative_residual", "residual", "composite_norm", "stable_rank", "energy_effective_rank",
    "attention_path_products", "holonomy_defect", "transport_closure_defect", "metric_compatibility_defect",
    "teacher_kernel", "kernel_attention", "fit_low_rank_kernel",
    # optimisation
    "Stiefel", "ManifoldParameter", "RiemannianAdam",
    # data and training
    "TaskData", "associative_recall", "pair_lookup", "modular_arithmetic", "counting", "char_lm",
    "TrainConfig", "TrainResult", "train", "evaluate", "compare",
]
