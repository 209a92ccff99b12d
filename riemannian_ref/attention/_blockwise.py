r"""The blockwise Riemannian attention operator (private): an autograd Function.

:func:`riemannian_ref.attention.functional.riemannian_attention` validates its
inputs, flattens the batch and calls :class:`_RiemannianAttentionFn` here. The
plain version of the same algorithm, written to be read, is
:func:`riemannian_ref.attention.reference.blockwise_attention`.

The expansion behind the operator (``"key"`` side; ``"query"`` is its mirror).
With :math:`M = \lambda I + \sum_{\text{shared}} W W^\top` (every shared
low-rank part joins the isotropic part), :math:`c^2 = \text{scale}\cdot w/2`
(``w = 1``, or ``1/2`` for each side of ``"mean"``) and dropping the terms that
are constant along a softmax row,

.. math::
    s_{ij} = \underbrace{q_i \cdot (\text{scale}\, M k_j)
             - \tfrac{\text{scale}}{2} k_j^\top M k_j - o_i}_{X^{(0)}_{ij}}
             \;-\; \sum_{t=1}^{r} \big(\underbrace{q_i\cdot (c\, U_{j,t}) - c\, U_{j,t}\cdot k_j}_{X^{(t)}_{ij}}\big)^2 .

Every :math:`X^{(t)}_{ij}` is an entry of ONE matrix product of the query
block, with ``[1, -o_i]`` appended to each query, and the key block's stacked
``[scale M k_j | c U_j]`` (``(1 + r)`` columns per key, each with its bias in
an extra row, and a row that is 1 under the ``t = 0`` columns), so the score
costs ``1 + r`` times :math:`Q K^\top` (``1 + 2r`` for ``"mean"``, whose
query side is a second product of the stacked ``c U_i`` with the keys). The
backward recomputes each tile from ``q, k, v, U``, the output and the row
log-sum-exp :cite:`dao2022flashattention`, so extra memory is
``O(n * block * (1 + r))`` in both passes.

**A fixed softmax offset.** A softmax row needs an offset :math:`o_i` with
:math:`s_{ij} - o_i` neither overflowing nor all underflowing. The online
softmax :cite:`milakov2018online` takes the running row maximum and rescales
what it accumulated whenever the maximum grows. Distance scores need less:
:math:`s_{ij} + \tfrac{\text{scale}}{2} q_i^\top M q_i` is minus half a
squared distance, so :math:`b_i = \tfrac{\text{scale}}{2} q_i^\top M q_i`
(plus the largest entry of a float mask's row) bounds the whole row from
above before any key is seen. The operator takes the exact maximum of the
first key block :math:`m_i`, and :math:`o_i = \max(m_i, b_i - 64)` (base 2):
no later key can exceed :math:`o_i` by more than 64 bits (no overflow), and
the row's sum is at least 1 unless its first key block lies more than 64 bits
below the bound. Every later tile is then exponentiated without a row
maximum, a subtraction or a rescaling; :math:`-o_i` rides in the product as
the extra query column. A row whose sum still falls below :math:`2^{-60}`
(every key more than about 86 nats below the bound: huge distances) is
recomputed, with its batch element, by the online softmax
(:func:`_chunk_online`, the fallback).

**Masks.** A float mask enters each row relative to the row's largest
visible entry (exact, a row constant; ``_validate.mask_row_max``,
skipped when every row's is 0), so a large finite mask does not round the
scores away; a row whose largest entry is at most ``-2**120``
(``finfo.min``) keeps its mask alone, SDPA's result there (the average of
the values it sees). Grouped-query attention: batch element ``b`` reads key
row ``b // g`` (``_kv_rows``), and the key-side gradients of a chunk are
added to the key heads it read.

**The row sum from the output's product.** The values carry a column of
ones, so ``P @ [V | 1]`` gives the unnormalised output and the row sum in one
product; in the backward, ``[dO | -D] @ [V | 1]^T`` gives
:math:`dP - \mathrm{rowsum}(dO \odot O)` in one product.

**Chunks of the batch.** The loops run over chunks of the flattened batch
(about one batch element per thread), so the products of a tile, the stacked
key block and the per-chunk running output stay in cache, and the per-call
buffers are chunk-sized.

Three more details make the loop fast on CPU, where an elementwise pass over a
tile costs a noticeable fraction of its matrix product: the squares are
subtracted in place into the product's own output (no copy of the tile), the
exponentials are ``exp2`` with ``log2(e)`` folded into the stacked constants
(the trick of fused attention kernels), and every tile's product goes into
one buffer allocated per call (a multi-megabyte tensor made and freed per
tile costs page faults). ``benchmarks/bench_attention_ablation.py`` switches
each of these off in the operator itself and measures what it is worth.
"""
from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from ._validate import DOMINANT_MASK

__all__: list[str] = []  # private: riemannian_ref.attention.functional calls blockwise_operator

_NEG_INF = float("-inf")



@dataclass(frozen=True)
class LoopOptions:
    """How the CPU loop computes the same function; ``benchmarks/bench_attention_ablation.py`` prices each.

    The defaults are what the measurements kept.
    """
    fixed_offset: bool = True  # False: the online softmax (running maximum and rescaling) for every row
    rowsum_in_product: bool = True  # False: the row sum as a separate pass over each tile
    chunk_tile: int = 2 ** 17  # products per thread and chunk; 0: the whole batch in every tile
    threads_over_chunks: bool = True  # False: one thread issues every chunk, each kernel multi-threaded


DEFAULT_LOOP = LoopOptions()
_MARGIN = 64.0  # bits a later key may exceed the offset by (no float32 overflow: 2^64 * n * |v|)
_TINY_SUM = 2.0 ** -60  # a row sum below this triggers the online fallback


def block_sizes_for(n_q: int, n_k: int, width: int, *, tile: int = 2 ** 17) -> tuple[int, int]:
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


def batch_chunk_for(n_batch: int, bq: int, bk: int, width: int, threads: int | None = None,
                    chunk_tile: int = DEFAULT_LOOP.chunk_tile) -> int:
    """Batch elements per chunk: all of a chunk's tiles together hold about ``threads * chunk_tile`` products.

    With the default blocks that is one batch element per thread: the products
    of a tile stay in that core's cache, and the matrix products and
    elementwise passes still split over the threads.
    """
    if not chunk_tile:
        return n_batch
    threads = torch.get_num_threads() if threads is None else threads
    return max(1, min(n_batch, (threads * chunk_tile) // max(1, bq * bk * width)))


def _key_block(k_b: Tensor, lam: Tensor, W: Tensor | None, U_b: Tensor | None, scale: float, ck: float):
    r"""The stacked key block ``Kt`` (Bf, d+2, (1+rk) nb) and ``Mk = scale M k`` (Bf, nb, d).

    Columns ``t * nb + j`` (t-major): ``t = 0`` is ``[scale M k_j ; -k_j.Mk_j / 2 ; 1]``,
    ``t >= 1`` is ``[c U_{j,t} ; -c U_{j,t}.k_j ; 0]``; the last two rows multiply the
    constant 1 and the row offset ``-o_i`` appended to every query.
    """
    Bf, nb, d = k_b.shape
    rk = U_b.shape[-1] if U_b is not None else 0
    Mk = lam.view(-1, 1, 1) * k_b
    if W is not None:
        Mk = Mk + (k_b @ W) @ W.transpose(-1, -2)  # shared low-rank parts join M
    Mk = scale * Mk  # (Bf, nb, d)
    Kt = k_b.new_empty(Bf, d + 2, (1 + rk) * nb)
    Kt[:, :d, :nb] = Mk.transpose(1, 2)
    Kt[:, d, :nb] = -0.5 * (k_b * Mk).sum(-1)
    Kt[:, d + 1, :nb] = 1.0
    if rk:
        Kt[:, d + 1, nb:] = 0.0
        cUt = Kt[:, :d, nb:].view(Bf, d, rk, nb)
        torch.mul(U_b.permute(0, 2, 3, 1), ck, out=cUt)  # c U_j, key index innermost
        # -c U_j^T k_j, elementwise along the contiguous key index (a batch of
        # 1 x d x r products is slow in BLAS, and so is a product over the size-r axis)
        ka = torch.mul(cUt, k_b.transpose(1, 2).unsqueeze(2)).sum(1)  # (Bf, rk, nb)
        torch.neg(ka, out=Kt[:, d, nb:].view(Bf, rk, nb))
    return Kt, Mk


def _key_block_backward(dKt, k_b, Mk, lam, W, U_b, scale, ck, need_lam):
    """Chain rule of :func:`_key_block`: (dk_b, dU_b, dlam, dW), all O(nb d r); row d+1 is constant."""
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


def _augment(x: Tensor, *cols: Tensor | float) -> Tensor:
    """Append columns to the last axis: (Bf, n, d) -> (Bf, n, d + len(cols)); a float is a constant column."""
    out = x.new_empty(*x.shape[:-1], x.shape[-1] + len(cols))
    out[..., :x.shape[-1]] = x
    for i, c in enumerate(cols):
        out[..., x.shape[-1] + i] = c
    return out


def _query_block(q_b: Tensor, U_b: Tensor, cq: float) -> Tensor:
    """Stacked query block ``[c U_{i,t}^T, -c U_{i,t}.q_i]``, rows ``i * rq + t``: (Bf, nb rq, d+1)."""
    Bf, nb, d, rq = U_b.shape
    Qa = q_b.new_empty(Bf, nb, rq, d + 1)
    cU = cq * U_b
    Qa[..., :d] = cU.transpose(-1, -2)
    Qa[..., d] = -(cU * q_b.unsqueeze(-1)).sum(-2)
    return Qa.view(Bf, nb * rq, d + 1)


def _tile(qa_b, Kt, Qa, kta_b, rk, rq, mask, mask_scale, causal, i0, i1, j0, j1, xbuf, ybuf):
    """Scores of one tile and the rank products X (cb, bq, 1+rk, bk), Y (cb, bq, rq, bk).

    ``qa_b`` is the query block with ``[1, -o_i]`` appended, so the scores ``S``
    (cb, bq, bk), the view ``X[:, :, 0]`` (rows of stride ``(1 + rk) bk``),
    come out of the product already shifted by the row offset, and are updated
    in place: the tile is never copied. ``mask`` is the chunk's mask and
    row offsets ``(m, rows)``: ``m`` [cb or 1, 1 or n_q, 1 or n_k] bool, or
    float added times ``mask_scale``; for a float mask ``rows``
    [cb or 1, 1 or n_q, 1] (or None: all 0) is every row's largest visible
    entry, subtracted from the row first (exact: a row constant), and a row
    whose largest entry is at most ``DOMINANT_MASK`` keeps its mask only,
    ``m - rows`` plus the row's offset (the query's last column): the scores
    vanish next to such a mask, as they do when SDPA adds it.
    ``xbuf`` and ``ybuf`` (flat, at least one tile long) receive the products:
    one allocation per call, not one per tile (large allocations that are
    freed and made again cost page faults).
    """
    cb, nb, mb = qa_b.shape[0], i1 - i0, j1 - j0
    X = torch.bmm(qa_b, Kt, out=xbuf[:cb * nb * (1 + rk) * mb].view(cb, nb, (1 + rk) * mb))
    X = X.view(cb, nb, 1 + rk, mb)  # ONE product for Q K^T and all U_j^T q_i
    S, *Xt = X.unbind(2)  # views, made by one call (fewer Python-level ops per tile)
    for x in Xt:
        S.addcmul_(x, x, value=-1.0)
    Y = None
    if rq:
        Y = torch.bmm(Qa, kta_b, out=ybuf[:cb * nb * rq * mb].view(cb, nb * rq, mb))
        Y = Y.view(cb, nb, rq, mb)  # U_i^T k_j for the query side
        for y in Y.unbind(2):
            S.addcmul_(y, y, value=-1.0)
    if mask is not None:
        m, mrows = mask
        m = _mask_tile(m, i0, i1, j0, j1)
        if m.dtype == torch.bool:
            S.masked_fill_(~m, _NEG_INF)
        elif mrows is None:
            S.add_(m, alpha=mask_scale)
        else:
            c = mrows[:, i0:i1] if mrows.shape[1] > 1 else mrows  # (cb|1, bq|1, 1)
            dom = c <= DOMINANT_MASK
            if bool(dom.any()):  # the mask alone, relative to the row's offset (the query's last column)
                S.copy_(torch.where(dom, qa_b[..., -1:], S))
            S.add_(m - c, alpha=mask_scale)
    if causal and j1 - 1 > i0:  # top-left aligned: key j is seen by query i iff j <= i
        rows = torch.arange(i0, i1, device=S.device).unsqueeze(-1)
        cols = torch.arange(j0, j1, device=S.device).unsqueeze(0)
        S.masked_fill_(cols > rows, _NEG_INF)
    return S, X, Y


def _mask_tile(mask: Tensor, i0: int, i1: int, j0: int, j1: int) -> Tensor:
    """The part of ``mask`` [..., 1 or n_q, 1 or n_k] that covers queries i0:i1 and keys j0:j1."""
    m = mask[..., i0:i1, :] if mask.shape[-2] > 1 else mask
    return m[..., j0:j1] if m.shape[-1] > 1 else m


class _MaskChunks:
    """A mask [*mb, 1|n_q, 1|n_k] (``mb`` broadcasting to the batch) read one chunk of the flat batch at a time.

    The mask is never expanded to the batch: a chunk whose elements share one
    mask (a key-padding mask [B, 1, 1, n_k] under h heads) or use consecutive
    ones gets a view; other chunks gather their rows. The gradient of a float
    mask is accumulated the same way, into the mask's own shape.
    """

    def __init__(self, mask: Tensor, batch: tuple[int, ...], need_grad: bool, rows: Tensor | None = None):
        self.mask = mask
        if not need_grad:  # a batch dimension of stride 0 (an expanded mask) is read once, not copied
            for dim in range(mask.dim() - 2):
                if mask.stride(dim) == 0:
                    mask = mask.narrow(dim, 0, 1)
                    rows = rows.narrow(dim, 0, 1) if rows is not None else None
        mb = mask.shape[:-2]
        self.flat = mask.reshape(-1, *mask.shape[-2:])  # (prod(mb), 1|n_q, 1|n_k)
        # a float mask's row offsets [*mb, 1|n_q] (see _tile), as (prod(mb), 1|n_q, 1)
        self.rows = rows.expand(*mb, rows.shape[-1]).reshape(-1, rows.shape[-1], 1) if rows is not None else None
        ids = torch.arange(self.flat.shape[0]).view(mb).expand(batch) if batch else torch.zeros((), dtype=torch.long)
        self.ids = ids.reshape(-1).tolist()  # mask row of every flat batch element
        self.grad = torch.zeros_like(self.flat) if need_grad else None

    def _where(self, c0: int, c1: int):
        ids = self.ids[c0:c1]
        if all(i == ids[0] for i in ids):
            return slice(ids[0], ids[0] + 1)
        if ids == list(range(ids[0], ids[0] + len(ids))):
            return slice(ids[0], ids[-1] + 1)
        return torch.tensor(ids, device=self.flat.device)

    def chunk(self, c0: int, c1: int) -> tuple[Tensor, Tensor | None]:
        """The mask of batch elements c0:c1, shape [c1 - c0 or 1, 1|n_q, 1|n_k], and its row offsets or None."""
        where = self._where(c0, c1)
        return self.flat[where], (self.rows[where] if self.rows is not None else None)

    def add_grad(self, c0: int, c1: int, i0: int, i1: int, j0: int, j1: int, dS: Tensor) -> None:
        """Add the scores' gradient of a tile (c1 - c0, bq, bk), summed to the mask's shape."""
        mq, mk = self.flat.shape[-2:]
        g = dS.sum(-2, keepdim=True) if mq == 1 else dS
        g = g.sum(-1, keepdim=True) if mk == 1 else g
        rows = slice(i0, i1) if mq > 1 else slice(None)
        cols = slice(j0, j1) if mk > 1 else slice(None)
        where = self._where(c0, c1)
        if isinstance(where, slice):
            tgt = self.grad[where, rows, cols]
            tgt += g.sum(0, keepdim=True) if tgt.shape[0] == 1 and g.shape[0] > 1 else g
        else:
            self.grad[:, rows, cols].index_add_(0, where, g)

    def grad_like_mask(self) -> Tensor:
        return self.grad.view(self.mask.shape)


def _dead_rows(mask: Tensor | None, causal: bool, cb: int, n_q: int, n_k: int) -> Tensor:
    """(cb, n_q) bool: rows that see no key (their output is 0 by definition)."""
    if mask is None:  # a causal row always sees key 0
        return torch.zeros(cb, n_q, dtype=torch.bool)
    if isinstance(mask, tuple):  # (mask, row offsets) of a chunk
        mask = mask[0]
    vis = mask if mask.dtype == torch.bool else ~torch.isneginf(mask)  # (cb|1, 1|n_q, 1|n_k)
    if vis.shape[-1] == 1:
        vis = vis.expand(*vis.shape[:-1], n_k)
    anyv = vis.any(-1)  # (cb|1, 1|n_q)
    if causal:  # row i sees a key iff its first visible key j has j <= i
        first = torch.where(anyv, vis.to(torch.uint8).argmax(-1), n_k)
        dead = first > torch.arange(n_q, device=mask.device)
    else:
        dead = ~anyv
    return dead.expand(cb, n_q)


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


def _row_bound(q: Tensor, lam: Tensor, W: Tensor | None, s2: float, mask, n_q: int) -> Tensor:
    """Upper bound of every score of a row, base 2: ``s2/2 q_i^T M q_i`` plus the row's largest float-mask entry.

    ``mask`` is ``(m, rows)`` (see :func:`_tile`) or None. With row offsets the
    mask enters relative to them, the largest visible entry of each row, so it
    adds at most 0 to a visible score; a row that keeps its mask only (its
    largest entry is at most ``DOMINANT_MASK``) is bounded by 0.
    """
    Mq = lam.view(-1, 1, 1) * q
    if W is not None:
        Mq = Mq + (q @ W) @ W.transpose(-1, -2)
    b = (0.5 * s2) * (q * Mq).sum(-1)  # (cb, n_q)
    if mask is not None and mask[0].dtype != torch.bool:
        m, rows = mask
        if rows is not None:
            return torch.where(rows[..., 0] <= DOMINANT_MASK, 0.0, b)  # rows (cb|1, 1|n_q, 1)
        mmax = m.amax(-1)  # (cb|1, 1|n_q); -inf on rows that see no key
        b = b + _LOG2E * mmax.masked_fill(torch.isneginf(mmax), 0.0)
    return b


def _buffers(q: Tensor, cb: int, n_q: int, n_k: int, bq: int, bk: int, rk: int, rq: int):
    """Flat buffers for the largest tile's products X and Y (see :func:`_tile`), one per call."""
    tq, tk = min(bq, n_q), min(bk, n_k)
    xbuf = q.new_empty(cb * tq * (1 + rk) * tk)
    ybuf = q.new_empty(cb * tq * rq * tk) if rq else None
    return xbuf, ybuf


def _chunk_fixed(q, k, v, lam, W, Uk, Uq, mask, causal, s2, ck2, cq2, bq, bk, bufs, rowsum_in_product=True):
    """Forward of one batch chunk with the fixed offset; returns (acc [.., dv+1 or dv], l, offset)."""
    cb, n_q, d = q.shape
    n_k, dv = k.shape[1], v.shape[2]
    rk = Uk.shape[-1] if Uk is not None else 0
    rq = Uq.shape[-1] if Uq is not None else 0
    off = _row_bound(q, lam, W, s2, mask, n_q)  # (cb, n_q), base 2
    qa = _augment(q, 1.0, 0.0)
    qa[..., d + 1] = -off  # the offset rides in the product
    va = _augment(v, 1.0) if rowsum_in_product else v  # P @ [V | 1]: output and row sum
    acc = q.new_empty(cb, n_q, va.shape[-1])
    l = None if rowsum_in_product else q.new_empty(cb, n_q)
    for j0 in range(0, n_k, bk):
        j1 = min(j0 + bk, n_k)
        Kt, _ = _key_block(k[:, j0:j1], lam, W, Uk[:, j0:j1] if rk else None, s2, ck2)
        kta_b = _augment(k[:, j0:j1], 1.0).transpose(1, 2) if rq else None
        i_start = (j0 // bq) * bq if causal else 0  # causal: earlier query blocks see none of these keys
        for i0 in range(i_start, n_q, bq):
            i1 = min(i0 + bq, n_q)
            Qa = _query_block(q[:, i0:i1], Uq[:, i0:i1], cq2) if rq else None
            S, X, Y = _tile(qa[:, i0:i1], Kt, Qa, kta_b, rk, rq, mask, _LOG2E, causal, i0, i1, j0, j1, *bufs)
            if j0 == 0:  # the first key block of every row (causally too): fix the offset
                o = S.amax(-1).clamp_min_(-_MARGIN)  # the block's maximum, at most 64 bits below the bound
                S.sub_(o.unsqueeze(-1))
                off[:, i0:i1] += o
                qa[:, i0:i1, d + 1] = -off[:, i0:i1]
            P = S.exp2_()  # (cb, bq, bk), in place in X: no maximum, no rescaling
            if l is not None:
                l_b = l[:, i0:i1]
                l_b.copy_(P.sum(-1)) if j0 == 0 else l_b.add_(P.sum(-1))
            acc[:, i0:i1].baddbmm_(P, va[:, j0:j1], beta=0.0 if j0 == 0 else 1.0)
            del X, Y, S, P
    if l is None:
        l = acc[..., dv]
    return acc, l, off


def _chunk_online(q, k, v, lam, W, Uk, Uq, mask, causal, s2, ck2, cq2, bq, bk, bufs):
    """Forward of one batch chunk with the online softmax (running maximum, rescaling): the fallback."""
    cb, n_q, d = q.shape
    n_k, dv = k.shape[1], v.shape[2]
    rk = Uk.shape[-1] if Uk is not None else 0
    rq = Uq.shape[-1] if Uq is not None else 0
    maybe_dead = mask is not None  # only a mask can leave a row with no visible key
    qa = _augment(q, 1.0, 0.0)  # offset 0: the running maximum is subtracted per tile
    m = q.new_empty(cb, n_q)
    l = q.new_empty(cb, n_q)
    acc = q.new_empty(cb, n_q, dv)
    for j0 in range(0, n_k, bk):
        j1 = min(j0 + bk, n_k)
        Kt, _ = _key_block(k[:, j0:j1], lam, W, Uk[:, j0:j1] if rk else None, s2, ck2)
        kta_b = _augment(k[:, j0:j1], 1.0).transpose(1, 2) if rq else None
        v_b = v[:, j0:j1]
        i_start = (j0 // bq) * bq if causal else 0
        for i0 in range(i_start, n_q, bq):
            i1 = min(i0 + bq, n_q)
            Qa = _query_block(q[:, i0:i1], Uq[:, i0:i1], cq2) if rq else None
            S, X, Y = _tile(qa[:, i0:i1], Kt, Qa, kta_b, rk, rq, mask, _LOG2E, causal, i0, i1, j0, j1, *bufs)
            m_b, l_b, acc_b = m[:, i0:i1], l[:, i0:i1], acc[:, i0:i1]
            m_new = S.amax(-1)
            if j0 > 0:
                m_new = torch.maximum(m_b, m_new)
            # rows that have seen no key yet (max -inf) subtract 0, not -inf
            ms = m_new.masked_fill(torch.isneginf(m_new), 0.0) if maybe_dead else m_new
            P = S.sub_(ms.unsqueeze(-1)).exp2_()
            if j0 == 0:
                l_b.copy_(P.sum(-1))
                acc_b.baddbmm_(P, v_b, beta=0.0)
            else:
                # alpha <= 1, and 0 for rows that had seen no key (m_b = -inf), never exp2(0 - m_new)
                alpha = (m_b - ms).exp2_()
                l_b.mul_(alpha).add_(P.sum(-1))
                acc_b.mul_(alpha.unsqueeze(-1)).baddbmm_(P, v_b)
            m_b.copy_(m_new)
            del X, Y, S, P
    off = m.masked_fill(torch.isneginf(m), 0.0)
    return acc, l, off


# Threads over independent chunks of the batch, the way PyTorch's CPU flash-attention kernel runs threads
# over independent tiles: each worker runs its chunks one after another with single-threaded kernels. Many
# small multi-threaded kernels instead pay a fork-join per call, and on a machine shared with other jobs a
# descheduled thread stalls every one of them.
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()


def _forget_pool_after_fork() -> None:
    """In a forked child: drop the parent's pool, whose threads were not copied (it would never run a task)."""
    global _POOL, _POOL_SIZE, _POOL_LOCK
    _POOL, _POOL_SIZE, _POOL_LOCK = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _single_threaded_worker() -> None:
    torch.get_num_threads()  # this thread's OpenMP/MKL settings from the process default, first ...
    torch.set_num_threads(1)  # ... then its own (thread-local) single thread


def _pool(workers: int) -> ThreadPoolExecutor:
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE != workers:
            if _POOL is not None:
                _POOL.shutdown(wait=True)
            main = torch.get_num_threads()
            _POOL = ThreadPoolExecutor(workers, thread_name_prefix="rr-attention",
                                       initializer=_single_threaded_worker)
            ready = threading.Barrier(workers)
            list(_POOL.map(lambda _: ready.wait(), range(workers)))  # start (and initialise) every worker
            torch.set_num_threads(main)  # the process default again; the workers keep their own setting
            _POOL_SIZE = workers
        return _POOL


def _plan_chunks(Bf: int, bq: int, bk: int, width: int, serial: bool, device: torch.device, options: LoopOptions):
    """(workers, chunk size, chunk slices): one worker per CPU thread when there are chunks enough."""
    threads = torch.get_num_threads()
    serial = serial or not options.threads_over_chunks or device.type != "cpu"  # a GPU queues kernels anyway
    workers = 1 if serial else min(threads, Bf)
    cb = batch_chunk_for(Bf, bq, bk, width, 1 if workers > 1 else threads, options.chunk_tile)
    chunks = [slice(c0, min(c0 + cb, Bf)) for c0 in range(0, Bf, cb)]
    return min(workers, len(chunks)), cb, chunks


def _kv_rows(t: Tensor | None, c: slice, g: int) -> Tensor | None:
    """The key-side rows (key heads) of batch chunk ``c`` when batch element ``b`` reads key head ``b // g``.

    A chunk within one key head gets a view (that head expanded); a chunk
    over several gets a chunk-sized copy. The whole key side is never
    repeated to the query heads.
    """
    if t is None or g == 1:
        return t[c] if t is not None else None
    lo, hi = c.start // g, (c.stop - 1) // g + 1
    if hi - lo == 1:
        return t[lo:hi].expand(c.stop - c.start, *t.shape[1:])
    return t[lo:hi].repeat_interleave(g, 0)[c.start - lo * g:c.stop - lo * g]


def _add_kv_grad(target: Tensor, c: slice, g: int, grad: Tensor) -> None:
    """Add a chunk's key-side gradient (one row per batch element of ``c``) to the key heads it read."""
    heads = torch.arange(c.start, c.stop, device=grad.device) // g
    target.index_add_(0, heads, grad)


def _run_chunks(run, chunks: list, workers: int, kv_group: int = 1) -> None:
    """``run(group)`` for ``workers`` balanced groups of chunks: here, or one group per pool thread.

    With ``kv_group > 1`` (grouped-query attention: batch element ``b`` reads
    key head ``b // kv_group``) chunks that share a key head go to one
    worker, so the key-side gradients it accumulates are its own.
    """
    if workers <= 1:
        run(chunks)
        return

    def task(group):
        with torch.no_grad():  # grad mode is per thread: the workers only fill preallocated results
            run(group)

    units = [[chunks[0]]]
    for c in chunks[1:]:
        if c.start // kv_group == (units[-1][-1].stop - 1) // kv_group:
            units[-1].append(c)  # shares a key head with the previous chunk
        else:
            units.append([c])
    groups = [[c for u in units[i::workers] for c in u] for i in range(workers)]
    for f in [_pool(workers).submit(task, g) for g in groups]:
        f.result()


class _RiemannianAttentionFn(torch.autograd.Function):
    """Blockwise forward with a fixed softmax offset; backward recomputes every tile.

    Inputs are flattened over the batch: q (Bf, n_q, d), k (Bk, n_k, d),
    v (Bk, n_k, dv), lam (Bf,), W (Bf, d, rs) or None (all shared low-rank
    parts), Uk (Bk, n_k, d, rk) or None, Uq (Bf, n_q, d, rq) or None,
    mask [*mb, 1 or n_q, 1 or n_k] bool/float or None, with ``mb``
    broadcasting to ``batch`` (the un-flattened batch shape, a tuple with
    product Bf): a mask is never expanded to the batch. ``kv_group`` g:
    batch element ``b`` reads key/value row ``b // g`` (``Bk = Bf / g``;
    grouped-query attention without repeating the key heads). ``mask_rows``
    [*mb, 1 or n_q] or None: a float mask's row offsets (see :func:`_tile`). ``scale``, ``ck``
    and ``cq`` are in natural units; the tiles use them times log2(e)
    (``scale``) and sqrt(log2(e)) (``ck``, ``cq``). Saved for the backward:
    the inputs, the output and the row log-sum-exp in base 2, nothing pairwise.
    A float mask that requires grad gets the gradient of the scores, summed to
    its own shape, as SDPA gives it. The backward is not itself differentiable
    (no double backward): it raises a ``RuntimeError`` saying so.
    """

    @staticmethod
    def forward(ctx, q, k, v, lam, W, Uk, Uq, mask, causal, scale, ck, cq, blocks, batch, kv_group, mask_rows,
                options=DEFAULT_LOOP):
        Bf, n_q, d = q.shape
        n_k, dv = k.shape[1], v.shape[2]
        rk = Uk.shape[-1] if Uk is not None else 0
        rq = Uq.shape[-1] if Uq is not None else 0
        bq, bk = blocks
        s2, ck2, cq2 = _base2(scale, ck, cq)
        workers, cb, chunks = _plan_chunks(Bf, bq, bk, 1 + rk + rq, False, q.device, options)
        g = kv_group
        masks = _MaskChunks(mask, batch, False, mask_rows) if mask is not None else None
        out = q.new_empty(Bf, n_q, dv)
        lse = q.new_empty(Bf, n_q)
        tiny = torch.finfo(q.dtype).tiny

        def run(group):  # one worker's chunks, with its own buffers
            bufs = _buffers(q, cb, n_q, n_k, bq, bk, rk, rq)
            for c in group:
                args = (q[c], _kv_rows(k, c, g), _kv_rows(v, c, g), lam[c], W[c] if W is not None else None,
                        _kv_rows(Uk, c, g) if rk else None,
                        Uq[c] if rq else None, masks.chunk(c.start, c.stop) if masks else None, causal,
                        s2, ck2, cq2, bq, bk, bufs)
                if options.fixed_offset:
                    acc, l, off = _chunk_fixed(*args, options.rowsum_in_product)
                    small = l < _TINY_SUM
                    if small.any() and (small & ~_dead_rows(args[7], causal, l.shape[0], n_q, n_k)).any():
                        acc, l, off = _chunk_online(*args)  # every key far below the bound: underflow
                else:
                    acc, l, off = _chunk_online(*args)
                out[c] = acc[..., :dv] / l.clamp_min(tiny).unsqueeze(-1)  # rows that see no key: 0 / tiny = 0
                # rows that see no key: lse = +inf, so that exp2(S - lse) = 0 in the backward
                lse[c] = torch.where(l > 0, off + torch.log2(l.clamp_min(tiny)), float("inf"))

        _run_chunks(run, chunks, workers)
        ctx.save_for_backward(q, k, v, lam, W, Uk, Uq, mask, out, lse, mask_rows)
        ctx.consts = (causal, scale, ck, cq, blocks, batch, g)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled():  # backward(create_graph=True): a gradient of this gradient
            raise RuntimeError(
                "riemannian_attention: the blockwise operator has no double backward "
                "(create_graph=True, e.g. a gradient penalty); use "
                "riemannian_ref.attention.riemannian_attention_reference, the dense path, for that")
        q, k, v, lam, W, Uk, Uq, mask, out, lse, mask_rows = ctx.saved_tensors
        causal, scale, ck, cq, (bq, bk), batch, g = ctx.consts
        need_mask = ctx.needs_input_grad[7]  # a float mask that requires grad
        need_lam = ctx.needs_input_grad[3]
        s2, ck2, cq2 = _base2(scale, ck, cq)
        Bf, n_q, d = q.shape
        n_k = k.shape[1]
        rk = Uk.shape[-1] if Uk is not None else 0
        rq = Uq.shape[-1] if Uq is not None else 0
        # a float mask's gradient is summed over batch elements that share it: chunks in one thread
        workers, cb, chunks = _plan_chunks(Bf, bq, bk, 1 + rk + rq, need_mask, q.device, ctx.options)
        masks = _MaskChunks(mask, batch, need_mask, mask_rows) if mask is not None else None
        dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dUk = torch.zeros_like(Uk) if rk else None
        dUq = torch.empty_like(Uq) if rq else None
        dlam = torch.zeros_like(lam) if need_lam else None
        dW = torch.zeros_like(W) if W is not None else None

        def run(group):  # one worker's chunks, with its own buffers; every gradient slice is its own
            bufs = _buffers(q, cb, n_q, n_k, bq, bk, rk, rq)
            dpbuf = q.new_empty(cb * min(bq, n_q) * min(bk, n_k))
            for c in group:
                m_c = masks.chunk(c.start, c.stop) if masks else None
                if g == 1:
                    dk_c, dv_c, dUk_c = dk[c], dv[c], (dUk[c] if rk else None)
                else:  # the chunk's key-side gradients, added to the key heads it read afterwards
                    n_c = c.stop - c.start
                    dk_c, dv_c = k.new_zeros(n_c, *k.shape[1:]), v.new_zeros(n_c, *v.shape[1:])
                    dUk_c = Uk.new_zeros(n_c, *Uk.shape[1:]) if rk else None
                _chunk_backward(ctx, q[c], _kv_rows(k, c, g), _kv_rows(v, c, g), lam[c],
                                W[c] if W is not None else None, _kv_rows(Uk, c, g) if rk else None,
                                Uq[c] if rq else None, m_c, causal, s2, ck2, cq2, bq, bk,
                                bufs, dpbuf, out[c], lse[c], dout[c], dq[c], dk_c, dv_c,
                                dUk_c, dUq[c] if rq else None, dlam[c] if need_lam else None,
                                dW[c] if W is not None else None, need_lam, (masks, c.start) if need_mask else None)
                if g > 1:
                    for target, grad in ((dk, dk_c), (dv, dv_c), (dUk, dUk_c)):
                        if grad is not None:
                            _add_kv_grad(target, c, g, grad)

        _run_chunks(run, chunks, workers, g)
        dmask = masks.grad_like_mask() if need_mask else None
        return dq, dk, dv, dlam, dW, dUk, dUq, dmask, None, None, None, None, None, None, None, None, None


def blockwise_operator(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, *, W, Uk, Uq, mask, causal: bool,
                       scale: float, ck: float, cq: float, blocks: tuple[int, int], batch: tuple, kv_group: int = 1,
                       mask_rows=None, options: LoopOptions = DEFAULT_LOOP, traced: bool = False) -> Tensor:
    """The operator on flattened inputs (listed by :class:`_RiemannianAttentionFn`), by keyword: (Bf, n_q, dv).

    The one entry of :func:`~riemannian_ref.attention.functional.riemannian_attention`
    and of the ablation benchmark, which passes ``options``. ``traced``: the
    custom op of ``_op.py`` (under ``torch.compile``, on meta tensors), which
    runs the default loop.
    """
    args = (q, k, v, lam, W, Uk, Uq, mask, causal, scale, ck, cq, blocks, batch, kv_group, mask_rows)
    if traced:
        if options != DEFAULT_LOOP:
            raise ValueError(f"options must be the default loop while tracing, got {options}")
        from ._op import TracedRiemannianAttentionFn  # _op imports this module

        return TracedRiemannianAttentionFn.apply(*args)
    return _RiemannianAttentionFn.apply(*args, options)


def _chunk_backward(ctx, q, k, v, lam, W, Uk, Uq, mask, causal, s2, ck2, cq2, bq, bk, bufs, dpbuf, out, lse,
                    dout, dq, dk, dv, dUk, dUq, dlam, dW, need_lam, mask_grad):
    """Backward of one batch chunk (FlashAttention-2's Algorithm 2 on the stacked products), in place into the
    chunk's slices of the gradients."""
    cb, n_q, d = q.shape
    n_k, dvv = k.shape[1], v.shape[2]
    rk = Uk.shape[-1] if Uk is not None else 0
    rq = Uq.shape[-1] if Uq is not None else 0
    # [q, 1, -lse]: the product gives S - lse directly (rows that see no key: every score is -inf anyway)
    qa = _augment(q, 1.0, 0.0)
    qa[..., d + 1] = -torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    # [dO, -D] @ [V | 1]^T = dP - rowsum(dO * O), one product
    dOa = _augment(dout, 0.0)
    dOa[..., dvv] = -(dout * out).sum(-1)
    # The tiles hold base-2 products X' (X'^(0) = log2(e) X^(0), X'^(t) = sqrt(log2(e)) X^(t)),
    # so dX'^(0) = ln 2 dS and dX'^(t) = -2 ln 2 X'^(t) dS: the factors ln 2 and -2 ln 2 go
    # into the key side (O(nb d r) per key block) instead of a pass over every tile.
    f0, ft = _LN2, -2.0 * _LN2
    dqa = q.new_zeros(cb, n_q, d + 2)
    dQa = q.new_zeros(cb, n_q * rq, d + 1) if rq else None  # d[c U_i^T, -c U_i^T q_i], row-stacked
    for j0 in range(0, n_k, bk):
        j1 = min(j0 + bk, n_k)
        nb = j1 - j0
        k_b = k[:, j0:j1]
        U_b = Uk[:, j0:j1] if rk else None
        Kt, Mk = _key_block(k_b, lam, W, U_b, s2, ck2)
        KtT = Kt.transpose(1, 2).clone()  # carries the factors f0 (t = 0) and ft (t >= 1) of dX
        KtT[:, :nb].mul_(f0)
        KtT[:, nb:].mul_(ft)
        kta_b = _augment(k_b, 1.0).transpose(1, 2) if rq else None  # (cb, d+1, nb)
        dKt = torch.zeros_like(Kt)
        dkta = q.new_zeros(cb, d + 1, nb) if rq else None
        dv_b = dv[:, j0:j1]
        vaT = _augment(v[:, j0:j1], 1.0).transpose(1, 2)  # (cb, dv+1, nb)
        i_start = (j0 // bq) * bq if causal else 0  # earlier query blocks see none of these keys
        for i0 in range(i_start, n_q, bq):
            i1 = min(i0 + bq, n_q)
            qa_b = qa[:, i0:i1]
            Qa = _query_block(q[:, i0:i1], Uq[:, i0:i1], cq2) if rq else None
            S, X, Y = _tile(qa_b, Kt, Qa, kta_b, rk, rq, mask, _LOG2E, causal, i0, i1, j0, j1, *bufs)
            P = S.exp2_()  # (cb, bq, bk), the view X[:, :, 0]
            dv_b.baddbmm_(P.transpose(1, 2), dout[:, i0:i1])
            dP = torch.bmm(dOa[:, i0:i1], vaT, out=dpbuf[:cb * (i1 - i0) * nb].view(cb, i1 - i0, nb))
            dS = P.mul_(dP)  # X[:, :, 0] now holds dX^(0) = dS, the gradient of the scores
            if mask_grad is not None:  # the mask is added to the scores: its gradient is dS, summed to its shape
                masks, c0 = mask_grad
                masks.add_grad(c0, c0 + cb, i0, i1, j0, j1, dS)
            if rk:  # X'^(t) dS; the factor -2 ln 2 is in KtT and applied to dKt below
                X[:, :, 1:].mul_(dS.unsqueeze(2))
            dX = X.view(cb, i1 - i0, -1)  # (cb, bq, (1+rk) bk)
            dqa[:, i0:i1].baddbmm_(dX, KtT)
            dKt.baddbmm_(qa_b.transpose(1, 2), dX)
            if rq:  # Y'^(t) dS; the factor -2 ln 2 is applied to dQa and dkta afterwards
                dY = Y.mul_(dS.unsqueeze(2)).view(cb, -1, nb)  # (cb, bq rq, bk)
                dQa[:, i0 * rq:i1 * rq].baddbmm_(dY, kta_b.transpose(1, 2))
                dkta.baddbmm_(Qa.transpose(1, 2), dY)
            del X, Y, S, P, dP, dS
        dKt[:, :, :nb].mul_(f0)
        dKt[:, :, nb:].mul_(ft)
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
    dq.copy_(dqa[..., :d])  # the two appended columns carry no gradient (the offset is a row constant)
    if rq:  # Qa = [c U_i^T, -c U_i^T q_i]
        dQa = dQa.view(cb, n_q, rq, d + 1).mul_(ft)
        dqb = -dQa[..., d]  # (cb, n_q, rq)
        dUq.copy_(cq2 * (dQa[..., :d].transpose(-1, -2) + q.unsqueeze(-1) * dqb.unsqueeze(-2)))  # (cb, n_q, d, rq)
        dq.add_(cq2 * (Uq * dqb.unsqueeze(-2)).sum(-1))
