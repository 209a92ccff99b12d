r"""Riemannian attention: softmax over metric distances, as a fast operator and a module.

:func:`riemannian_attention_reference` is the dense definition,
``softmax(riemannian_scores(...) + mask) @ v``; it materialises the
``[..., n_q, n_k]`` scores and the ``[..., n_q, n_k, r]`` rank products.
:func:`riemannian_attention` is the operator other code calls: a blockwise
(flash-style) computation that never holds more than one tile of scores.

The expansion behind the operator (``"key"`` side; ``"query"`` is its mirror).
With :math:`M = \lambda I + \sum_{\text{shared}} W W^\top` (every shared
low-rank part joins the isotropic part), :math:`c^2 = \text{scale}\cdot w/2`
(``w = 1``, or ``1/2`` for each side of ``"mean"``) and dropping the terms that
are constant along a softmax row,

.. math::
    s_{ij} = \underbrace{q_i \cdot (\text{scale}\, M k_j)
             - \tfrac{\text{scale}}{2} k_j^\top M k_j}_{X^{(0)}_{ij}}
             \;-\; \sum_{t=1}^{r} \big(\underbrace{q_i\cdot (c\, U_{j,t}) - c\, U_{j,t}\cdot k_j}_{X^{(t)}_{ij}}\big)^2 .

Every :math:`X^{(t)}_{ij}` is an entry of ONE matrix product of the query
block, with a constant 1 appended to each query, and the key block's stacked
``[scale M k_j | c U_j]`` (``(1 + r)`` columns per key, each with its bias in
the extra row), so the score costs ``1 + r`` times
:math:`Q K^\top` (``1 + 2r`` for ``"mean"``, whose query side is a second
product of the stacked ``c U_i`` with the keys). A softmax row is computed
online over key blocks :cite:`milakov2018online,dao2022flashattention`; the
backward recomputes each tile from ``q, k, v, U``, the output and the row
log-sum-exp, so extra memory is ``O(n * block * (1 + r))`` in both passes.

Three details make the loop fast on CPU, where an elementwise pass over a
tile costs a noticeable fraction of its matrix product: the squares are
subtracted in place into the product's own output (no copy of the tile), the
exponentials are ``exp2`` with ``log2(e)`` folded into the stacked constants
(the trick of fused attention kernels), and every tile's product goes into
one buffer allocated per call (a multi-megabyte tensor made and freed per
tile costs page faults). ``benchmarks/bench_attention_ablation.py`` measures
what each is worth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ._checks import check_same, check_tensor, shape_str
from .metrics import MetricNet
from .scores import check_score_inputs, riemannian_scores

__all__ = [
    "riemannian_attention",
    "riemannian_attention_reference",
    "build_additive_mask",
    "attention_block_sizes",
    "RiemannianAttentionConfig",
    "RiemannianMultiheadAttention",
]


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
    attn_mask = _check_mask(attn_mask, is_causal, n_q, n_k, like)
    if is_causal:
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=like.device).tril()
        return torch.zeros(n_q, n_k, dtype=like.dtype, device=like.device).masked_fill(~keep, float("-inf"))
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=like.dtype, device=like.device).masked_fill(~attn_mask, float("-inf"))
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
    _check_has_keys(k)
    S = riemannian_scores(q, k, U_q, U_k, lam=lam, metric_side=metric_side, scale=scale)
    M = build_additive_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], q)
    if M is not None:
        S = S + M
    # Rows with every key masked: the max is -inf; define their weights as 0.
    row_max = S.amax(-1, keepdim=True)
    dead = torch.isneginf(row_max)
    S = S - torch.where(dead, torch.zeros_like(row_max), row_max).detach()
    A = torch.exp(S)
    # (dividing dead rows by 1, not by a clamped 0, keeps their gradient 0 instead of 0/0)
    A = A / torch.where(dead, torch.ones_like(row_max), A.sum(-1, keepdim=True))
    if dropout_p > 0.0:
        A = torch.nn.functional.dropout(A, p=dropout_p)
    out = A @ v
    return (out, A) if return_weights else out


# ---------------------------------------------------------------- the operator

_NEG_INF = float("-inf")


def attention_block_sizes(n_q: int, n_k: int, width: int, *, tile: int = 2 ** 17) -> tuple[int, int]:
    """Query and key block sizes of the blockwise operator (both passes).

    A tile holds ``bq * bk * width`` products (``width = 1 + r`` one-sided,
    ``1 + 2r`` for ``"mean"``) per batch element; ``tile`` bounds that number
    (down to a floor of 64 keys per block), so the extra memory of a tile does
    not grow with the rank.

    Parameters
    ----------
    n_q, n_k : int
        Numbers of queries and keys.
    width : int
        Products per (query, key) pair, ``>= 1``.
    tile : int
        Products per tile and batch element (default ``2**17``: 512 KiB in
        float32), chosen by measurement on the benchmark machine
        (``benchmarks/bench_attention.py``), not derived.

    Returns
    -------
    (bq, bk) : tuple of int
    """
    for name, val in (("n_q", n_q), ("n_k", n_k), ("width", width), ("tile", tile)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    bq = max(1, min(n_q, 256))
    # a multiple of 64 columns per rank product keeps the GEMM on its fast path
    bk = max(64, 64 * round(tile / (bq * width * 64)))
    return bq, max(1, min(n_k, bk))


def _key_block(k_b: Tensor, lam: Tensor, W: Tensor | None, U_b: Tensor | None, scale: float, ck: float):
    r"""The stacked key block ``Kt`` (Bf, d+1, (1+rk) nb) and ``Mk = scale M k`` (Bf, nb, d).

    Columns ``t * nb + j`` (t-major): ``t = 0`` is ``[scale M k_j ; -k_j.Mk_j / 2]``,
    ``t >= 1`` is ``[c U_{j,t} ; -c U_{j,t}.k_j]``; the last row multiplies the
    constant 1 appended to every query.
    """
    Bf, nb, d = k_b.shape
    rk = U_b.shape[-1] if U_b is not None else 0
    Mk = lam.view(-1, 1, 1) * k_b
    if W is not None:
        Mk = Mk + (k_b @ W) @ W.transpose(-1, -2)  # shared low-rank parts join M
    Mk = scale * Mk  # (Bf, nb, d)
    Kt = k_b.new_empty(Bf, d + 1, (1 + rk) * nb)
    Kt[:, :d, :nb] = Mk.transpose(1, 2)
    Kt[:, d, :nb] = -0.5 * (k_b * Mk).sum(-1)
    if rk:
        cUt = Kt[:, :d, nb:].view(Bf, d, rk, nb)
        torch.mul(U_b.permute(0, 2, 3, 1), ck, out=cUt)  # c U_j, key index innermost
        # -c U_j^T k_j, elementwise along the contiguous key index (a batch of
        # 1 x d x r products is slow in BLAS, and so is a product over the size-r axis)
        ka = torch.mul(cUt, k_b.transpose(1, 2).unsqueeze(2)).sum(1)  # (Bf, rk, nb)
        torch.neg(ka, out=Kt[:, d, nb:].view(Bf, rk, nb))
    return Kt, Mk


def _key_block_backward(dKt, k_b, Mk, lam, W, U_b, scale, ck, need_lam):
    """Chain rule of :func:`_key_block`: (dk_b, dU_b, dlam, dW), all O(nb d r)."""
    Bf, nb, d = k_b.shape
    rk = U_b.shape[-1] if U_b is not None else 0
    dkb = dKt[:, d, :nb]  # (Bf, nb)
    dMk = dKt[:, :d, :nb].transpose(1, 2) - 0.5 * dkb.unsqueeze(-1) * k_b  # (Bf, nb, d)
    dk = -0.5 * dkb.unsqueeze(-1) * Mk
    dU = None
    if rk:
        dU = ck * dKt[:, :d, nb:].reshape(Bf, d, rk, nb).permute(0, 3, 1, 2)  # (Bf, nb, d, rk)
        dka = -dKt[:, d, nb:].reshape(Bf, rk, nb).transpose(1, 2)  # (Bf, nb, rk)
        dU = dU + ck * k_b.unsqueeze(-1) * dka.unsqueeze(-2)
        dk = dk + ck * (U_b * dka.unsqueeze(-2)).sum(-1)
    dMs = scale * dMk
    dk = dk + lam.view(-1, 1, 1) * dMs
    dlam = (k_b * dMs).sum((1, 2)) if need_lam else None  # (Bf,)
    dW = None
    if W is not None:
        dk = dk + (dMs @ W) @ W.transpose(-1, -2)
        dW = k_b.transpose(1, 2) @ (dMs @ W) + dMs.transpose(1, 2) @ (k_b @ W)  # (Bf, d, rs)
    return dk, dU, dlam, dW


def _augment(x: Tensor) -> Tensor:
    """Append the constant 1: (Bf, n, d) -> (Bf, n, d+1)."""
    return torch.cat([x, x.new_ones(*x.shape[:-1], 1)], -1)


def _query_block(q_b: Tensor, U_b: Tensor, cq: float) -> Tensor:
    """Stacked query block ``[c U_{i,t}^T, -c U_{i,t}.q_i]``, rows ``i * rq + t``: (Bf, nb rq, d+1)."""
    Bf, nb, d, rq = U_b.shape
    Qa = q_b.new_empty(Bf, nb, rq, d + 1)
    cU = cq * U_b
    Qa[..., :d] = cU.transpose(-1, -2)
    Qa[..., d] = -(cU * q_b.unsqueeze(-1)).sum(-2)
    return Qa.view(Bf, nb * rq, d + 1)


def _tile(qa_b, Kt, Qa, kta_b, rk, rq, mask, mask_scale, causal, i0, i1, j0, j1, xbuf, ybuf):
    """Scores of one tile and the rank products X (Bf, bq, 1+rk, bk), Y (Bf, bq, rq, bk).

    The scores ``S`` (Bf, bq, bk) are the view ``X[:, :, 0]`` (rows of stride
    ``(1 + rk) bk``), updated in place: the tile is never copied. A float
    mask is added times ``mask_scale``. ``xbuf`` and ``ybuf`` (flat, at least
    one tile long) receive the products: one allocation per call, not one per
    tile (large allocations that are freed and made again cost page faults).
    """
    Bf, nb, mb = qa_b.shape[0], i1 - i0, j1 - j0
    X = torch.bmm(qa_b, Kt, out=xbuf[:Bf * nb * (1 + rk) * mb].view(Bf, nb, (1 + rk) * mb))
    X = X.view(Bf, nb, 1 + rk, mb)  # ONE product for Q K^T and all U_j^T q_i
    S = X[:, :, 0]
    for t in range(1, rk + 1):
        S.addcmul_(X[:, :, t], X[:, :, t], value=-1.0)
    Y = None
    if rq:
        Y = torch.bmm(Qa, kta_b, out=ybuf[:Bf * nb * rq * mb].view(Bf, nb * rq, mb))
        Y = Y.view(Bf, nb, rq, mb)  # U_i^T k_j for the query side
        for t in range(rq):
            S.addcmul_(Y[:, :, t], Y[:, :, t], value=-1.0)
    if causal and j1 - 1 > i0:  # top-left aligned: key j is seen by query i iff j <= i
        rows = torch.arange(i0, i1, device=S.device).unsqueeze(-1)
        cols = torch.arange(j0, j1, device=S.device).unsqueeze(0)
        S.masked_fill_(cols > rows, _NEG_INF)
    if mask is not None:
        m = mask[:, i0:i1] if mask.shape[1] > 1 else mask
        m = m[:, :, j0:j1] if m.shape[2] > 1 else m
        if m.dtype == torch.bool:
            S.masked_fill_(~m, _NEG_INF)
        else:
            S.add_(m, alpha=mask_scale)
    return S, X, Y


# The tiles compute scores in base 2: every constant carries log2(e), so the
# softmax runs on exp2, which is markedly faster than exp on CPU (the trick of
# fused attention kernels). In the backward, dS is in natural units and the
# factor ln 2 of the base-2 products is folded into the stacked key block; the
# chain rule through the key block then uses the same scaled constants.
_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)


def _base2(scale: float, ck: float, cq: float) -> tuple[float, float, float]:
    """The tiles' constants: ``scale`` times log2(e), the factors ``c`` times sqrt(log2(e))."""
    return scale * _LOG2E, ck * math.sqrt(_LOG2E), cq * math.sqrt(_LOG2E)


def _tile_buffers(q: Tensor, n_q: int, n_k: int, bq: int, bk: int, rk: int, rq: int):
    """Flat buffers for the largest tile's products X and Y (see :func:`_tile`), one per call."""
    Bf, tq, tk = q.shape[0], min(bq, n_q), min(bk, n_k)
    xbuf = q.new_empty(Bf * tq * (1 + rk) * tk)
    ybuf = q.new_empty(Bf * tq * rq * tk) if rq else None
    return xbuf, ybuf


class _RiemannianAttentionFn(torch.autograd.Function):
    """Blockwise forward with online softmax; backward recomputes every tile.

    Inputs are flattened over the batch: q (Bf, n_q, d), k (Bf, n_k, d),
    v (Bf, n_k, dv), lam (Bf,), W (Bf, d, rs) or None (all shared low-rank
    parts), Uk (Bf, n_k, d, rk) or None, Uq (Bf, n_q, d, rq) or None,
    mask (1 or Bf, n_q or 1, n_k or 1) bool/float or None. ``scale``, ``ck``
    and ``cq`` are in natural units; the tiles use them times log2(e)
    (``scale``) and sqrt(log2(e)) (``ck``, ``cq``). Saved for the backward:
    the inputs, the output and the row log-sum-exp in base 2, nothing pairwise.
    """

    @staticmethod
    def forward(ctx, q, k, v, lam, W, Uk, Uq, mask, causal, scale, ck, cq, blocks):
        Bf, n_q, d = q.shape
        n_k, dv = k.shape[1], v.shape[2]
        rk = Uk.shape[-1] if Uk is not None else 0
        rq = Uq.shape[-1] if Uq is not None else 0
        bq, bk = blocks
        s2, ck2, cq2 = _base2(scale, ck, cq)
        # Only a mask can leave a row with no visible key (a causal row always sees key 0).
        maybe_dead = mask is not None
        xbuf, ybuf = _tile_buffers(q, n_q, n_k, bq, bk, rk, rq)
        # Key blocks outside, so each stacked key block is built once; the running
        # max m (base 2), sum l and output acc of every query row live across them.
        m = q.new_empty(Bf, n_q)
        l = q.new_empty(Bf, n_q)
        acc = q.new_empty(Bf, n_q, dv)  # running unnormalised output
        for j0 in range(0, n_k, bk):
            j1 = min(j0 + bk, n_k)
            Kt, _ = _key_block(k[:, j0:j1], lam, W, Uk[:, j0:j1] if rk else None, s2, ck2)
            kta_b = _augment(k[:, j0:j1]).transpose(1, 2) if rq else None
            v_b = v[:, j0:j1]
            i_start = (j0 // bq) * bq if causal else 0  # causal: earlier query blocks see none of these keys
            for i0 in range(i_start, n_q, bq):
                i1 = min(i0 + bq, n_q)
                Qa = _query_block(q[:, i0:i1], Uq[:, i0:i1], cq2) if rq else None
                S, X, Y = _tile(_augment(q[:, i0:i1]), Kt, Qa, kta_b, rk, rq, mask, _LOG2E, causal,
                                i0, i1, j0, j1, xbuf, ybuf)
                m_b, l_b, acc_b = m[:, i0:i1], l[:, i0:i1], acc[:, i0:i1]
                m_new = S.amax(-1)
                if j0 > 0:
                    m_new = torch.maximum(m_b, m_new)
                # rows that have seen no key yet (max -inf) subtract 0, not -inf
                ms = m_new.masked_fill(torch.isneginf(m_new), 0.0) if maybe_dead else m_new
                P = S.sub_(ms.unsqueeze(-1)).exp2_()  # (Bf, bq, bk), in place in X
                if j0 == 0:  # the first block every query row sees (causally too: key 0)
                    l_b.copy_(P.sum(-1))
                    acc_b.baddbmm_(P, v_b, beta=0.0)  # beta = 0 ignores the uninitialised acc
                else:
                    # Rescale what was accumulated so far: alpha <= 1, and 0 for rows that
                    # had seen no key (m_b = -inf), never exp2(0 - m_new), which can overflow.
                    alpha = (m_b - ms).exp2_()
                    l_b.mul_(alpha).add_(P.sum(-1))
                    acc_b.mul_(alpha.unsqueeze(-1)).baddbmm_(P, v_b)
                m_b.copy_(m_new)
                del X, Y, S, P
        tiny = torch.finfo(q.dtype).tiny
        out = acc.div_(l.clamp_min(tiny).unsqueeze(-1))  # fully masked rows: 0 / tiny = 0
        # fully masked rows: lse = +inf, so that exp2(S - lse) = 0 in the backward
        lse = torch.where(l > 0, m + torch.log2(l.clamp_min(tiny)), float("inf"))
        ctx.save_for_backward(q, k, v, lam, W, Uk, Uq, mask, out, lse)
        ctx.consts = (causal, scale, ck, cq, blocks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, lam, W, Uk, Uq, mask, out, lse = ctx.saved_tensors
        causal, scale, ck, cq, (bq, bk) = ctx.consts
        s2, ck2, cq2 = _base2(scale, ck, cq)
        need_lam = ctx.needs_input_grad[3]
        Bf, n_q, d = q.shape
        n_k = k.shape[1]
        rk = Uk.shape[-1] if Uk is not None else 0
        rq = Uq.shape[-1] if Uq is not None else 0
        dout = dout.contiguous()
        Drow = (dout * out).sum(-1)  # rowsum(dO * O)                     (Bf, n_q)
        xbuf, ybuf = _tile_buffers(q, n_q, n_k, bq, bk, rk, rq)
        # The tiles hold base-2 products X' (X'^(0) = log2(e) X^(0), X'^(t) = sqrt(log2(e)) X^(t)),
        # so dX'^(0) = ln 2 dS and dX'^(t) = -2 ln 2 X'^(t) dS: the factors ln 2 and -2 ln 2 go
        # into the key side (O(nb d r) per key block) instead of a pass over every tile.
        f0, ft = _LN2, -2.0 * _LN2
        dqa = q.new_zeros(Bf, n_q, d + 1)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dUk = torch.zeros_like(Uk) if rk else None
        dlam = torch.zeros_like(lam) if need_lam else None
        dW = torch.zeros_like(W) if W is not None else None
        dQa = q.new_zeros(Bf, n_q * rq, d + 1) if rq else None  # d[c U_i^T, -c U_i^T q_i], row-stacked
        for j0 in range(0, n_k, bk):
            j1 = min(j0 + bk, n_k)
            k_b, v_b = k[:, j0:j1], v[:, j0:j1]
            U_b = Uk[:, j0:j1] if rk else None
            Kt, Mk = _key_block(k_b, lam, W, U_b, s2, ck2)
            KtT = Kt.transpose(1, 2).clone()  # carries the factors f0 (t = 0) and ft (t >= 1) of dX
            KtT[:, :j1 - j0].mul_(f0)
            KtT[:, j1 - j0:].mul_(ft)
            kta_b = _augment(k_b).transpose(1, 2) if rq else None  # (Bf, d+1, nb)
            dKt = torch.zeros_like(Kt)
            dkta = torch.zeros(Bf, d + 1, j1 - j0, dtype=q.dtype, device=q.device) if rq else None
            dv_b = dv[:, j0:j1]
            vT = v_b.transpose(1, 2)
            i_start = (j0 // bq) * bq if causal else 0  # earlier query blocks see none of these keys
            for i0 in range(i_start, n_q, bq):
                i1 = min(i0 + bq, n_q)
                qa_b = _augment(q[:, i0:i1])
                Qa = _query_block(q[:, i0:i1], Uq[:, i0:i1], cq2) if rq else None
                S, X, Y = _tile(qa_b, Kt, Qa, kta_b, rk, rq, mask, _LOG2E, causal, i0, i1, j0, j1, xbuf, ybuf)
                P = S.sub_(lse[:, i0:i1].unsqueeze(-1)).exp2_()  # (Bf, bq, bk), the view X[:, :, 0]
                dv_b.baddbmm_(P.transpose(1, 2), dout[:, i0:i1])
                dP = torch.bmm(dout[:, i0:i1], vT).sub_(Drow[:, i0:i1].unsqueeze(-1))
                dS = P.mul_(dP)  # X[:, :, 0] now holds dX^(0) = dS
                if rk:  # X'^(t) dS; the factor -2 ln 2 is in KtT and applied to dKt below
                    X[:, :, 1:].mul_(dS.unsqueeze(2))
                dX = X.view(Bf, i1 - i0, -1)  # (Bf, bq, (1+rk) bk)
                dqa[:, i0:i1].baddbmm_(dX, KtT)
                dKt.baddbmm_(qa_b.transpose(1, 2), dX)
                if rq:  # Y'^(t) dS; the factor -2 ln 2 is applied to dQa and dkta afterwards
                    dY = Y.mul_(dS.unsqueeze(2)).view(Bf, -1, j1 - j0)  # (Bf, bq rq, bk)
                    dQa[:, i0 * rq:i1 * rq].baddbmm_(dY, kta_b.transpose(1, 2))
                    dkta.baddbmm_(Qa.transpose(1, 2), dY)
                del X, Y, S, P, dP, dS
            dKt[:, :, :j1 - j0].mul_(f0)
            dKt[:, :, j1 - j0:].mul_(ft)
            dk_b, dU_b, dlam_b, dW_b = _key_block_backward(dKt, k_b, Mk, lam, W, U_b, s2, ck2, need_lam)
            if rq:
                dk_b = dk_b + ft * dkta[:, :d].transpose(1, 2)
            dk[:, j0:j1] = dk_b
            if rk:
                dUk[:, j0:j1] = dU_b
            if need_lam:
                dlam += dlam_b
            if W is not None:
                dW += dW_b
        dq = dqa[..., :d]
        dUq = None
        if rq:  # Qa = [c U_i^T, -c U_i^T q_i]
            dQa = dQa.view(Bf, n_q, rq, d + 1).mul_(ft)
            dqb = -dQa[..., d]  # (Bf, n_q, rq)
            dUq = cq2 * (dQa[..., :d].transpose(-1, -2) + q.unsqueeze(-1) * dqb.unsqueeze(-2))  # (Bf, n_q, d, rq)
            dq = dq + cq2 * (Uq * dqb.unsqueeze(-2)).sum(-1)
        return dq, dk, dv, dlam, dW, dUk, dUq, None, None, None, None, None, None


def _check_mask(attn_mask, is_causal, n_q, n_k, q):
    """Validate an SDPA-style mask against ``n_q``, ``n_k`` and the dtype/device of ``q``."""
    if attn_mask is not None and is_causal:
        raise ValueError("give either attn_mask or is_causal=True, not both (as scaled_dot_product_attention)")
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
        raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {q.device}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        raise ValueError(f"a float attn_mask must have the dtype of q ({q.dtype}), got {attn_mask.dtype}")
    return attn_mask


def _check_has_keys(k: Tensor) -> None:
    if k.shape[-2] == 0:
        raise ValueError(f"k must hold at least one key (shape [..., n_k, d] with n_k >= 1), got {shape_str(k)}: "
                         "a softmax over no keys is undefined")


def _check_block_sizes(block_sizes) -> tuple[int, int]:
    ok = isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 2 and all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block_sizes)
    if not ok:
        raise ValueError(f"block_sizes must be a pair of positive ints (bq, bk), got {block_sizes!r}")
    return int(block_sizes[0]), int(block_sizes[1])


def _flat(x: Tensor, batch: torch.Size, tail: int) -> Tensor:
    """Broadcast the batch dims of ``x`` to ``batch`` and flatten them: (prod(batch), *tail)."""
    t = x.shape[x.dim() - tail:]
    return x.expand(*batch, *t).reshape(-1, *t)


@torch.compiler.disable
def riemannian_attention(q: Tensor, k: Tensor, v: Tensor, U_q: Tensor | None = None,
                         U_k: Tensor | None = None, *, lam=1.0, metric_side: str = "key",
                         attn_mask: Tensor | None = None, is_causal: bool = False,
                         scale: float | None = None, dropout_p: float = 0.0,
                         block_sizes: tuple[int, int] | None = None) -> Tensor:
    r"""Riemannian attention with the call signature of ``scaled_dot_product_attention``.

    Computes :math:`\mathrm{softmax}(S + M)\,V` with the Riemannian scores
    :math:`s_{ij} = -\tfrac{\text{scale}}{2}(q_i-k_j)^\top \bar G_{ij}(q_i-k_j)`
    of :func:`riemannian_ref.riemannian_scores`, blockwise: the score matrix
    and the pairwise rank products are never formed whole.

    Parameters
    ----------
    q : Tensor, shape [..., n_q, d]
    k : Tensor, shape [..., n_k, d]
    v : Tensor, shape [..., n_k, d_v]
    U_q : Tensor, shape [..., n_q, d, r] or [..., d, r], optional
        Query metric factors (per token, or one shared metric); for
        ``metric_side`` ``"query"`` and ``"mean"``.
    U_k : Tensor, shape [..., n_k, d, r] or [..., d, r], optional
        Key metric factors; for ``"key"`` and ``"mean"``.
    lam : float or Tensor, shape broadcastable to ``q.shape[:-2]``
        Isotropic part :math:`\lambda > 0` (e.g. per head ``[h]``).
    metric_side : {"key", "query", "mean"}
    attn_mask : Tensor, optional
        Boolean (``True`` = may attend) or additive float mask of q's dtype,
        broadcastable to ``[..., n_q, n_k]``.
    is_causal : bool
        Top-left aligned causal mask (key ``j`` visible to query ``i`` iff
        ``j <= i``), as ``scaled_dot_product_attention``.
    scale : float, optional
        :math:`1/\tau`, default :math:`1/\sqrt d`.
    dropout_p : float
        Dropout on the attention weights. ``dropout_p > 0`` runs the dense
        :func:`riemannian_attention_reference` (memory :math:`O(n^2 r)`):
        the blockwise kernel has no dropout. Pass 0 in evaluation.
    block_sizes : (int, int), optional
        Query and key block sizes; default :func:`attention_block_sizes`.

    Returns
    -------
    Tensor, shape [..., n_q, d_v]
        Rows whose keys are all masked give 0, with zero gradients (no NaN).

    Notes
    -----
    Cost: the scores of a ``(query block, key block)`` tile are one matrix
    product of width ``(1 + r) * bk`` (plus a second one of ``r * bq`` rows for
    the query side of ``"mean"``/``"query"``), so score FLOPs are ``1 + r``
    times those of :math:`QK^\top` (``1 + 2r`` for ``"mean"``). Shared metrics
    cost nothing pairwise: they fold into :math:`M`. Memory beyond the output
    and the gradients: the row log-sum-exp and one tile of ``bq * bk * (1 + r)``
    numbers per batch element (plus one stacked key block), in forward and
    backward; nothing of size ``n_q * n_k`` is stored.

    Precision: float32 and float64 run natively. Under ``torch.autocast``
    (and for float16/bfloat16 inputs) the operator upcasts to float32, computes
    there and returns float32 under autocast (the input dtype otherwise): the
    expanded distance cancels terms of size :math:`|q|^2` and bfloat16's
    8-bit mantissa would leave no correct digit in the differences.

    ``torch.compile``: the operator is excluded from tracing
    (``torch.compiler.disable``), so a compiled model graph-breaks around it
    and runs it eagerly (``fullgraph=True`` is therefore not possible). The
    tests compile a module with the ``"eager"`` backend; the default inductor
    backend was checked by hand on CPU (same output and gradients; the
    compilation takes about 30 s on this book's machine).

    Dropout: ``dropout_p > 0`` takes the dense reference path (see above);
    SDPA-style, dropout is applied whenever ``dropout_p > 0``, so pass
    ``dropout_p=0`` in evaluation (:class:`RiemannianMultiheadAttention` does).
    """
    dev = q.device.type if isinstance(q, Tensor) else "cpu"
    autocast_on = torch.is_autocast_enabled(dev) if dev in ("cpu", "cuda") else False
    if autocast_on:  # inputs may come in mixed precisions: compute in float32, return float32
        f32 = lambda t: t.float() if isinstance(t, Tensor) and t.is_floating_point() else t  # noqa: E731
        with torch.autocast(dev, enabled=False):
            return riemannian_attention(f32(q), f32(k), f32(v), f32(U_q), f32(U_k), lam=f32(lam),
                                        metric_side=metric_side, attn_mask=f32(attn_mask), is_causal=is_causal,
                                        scale=scale, dropout_p=dropout_p, block_sizes=block_sizes)
    lam_t, scale, per_q, per_k = check_score_inputs(q, k, U_q, U_k, lam, metric_side, scale)
    v = check_tensor(v, "v", min_dim=2)
    check_same(q, "q", [("v", v)])
    if v.dim() != q.dim() or v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v must have shape [..., n_k, d_v] with n_k = {k.shape[-2]} and {q.dim()} dims, "
                         f"got {shape_str(v)}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    _check_has_keys(k)
    attn_mask = _check_mask(attn_mask, is_causal, n_q, n_k, q)
    if dropout_p > 0.0:
        return riemannian_attention_reference(q, k, v, U_q, U_k, lam=lam, metric_side=metric_side,
                                              attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              dropout_p=dropout_p)
    if q.dtype in (torch.float16, torch.bfloat16):  # half inputs: compute in float32, return their dtype
        f32 = lambda t: t.float() if isinstance(t, Tensor) and t.is_floating_point() else t  # noqa: E731
        out = riemannian_attention(f32(q), f32(k), f32(v), f32(U_q), f32(U_k), lam=f32(lam_t),
                                   metric_side=metric_side, attn_mask=f32(attn_mask), is_causal=is_causal,
                                   scale=scale, block_sizes=block_sizes)
        return out.to(q.dtype)

    # Sort the metric parts: shared ones join M (free), per-token ones give squared terms.
    w = 0.5 if metric_side == "mean" else 1.0
    shared, Uk_tok, Uq_tok = [], None, None
    if metric_side in ("key", "mean") and U_k.shape[-1] > 0:
        if per_k:
            Uk_tok = U_k
        else:
            shared.append(U_k)
    if metric_side in ("query", "mean") and U_q.shape[-1] > 0:
        if per_q:
            Uq_tok = U_q
        else:
            shared.append(U_q)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], lam_t.shape,
                                   *[U.shape[:-2] for U in shared],
                                   *[U.shape[:-3] for U in (Uk_tok, Uq_tok) if U is not None])
    qf, kf, vf = _flat(q, batch, 2), _flat(k, batch, 2), _flat(v, batch, 2)
    lamf = lam_t.expand(batch).reshape(-1)
    W = None
    if shared:
        W = torch.cat([_flat(U, batch, 2) for U in shared], -1)
        if w != 1.0:
            W = W * math.sqrt(w)
    Ukf = _flat(Uk_tok, batch, 3) if Uk_tok is not None else None
    Uqf = _flat(Uq_tok, batch, 3) if Uq_tok is not None else None
    maskf = None
    if attn_mask is not None:
        mb = attn_mask.shape[:-2]
        try:
            ok = torch.broadcast_shapes(batch, mb) == batch
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"attn_mask batch dims {shape_str(mb)} must broadcast to the batch "
                             f"{shape_str(batch)} of q, k, v")
        mt = attn_mask.shape[-2:]
        maskf = attn_mask.reshape(1, *mt) if math.prod(mb) == 1 else _flat(attn_mask, batch, 2)
    c = math.sqrt(scale * w / 2.0)
    rk = Ukf.shape[-1] if Ukf is not None else 0
    rq = Uqf.shape[-1] if Uqf is not None else 0
    if block_sizes is not None:
        blocks = _check_block_sizes(block_sizes)
    else:
        blocks = attention_block_sizes(n_q, n_k, 1 + rk + rq)
    out = _RiemannianAttentionFn.apply(qf.contiguous(), kf.contiguous(), vf.contiguous(), lamf, W,
                                       Ukf.contiguous() if Ukf is not None else None,
                                       Uqf.contiguous() if Uqf is not None else None,
                                       maskf, bool(is_causal), scale, c, c, blocks)
    return out.view(*batch, n_q, v.shape[-1])


# ------------------------------------------------------------------ the module


@dataclass
class RiemannianAttentionConfig:
    r"""Configuration of :class:`RiemannianMultiheadAttention`.

    Checked when the module is built: ``d_model`` not divisible by
    ``n_heads``, an unknown ``metric_side`` or ``dropout`` outside ``[0, 1)``
    raises ``ValueError`` there.

    Parameters
    ----------
    d_model : int, default 64
        Width :math:`D` of the query-side token states and of the output;
        must be divisible by ``n_heads`` (head dimension :math:`d = D / h`).
    n_heads : int, default 4
        Number of heads :math:`h`.
    rank : int, default 2
        Metric rank :math:`r \ge 0` of :math:`G = \lambda I + U U^\top`;
        0 gives :math:`G = \lambda I` (attention by scaled Euclidean distance).
    metric_side : {"key", "query", "mean"}, default "key"
        Whose metric measures the pair :math:`(i, j)`: the key's
        :math:`G_j`, the query's :math:`G_i`, or their mean
        :math:`(G_i + G_j)/2`.
    shared_metric : bool, default False
        True: one learned metric per head (a parameter :math:`U_h`, shape
        ``[h, d, r]``, and :math:`\lambda_h`), the same for every token.
        False: per-token metrics produced from the states by
        :class:`riemannian_ref.MetricNet`.
    learn_temperature : bool, default False
        Learn a per-head factor :math:`t_h = e^{\theta_h}` (1 at init) on
        the scale :math:`1/\tau`, :math:`\tau = \sqrt d`; it is folded into
        the metric as :math:`t_h G`.
    lam_init : float, default 1.0
        Initial isotropic part :math:`\lambda` of every head; must exceed
        ``lam_min``.
    lam_min : float, default 1e-3
        Floor :math:`\lambda_{\min} > 0` of :math:`\lambda` (a softplus
        plus this floor), which keeps :math:`G` uniformly positive definite.
    strength : float, default 1.0
        Size of :math:`U` at init relative to :math:`\lambda` (the scale of
        its random initial weights); 0 gives :math:`U = 0` at init.
    kv_dim : int or None, default None
        Width :math:`D_{kv}` of the key/value states (cross-attention from
        states of another width); None: ``d_model``.
    bias : bool, default True
        Biases in the query, key, value and output projections.
    dropout : float, default 0.0
        Dropout probability on the attention weights, in ``[0, 1)``; applied
        in training mode only, and when positive the dense reference path
        runs instead of the blockwise kernel.
    """

    d_model: int = 64  # width D of the token states (queries' side)
    n_heads: int = 4  # h
    rank: int = 2  # metric rank r; 0 gives G = lam I (Euclidean distance attention)
    metric_side: str = "key"  # "key", "query" or "mean": whose metric measures a pair
    shared_metric: bool = False  # True: one learned metric per head; False: per-token metrics from the states
    learn_temperature: bool = False  # learn a per-head factor on 1/tau (tau = sqrt(d) at init)
    lam_init: float = 1.0  # initial isotropic part lambda
    lam_min: float = 1e-3  # floor that keeps G uniformly positive definite
    strength: float = 1.0  # size of U at init relative to lambda (0: U = 0 at init)
    kv_dim: int | None = None  # width of the key/value states for cross-attention (None: d_model)
    bias: bool = True  # biases in the q, k, v and output projections
    dropout: float = 0.0  # dropout on the attention weights (training only; dense path)


class RiemannianMultiheadAttention(nn.Module):
    r"""Multi-head attention whose scores are per-token Riemannian distances.

    For head :math:`h`, :math:`q_i = W_Q x_i`, :math:`k_j = W_K y_j`,
    :math:`v_j = W_V y_j` (``y = x`` for self-attention), a metric
    :math:`G = \lambda_h I + U U^\top` produced from the states of its side
    (:class:`riemannian_ref.MetricNet`: a query's metric from ``x_i``, a key's
    from ``y_j``), and :func:`riemannian_attention` over the heads.

    Parameters
    ----------
    cfg : RiemannianAttentionConfig

    Notes
    -----
    ``shared_metric=True`` gives every head one learned factor
    :math:`U_h \in \mathbb{R}^{d\times r}` (the dot-product form of
    :func:`riemannian_ref.dot_product_form` applies). With
    ``learn_temperature`` the per-head factor :math:`t_h = e^{\theta_h}` on
    :math:`1/\tau` is folded into the metric (:math:`t_h G`), which is the
    same scores.
    """

    def __init__(self, cfg: RiemannianAttentionConfig):
        super().__init__()
        if not isinstance(cfg, RiemannianAttentionConfig):
            raise ValueError(f"cfg must be a RiemannianAttentionConfig, got {type(cfg).__name__}")
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads})")
        if cfg.metric_side not in ("key", "query", "mean"):
            raise ValueError(f"metric_side must be 'key', 'query' or 'mean', got {cfg.metric_side!r}")
        if not 0.0 <= cfg.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {cfg.dropout}")
        self.cfg = cfg
        D, h = cfg.d_model, cfg.n_heads
        Dkv = cfg.kv_dim if cfg.kv_dim is not None else D
        self.head_dim = d = D // h
        self.q_proj = nn.Linear(D, D, bias=cfg.bias)
        self.k_proj = nn.Linear(Dkv, D, bias=cfg.bias)
        self.v_proj = nn.Linear(Dkv, D, bias=cfg.bias)
        self.out_proj = nn.Linear(D, D, bias=cfg.bias)
        self.need_q = cfg.metric_side in ("query", "mean")
        self.need_k = cfg.metric_side in ("key", "mean")
        if cfg.shared_metric:
            self.metric_q = self.metric_k = None
            rho = math.log(math.expm1(cfg.lam_init - cfg.lam_min))
            self.rho = nn.Parameter(torch.full((h,), rho))
            # E |U^T v|^2 = strength^2 |v|^2, as MetricNet's initialisation
            std = cfg.strength / math.sqrt(max(cfg.rank, 1))
            self.U_shared = nn.Parameter(torch.randn(h, d, cfg.rank) * std)  # (h, d, r)
        else:
            kw = dict(lam_init=cfg.lam_init, lam_min=cfg.lam_min, strength=cfg.strength)
            # a query's metric comes from the query states, a key's from the key/value states
            self.metric_q = MetricNet(D, h, d, cfg.rank, **kw) if self.need_q else None
            self.metric_k = MetricNet(Dkv, h, d, cfg.rank, **kw) if self.need_k else None
            self.rho = None
            self.U_shared = None
        self.log_temp = nn.Parameter(torch.zeros(h)) if cfg.learn_temperature else None

    def _lam(self) -> Tensor:
        if self.rho is not None:
            return nn.functional.softplus(self.rho) + self.cfg.lam_min
        if self.metric_q is not None and self.metric_k is not None:
            # "mean": (G_i + G_j)/2 has isotropic part (lam_q + lam_k)/2
            return 0.5 * (self.metric_q.lam() + self.metric_k.lam())
        net = self.metric_k if self.metric_k is not None else self.metric_q
        return net.lam()

    def metrics(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The metric of every head (and token): ``(lam [h], U_q, U_k)``.

        ``U_*`` has shape ``[B, h, n, d, r]`` (per token) or ``[h, d, r]``
        (shared), or is None when ``metric_side`` does not use it. The learned
        temperature is folded in.
        """
        lam = self._lam()  # (h,)
        if self.U_shared is not None:
            U = self.U_shared.unsqueeze(0)  # (1, h, d, r): broadcasts over the batch
            U_q = U if self.need_q else None
            U_k = U if self.need_k else None
        else:
            U_q = self.metric_q(x)[1] if self.need_q else None  # (B, h, n_q, d, r)
            U_k = self.metric_k(y)[1] if self.need_k else None  # (B, h, n_k, d, r)
        if self.log_temp is not None:
            t = self.log_temp.exp()  # (h,)
            lam = lam * t
            root = t.sqrt().view(-1, 1, 1) if self.U_shared is not None else t.sqrt().view(-1, 1, 1, 1)
            U_q = U_q * root if U_q is not None else None
            U_k = U_k * root if U_k is not None else None
        return lam, U_q, U_k

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None,
                is_causal: bool = False, need_weights: bool = False
                ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` states to ``key``/``value`` states.

        Parameters
        ----------
        query : Tensor, shape [B, n_q, D]
        key, value : Tensor, shape [B, n_k, D_kv], optional
            Default: ``query`` (self-attention). ``value`` defaults to ``key``.
        attn_mask : Tensor, optional
            SDPA convention: boolean ``True`` = may attend, or additive float;
            shape ``[n_q, n_k]`` or ``[B, h, n_q, n_k]`` (broadcastable).
        key_padding_mask : Tensor, shape [B, n_k], optional
            ``nn.MultiheadAttention`` convention: ``True`` marks padding (ignored keys).
        is_causal : bool
        need_weights : bool
            Also return the attention weights ``[B, h, n_q, n_k]`` (computed
            by the dense reference; for plots and small inputs).

        Returns
        -------
        out : Tensor, shape [B, n_q, D]
        weights : Tensor, shape [B, h, n_q, n_k], or None
        """
        x = check_tensor(query, "query", min_dim=3)
        y = x if key is None else check_tensor(key, "key", min_dim=3)
        z = y if value is None else check_tensor(value, "value", min_dim=3)
        D, h, d = self.cfg.d_model, self.cfg.n_heads, self.head_dim
        Dkv = self.k_proj.in_features
        if x.dim() != 3 or x.shape[-1] != D:
            raise ValueError(f"query must have shape [B, n_q, {D}], got {shape_str(x)}")
        for name, t in (("key", y), ("value", z)):
            if t.dim() != 3 or t.shape[0] != x.shape[0] or t.shape[-1] != Dkv:
                raise ValueError(f"{name} must have shape [{x.shape[0]}, n_k, {Dkv}], got {shape_str(t)}")
        if z.shape[1] != y.shape[1]:
            raise ValueError(f"value must have n_k = {y.shape[1]} tokens like key, got {shape_str(z)}")
        B, n_q, _ = x.shape
        n_k = y.shape[1]
        q = self.q_proj(x).view(B, n_q, h, d).transpose(1, 2)  # (B, h, n_q, d)
        k = self.k_proj(y).view(B, n_k, h, d).transpose(1, 2)  # (B, h, n_k, d)
        v = self.v_proj(z).view(B, n_k, h, d).transpose(1, 2)  # (B, h, n_k, d)
        lam, U_q, U_k = self.metrics(x, y)
        mask = attn_mask
        if key_padding_mask is not None:
            kpm = check_tensor(key_padding_mask, "key_padding_mask", floating=False)
            if kpm.dtype != torch.bool or tuple(kpm.shape) != (B, n_k):
                raise ValueError(f"key_padding_mask must be a bool tensor [B, n_k] = [{B}, {n_k}], "
                                 f"got {kpm.dtype} {shape_str(kpm)}")
            keep = ~kpm.view(B, 1, 1, n_k)  # (B, 1, 1, n_k)
            if is_causal:
                keep = keep & torch.ones(n_q, n_k, dtype=torch.bool, device=x.device).tril()
                is_causal = False
            if mask is None:
                mask = keep
            elif mask.dtype == torch.bool:
                mask = mask & keep
            else:
                mask = mask.masked_fill(~keep, float("-inf"))
        p = self.cfg.dropout if self.training else 0.0
        kw = dict(lam=lam, metric_side=self.cfg.metric_side, attn_mask=mask, is_causal=is_causal)
        if need_weights:
            o, A = riemannian_attention_reference(q, k, v, U_q, U_k, dropout_p=p, return_weights=True, **kw)
        else:
            o, A = riemannian_attention(q, k, v, U_q, U_k, dropout_p=p, **kw), None
        out = self.out_proj(o.transpose(1, 2).reshape(B, n_q, D))  # (B, n_q, D)
        return out, A
