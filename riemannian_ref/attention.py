r"""Riemannian attention: softmax over metric distances.

:func:`riemannian_attention_reference` is the dense definition,
``softmax(riemannian_scores(...) + mask) @ v``. :func:`riemannian_attention`
is the operator other code calls; it currently forwards to the reference.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_same, check_tensor, shape_str
from .scores import riemannian_scores

__all__ = ["riemannian_attention", "riemannian_attention_reference", "build_additive_mask"]


def build_additive_mask(attn_mask: Tensor | None, is_causal: bool, n_q: int, n_k: int,
                        like: Tensor) -> Tensor | None:
    """Turn SDPA-style masks into one additive float mask (``-inf`` where masked).

    Parameters
    ----------
    attn_mask : Tensor, optional
        Boolean (``True`` = may attend) or float (added to the scores), shape
        broadcastable to ``[..., n_q, n_k]``.
    is_causal : bool
        Top-left aligned causal mask, as ``scaled_dot_product_attention``.
    n_q, n_k : int
    like : Tensor
        Gives dtype and device.

    Returns
    -------
    Tensor of shape broadcastable to [..., n_q, n_k], or None
    """
    if attn_mask is not None and is_causal:
        raise ValueError("give either attn_mask or is_causal=True, not both (as scaled_dot_product_attention)")
    if is_causal:
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=like.device).tril()
        return torch.zeros(n_q, n_k, dtype=like.dtype, device=like.device).masked_fill(~keep, float("-inf"))
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, Tensor):
        raise ValueError(f"attn_mask must be a Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dim() < 2 or attn_mask.shape[-2] not in (1, n_q) or attn_mask.shape[-1] not in (1, n_k):
        raise ValueError(
            f"attn_mask must have shape broadcastable to [..., n_q, n_k] = [..., {n_q}, {n_k}], "
            f"got {shape_str(attn_mask)}"
        )
    if attn_mask.device != like.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {like.device}")
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=like.dtype, device=like.device).masked_fill(~attn_mask, float("-inf"))
    if attn_mask.dtype != like.dtype:
        raise ValueError(f"a float attn_mask must have the dtype of q ({like.dtype}), got {attn_mask.dtype}")
    return attn_mask


def riemannian_attention_reference(q: Tensor, k: Tensor, v: Tensor, U_q: Tensor | None = None,
                                   U_k: Tensor | None = None, *, lam=1.0, metric_side: str = "key",
                                   attn_mask: Tensor | None = None, is_causal: bool = False,
                                   scale: float | None = None, dropout_p: float = 0.0,
                                   return_weights: bool = False):
    r"""Dense Riemannian attention, :math:`\mathrm{softmax}(S + M)\,V`.

    Parameters
    ----------
    q : Tensor, shape [..., n_q, d]
    k : Tensor, shape [..., n_k, d]
    v : Tensor, shape [..., n_k, d_v]
    U_q, U_k, lam, metric_side, scale
        As in :func:`riemannian_ref.riemannian_scores`.
    attn_mask : Tensor, optional
        Boolean (``True`` = attend) or additive float mask, broadcastable to
        ``[..., n_q, n_k]``.
    is_causal : bool
        Top-left aligned causal mask.
    dropout_p : float
        Dropout on the attention weights.
    return_weights : bool
        Also return the attention matrix ``[..., n_q, n_k]``.

    Returns
    -------
    Tensor, shape [..., n_q, d_v]
        Rows whose keys are all masked give 0 (not NaN).
    """
    v = check_tensor(v, "v", min_dim=2)
    check_same(q, "q", [("v", v)])
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v must have shape [..., n_k, d_v] with n_k = {k.shape[-2]}, got {shape_str(v)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    S = riemannian_scores(q, k, U_q, U_k, lam=lam, metric_side=metric_side, scale=scale)
    M = build_additive_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], q)
    if M is not None:
        S = S + M
    # Rows with every key masked: the max is -inf; define their weights as 0.
    row_max = S.amax(-1, keepdim=True)
    dead = torch.isneginf(row_max)
    S = S - torch.where(dead, torch.zeros_like(row_max), row_max).detach()
    A = torch.exp(S)
    A = A / A.sum(-1, keepdim=True).clamp_min(torch.finfo(A.dtype).tiny)
    if dropout_p > 0.0:
        A = torch.nn.functional.dropout(A, p=dropout_p)
    out = A @ v
    return (out, A) if return_weights else out


def riemannian_attention(q: Tensor, k: Tensor, v: Tensor, U_q: Tensor | None = None,
                         U_k: Tensor | None = None, *, lam=1.0, metric_side: str = "key",
                         attn_mask: Tensor | None = None, is_causal: bool = False,
                         scale: float | None = None, dropout_p: float = 0.0) -> Tensor:
    """Riemannian attention with the call signature of ``scaled_dot_product_attention``.

    See :func:`riemannian_attention_reference` for the arguments.
    """
    return riemannian_attention_reference(q, k, v, U_q, U_k, lam=lam, metric_side=metric_side,
                                          attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                          dropout_p=dropout_p)
