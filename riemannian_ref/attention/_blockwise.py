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

import torch
from torch import Tensor

__all__: list[str] = []  # private: called by riemannian_ref.attention.functional

_NEG_INF = float("-inf")


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


def _tile(qa_b, Kt, Qa, kta_b, rk, rq, mask, mask_scale, causal, i0, i1, j0, j1, xbuf, ybuf, batch):
    """Scores of one tile and the rank products X (Bf, bq, 1+rk, bk), Y (Bf, bq, rq, bk).

    The scores ``S`` (Bf, bq, bk) are the view ``X[:, :, 0]`` (rows of stride
    ``(1 + rk) bk``), updated in place: the tile is never copied. A float
    mask (shape [*mb, 1 or n_q, 1 or n_k] with ``mb`` broadcasting to
    ``batch``, the un-flattened batch shape) is added times ``mask_scale``.
    ``xbuf`` and ``ybuf`` (flat, at least
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
        m = _mask_tile(mask, i0, i1, j0, j1)
        Sb = S.view(*batch, nb, mb)  # the mask keeps its own (broadcast) batch shape: no copy of it
        if m.dtype == torch.bool:
            Sb.masked_fill_(~m, _NEG_INF)
        else:
            Sb.add_(m, alpha=mask_scale)
    return S, X, Y


def _mask_tile(mask: Tensor, i0: int, i1: int, j0: int, j1: int) -> Tensor:
    """The part of ``mask`` [..., 1 or n_q, 1 or n_k] that covers queries i0:i1 and keys j0:j1."""
    m = mask[..., i0:i1, :] if mask.shape[-2] > 1 else mask
    return m[..., j0:j1] if m.shape[-1] > 1 else m


def _sum_to(g: Tensor, shape: torch.Size) -> Tensor:
    """Sum ``g`` over the dimensions that ``shape`` broadcasts (the adjoint of broadcasting)."""
    lead = g.dim() - len(shape)
    g = g.sum(tuple(range(lead))) if lead else g
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    return g.sum(dims, keepdim=True) if dims else g


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
    mask [*mb, 1 or n_q, 1 or n_k] bool/float or None, with ``mb``
    broadcasting to ``batch`` (the un-flattened batch shape, a tuple with
    product Bf): a mask is never expanded to the batch. ``scale``, ``ck``
    and ``cq`` are in natural units; the tiles use them times log2(e)
    (``scale``) and sqrt(log2(e)) (``ck``, ``cq``). Saved for the backward:
    the inputs, the output and the row log-sum-exp in base 2, nothing pairwise.
    A float mask that requires grad gets the gradient of the scores, summed to
    its own shape, as SDPA gives it. The backward is not itself differentiable
    (no double backward): it raises a ``RuntimeError`` saying so.
    """

    @staticmethod
    def forward(ctx, q, k, v, lam, W, Uk, Uq, mask, causal, scale, ck, cq, blocks, batch):
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
                                i0, i1, j0, j1, xbuf, ybuf, batch)
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
        ctx.consts = (causal, scale, ck, cq, blocks, batch)
        return out

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled():  # backward(create_graph=True): a gradient of this gradient
            raise RuntimeError(
                "riemannian_attention: the blockwise operator has no double backward "
                "(create_graph=True, e.g. a gradient penalty); use "
                "riemannian_ref.attention.riemannian_attention_reference, the dense path, for that")
        q, k, v, lam, W, Uk, Uq, mask, out, lse = ctx.saved_tensors
        causal, scale, ck, cq, (bq, bk), batch = ctx.consts
        need_mask = ctx.needs_input_grad[7]  # a float mask that requires grad
        dmask = torch.zeros_like(mask) if need_mask else None
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
                S, X, Y = _tile(qa_b, Kt, Qa, kta_b, rk, rq, mask, _LOG2E, causal, i0, i1, j0, j1, xbuf, ybuf,
                                batch)
                P = S.sub_(lse[:, i0:i1].unsqueeze(-1)).exp2_()  # (Bf, bq, bk), the view X[:, :, 0]
                dv_b.baddbmm_(P.transpose(1, 2), dout[:, i0:i1])
                dP = torch.bmm(dout[:, i0:i1], vT).sub_(Drow[:, i0:i1].unsqueeze(-1))
                dS = P.mul_(dP)  # X[:, :, 0] now holds dX^(0) = dS, the gradient of the scores
                if need_mask:  # the mask is added to the scores: its gradient is dS, summed to its shape
                    dm = _mask_tile(dmask, i0, i1, j0, j1)
                    dm += _sum_to(dS.view(*batch, i1 - i0, j1 - j0), dm.shape)
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
        return dq, dk, dv, dlam, dW, dUk, dUq, dmask, None, None, None, None, None, None

