r"""Riemannian attention written to be read: the dense definition and Algorithm 1.

Both functions take the arguments of
:func:`torch.nn.functional.scaled_dot_product_attention` plus the metric, like
the fast operator :func:`riemannian_ref.attention.functional.riemannian_attention`,
and both serve the tests as oracles for it.

- :func:`riemannian_attention_reference` is the definition,
  :math:`\mathrm{softmax}(S + M)\,V` with the Riemannian scores of
  :func:`riemannian_ref.geometry.scores.riemannian_scores`: it materialises the
  ``[..., n_q, n_k]`` scores (and the ``[..., n_q, n_k, r]`` rank products).
- :func:`blockwise_attention` is the same function computed one tile of
  scores at a time with an online softmax
  :cite:`milakov2018online,dao2022flashattention`, in the order of
  FlashAttention-2's Algorithm 1 :cite:`dao2023flashattention2` (query blocks
  outside, key blocks inside), in natural units and with plain PyTorch ops.
  The fast operator runs the same loop with its CPU details (base-2 units,
  one stacked matrix product per tile, buffers reused, a recomputing backward).

One rule for masked rows holds everywhere, SDPA's: rows whose keys are all
masked (``False``, ``-inf``) give 0, with zero gradients, never NaN
(:func:`masked_softmax`); a row whose mask is ``torch.finfo(dtype).min``
everywhere gives the average of its values, as ``s + m`` rounds to ``m``
(the fast operators reproduce this, see
:func:`riemannian_ref.attention.functional.riemannian_attention`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..geometry.scores import scores_unchecked
from ._validate import check_attention_inputs

__all__ = ["riemannian_attention_reference", "blockwise_attention"]


def additive_mask(attn_mask: Tensor | None, is_causal: bool, n_q: int, n_k: int, like: Tensor) -> Tensor | None:
    """One additive float mask (``-inf`` where masked) from an SDPA-style mask and/or the causal flag.

    Parameters
    ----------
    attn_mask : Tensor, shape broadcastable to [..., n_q, n_k], optional
        Boolean (``True`` = may attend) or float (added to the scores).
    is_causal : bool
        Top-left aligned causal mask: key ``j`` is visible to query ``i`` iff ``j <= i``.
    n_q, n_k : int
        Numbers of queries and keys.
    like : Tensor
        Gives dtype and device.

    Returns
    -------
    Tensor, shape broadcastable to [..., n_q, n_k], or None when nothing is masked
    """
    M = None
    if attn_mask is not None:
        M = attn_mask if attn_mask.dtype != torch.bool else \
            torch.zeros(attn_mask.shape, dtype=like.dtype, device=like.device).masked_fill(~attn_mask, float("-inf"))
    if is_causal:
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=like.device).tril()
        C = torch.zeros(n_q, n_k, dtype=like.dtype, device=like.device).masked_fill(~keep, float("-inf"))
        M = C if M is None else M + C
    return M


def masked_softmax(S: Tensor) -> Tensor:
    """Softmax over the last axis where a row of ``-inf`` (every key masked) gives 0, not NaN.

    Parameters
    ----------
    S : Tensor, shape [..., n_q, n_k]
        Scores with the mask already added.

    Returns
    -------
    Tensor, shape [..., n_q, n_k]
        Row-stochastic weights; all-zero rows where every score is ``-inf``,
        with zero gradient there.
    """
    row_max = S.amax(-1, keepdim=True)
    dead = torch.isneginf(row_max)
    A = torch.exp(S - torch.where(dead, torch.zeros_like(row_max), row_max).detach())
    # dividing dead rows by 1 (not by a clamped 0) keeps their gradient 0 instead of 0/0
    return A / torch.where(dead, torch.ones_like(row_max), A.sum(-1, keepdim=True))


def riemannian_attention_reference(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, *,
                                   U_q: Tensor | None = None, U_k: Tensor | None = None, lam=1.0,
                                   metric_side: str = "key", return_weights: bool = False):
    r"""Dense Riemannian attention, :math:`\mathrm{softmax}(S + M)\,V`.

    Parameters
    ----------
    query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam, metric_side
        As in :func:`riemannian_ref.attention.functional.riemannian_attention`.
    return_weights : bool
        Also return the attention weights, shape ``[..., n_q, n_k]``.

    Returns
    -------
    Tensor, shape [..., n_q, d_v]
        Rows whose keys are all masked give 0 (not NaN). With
        ``return_weights``, the pair ``(output, weights)``.

    Notes
    -----
    Memory :math:`O(n_q n_k r)`; differentiable by autograd to any order
    (gradient penalties), which the blockwise operator is not. Float16 and
    bfloat16 inputs are computed in float32 and returned in their dtype, as
    the operator computes them. A call whose scores could overflow the
    compute dtype is refused, naming ``lam`` and ``scale``: the bound
    :math:`\max(1, \text{scale}/2)\,(\max\lambda + w\max|U|_F^2)
    (\max_i|q_i| + \max_j|k_j|)^2` (:math:`w = 1/2` for ``"mean"``, else
    1), which holds every squared distance and every score, must stay below
    the dtype's largest finite number over 16. So an overflowed score never
    reads as a masked key (a row of them would give 0). The operator checks
    only the part without the data (it gives NaN rows where the data makes
    the scores overflow, as SDPA does).
    """
    lam_t, scale, per_q, per_k, _ = check_attention_inputs(query, key, value, attn_mask, dropout_p, is_causal,
                                                           scale, U_q, U_k, lam, metric_side, full_range=True)
    if query.dtype in (torch.float16, torch.bfloat16):  # computed in float32, as every other path computes them
        up = lambda t: t.float() if isinstance(t, Tensor) and t.is_floating_point() else t  # noqa: E731
        res = _reference_attention(*map(up, (query, key, value, attn_mask)), dropout_p, is_causal, scale, up(U_q),
                                   up(U_k), up(lam_t), metric_side, per_q, per_k, return_weights)
        return tuple(t.to(query.dtype) for t in res) if return_weights else res.to(query.dtype)
    return _reference_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam_t,
                                metric_side, per_q, per_k, return_weights)


def _reference_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam_t, metric_side,
                         per_q, per_k, return_weights=False):
    """:func:`riemannian_attention_reference` of a validated call (``lam_t``, ``scale``, ``per_q``, ``per_k`` as
    ``check_attention_inputs`` returns them), unchecked: for the operators' branches that take the dense path."""
    S = scores_unchecked(query, key, U_q, U_k, lam_t, metric_side, scale, per_q, per_k)
    M = additive_mask(attn_mask, is_causal, query.shape[-2], key.shape[-2], query)
    A = masked_softmax(S if M is None else S + M)
    if dropout_p > 0.0:
        A = torch.nn.functional.dropout(A, p=dropout_p)
    out = A @ value
    return (out, A) if return_weights else out


def blockwise_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                        is_causal: bool = False, scale: float | None = None, *, U_q: Tensor | None = None,
                        U_k: Tensor | None = None, lam=1.0, metric_side: str = "key",
                        block_sizes: tuple[int, int] = (64, 64)) -> Tensor:
    r"""Riemannian attention one tile at a time: FlashAttention's online softmax, plainly.

    For each block of query rows, the running row maximum :math:`m`, the
    running sum :math:`\ell` of :math:`e^{s - m}` and the unnormalised output
    are updated key block by key block; when the maximum grows, what was
    accumulated is rescaled by :math:`e^{m_{\text{old}} - m_{\text{new}}}`.
    No ``[n_q, n_k]`` matrix is formed; a tile of scores is
    :func:`~riemannian_ref.geometry.scores.riemannian_scores` of the blocks.

    Parameters
    ----------
    query, key, value, attn_mask, is_causal, scale, U_q, U_k, lam, metric_side
        As in :func:`riemannian_ref.attention.functional.riemannian_attention`
        (no dropout).
    block_sizes : (int, int)
        Rows of a query block and of a key block.

    Returns
    -------
    Tensor, shape [..., n_q, d_v]
    """
    lam, scale, per_q, per_k, _ = check_attention_inputs(query, key, value, attn_mask, 0.0, is_causal, scale,
                                                         U_q, U_k, lam, metric_side)
    bq, bk = block_sizes
    n_q, n_k = query.shape[-2], key.shape[-2]
    M = additive_mask(attn_mask, is_causal, n_q, n_k, query)          # [..., n_q | 1, n_k | 1] or None
    rows = lambda U, per, a, b: U[..., a:b, :, :] if per else U        # noqa: E731  a block of a factor
    out = []
    for i0 in range(0, n_q, bq):                                      # one block of query rows
        q = query[..., i0:i0 + bq, :]
        m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)   # running max
        l = torch.zeros_like(m)                                                       # running sum
        acc = q.new_zeros(*q.shape[:-1], value.shape[-1])                              # running output
        for j0 in range(0, n_k, bk):                                  # one block of keys and values
            S = scores_unchecked(q, key[..., j0:j0 + bk, :],                 # validated once, above
                                 rows(U_q, per_q, i0, i0 + bq) if U_q is not None else None,
                                 rows(U_k, per_k, j0, j0 + bk) if U_k is not None else None,
                                 lam, metric_side, scale, per_q, per_k)                 # (..., bq, bk)
            if M is not None:
                Mi = M[..., i0:i0 + bq, :] if M.shape[-2] > 1 else M
                S = S + (Mi[..., j0:j0 + bk] if M.shape[-1] > 1 else Mi)
            m_new = torch.maximum(m, S.amax(-1))
            shift = torch.where(torch.isneginf(m_new), 0.0, m_new)    # rows with no visible key yet
            P = torch.exp(S - shift.unsqueeze(-1))                   # (..., bq, bk)
            alpha = torch.exp(m - shift)                             # rescales what came before
            l = alpha * l + P.sum(-1)
            acc = alpha.unsqueeze(-1) * acc + P @ value[..., j0:j0 + bk, :]
            m = m_new
        # rows with every key masked: 0 / 1 = 0, with a finite gradient (dividing by a tiny clamp
        # would scale the incoming gradient by 1/tiny, overflow, and give 0 * inf = NaN)
        out.append(acc / torch.where(l > 0, l, torch.ones_like(l)).unsqueeze(-1))
    return torch.cat(out, dim=-2)
