r"""Attention along a content connection as Triton kernels for GPUs (private; needs the optional ``triton``).

The content connections turn pair :math:`m` of every (query, key) pair by its
own angle, :math:`\phi_{ijm} = (p_i - p_j)\,(\omega_{im} + \omega_{jm})/2`
(``rule="mean"``) or :math:`(p_i - p_j)\,\omega_{jm}` (``"source"``), so
unlike the flat connection the transport cannot be moved into one common
frame. The dense path (``connections._content_attention_f32``, the readable
reference and the tests' oracle) materialises the turned queries of every
pair; the CPU runs a fused row kernel (``_content_cpu``). This module computes
the same function in tiles on a GPU with memory :math:`O(n d)`: nothing
pairwise is stored, the backward recomputes the angles of every tile, as
FlashAttention recomputes its scores :cite:`dao2022flashattention`.

The maths is that of ``_content_kernel.c``. With the pairs as complex numbers
and :math:`W_{j0} = k_j`, :math:`W_{jt} = U_{k,j,t}` (the key-side factors),

.. math::
    x_{t,ij} = \mathrm{Re} \sum_m \overline{q_{im}}\, W_{jtm}\, e^{i\phi_{ijm}}
             = (P_{j\to i}^\top q_i) \cdot W_{jt},

    s_{ij} = -\tfrac{\text{scale}}{2}\Big(\lambda\,(|q_i|^2 + |k_j|^2 - 2 x_{0,ij})
             + w \sum_{t \ge 1} (x_{t,ij} - c_{jt})^2\Big) + M_{ij},
    \qquad c_{jt} = U_{k,j,t} \cdot k_j,

or :math:`s_{ij} = \text{scale}\; x_{0,ij} + M_{ij}` for dot scores, and the
output :math:`o_i = \sum_j A_{ij}\, P_{j\to i} v_j` (transported values, pair
:math:`m` of :math:`P v_j` being :math:`v_{jm} e^{i\phi_{ijm}}`) or
:math:`\sum_j A_{ij} v_j`. :math:`|q_i|^2`, :math:`|k_j|^2` and :math:`c_{jt}`
are inputs of the kernels: the wrapper computes them with autograd, which
carries their gradients back to ``q``, ``k`` and ``U_k``, so the kernels only
differentiate what depends on the angles.

Kernels. Every tile ``[BLOCK_M, BLOCK_N]`` loops over the pairs ``m`` (a
runtime loop): it loads pair ``m`` of the query block, of the key block's
``1 + r`` vectors :math:`W_{jt}` and the rates, computes the angles and their
cosines and sines, and accumulates :math:`x_0` (a ``[BM, BN]`` tile) and the
rank products (a ``[BM, R, BN]`` tile, ``R`` the rank rounded up to a power
of two). The per-token arrays the pair loops read (queries, keys, factors,
transported values, rates) are stored with the tokens innermost
(``[B, d, n]``), so the loads of one pair's column are contiguous.

- Forward, one program per (batch element, query block): per key block the
  scores (pair loop), the online softmax in base e (running maximum and
  sum), then a second pair loop that recomputes the angles and accumulates
  the transported values (real and imaginary parts as ``[BM, d/2]`` tiles, the
  column of pair ``m`` updated through a one-hot mask), or one ``tl.dot``
  with the value block. Two evaluations of the angles per tile. The row
  maximum and the inverse row sum are stored (float32, ``[B, n]``), not the
  log-sum-exp: next to a mask of ``finfo.min`` the log-sum-exp keeps no
  digit of log(sum), and these two give back the forward's weights.
- Backward, :math:`D_i = dO_i \cdot o_i` on the host, then one program per
  (batch element, key block) for :math:`dk`, :math:`dU_k`, :math:`dv`, the
  key's rate, :math:`d|k|^2` and :math:`dc`, and one per (batch element,
  query block) for :math:`dq`, the query's rate (mean rule),
  :math:`d|q|^2` and a partial :math:`d\lambda` (summed on the host). Each
  recomputes the tile's scores and weights (one pair loop, which also forms
  :math:`dO_i \cdot P v_j` for transported values), then a second pair loop
  for the gradients. Every program owns the rows it writes: no atomics, the
  result is deterministic.

Supported: dot or metric scores with a key-side metric of any rank (per
token or shared; a shared one is expanded per token, :math:`O(n d r)`),
``metric_side="key"`` or ``"mean"`` without query factors, transported values
or not, both rules, causal (key blocks past the diagonal skipped), an additive
float mask broadcastable to ``[..., n, n]`` without grad (stored as
``[Bm, 1|n, n]``, read through a mask row per batch element, never expanded
to the batch) or a boolean one (converted), fully
masked rows giving zero output and zero gradients (SDPA's behaviour), float32,
float16 and bfloat16 inputs (computed in float32, returned in the input
dtype). Not here, so the dense path runs them: query-side metric factors
(``metric_side="query"`` or ``"mean"`` with ``U_q``), dropout, returned
weights, float64, a mask that requires grad; double backward raises. While
``torch.compile`` traces, the kernels are the custom ops
``riemannian_ref::triton_content_attention`` and its backward (one node each
in the graph), as in ``_triton.py``; eager calls run the same code through
the autograd Function.

Tested only in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``
set before ``triton`` is first imported), where the kernels' helper functions
run as plain Python (see :func:`_helper`); compiled for sm_80 and sm_90 with
the ``ptxas`` that ships with triton
(``benchmarks/check_triton_content_compile.py``), but never run or timed on a
GPU (none was lent), so the default block sizes are a guess.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
from torch import Tensor

# triton (optional: None when absent, then the dense path stays), the switch and the block check are the
# plain operator's: one environment rule and one dtype set for both kernels
from ._triton import HAS_TRITON, SUPPORTED_DTYPES, _check_blocks, disabled_by_env, tl, triton  # noqa: F401

__all__: list[str] = []  # private


def interpreted() -> bool:
    """Whether this module's kernels run in Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return HAS_TRITON and type(_content_fwd_kernel).__name__ == "InterpretedFunction"


def unsupported_reason(q: Tensor, attn_mask, dropout_p: float, return_weights: bool, U_q, metric_side: str,
                       scores: str) -> str | None:
    """Why the kernels cannot run this (validated) content-connection call, or None when they can."""
    if not HAS_TRITON:
        return "triton is not installed"
    if dropout_p > 0.0:
        return "dropout_p > 0 (the kernels have no dropout)"
    if return_weights:
        return "return_weights=True (the kernels never form the weights)"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} (the kernels take float16, bfloat16 and float32)"
    if scores == "metric" and U_q is not None and metric_side in ("query", "mean"):
        return "query-side metric factors (metric_side='query' or 'mean' with U_q)"
    if isinstance(attn_mask, Tensor) and attn_mask.requires_grad:
        return "an attn_mask that requires grad (its gradient is not computed by the kernels)"
    if q.device.type != "cuda" and not interpreted():
        return "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported)"
    return None


def dispatch(q: Tensor, attn_mask, dropout_p: float, return_weights: bool, U_q, metric_side: str,
             scores: str) -> bool:
    """Whether ``connections._content_attention`` sends this call here.

    CUDA tensors with triton installed, ``RR_DISABLE_TRITON`` unset and a
    supported call; or any call inside the private
    ``functional._force_backend("triton")`` (tests: CPU tensors in the
    interpreter), where an unsupported one raises ``RuntimeError`` naming
    the reason instead of taking the dense path.
    """
    from .functional import _FORCED_BACKEND

    why = unsupported_reason(q, attn_mask, dropout_p, return_weights, U_q, metric_side, scores)
    if _FORCED_BACKEND == "triton":
        if why is not None:
            raise RuntimeError(f"connection_attention under _force_backend('triton'): the content-connection "
                               f"Triton kernels do not support this call: {why}")
        return True
    return q.device.type == "cuda" and not disabled_by_env() and why is None


def _pow2(n: int, lo: int) -> int:
    return max(lo, triton.next_power_of_2(max(n, 1)))


def default_blocks(d: int) -> tuple[int, int]:
    """Query and key block sizes (powers of two): (16, 32) up to d = 64, (16, 16) above.

    Never timed on a GPU (none was at hand): chosen as the largest blocks for
    which ptxas (the one that ships with triton 3.9, sm_80 and sm_90, 4 warps)
    reports the kernels without register spills, or a few dozen bytes, at
    d = 64, r = 2 and d = 128, r = 2 (``benchmarks/check_triton_content_compile.py``).
    """
    return (16, 32) if d <= 64 else (16, 16)


def _device_of(t: Tensor):
    """Triton launches on the current CUDA device: make it the tensors' (cuda:1 while cuda:0 is current)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


CAUSAL, SOURCE, DOT, TV = 1, 2, 4, 8


def content_attention_triton(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float,
                             U_q: Tensor | None, U_k: Tensor | None, lam, metric_side: str, scores: str,
                             rates: Tensor, p: Tensor, transport_values: bool, rule: str,
                             blocks: tuple[int, int] | None = None) -> Tensor:
    """A validated content-connection call on the Triton kernels (arguments as ``_content_cpu.content_attention``).

    ``U_q`` must not be used (``metric_side="key"``, or ``"mean"``/``"query"``
    without query factors, or dot scores); ``U_k`` per token [..., n, d, r] or
    shared [..., d, r] (expanded here); ``mask`` None, boolean, or additive
    float without grad, broadcastable to [..., n, n]; ``p`` the positions [n]
    or [..., n]. Inputs of float16/bfloat16 are computed in float32 and the
    result comes back in their dtype. ``blocks``: (BLOCK_M, BLOCK_N), powers of
    two >= 16 (default :func:`default_blocks`).
    """
    dtype = q.dtype
    f32 = lambda t: t.float() if isinstance(t, Tensor) and t.is_floating_point() else t  # noqa: E731
    q, k, v, U_k, rates = f32(q), f32(k), f32(v), f32(U_k), f32(rates)
    lam = f32(lam)
    n, d = q.shape[-2], q.shape[-1]
    dot = scores == "dot"
    if not dot and U_q is not None and metric_side in ("query", "mean"):
        raise ValueError("the content-connection Triton kernels take no query-side metric factors")
    per_k = U_k is not None and U_k.dim() == k.dim() + 1
    from ._content_cpu import flatten_batch  # the CPU kernel's wrapper: the same batch rule

    batch, B, flat, lam_t = flatten_batch(q, k, v, rates, p, lam, ((U_k, k),))

    use_uk = U_k is not None and U_k.shape[-1] > 0 and not dot and metric_side in ("key", "mean")
    w = 0.5 if metric_side == "mean" else 1.0
    qf, kf, vf = flat(q, 2), flat(k, 2), flat(v, 2)
    qT = qf.transpose(1, 2).contiguous()  # [B, d, n]: tokens innermost
    kT = kf.transpose(1, 2).contiguous()
    UkT, cK = None, None
    if use_uk:
        Uk = U_k if per_k else U_k.unsqueeze(-3).expand(*U_k.shape[:-2], n, *U_k.shape[-2:])
        Uk = flat(Uk, 3)  # [B, n, d, r]
        UkT = Uk.permute(0, 3, 2, 1).contiguous()  # [B, r, d, n]
        cK = torch.einsum("bjdt,bjd->btj", Uk, kf).contiguous()  # U_kj^T k_j  [B, r, n]
    VX = vf.transpose(1, 2).contiguous() if transport_values else vf.contiguous()  # [B, d, n] or [B, n, dv]
    ratesT = flat(rates, 2).transpose(1, 2).contiguous()  # [B, d/2, n]
    pos = p.detach().to(torch.float32).expand(*batch, n).reshape(B, n).contiguous()
    lamf = lam_t.expand(batch).reshape(B).to(torch.float32).contiguous()
    qq = None if dot else (qf * qf).sum(-1).contiguous()
    kk = None if dot else (kf * kf).sum(-1).contiguous()
    mflat, mids = _flat_mask(mask, batch, is_causal, n, q.device) if mask is not None else (None, None)
    flags = (CAUSAL if is_causal else 0) | (SOURCE if rule == "source" else 0) | (DOT if dot else 0) | \
        (TV if transport_values else 0)
    blocks = default_blocks(d) if blocks is None else _check_blocks(blocks)
    fn = _TracedContentFn if torch.compiler.is_compiling() else _ContentTritonFn
    out = fn.apply(qT, kT, UkT, cK, VX, ratesT, pos, lamf, qq, kk, mflat, mids, float(scale), w, flags, blocks)
    return out.view(*batch, n, out.shape[-1]).to(dtype)


def _flat_mask(mask: Tensor, batch: torch.Size, is_causal: bool, n: int, device) -> tuple[Tensor, Tensor]:
    """The mask as float32 [Mb, 1|n, n] (each row relative to its largest visible entry, as the CPU paths read
    it; boolean: 0 or -inf) and the mask row of every flat batch element, int32 [B] (never expanded to the
    batch)."""
    from .functional import _relative_mask

    m = mask.detach()
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=torch.float32, device=device).masked_fill_(~m, float("-inf"))
    else:
        m = _relative_mask(m.to(torch.float32), is_causal, n, n)
    while m.dim() < 2:
        m = m.unsqueeze(0)
    for dim in range(m.dim() - 2):  # a batch dimension of stride 0 (an expanded mask) is read once
        if m.stride(dim) == 0:
            m = m.narrow(dim, 0, 1)
    mb = m.shape[:-2]
    m = m.expand(*mb, m.shape[-2], n)
    flat = m.reshape(-1, m.shape[-2], n).contiguous()
    ids = torch.arange(flat.shape[0], device=device).view(mb) if mb else torch.zeros((), dtype=torch.long,
                                                                                      device=device)
    return flat, ids.expand(batch).reshape(-1).to(torch.int32).contiguous()


class _ContentTritonFn(torch.autograd.Function):
    """Forward and backward on the kernels; inputs float32, flat over the batch (B), contiguous.

    qT [B, d, n], kT [B, d, n], UkT [B, r, d, n] or None, cK [B, r, n]
    (:math:`U_{kj}^\\top k_j`) or None, VX [B, d, n] (transported values) or
    [B, n, dv], ratesT [B, d/2, n], pos [B, n], lam [B], qq [B, n]
    (:math:`|q_i|^2`) and kk [B, n] (None for dot scores), mask float32
    [Mb, 1|n, n] or None with mask_ids int32 [B]. Saved for the backward: the
    inputs, the output and two float32 numbers per row (its maximum and
    inverse sum), nothing pairwise.
    """

    @staticmethod
    def forward(ctx, qT, kT, UkT, cK, VX, ratesT, pos, lam, qq, kk, mask, mask_ids, scale, w, flags, blocks):
        B, d, n = qT.shape
        dv = d if flags & TV else VX.shape[2]
        out = torch.empty(B, n, dv, dtype=torch.float32, device=qT.device)
        mrow = torch.empty(B, n, dtype=torch.float32, device=qT.device)
        il = torch.empty(B, n, dtype=torch.float32, device=qT.device)
        a = _kernel_args(qT, UkT, VX, qq, kk, cK, mask, mask_ids, scale, w, flags, blocks)
        with _device_of(qT):
            _content_fwd_kernel[(B, triton.cdiv(n, blocks[0]))](
                qT, kT, a["uk"], a["ck"], VX, ratesT, pos, lam, a["qq"], a["kk"], a["mask"], a["mids"],
                out, mrow, il, *a["sizes"], a["scale"], a["w"], **a["const"])
        ctx.save_for_backward(qT, kT, UkT, cK, VX, ratesT, pos, lam, qq, kk, mask, mask_ids, out, mrow, il)
        ctx.consts = (scale, w, flags, blocks)
        return out

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "connection_attention: the content-connection Triton kernels have no double backward "
                "(create_graph=True); set RR_DISABLE_TRITON=1 to run the dense path, which has one")
        qT, kT, UkT, cK, VX, ratesT, pos, lam, qq, kk, mask, mask_ids, out, mrow, il = ctx.saved_tensors
        scale, w, flags, blocks = ctx.consts
        B, d, n = qT.shape
        H = d // 2
        dout = dout.float().contiguous()
        Dr = (dout * out).sum(-1).contiguous()  # rowsum(dO * O)
        DO = dout.transpose(1, 2).contiguous() if flags & TV else dout  # per-pair columns, or rows for tl.dot
        dev = qT.device
        e = lambda *s: torch.empty(*s, dtype=torch.float32, device=dev)  # noqa: E731
        dq, dkT, dVX = e(B, n, d), e(B, d, n), torch.empty_like(VX)
        dUkT = torch.empty_like(UkT) if UkT is not None else None
        dcK = torch.empty_like(cK) if cK is not None else None
        dri = torch.zeros(B, n, H, dtype=torch.float32, device=dev) if not flags & SOURCE else None
        drj = e(B, H, n)
        dqq = e(B, n) if qq is not None else None
        dkk = e(B, n) if kk is not None else None
        nqb = triton.cdiv(n, blocks[0])
        dlam = torch.zeros(B, nqb, dtype=torch.float32, device=dev)
        a = _kernel_args(qT, UkT, VX, qq, kk, cK, mask, mask_ids, scale, w, flags, blocks)
        common = (qT, kT, a["uk"], a["ck"], VX, ratesT, pos, lam, a["qq"], a["kk"], a["mask"], a["mids"], mrow,
                  il, DO, Dr)
        some = lambda t: t if t is not None else Dr  # noqa: E731  (an unused pointer)
        with _device_of(qT):
            _content_bwd_q_kernel[(B, nqb)](*common, dq, some(dri), some(dqq), dlam, *a["sizes"], a["scale"],
                                             a["w"], **a["const"])
            _content_bwd_k_kernel[(B, triton.cdiv(n, blocks[1]))](
                *common, dkT, some(dUkT), some(dcK), dVX, drj, some(dkk), *a["sizes"], a["scale"], a["w"],
                **a["const"])
        dratesT = drj if dri is None else drj + dri.transpose(1, 2)
        return (dq.transpose(1, 2).contiguous(), dkT, dUkT, dcK, dVX, dratesT, None, dlam.sum(-1), dqq, dkk,
                None, None, None, None, None, None)


# --------------------------------------------------------------- the kernels as custom ops, for torch.compile
# Traced code (torch.compile, torch.export) calls the kernels through these ops, which the graph records as
# single nodes (fake implementations give the shapes, the autograd formula calls the backward op), as
# _triton.py does for riemannian_attention; eager calls use _ContentTritonFn itself. Same code either way.
_GRADS = ("qT", "kT", "UkT", "cK", "VX", "ratesT", "lam", "qq", "kk")  # what the backward op returns


@torch.library.custom_op("riemannian_ref::triton_content_attention", mutates_args=())
def _content_op(qT: Tensor, kT: Tensor, UkT: Optional[Tensor], cK: Optional[Tensor], VX: Tensor, ratesT: Tensor,
                pos: Tensor, lam: Tensor, qq: Optional[Tensor], kk: Optional[Tensor], mask: Optional[Tensor],
                mask_ids: Optional[Tensor], scale: float, w: float, flags: int,
                blocks: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
    """The kernels' forward: (output [B, n, dv], row maximum [B, n], inverse row sum [B, n]), float32."""
    from ._op import _Ctx

    ctx = _Ctx()
    out = _ContentTritonFn.forward(ctx, qT, kT, UkT, cK, VX, ratesT, pos, lam, qq, kk, mask, mask_ids, scale, w,
                                   flags, tuple(blocks))
    return out, ctx.saved_tensors[13], ctx.saved_tensors[14]


@_content_op.register_fake
def _content_op_fake(qT, kT, UkT, cK, VX, ratesT, pos, lam, qq, kk, mask, mask_ids, scale, w, flags, blocks):
    B, d, n = qT.shape
    dv = d if flags & TV else VX.shape[2]
    return qT.new_empty(B, n, dv), qT.new_empty(B, n), qT.new_empty(B, n)


@torch.library.custom_op("riemannian_ref::triton_content_attention_backward", mutates_args=())
def _content_op_backward(dout: Tensor, qT: Tensor, kT: Tensor, UkT: Optional[Tensor], cK: Optional[Tensor],
                         VX: Tensor, ratesT: Tensor, pos: Tensor, lam: Tensor, qq: Optional[Tensor],
                         kk: Optional[Tensor], mask: Optional[Tensor], mask_ids: Optional[Tensor], out: Tensor,
                         mrow: Tensor, il: Tensor, scale: float, w: float, flags: int,
                         blocks: Sequence[int]) -> list[Tensor]:
    """The gradients of ``_GRADS``; an empty tensor where there is none."""
    from ._op import _Ctx

    ctx = _Ctx((qT, kT, UkT, cK, VX, ratesT, pos, lam, qq, kk, mask, mask_ids, out, mrow, il),
               (scale, w, flags, tuple(blocks)))
    with torch.no_grad():
        g = _ContentTritonFn.backward(ctx, dout)
    grads = (*g[:6], *g[7:10])
    return [t if t is not None else qT.new_empty(0) for t in grads]


@_content_op_backward.register_fake
def _content_op_backward_fake(dout, qT, kT, UkT, cK, VX, ratesT, pos, lam, qq, kk, mask, mask_ids, out, mrow, il,
                              scale, w, flags, blocks):
    return [torch.empty_like(t) if t is not None else qT.new_empty(0)
            for t in (qT, kT, UkT, cK, VX, ratesT, lam, qq, kk)]


def _content_setup_context(ctx, inputs, output):
    qT, kT, UkT, cK, VX, ratesT, pos, lam, qq, kk, mask, mask_ids, scale, w, flags, blocks = inputs
    out, mrow, il = output
    ctx.save_for_backward(qT, kT, UkT, cK, VX, ratesT, pos, lam, qq, kk, mask, mask_ids, out, mrow, il)
    ctx.consts = (scale, w, flags, tuple(blocks))
    ctx.mark_non_differentiable(mrow, il)


def _content_backward(ctx, dout, dmrow, dil):
    if torch.is_grad_enabled():
        raise RuntimeError(
            "connection_attention: the content-connection Triton kernels have no double backward "
            "(create_graph=True); set RR_DISABLE_TRITON=1 to run the dense path, which has one")
    saved = ctx.saved_tensors
    scale, w, flags, blocks = ctx.consts
    g = _content_op_backward(dout, *saved, scale, w, flags, list(blocks))
    present = [t is not None for t in (saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], saved[7],
                                       saved[8], saved[9])]
    g = [t if p else None for t, p in zip(g, present)]
    return (*g[:6], None, *g[6:], None, None, None, None, None, None)


_content_op.register_autograd(_content_backward, setup_context=_content_setup_context)


class _TracedContentFn:
    """``_ContentTritonFn`` for a trace: ``apply`` takes the same arguments and calls the custom op."""

    @staticmethod
    def apply(qT, kT, UkT, cK, VX, ratesT, pos, lam, qq, kk, mask, mask_ids, scale, w, flags, blocks) -> Tensor:
        return _content_op(qT, kT, UkT, cK, VX, ratesT, pos, lam, qq, kk, mask, mask_ids, scale, w, flags,
                           list(blocks))[0]


def _kernel_args(qT, UkT, VX, qq, kk, cK, mask, mask_ids, scale, w, flags, blocks):
    """The kernels' common arguments: stand-ins for absent tensors, sizes, mask strides, constants."""
    B, d, n = qT.shape
    rk = UkT.shape[1] if UkT is not None else 0
    dv = d if flags & TV else VX.shape[2]
    if mask is not None:
        mq = mask.shape[1]
        smq, smb = (n if mq > 1 else 0), mq * n
    else:
        smq = smb = 0
    const = dict(CAUSAL=bool(flags & CAUSAL), SOURCE=bool(flags & SOURCE), DOT=bool(flags & DOT),
                 TV=bool(flags & TV), HAS_UK=rk > 0, HAS_MASK=mask is not None, RK=_pow2(rk, 2),
                 HP=_pow2(d // 2, 2), BDV=_pow2(dv, 16), BM=blocks[0], BN=blocks[1])
    return dict(uk=UkT if UkT is not None else qT, ck=cK if cK is not None else qT,
                qq=qq if qq is not None else qT, kk=kk if kk is not None else qT,
                mask=mask if mask is not None else qT, mids=mask_ids if mask_ids is not None else qT,
                sizes=(n, d // 2, d, rk, dv, smq, smb), scale=float(scale), w=float(w), const=const)


_HELPERS: list = []


def _helper(fn):
    """A device function of the kernels: ``triton.jit``, except in Triton's interpreter, where the plain
    function runs (the same code on the same interpreted tensors; the interpreter re-patches
    triton.language on every call of a jit function, about a millisecond, which would dominate the tests).

    Which of the two is decided once the kernels exist, by what ``triton.jit`` made of them
    (:func:`_bind_helpers`): a helper must run the way its kernel does, and Triton's own switch may have
    been read when triton was first imported, before ``TRITON_INTERPRET`` was set.
    """
    _HELPERS.append(fn)
    return fn


def _bind_helpers() -> None:
    """Compiled kernels call jit helpers (the module globals, read when a kernel compiles); interpreted
    kernels call the plain functions."""
    if not interpreted():
        for fn in _HELPERS:
            globals()[fn.__name__] = triton.jit(fn)


if HAS_TRITON:
    # Only builtins of triton.language and this module's jit functions (sums and maxima as tl.reduce with
    # tl.standard's combine functions, not tl.sum/tl.max, and zeros as tl.full, not tl.zeros: those are jit
    # functions defined when triton was imported): Triton's interpreter then works even if triton was
    # imported before TRITON_INTERPRET=1 was set, as long as THIS module is imported after (the same rule
    # as _triton.py).

    @_helper
    def _rsum(x, axis: tl.constexpr):
        return tl.reduce(x, axis, tl.standard._sum_combine)

    @_helper
    def _rmax(x, axis: tl.constexpr):
        return tl.reduce(x, axis, tl.standard._elementwise_max)

    @_helper
    def _col(X, b, c, rows, n, offs):
        """Column ``c`` (of ``rows``) of the [B, rows, n] array X for tokens ``offs`` (0 past n), float32."""
        return tl.load(X + (b * rows + c) * n + offs, mask=offs < n, other=0.0).to(tl.float32)

    @_helper
    def _angles(RT, b, m, H, n, offs_m, offs_n, dp, SOURCE: tl.constexpr):
        """cos and sin of the angles of pair m over a tile: dp (p_i - p_j) times the edge's rate."""
        wj = _col(RT, b, m, H, n, offs_n)
        if SOURCE:
            phi = dp * wj[None, :]
        else:
            wi = _col(RT, b, m, H, n, offs_m)
            phi = dp * ((wi[:, None] + wj[None, :]) * 0.5)
        return tl.cos(phi), tl.sin(phi)

    @_helper
    def _turned(QT, b, m, d, n, offs, c, s):
        """Pair m of the query block turned back, conj(q_im) e^{i phi} = (qr, qi) over the tile."""
        ar = _col(QT, b, 2 * m, d, n, offs)
        ai = _col(QT, b, 2 * m + 1, d, n, offs)
        return ar[:, None] * c + ai[:, None] * s, ar[:, None] * s - ai[:, None] * c

    @_helper
    def _factor_pair(UKT, b, m, rk, d, n, offs_t, offs_n):
        """Pair m of the key block's factors U_{k,j,t}: real and imaginary parts [R, BN] (0 past rk, n)."""
        ptr = UKT + ((b * rk + offs_t[:, None]) * d + 2 * m) * n + offs_n[None, :]
        msk = (offs_t[:, None] < rk) & (offs_n[None, :] < n)
        return tl.load(ptr, mask=msk, other=0.0), tl.load(ptr + n, mask=msk, other=0.0)

    @_helper
    def _products(QT, KT, UKT, VX, RT, DO, b, offs_m, offs_n, dp, n, H, d, rk, offs_t,
                  SOURCE: tl.constexpr, HAS_UK: tl.constexpr, WITH_DP: tl.constexpr, RK: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr):
        """A tile's x_0 [BM, BN] and rank products x_t [BM, RK, BN] (t >= 1), and with WITH_DP the products
        dO_i . P v_j [BM, BN] of transported values: one loop over the pairs."""
        x0 = tl.full((BM, BN), 0.0, tl.float32)
        xu = tl.full((BM, RK, BN), 0.0, tl.float32)
        dpv = tl.full((BM, BN), 0.0, tl.float32)
        for m in range(0, H):
            c, s = _angles(RT, b, m, H, n, offs_m, offs_n, dp, SOURCE)
            qr, qi = _turned(QT, b, m, d, n, offs_m, c, s)
            kr = _col(KT, b, 2 * m, d, n, offs_n)
            ki = _col(KT, b, 2 * m + 1, d, n, offs_n)
            x0 += qr * kr[None, :] - qi * ki[None, :]
            if HAS_UK:
                ur, ui = _factor_pair(UKT, b, m, rk, d, n, offs_t, offs_n)
                xu += qr[:, None, :] * ur[None, :, :] - qi[:, None, :] * ui[None, :, :]
            if WITH_DP:
                er, ei = _turned(DO, b, m, d, n, offs_m, c, s)
                vr = _col(VX, b, 2 * m, d, n, offs_n)
                vi = _col(VX, b, 2 * m + 1, d, n, offs_n)
                dpv += er * vr[None, :] - ei * vi[None, :]
        return x0, xu, dpv

    @_helper
    def _scores(x0, xu, QQ, KK, CK, MASK_PTR, b, lam, scale, wk, offs_m, offs_n, offs_t, n, rk, smq,
                CAUSAL: tl.constexpr, DOT: tl.constexpr, HAS_UK: tl.constexpr, HAS_MASK: tl.constexpr):
        """A tile's scores (natural base), -inf where masked, causally hidden or outside [0, n)^2."""
        if DOT:
            sc = scale * x0
        else:
            qq = tl.load(QQ + b * n + offs_m, mask=offs_m < n, other=0.0)
            kk = tl.load(KK + b * n + offs_n, mask=offs_n < n, other=0.0)
            dist = lam * ((qq[:, None] + kk[None, :]) - 2.0 * x0)
            if HAS_UK:
                ck = tl.load(CK + (b * rk + offs_t[:, None]) * n + offs_n[None, :],
                             mask=(offs_t[:, None] < rk) & (offs_n[None, :] < n), other=0.0)
                u = xu - ck[None, :, :]
                dist += wk * _rsum(u * u, 1)
            sc = (-0.5 * scale) * dist
        valid = (offs_m[:, None] < n) & (offs_n[None, :] < n)
        if HAS_MASK:
            sc += tl.load(MASK_PTR + offs_m[:, None].to(tl.int64) * smq + offs_n[None, :], mask=valid, other=0.0)
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        return tl.where(valid, sc, float("-inf"))

    @_helper
    def _grads_of_scores(sc, p, dpv, Dr, x0, xu, QQ, KK, CK, b, lam, scale, wk, offs_m, offs_n, offs_t, n, rk,
                         DOT: tl.constexpr, HAS_UK: tl.constexpr):
        """dS -> the gradients g_0 of x_0 [BM, BN] and g_t of x_t [BM, RK, BN], and dd, that of dist2."""
        ds = p * (dpv - Dr[:, None])
        if DOT:
            g0 = scale * ds
            dd = ds
            gu = xu
        else:
            dd = (-0.5 * scale) * ds
            g0 = (-2.0 * lam) * dd
            gu = xu
            if HAS_UK:
                ck = tl.load(CK + (b * rk + offs_t[:, None]) * n + offs_n[None, :],
                             mask=(offs_t[:, None] < rk) & (offs_n[None, :] < n), other=0.0)
                gu = (2.0 * wk) * (xu - ck[None, :, :]) * dd[:, None, :]
        return g0, gu, dd

    @triton.jit
    def _content_fwd_kernel(QT, KT, UKT, CK, VX, RT, POS, LAM, QQ, KK, MASK, MIDS, OUT, MROW, ILROW,
                            n, H, d, rk, dv, smq, smb, scale, wk,
                            CAUSAL: tl.constexpr, SOURCE: tl.constexpr, DOT: tl.constexpr, TV: tl.constexpr,
                            HAS_UK: tl.constexpr, HAS_MASK: tl.constexpr, RK: tl.constexpr, HP: tl.constexpr,
                            BDV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        m0 = tl.program_id(1) * BM
        offs_m = m0 + tl.arange(0, BM)
        offs_h = tl.arange(0, HP)
        offs_t = tl.arange(0, RK)
        offs_dv = tl.arange(0, BDV)
        pos_i = tl.load(POS + b * n + offs_m, mask=offs_m < n, other=0.0)
        lam = tl.load(LAM + b)
        mask_ptr = MASK
        if HAS_MASK:
            mask_ptr = MASK + tl.load(MIDS + b).to(tl.int64) * smb
        m_i = tl.full((BM,), float("-inf"), tl.float32)
        l_i = tl.full((BM,), 0.0, tl.float32)
        acc_re = tl.full((BM, HP), 0.0, tl.float32)
        acc_im = tl.full((BM, HP), 0.0, tl.float32)
        acc = tl.full((BM, BDV), 0.0, tl.float32)
        hi = n
        if CAUSAL:
            hi = tl.minimum(n, m0 + BM)
        for n0 in range(0, hi, BN):
            offs_n = n0 + tl.arange(0, BN)
            dp = pos_i[:, None] - tl.load(POS + b * n + offs_n, mask=offs_n < n, other=0.0)[None, :]
            x0, xu, _unused = _products(QT, KT, UKT, VX, RT, QT, b, offs_m, offs_n, dp, n, H, d, rk, offs_t,
                                        SOURCE, HAS_UK, False, RK, BM, BN)
            sc = _scores(x0, xu, QQ, KK, CK, mask_ptr, b, lam, scale, wk, offs_m, offs_n, offs_t, n, rk, smq,
                         CAUSAL, DOT, HAS_UK, HAS_MASK)
            m_new = tl.maximum(m_i, _rmax(sc, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
            p = tl.exp(sc - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + _rsum(p, 1)
            m_i = m_new
            if TV:  # o_im = sum_j p_ij v_jm e^{i phi}: the angles again, pair by pair
                acc_re = acc_re * alpha[:, None]
                acc_im = acc_im * alpha[:, None]
                for m in range(0, H):
                    c, s = _angles(RT, b, m, H, n, offs_m, offs_n, dp, SOURCE)
                    vr = _col(VX, b, 2 * m, d, n, offs_n)
                    vi = _col(VX, b, 2 * m + 1, d, n, offs_n)
                    o_re = _rsum(p * (c * vr[None, :] - s * vi[None, :]), 1)
                    o_im = _rsum(p * (s * vr[None, :] + c * vi[None, :]), 1)
                    sel = offs_h[None, :] == m
                    acc_re += tl.where(sel, o_re[:, None], 0.0)
                    acc_im += tl.where(sel, o_im[:, None], 0.0)
            else:
                vmask = (offs_n[:, None] < n) & (offs_dv[None, :] < dv)
                v = tl.load(VX + (b * n + offs_n[:, None]) * dv + offs_dv[None, :], mask=vmask, other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        alive = l_i > 0.0  # a row that sees no key: output 0, and weights 0 in the backward (inverse sum 0)
        inv = tl.where(alive, 1.0 / tl.where(alive, l_i, 1.0), 0.0)
        rmask = offs_m < n
        tl.store(MROW + b * n + offs_m, tl.where(alive, m_i, 0.0), mask=rmask)
        tl.store(ILROW + b * n + offs_m, inv, mask=rmask)
        if TV:
            optr = OUT + (b * n + offs_m[:, None]) * d + 2 * offs_h[None, :]
            omask = rmask[:, None] & (offs_h[None, :] < H)
            tl.store(optr, acc_re * inv[:, None], mask=omask)
            tl.store(optr + 1, acc_im * inv[:, None], mask=omask)
        else:
            tl.store(OUT + (b * n + offs_m[:, None]) * dv + offs_dv[None, :], acc * inv[:, None],
                     mask=rmask[:, None] & (offs_dv[None, :] < dv))

    @triton.jit
    def _content_bwd_q_kernel(QT, KT, UKT, CK, VX, RT, POS, LAM, QQ, KK, MASK, MIDS, MROW, ILROW, DO, DR,
                              DQ, DRI, DQQ, DLAM, n, H, d, rk, dv, smq, smb, scale, wk,
                              CAUSAL: tl.constexpr, SOURCE: tl.constexpr, DOT: tl.constexpr, TV: tl.constexpr,
                              HAS_UK: tl.constexpr, HAS_MASK: tl.constexpr, RK: tl.constexpr,
                              HP: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """dq, the query's rate (mean rule), d|q|^2 and a partial dlam of one query block."""
        b = tl.program_id(0).to(tl.int64)
        pid_m = tl.program_id(1)
        m0 = pid_m * BM
        offs_m = m0 + tl.arange(0, BM)
        offs_h = tl.arange(0, HP)
        offs_t = tl.arange(0, RK)
        offs_dv = tl.arange(0, BDV)
        rmask = offs_m < n
        pos_i = tl.load(POS + b * n + offs_m, mask=rmask, other=0.0)
        mrow = tl.load(MROW + b * n + offs_m, mask=rmask, other=0.0)
        il = tl.load(ILROW + b * n + offs_m, mask=rmask, other=0.0)
        Dr = tl.load(DR + b * n + offs_m, mask=rmask, other=0.0)
        lam = tl.load(LAM + b)
        mask_ptr = MASK
        if HAS_MASK:
            mask_ptr = MASK + tl.load(MIDS + b).to(tl.int64) * smb
        do = tl.full((BM, BDV), 0.0, tl.float32)
        if not TV:
            do = tl.load(DO + (b * n + offs_m[:, None]) * dv + offs_dv[None, :],
                         mask=rmask[:, None] & (offs_dv[None, :] < dv), other=0.0)
        acc_qr = tl.full((BM, HP), 0.0, tl.float32)
        acc_qi = tl.full((BM, HP), 0.0, tl.float32)
        acc_w = tl.full((BM, HP), 0.0, tl.float32)
        dqq = tl.full((BM,), 0.0, tl.float32)
        dlam = tl.full((BM,), 0.0, tl.float32)
        hi = n
        if CAUSAL:
            hi = tl.minimum(n, m0 + BM)
        for n0 in range(0, hi, BN):
            offs_n = n0 + tl.arange(0, BN)
            dp = pos_i[:, None] - tl.load(POS + b * n + offs_n, mask=offs_n < n, other=0.0)[None, :]
            x0, xu, dpv = _products(QT, KT, UKT, VX, RT, DO, b, offs_m, offs_n, dp, n, H, d, rk, offs_t,
                                    SOURCE, HAS_UK, TV, RK, BM, BN)
            sc = _scores(x0, xu, QQ, KK, CK, mask_ptr, b, lam, scale, wk, offs_m, offs_n, offs_t, n, rk, smq,
                         CAUSAL, DOT, HAS_UK, HAS_MASK)
            p = tl.exp(sc - mrow[:, None]) * il[:, None]
            if not TV:
                vmask = (offs_n[:, None] < n) & (offs_dv[None, :] < dv)
                v = tl.load(VX + (b * n + offs_n[:, None]) * dv + offs_dv[None, :], mask=vmask, other=0.0)
                dpv = tl.dot(do, tl.trans(v), input_precision="ieee")
            g0, gu, dd = _grads_of_scores(sc, p, dpv, Dr, x0, xu, QQ, KK, CK, b, lam, scale, wk, offs_m, offs_n,
                                          offs_t, n, rk, DOT, HAS_UK)
            if not DOT:
                qq = tl.load(QQ + b * n + offs_m, mask=rmask, other=0.0)
                kk = tl.load(KK + b * n + offs_n, mask=offs_n < n, other=0.0)
                dlam += _rsum(dd * ((qq[:, None] + kk[None, :]) - 2.0 * x0), 1)
                dqq += lam * _rsum(dd, 1)
            for m in range(0, H):
                c, s = _angles(RT, b, m, H, n, offs_m, offs_n, dp, SOURCE)
                qr, qi = _turned(QT, b, m, d, n, offs_m, c, s)
                kr = _col(KT, b, 2 * m, d, n, offs_n)
                ki = _col(KT, b, 2 * m + 1, d, n, offs_n)
                GR = g0 * kr[None, :]
                GI = g0 * ki[None, :]
                dphi = -g0 * (qr * ki[None, :] + qi * kr[None, :])
                if HAS_UK:
                    ur, ui = _factor_pair(UKT, b, m, rk, d, n, offs_t, offs_n)
                    GR += _rsum(gu * ur[None, :, :], 1)
                    GI += _rsum(gu * ui[None, :, :], 1)
                    dphi -= _rsum(gu * (qr[:, None, :] * ui[None, :, :] + qi[:, None, :] * ur[None, :, :]), 1)
                if TV:
                    er, ei = _turned(DO, b, m, d, n, offs_m, c, s)
                    vr = _col(VX, b, 2 * m, d, n, offs_n)
                    vi = _col(VX, b, 2 * m + 1, d, n, offs_n)
                    dphi -= p * (er * vi[None, :] + ei * vr[None, :])
                sel = offs_h[None, :] == m
                acc_qr += tl.where(sel, _rsum(GR * c - GI * s, 1)[:, None], 0.0)
                acc_qi += tl.where(sel, _rsum(GR * s + GI * c, 1)[:, None], 0.0)
                if not SOURCE:
                    acc_w += tl.where(sel, (0.5 * _rsum(dp * dphi, 1))[:, None], 0.0)
        hmask = rmask[:, None] & (offs_h[None, :] < H)
        qptr = DQ + (b * n + offs_m[:, None]) * d + 2 * offs_h[None, :]
        tl.store(qptr, acc_qr, mask=hmask)
        tl.store(qptr + 1, acc_qi, mask=hmask)
        if not SOURCE:
            tl.store(DRI + (b * n + offs_m[:, None]) * H + offs_h[None, :], acc_w, mask=hmask)
        if not DOT:
            tl.store(DQQ + b * n + offs_m, dqq, mask=rmask)
        tl.store(DLAM + b * tl.num_programs(1) + pid_m, _rsum(dlam, 0))

    @triton.jit
    def _content_bwd_k_kernel(QT, KT, UKT, CK, VX, RT, POS, LAM, QQ, KK, MASK, MIDS, MROW, ILROW, DO, DR,
                              DKT, DUKT, DCK, DVX, DRJ, DKK, n, H, d, rk, dv, smq, smb, scale, wk,
                              CAUSAL: tl.constexpr, SOURCE: tl.constexpr, DOT: tl.constexpr, TV: tl.constexpr,
                              HAS_UK: tl.constexpr, HAS_MASK: tl.constexpr, RK: tl.constexpr,
                              HP: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """dk, dU_k, dv, the key's rate, d|k|^2 and dc of one key block."""
        b = tl.program_id(0).to(tl.int64)
        n0 = tl.program_id(1) * BN
        offs_n = n0 + tl.arange(0, BN)
        offs_h = tl.arange(0, HP)
        offs_t = tl.arange(0, RK)
        offs_dv = tl.arange(0, BDV)
        cmask = offs_n < n
        pos_j = tl.load(POS + b * n + offs_n, mask=cmask, other=0.0)
        lam = tl.load(LAM + b)
        mask_ptr = MASK
        if HAS_MASK:
            mask_ptr = MASK + tl.load(MIDS + b).to(tl.int64) * smb
        v = tl.full((BN, BDV), 0.0, tl.float32)
        if not TV:
            v = tl.load(VX + (b * n + offs_n[:, None]) * dv + offs_dv[None, :],
                        mask=cmask[:, None] & (offs_dv[None, :] < dv), other=0.0)
        acc_kr = tl.full((HP, BN), 0.0, tl.float32)
        acc_ki = tl.full((HP, BN), 0.0, tl.float32)
        acc_ur = tl.full((RK, HP, BN), 0.0, tl.float32)
        acc_ui = tl.full((RK, HP, BN), 0.0, tl.float32)
        acc_vr = tl.full((HP, BN), 0.0, tl.float32)
        acc_vi = tl.full((HP, BN), 0.0, tl.float32)
        acc_v = tl.full((BN, BDV), 0.0, tl.float32)
        acc_w = tl.full((HP, BN), 0.0, tl.float32)
        dkk = tl.full((BN,), 0.0, tl.float32)
        dck = tl.full((RK, BN), 0.0, tl.float32)
        lo = 0
        if CAUSAL:
            lo = (n0 // BM) * BM  # query blocks before the key block's first key see none of its keys
        for m0 in range(lo, n, BM):
            offs_m = m0 + tl.arange(0, BM)
            rmask = offs_m < n
            pos_i = tl.load(POS + b * n + offs_m, mask=rmask, other=0.0)
            mrow = tl.load(MROW + b * n + offs_m, mask=rmask, other=0.0)
            il = tl.load(ILROW + b * n + offs_m, mask=rmask, other=0.0)
            Dr = tl.load(DR + b * n + offs_m, mask=rmask, other=0.0)
            dp = pos_i[:, None] - pos_j[None, :]
            x0, xu, dpv = _products(QT, KT, UKT, VX, RT, DO, b, offs_m, offs_n, dp, n, H, d, rk, offs_t,
                                    SOURCE, HAS_UK, TV, RK, BM, BN)
            sc = _scores(x0, xu, QQ, KK, CK, mask_ptr, b, lam, scale, wk, offs_m, offs_n, offs_t, n, rk, smq,
                         CAUSAL, DOT, HAS_UK, HAS_MASK)
            p = tl.exp(sc - mrow[:, None]) * il[:, None]
            if not TV:
                do = tl.load(DO + (b * n + offs_m[:, None]) * dv + offs_dv[None, :],
                             mask=rmask[:, None] & (offs_dv[None, :] < dv), other=0.0)
                dpv = tl.dot(do, tl.trans(v), input_precision="ieee")
                acc_v += tl.dot(tl.trans(p), do, input_precision="ieee")
            g0, gu, dd = _grads_of_scores(sc, p, dpv, Dr, x0, xu, QQ, KK, CK, b, lam, scale, wk, offs_m, offs_n,
                                          offs_t, n, rk, DOT, HAS_UK)
            if not DOT:
                dkk += lam * _rsum(dd, 0)
                if HAS_UK:
                    dck -= _rsum(gu, 0)
            for m in range(0, H):
                c, s = _angles(RT, b, m, H, n, offs_m, offs_n, dp, SOURCE)
                qr, qi = _turned(QT, b, m, d, n, offs_m, c, s)
                kr = _col(KT, b, 2 * m, d, n, offs_n)
                ki = _col(KT, b, 2 * m + 1, d, n, offs_n)
                dphi = -g0 * (qr * ki[None, :] + qi * kr[None, :])
                sel = offs_h[:, None] == m
                acc_kr += tl.where(sel, _rsum(g0 * qr, 0)[None, :], 0.0)
                acc_ki -= tl.where(sel, _rsum(g0 * qi, 0)[None, :], 0.0)
                if HAS_UK:
                    ur, ui = _factor_pair(UKT, b, m, rk, d, n, offs_t, offs_n)
                    dphi -= _rsum(gu * (qr[:, None, :] * ui[None, :, :] + qi[:, None, :] * ur[None, :, :]), 1)
                    selu = offs_h[None, :, None] == m
                    acc_ur += tl.where(selu, _rsum(gu * qr[:, None, :], 0)[:, None, :], 0.0)
                    acc_ui -= tl.where(selu, _rsum(gu * qi[:, None, :], 0)[:, None, :], 0.0)
                if TV:
                    er, ei = _turned(DO, b, m, d, n, offs_m, c, s)
                    vr = _col(VX, b, 2 * m, d, n, offs_n)
                    vi = _col(VX, b, 2 * m + 1, d, n, offs_n)
                    dphi -= p * (er * vi[None, :] + ei * vr[None, :])
                    acc_vr += tl.where(sel, _rsum(p * er, 0)[None, :], 0.0)
                    acc_vi -= tl.where(sel, _rsum(p * ei, 0)[None, :], 0.0)
                dw = _rsum(dp * dphi, 0)
                if not SOURCE:
                    dw = 0.5 * dw
                acc_w += tl.where(sel, dw[None, :], 0.0)
        hmask = (offs_h[:, None] < H) & cmask[None, :]
        kptr = DKT + (b * d + 2 * offs_h[:, None]) * n + offs_n[None, :]
        tl.store(kptr, acc_kr, mask=hmask)
        tl.store(kptr + n, acc_ki, mask=hmask)
        tl.store(DRJ + (b * H + offs_h[:, None]) * n + offs_n[None, :], acc_w, mask=hmask)
        if TV:
            vptr = DVX + (b * d + 2 * offs_h[:, None]) * n + offs_n[None, :]
            tl.store(vptr, acc_vr, mask=hmask)
            tl.store(vptr + n, acc_vi, mask=hmask)
        else:
            tl.store(DVX + (b * n + offs_n[:, None]) * dv + offs_dv[None, :], acc_v,
                     mask=cmask[:, None] & (offs_dv[None, :] < dv))
        if not DOT:
            tl.store(DKK + b * n + offs_n, dkk, mask=cmask)
        if HAS_UK:
            umask = (offs_t[:, None, None] < rk) & hmask[None, :, :]
            uptr = DUKT + ((b * rk + offs_t[:, None, None]) * d + 2 * offs_h[None, :, None]) * n \
                + offs_n[None, None, :]
            tl.store(uptr, acc_ur, mask=umask)
            tl.store(uptr + n, acc_ui, mask=umask)
            tl.store(DCK + (b * rk + offs_t[:, None]) * n + offs_n[None, :], dck,
                     mask=(offs_t[:, None] < rk) & cmask[None, :])

    _bind_helpers()
