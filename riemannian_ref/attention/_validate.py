"""Argument checks shared by every attention entry point (private).

One place decides what a valid call is, so the blockwise operator, the dense
reference and the plain blockwise version accept and refuse the same inputs,
with errors that name the argument.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_same, check_tensor, shape_str
from ..geometry.scores import _check_score_inputs

__all__: list[str] = []


def check_mask(attn_mask, n_q: int, n_k: int, q: Tensor) -> Tensor | None:
    """Validate an SDPA-style mask: bool (True = may attend) or float of q's dtype, [..., 1|n_q, 1|n_k]."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, Tensor):
        raise ValueError(f"attn_mask must be a Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dim() < 2 or attn_mask.shape[-2] not in (1, n_q) or attn_mask.shape[-1] not in (1, n_k):
        raise ValueError(
            f"attn_mask must have shape broadcastable to [..., n_q, n_k] = [..., {n_q}, {n_k}], "
            f"got {shape_str(attn_mask)}"
        )
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {q.device}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        raise ValueError(f"a float attn_mask must have the dtype of query ({q.dtype}), got {attn_mask.dtype}")
    return attn_mask


def check_attention_inputs(q, k, v, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam, metric_side):
    """Validate a call; return ``(lam, scale, per_q, per_k, batch)``.

    ``batch`` is the broadcast batch shape of query, key, value and the metric
    factors. ``lam`` and ``attn_mask`` must broadcast *to* it: they may not
    grow the output's batch (a silent broadcast there is almost always a bug).
    """
    lam_t, scale, per_q, per_k = _check_score_inputs(q, k, U_q, U_k, lam, metric_side, scale,
                                                          names=("query", "key"))
    v = check_tensor(v, "value", min_dim=2)
    check_same(q, "query", [("value", v)])
    if v.dim() != q.dim() or v.shape[-2] != k.shape[-2]:
        raise ValueError(f"value must have shape [..., n_k, d_v] with n_k = {k.shape[-2]} and {q.dim()} dims "
                         f"like query, got {shape_str(v)}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
    if k.shape[-2] == 0:
        raise ValueError(f"key must hold at least one key (shape [..., n_k, d] with n_k >= 1), got "
                         f"{shape_str(k)}: a softmax over no keys is undefined")
    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    for U, per in ((U_q, per_q), (U_k, per_k)):
        if U is not None:
            shapes.append(U.shape[:-3] if per else U.shape[:-2])
    batch = torch.broadcast_shapes(*shapes)
    if torch.broadcast_shapes(batch, lam_t.shape) != batch:
        raise ValueError(f"lam of shape {shape_str(lam_t)} must broadcast to the batch {shape_str(batch)} of "
                         "query, key and value without enlarging it (one lam per head for inputs "
                         "[B, h, n, d] has shape [h])")
    attn_mask = check_mask(attn_mask, q.shape[-2], k.shape[-2], q)
    if attn_mask is not None and not _broadcasts_to(attn_mask.shape[:-2], batch):
        raise ValueError(f"attn_mask batch dims {shape_str(attn_mask.shape[:-2])} must broadcast to the "
                         f"batch {shape_str(batch)} of query, key and value")
    return lam_t, scale, per_q, per_k, batch



def _broadcasts_to(shape, batch) -> bool:
    """Whether ``shape`` broadcasts to ``batch`` without enlarging it (False, not an error, if it does not broadcast)."""
    try:
        return torch.broadcast_shapes(batch, shape) == batch
    except RuntimeError:
        return False
