r"""Riemannian attention as Triton kernels for GPUs (private; needs the optional ``triton``).

:func:`riemannian_ref.attention.functional.riemannian_attention` calls
:func:`attention_flat` here for CUDA tensors when :func:`usable` says the
case is supported, and for every call inside the private
``functional._force_backend("triton")`` (the tests' way onto the kernels):
on CPU tensors they run under Triton's interpreter (``TRITON_INTERPRET=1``,
which must be set before ``triton`` is first imported: Triton reads it when a
kernel is defined, i.e. when this module is imported). The package imports
and works without ``triton``; this module is imported only on first use.

The algebra is that of :mod:`riemannian_ref.attention._blockwise`, written
per tile in the style of FlashAttention-2 :cite:`dao2023flashattention2`.
With ``w = 1`` (``1/2`` for each side of ``"mean"``), per-token factors
:math:`U_j` (keys) and :math:`V_i` (queries), and dropping the row constant
:math:`-\tfrac{\text{scale}\,\lambda}{2}|q_i|^2`,

.. math::
    s_{ij} = \text{scale}\,\lambda\,(q_i\cdot k_j - \tfrac12 |k_j|^2)
             - \tfrac{\text{scale}\,w}{2}\sum_t X_{t,ij}^2
             - \tfrac{\text{scale}\,w}{2}\sum_t Y_{t,ij}^2,\quad
    X_{t,ij} = q_i\cdot U_{j,t} - U_{j,t}\cdot k_j,\;
    Y_{t,ij} = V_{i,t}\cdot q_i - V_{i,t}\cdot k_j .

A tile gets every :math:`X_t` from ONE product of the query block with the
key block's factors stacked as ``r * BLOCK_N`` rows (row ``t * BLOCK_N + j``),
and every :math:`Y_t` from one product of the stacked query factors
(``r * BLOCK_M`` rows) with the key block; the sums over ``t`` are reductions
of the reshaped products. Shared metrics (``[..., d, r]``) are expanded to
per-token factors (the gradient sums back over the tokens through autograd),
so they cost ``r`` products per pair here, unlike the CPU operator, which folds
them into the isotropic part.

Forward: one program per (batch element, query block), online softmax in
base 2 (running maximum, rescaling), the output and the row log-sum-exp
stored. Backward: D = rowsum(dO * O) on the host, then one kernel per
(batch element, key block) for dK, dV, dU_k and a partial of dlam (summed on
the host), and one per (batch element, query block) for dQ and dU_q; both
recompute the tiles, every program owns the rows it writes (no atomics, the
result is deterministic).

Precision. Float32 inputs: every product in float32
(``input_precision="ieee"``, no TF32: the expanded distance cancels terms of
size :math:`|q|^2`). Float16/bfloat16 inputs: the matrix products run on the
GPU's matrix units, ``tl.dot`` on operands in the input dtype accumulated in
float32, as in FlashAttention's kernels :cite:`dao2023flashattention2`. Their
operands are the inputs themselves (q, k, v, the factors, dO), whose products
float32 holds exactly, and, rounded once to the input dtype, the
probabilities P (for P V and P^T dO) and the score gradients dS (alone and
times the rank products X, Y). The distance terms (:math:`|k_j|^2`,
:math:`U_{j,t}\cdot k_j`, :math:`V_{i,t}\cdot q_i` and their differences with
the products), the scores, the softmax, the log-sum-exp, D = rowsum(dO * O)
and every accumulator stay float32; the results are stored in the input
dtype. So the scores lose nothing to half precision (the cancelling terms are
float32 sums of exact products, and scale and lam multiply the float32 result,
never an operand); the online softmax's running maximum is taken on those
float32 scores. The backward uses each rounded dS on both sides of every
expanded difference and keeps the row constant's gradient, so its error
scales with :math:`|q_i - k_j|`, not with :math:`|q_i|` (see the kernels).
Float16's range bounds the rounded operands: a score gradient (times X or Y)
beyond 65504 overflows, as in FlashAttention's float16 backward.
Measured against the float64 reference: ``benchmarks/check_triton_precision.py``.

Masks follow the rule of the CPU operator: a float mask enters each row
relative to the row's largest visible entry, and a row whose largest entry is
at most ``-2**120`` (``finfo.min``) keeps its mask alone (SDPA's row
average). Grouped-query attention reads key head ``b // g`` for query head
``b``; the key/value kernel of a key head sums over its ``g`` query heads.

Not here (the caller keeps the PyTorch operator for these): dropout, float64,
a float mask that requires grad, double backward (raises, as the CPU
operator does), head dimensions above 256.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Optional, Sequence

import torch
from torch import Tensor

from ._validate import mask_row_max

try:  # optional: the package works without it
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - not installed (or a broken install): the CPU operator stays
    triton = None
    tl = None

__all__: list[str] = []  # private

HAS_TRITON = triton is not None
_LOG2E = 1.0 / math.log(2.0)
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def disabled_by_env() -> bool:
    """``RR_DISABLE_TRITON=1`` (or ``true``/``yes``) turns the Triton path off."""
    return os.environ.get("RR_DISABLE_TRITON", "").strip().lower() in ("1", "true", "yes", "on")


def interpreted() -> bool:
    """Whether this module's kernels run in Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return HAS_TRITON and type(_fwd_kernel).__name__ == "InterpretedFunction"


def unsupported_reason(query: Tensor, value: Tensor, attn_mask: Tensor | None, U_q, U_k) -> str | None:
    """Why the Triton kernels cannot run this (validated) call, or None when they can."""
    if not HAS_TRITON:
        return "triton is not installed"
    if query.dtype not in SUPPORTED_DTYPES:
        return f"dtype {query.dtype} (the kernels take float16, bfloat16 and float32)"
    if query.shape[-1] > MAX_HEAD_DIM or value.shape[-1] > MAX_HEAD_DIM:
        return f"head dimension above {MAX_HEAD_DIM}"
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.requires_grad:
        return "a float attn_mask that requires grad (its gradient is not computed by the kernels)"
    if query.device.type != "cuda" and not interpreted():
        return "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported)"
    return None


def usable(query: Tensor, value: Tensor, attn_mask: Tensor | None, U_q, U_k) -> bool:
    """The dispatch rule of ``riemannian_attention``: CUDA tensors, triton present, not disabled, supported."""
    return (query.device.type == "cuda" and not disabled_by_env()
            and unsupported_reason(query, value, attn_mask, U_q, U_k) is None)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def default_blocks(d: int, dv: int, rk: int, rq: int) -> tuple[int, int]:
    """Query and key block sizes (powers of two, 16 to 64), smaller as the head dimension and the rank grow.

    Not tuned on a GPU (none was at hand): chosen from the shared memory that
    Triton 3.9 reports when it compiles the kernels for sm_80 and sm_90
    without one (the rule keeps the stacked factor blocks at 4096 entries;
    on sm_90 at most 144 KiB for float32 and 53 KiB for bfloat16 at d = 64,
    r = 2, 132 and 36 KiB at d = 128, r = 2: half operands need less).
    A GPU with less shared memory gets smaller blocks at launch
    (:func:`_fitting_blocks`).
    """
    bd = max(_pow2(d), _pow2(dv))
    RK, RQ = _pow2(max(rk, 1), 1), _pow2(max(rq, 1), 1)
    bm = max(16, min(64, 4096 // bd, 8192 // (RQ * bd)))
    bn = max(16, min(64, 4096 // (RK * bd)))
    return bm, bn


def _check_blocks(blocks) -> tuple[int, int]:
    ok = (isinstance(blocks, (tuple, list)) and len(blocks) == 2
          and all(isinstance(b, int) and b >= 16 and b & (b - 1) == 0 for b in blocks))
    if not ok:
        raise ValueError(f"block_sizes for the Triton kernels must be two powers of two >= 16, got {blocks!r}")
    return int(blocks[0]), int(blocks[1])


def _flat(x: Tensor, batch: torch.Size, tail: int) -> Tensor:
    t = x.shape[x.dim() - tail:]
    return x.expand(*batch, *t).reshape(math.prod(batch), *t)


def _stacked_factors(U: Tensor | None, per_token: bool, n: int, batch: torch.Size) -> Tensor | None:
    """Metric factors as (Bf, r, n, d), contiguous: the kernels read ``U[b, t, j, :]`` as one row."""
    if U is None or U.shape[-1] == 0:
        return None
    if not per_token:  # a shared metric: the same factor for every token (autograd sums its gradient back)
        U = U.unsqueeze(-3).expand(*U.shape[:-2], n, *U.shape[-2:])
    return _flat(U, batch, 3).permute(0, 3, 1, 2).contiguous()


def _mask_rows(attn_mask: Tensor, batch: torch.Size, is_causal: bool, n_q: int, n_k: int):
    """The mask as (Mb, 1|n_q, 1|n_k), the mask row of every flat batch element (never expanded to the batch),
    and for a float mask its row offsets (Mb, 1|n_q) in float32 (``mask_row_max``; None for a bool mask)."""
    m = attn_mask
    for dim in range(m.dim() - 2):  # a batch dimension of stride 0 (an expanded mask) is read once
        if m.stride(dim) == 0:
            m = m.narrow(dim, 0, 1)
    mb = m.shape[:-2]
    flat = m.reshape(-1, *m.shape[-2:]).contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.int8)
    ids = torch.arange(flat.shape[0], device=m.device).view(mb).expand(batch).reshape(-1)
    rows = None
    if flat.dtype != torch.int8:  # each row enters relative to its largest visible entry (see _scores)
        rows = mask_row_max(flat, is_causal, n_q, n_k).float().contiguous()
    return flat, ids.to(torch.int32).contiguous(), rows


def attention_flat(query, key, value, attn_mask, is_causal, scale, U_q, U_k, lam_t, metric_side, per_q, per_k,
                   batch, blocks=None, kv_group: int = 1):
    """The Triton path for a validated call (the arguments as ``check_attention_inputs`` returns them).

    ``kv_group`` g > 1: grouped-query views (``group_heads``), the batch
    ``[..., h_kv, g]`` and the key side ``[..., h_kv, 1]``: batch element ``b``
    reads key head ``b // g`` in the kernels, the key heads are not repeated.
    """
    n_q, n_k, d, dv = query.shape[-2], key.shape[-2], query.shape[-1], value.shape[-1]
    w = 0.5 if metric_side == "mean" else 1.0
    # the key side keeps its heads unless its metric factors were given per query head
    g = kv_group if kv_group > 1 and (U_k is None or U_k.shape[-4 if per_k else -3] == 1) else 1
    kv_batch = (*batch[:-1], 1) if g > 1 else batch
    qf = _flat(query, batch, 2).contiguous()
    kf, vf = (_flat(t, kv_batch, 2).contiguous() for t in (key, value))
    lamf = lam_t.expand(batch).reshape(-1).contiguous()
    Ukt = _stacked_factors(U_k, per_k, n_k, kv_batch)
    Uqt = _stacked_factors(U_q, per_q, n_q, batch)
    rk = Ukt.shape[1] if Ukt is not None else 0
    rq = Uqt.shape[1] if Uqt is not None else 0
    blocks = default_blocks(d, dv, rk, rq) if blocks is None else _check_blocks(blocks)
    mflat, mids, mrows = _mask_rows(attn_mask, batch, is_causal, n_q, n_k) if attn_mask is not None else (None,) * 3
    fn = _TracedTritonAttentionFn if torch.compiler.is_compiling() else _TritonAttentionFn
    out = fn.apply(qf, kf, vf, lamf, Ukt, Uqt, mflat, mids, mrows, bool(is_causal), float(scale), w, blocks, g)
    return out.view(*batch, n_q, dv)


class _TritonAttentionFn(torch.autograd.Function):
    """Forward and backward on the Triton kernels; inputs flattened over the batch (Bf).

    q (Bf, n_q, d), k (Bk, n_k, d), v (Bk, n_k, dv), lam (Bf,), Ukt (Bk, rk, n_k, d)
    or None, Uqt (Bf, rq, n_q, d) or None, mask (Mb, 1|n_q, 1|n_k) int8 (bool) or
    float, with mask_ids (Bf,) int32, the mask row of every batch element, and
    mask_rows (Mb, 1|n_q) float32 (a float mask's row offsets) or None;
    ``group`` g: batch element ``b`` reads key row ``b // g`` (``Bk = Bf / g``).
    Saved for the backward: the inputs, the output and the row log-sum-exp
    (base 2, float32), nothing pairwise.
    """

    @staticmethod
    def forward(ctx, q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, causal, scale, w, blocks, group):
        Bf, n_q = q.shape[:2]
        dv = v.shape[2]
        out = torch.empty(Bf, n_q, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(Bf, n_q, dtype=torch.float32, device=q.device)

        def launch(blocks):
            a = _kernel_args(q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, causal, scale, w, blocks, group)
            _fwd_kernel[(Bf, triton.cdiv(n_q, blocks[0]))](q, k, v, lam, a["uk"], a["uq"], a["mask"], a["mids"],
                                                           a["mrow"], out, lse, *a["sizes"], *a["strides"],
                                                           a["scale"], a["w"], a["G"], **a["const"])

        with _device_of(q):
            blocks = _fitting_blocks(launch, blocks)
        ctx.save_for_backward(q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, out, lse)
        ctx.consts = (causal, scale, w, blocks, group)
        return out

    @staticmethod
    def backward(ctx, dout):
        _refuse_double_backward()
        q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, out, lse = ctx.saved_tensors
        causal, scale, w, blocks, group = ctx.consts
        Bf, n_q, d = q.shape
        n_k = k.shape[1]
        dout = dout.contiguous()
        Dr = (dout.float() * out.float()).sum(-1).contiguous()  # rowsum(dO * O), float32
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dUk = torch.empty_like(Ukt) if Ukt is not None else None
        dUq = torch.empty_like(Uqt) if Uqt is not None else None
        dlam_part = []

        def args(blocks):
            a = _kernel_args(q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, causal, scale, w, blocks, group)
            common = (q, k, v, lam, a["uk"], a["uq"], a["mask"], a["mids"], a["mrow"], dout, lse, Dr)
            tail = (*a["sizes"], *a["strides"], a["scale"], a["w"], a["G"])
            return common, tail, a["const"]

        def launch_dkdv(blocks):
            common, tail, const = args(blocks)
            nkb = triton.cdiv(n_k, blocks[1])
            part = torch.empty(Bf, nkb, dtype=torch.float32, device=q.device)
            _bwd_dkdv_kernel[(k.shape[0], nkb)](*common, dk, dv, dUk if dUk is not None else dk, part, *tail, **const)
            dlam_part[:] = [part]

        def launch_dq(blocks):
            common, tail, const = args(blocks)
            _bwd_dq_kernel[(Bf, triton.cdiv(n_q, blocks[0]))](*common, dq, dUq if dUq is not None else dq, *tail,
                                                              **const)

        with _device_of(q):
            _fitting_blocks(launch_dkdv, blocks)
            _fitting_blocks(launch_dq, blocks)
        dlam = dlam_part[0].sum(-1).to(lam.dtype) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dlam, dUk, dUq, None, None, None, None, None, None, None, None


# --------------------------------------------------------------- the kernels as custom ops, for torch.compile
# Traced code (torch.compile, torch.export) calls the kernels through these ops, which the graph records as
# single nodes (fake implementations give the shapes; the autograd formula calls the backward op), so a
# compiled model keeps them in one graph; eager calls use _TritonAttentionFn itself. Same code either way.
@torch.library.custom_op("riemannian_ref::triton_attention", mutates_args=())
def _triton_attention(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, Ukt: Optional[Tensor], Uqt: Optional[Tensor],
                      mask: Optional[Tensor], mask_ids: Optional[Tensor], mask_rows: Optional[Tensor], causal: bool,
                      scale: float, w: float, blocks: Sequence[int], group: int) -> tuple[Tensor, Tensor]:
    """The kernels' forward: (output (Bf, n_q, dv), row log-sum-exp in base 2, float32 (Bf, n_q))."""
    from ._op import _Ctx

    ctx = _Ctx()
    out = _TritonAttentionFn.forward(ctx, q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, causal, scale, w,
                                     tuple(blocks), group)
    return out, ctx.saved_tensors[10]


@_triton_attention.register_fake
def _triton_attention_fake(q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, causal, scale, w, blocks, group):
    return (q.new_empty(q.shape[0], q.shape[1], v.shape[2]),
            q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32))


@torch.library.custom_op("riemannian_ref::triton_attention_backward", mutates_args=())
def _triton_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, Ukt: Optional[Tensor],
                               Uqt: Optional[Tensor], mask: Optional[Tensor], mask_ids: Optional[Tensor],
                               mask_rows: Optional[Tensor], out: Tensor, lse: Tensor, causal: bool, scale: float,
                               w: float, blocks: Sequence[int], group: int, need_lam: bool) -> list[Tensor]:
    """Gradients ``[dq, dk, dv, dlam, dUk, dUq]``; an empty tensor where there is none."""
    from ._op import _Ctx

    ctx = _Ctx((q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, out, lse),
               (causal, scale, w, tuple(blocks), group), (True, True, True, need_lam))
    with torch.no_grad():
        grads = _TritonAttentionFn.backward(ctx, dout)[:6]
    return [g if g is not None else q.new_empty(0) for g in grads]


@_triton_attention_backward.register_fake
def _triton_attention_backward_fake(dout, q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, out, lse, causal,
                                    scale, w, blocks, group, need_lam):
    def like(t, need=True):
        return torch.empty_like(t) if need and t is not None else q.new_empty(0)

    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), like(lam, need_lam), like(Ukt),
            like(Uqt)]


def _triton_setup_context(ctx, inputs, output):
    q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, causal, scale, w, blocks, group = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, out, lse)
    ctx.consts = (causal, scale, w, tuple(blocks), group)
    ctx.need_lam = ctx.needs_input_grad[3]
    ctx.mark_non_differentiable(lse)


def _triton_backward(ctx, dout, dlse):
    _refuse_double_backward()
    q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, out, lse = ctx.saved_tensors
    causal, scale, w, blocks, group = ctx.consts
    g = _triton_attention_backward(dout, q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, out, lse, causal,
                                   scale, w, list(blocks), group, ctx.need_lam)
    present = (True, True, True, ctx.need_lam, Ukt is not None, Uqt is not None)
    return (*[t if p else None for t, p in zip(g, present)], *([None] * 8))


_triton_attention.register_autograd(_triton_backward, setup_context=_triton_setup_context)


class _TracedTritonAttentionFn:
    """``_TritonAttentionFn`` for a trace: ``apply`` takes the same arguments and calls the custom op."""

    @staticmethod
    def apply(q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, causal, scale, w, blocks, group) -> Tensor:
        return _triton_attention(q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, causal, scale, w, list(blocks),
                                 group)[0]


def _refuse_double_backward() -> None:
    """The kernels' backward is not differentiable: backward(create_graph=True) gets a RuntimeError saying so."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "riemannian_attention: the Triton kernels have no double backward (create_graph=True, e.g. a "
            "gradient penalty); use riemannian_ref.attention.riemannian_attention_reference, the dense path, "
            "for that (or set RR_DISABLE_TRITON=1 for the PyTorch operator, which has none either)")


def _device_of(t: Tensor):
    """Triton launches on the current CUDA device: make it the tensors' (cuda:1 while cuda:0 is current)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _fitting_blocks(launch, blocks: tuple[int, int]) -> tuple[int, int]:
    """``launch(blocks)``, halving the larger block while the GPU lacks shared memory or registers for it.

    Returns the blocks that ran. The default blocks are a guess (no GPU was
    at hand to tune them); a smaller GPU than the one they suit still runs.
    """
    while True:
        try:
            launch(blocks)
            return blocks
        except triton.runtime.errors.OutOfResources:
            if max(blocks) <= 16:
                raise
            bm, bn = blocks
            blocks = (bm // 2, bn) if bm >= bn else (bm, bn // 2)


def _kernel_args(q, k, v, lam, Ukt, Uqt, mask, mask_ids, mask_rows, causal, scale, w, blocks, group):
    """The kernels' common arguments: sizes, mask strides, constants (the last-dim strides are 1)."""
    n_q, d = q.shape[1:]
    n_k, dv = k.shape[1], v.shape[2]
    rk = Ukt.shape[1] if Ukt is not None else 0
    rq = Uqt.shape[1] if Uqt is not None else 0
    if mask is not None:
        mq, mk = mask.shape[-2:]
        smq, smk, smb = (mk if mq > 1 else 0), (1 if mk > 1 else 0), mq * mk
        kind = 1 if mask.dtype == torch.int8 else 2
    else:
        smq = smk = smb = 0
        kind = 0
    # a float mask's row offsets (Mb, 1|n_q): row stride, and stride per distinct mask
    smr, smrb = ((1 if mask_rows.shape[-1] > 1 else 0), mask_rows.shape[-1]) if mask_rows is not None else (0, 0)
    BM, BN = blocks
    # LOWP: half inputs (half products, see the kernels); EMU: bfloat16 in the interpreter, which has no
    # bfloat16 product (the same numbers in float32)
    const = dict(CAUSAL=bool(causal), MASK_KIND=kind, HAS_UK=rk > 0, HAS_UQ=rq > 0,
                 RK=_pow2(max(rk, 1), 1), RQ=_pow2(max(rq, 1), 1), BM=BM, BN=BN, BD=_pow2(d), BDV=_pow2(dv),
                 LOWP=q.dtype != torch.float32, EMU=q.dtype == torch.bfloat16 and interpreted())
    return dict(uk=Ukt if Ukt is not None else q, uq=Uqt if Uqt is not None else q,
                mask=mask if mask is not None else q, mids=mask_ids if mask_ids is not None else lam,
                mrow=mask_rows if mask_rows is not None else lam, sizes=(n_q, n_k, d, dv, rk, rq),
                strides=(smq, smk, smb, smr, smrb), scale=float(scale), w=float(w), G=int(group), const=const)


if HAS_TRITON:
    # The kernels call only builtins of triton.language and this module's jit functions: the sums and
    # maxima are tl.reduce with the combine functions of tl.sum and tl.max themselves (what those two
    # compile to), not tl.sum/tl.max, which are jit functions of triton's library, defined when triton
    # was imported. Triton's interpreter then works even if triton was imported before TRITON_INTERPRET=1
    # was set (torch._dynamo imports triton when it is installed), as long as THIS module is imported
    # after, and it still reduces with numpy (it recognises these two combine functions).

    @triton.jit
    def _rsum(x, axis: tl.constexpr):
        return tl.reduce(x, axis, tl.standard._sum_combine)

    @triton.jit
    def _rmax(x, axis: tl.constexpr):
        return tl.reduce(x, axis, tl.standard._elementwise_max)

    @triton.jit
    def _load_rows(ptr, rows, n_rows, row_stride, offs_c, n_cols):
        """A block of rows ``rows`` (masked to n_rows) and columns ``offs_c`` (masked to n_cols), in its dtype."""
        msk = (rows[:, None] < n_rows) & (offs_c[None, :] < n_cols)
        return tl.load(ptr + rows[:, None].to(tl.int64) * row_stride + offs_c[None, :], mask=msk, other=0.0)

    @triton.jit
    def _load_stacked(ptr, r, n, d, blk0, offs_d, R: tl.constexpr, BLK: tl.constexpr):
        """Factors (r, n, d) of tokens blk0 .. blk0+BLK stacked as (R * BLK, d): row t * BLK + j is U[t, blk0+j]."""
        offs = tl.arange(0, R * BLK)
        t = offs // BLK
        j = blk0 + offs % BLK
        msk = (t[:, None] < r) & (j[:, None] < n) & (offs_d[None, :] < d)
        return tl.load(ptr + (t[:, None] * n + j[:, None]).to(tl.int64) * d + offs_d[None, :], mask=msk,
                       other=0.0)

    # Matrix products. Their operands are the inputs as loaded (float16/bfloat16/float32) and, among the
    # computed tiles, only the probabilities P and the score gradients dS (alone or times a rank product X or
    # Y), rounded to the inputs' dtype: _rnd. Everything else (|k|^2, U.k, V.q, the scores, the softmax, the
    # log-sum-exp, the accumulators) is float32. EMU (bfloat16 in Triton's interpreter, which has no bfloat16
    # product and truncates its bfloat16 casts) computes the same numbers in float32: the operands are the
    # float32 values of the bfloat16 ones (rounded to nearest even, as a GPU rounds) and a product of two of
    # them is exact in float32, as it is in the tensor cores, which accumulate in float32.

    @triton.jit
    def _mm(a, b):
        """a @ b accumulated in float32: tensor cores for half operands, float32 operands exactly (no TF32)."""
        return tl.dot(a, b, input_precision="ieee")

    @triton.jit
    def _opnd(x, EMU: tl.constexpr):
        """An input block as a product operand: as loaded (float32 under EMU)."""
        if EMU:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _rnd(x, DT: tl.constexpr, EMU: tl.constexpr):
        """A float32 block rounded to the inputs' dtype DT (to nearest even): a product operand or a result."""
        if EMU:  # bfloat16's rounding on the float32 bits (finite values; +-inf stay)
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        else:
            x = x.to(DT)
        return x

    @triton.jit
    def _factor_rows(X, U, b, blk0, n, d, r, x, offs_d, HAS_U: tl.constexpr, R: tl.constexpr,
                     BLK: tl.constexpr, EMU: tl.constexpr):
        """A block's factors stacked as (R * BLK, d) (product operands), its rows repeated alike (float32), and
        the products U_{t,j} . x_j of each stacked row (float32); ``x`` (the block's operand rows) where it has
        no factors."""
        u = x
        xr = x
        ux = x
        if HAS_U:
            u = _opnd(_load_stacked(U + b * r * n * d, r, n, d, blk0, offs_d, R, BLK), EMU)
            xr = _load_rows(X + b * n * d, blk0 + tl.arange(0, R * BLK) % BLK, n, d, offs_d, d).to(tl.float32)
            ux = _rsum(u.to(tl.float32) * xr, 1)
        return u, xr, ux

    @triton.jit
    def _mask_base(MASK, MIDS, b, smb, MASK_KIND: tl.constexpr):
        """Where batch element b's mask starts (masks are stored once per distinct mask, MIDS maps to them)."""
        mask_ptr = MASK
        if MASK_KIND != 0:
            mask_ptr = MASK + tl.load(MIDS + b).to(tl.int64) * smb
        return mask_ptr

    @triton.jit
    def _key_tile(K, V, UK, b, n0, n_k, d, dv, rk, offs_d, offs_dv, HAS_UK: tl.constexpr, RK: tl.constexpr,
                  BN: tl.constexpr, EMU: tl.constexpr):
        """Keys, values and stacked key factors (operands) of the key block at n0, |k_j|^2 and U_{t,j} . k_j."""
        offs_n = n0 + tl.arange(0, BN)
        k = _opnd(_load_rows(K + b * n_k * d, offs_n, n_k, d, offs_d, d), EMU)
        v = _opnd(_load_rows(V + b * n_k * dv, offs_n, n_k, dv, offs_dv, dv), EMU)
        kf = k.to(tl.float32)
        uk, kr, uk_k = _factor_rows(K, UK, b, n0, n_k, d, rk, k, offs_d, HAS_UK, RK, BN, EMU)
        return offs_n, k, v, uk, _rsum(kf * kf, 1), uk_k

    @triton.jit
    def _scores(q, k, kk, uk, uk_k, uq, uq_q, lam, scale, w, offs_m, offs_n, n_q, n_k, mask_ptr, smq, smk,
                mrow_ptr, smr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_UK: tl.constexpr,
                HAS_UQ: tl.constexpr, RK: tl.constexpr, RQ: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """Scores of a tile in base 2 (masked: -inf), with the rank products X (BM, RK*BN) and Y (RQ*BM, BN).

        ``q``, ``k`` are operand blocks, ``kk`` = |k_j|^2; ``uk`` (RK*BN, BD)
        are the key block's factors stacked (operands), ``uk_k`` their
        products with their keys; ``uq``/``uq_q`` the same for the query block
        (RQ*BM rows). Every product here multiplies two inputs, which float32
        holds exactly (half operands), and the cancelling terms |k_j|^2/2
        against q_i . k_j and U.k against q.U stay float32 sums of float32
        products: half inputs cost the scores nothing.
        """
        qk = _mm(q, tl.trans(k))
        s = (scale * lam) * (qk - 0.5 * kk[None, :])
        X = qk
        Y = qk
        if HAS_UK:
            X = _mm(q, tl.trans(uk)) - uk_k[None, :]
            X3 = tl.reshape(X, (BM, RK, BN))
            s -= (0.5 * scale * w) * _rsum(X3 * X3, 1)
        if HAS_UQ:
            Y = uq_q[:, None] - _mm(uq, tl.trans(k))
            Y3 = tl.reshape(Y, (RQ, BM, BN))
            s -= (0.5 * scale * w) * _rsum(Y3 * Y3, 0)
        valid = offs_n[None, :] < n_k
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        inb = (offs_m[:, None] < n_q) & (offs_n[None, :] < n_k)
        mptr = mask_ptr + offs_m[:, None].to(tl.int64) * smq + offs_n[None, :].to(tl.int64) * smk
        if MASK_KIND == 1:
            valid = valid & (tl.load(mptr, mask=inb, other=0) != 0)
        if MASK_KIND == 2:
            # each row relative to its largest visible entry c_i (a row constant); a row whose c_i is at most
            # -2**120 (DOMINANT_MASK: finfo.min) keeps its mask only, as SDPA's sum s + m rounds to m there
            mv = tl.load(mptr, mask=inb, other=float("-inf")).to(tl.float32)  # outside the tile: no key
            c = tl.load(mrow_ptr + offs_m.to(tl.int64) * smr, mask=offs_m < n_q, other=0.0)
            mv = mv - c[:, None]
            s = tl.where(c[:, None] <= -1.329227995784916e36, mv, s + mv)
            # finite entries far below the row's maximum weigh 0 either way, and those above it are causally
            # hidden: keep s * log2(e) finite
            s = tl.where(s == float("-inf"), s, tl.minimum(tl.maximum(s, -1.0e38), 1.0e38))
        s = tl.where(valid, s * 1.4426950408889634, float("-inf"))
        return s, X, Y

    @triton.jit
    def _fwd_kernel(Q, K, V, LAM, UK, UQ, MASK, MIDS, MROW, OUT, LSE,
                    n_q, n_k, d, dv, rk, rq, smq, smk, smb, smr, smrb, scale, w, G,
                    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_UK: tl.constexpr, HAS_UQ: tl.constexpr,
                    RK: tl.constexpr, RQ: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BD: tl.constexpr, BDV: tl.constexpr, LOWP: tl.constexpr, EMU: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        kb = b // G  # the key head this query head reads (grouped-query attention)
        m0 = tl.program_id(1) * BM
        offs_m = m0 + tl.arange(0, BM)
        offs_d = tl.arange(0, BD)
        offs_dv = tl.arange(0, BDV)
        q = _opnd(_load_rows(Q + b * n_q * d, offs_m, n_q, d, offs_d, d), EMU)
        lam = tl.load(LAM + b).to(tl.float32)
        mask_ptr = _mask_base(MASK, MIDS, b, smb, MASK_KIND)
        mrow_ptr = _mask_base(MROW, MIDS, b, smrb, MASK_KIND)
        uq, qr, uq_q = _factor_rows(Q, UQ, b, m0, n_q, d, rq, q, offs_d, HAS_UQ, RQ, BM, EMU)
        m_i = tl.full((BM,), float("-inf"), tl.float32)
        l_i = tl.full((BM,), 0.0, tl.float32)
        acc = tl.full((BM, BDV), 0.0, tl.float32)
        hi = n_k
        if CAUSAL:
            hi = tl.minimum(n_k, m0 + BM)
        for n0 in range(0, hi, BN):
            offs_n, k, v, uk, kk, uk_k = _key_tile(K, V, UK, kb, n0, n_k, d, dv, rk, offs_d, offs_dv, HAS_UK, RK,
                                                   BN, EMU)
            s, X, Y = _scores(q, k, kk, uk, uk_k, uq, uq_q, lam, scale, w, offs_m, offs_n, n_q, n_k, mask_ptr, smq,
                              smk, mrow_ptr, smr, CAUSAL, MASK_KIND, HAS_UK, HAS_UQ, RK, RQ, BM, BN)
            m_new = tl.maximum(m_i, _rmax(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + _rsum(p, 1)  # from the float32 p (FlashAttention's order)
            acc = acc * alpha[:, None] + _mm(_rnd(p, Q.dtype.element_ty, EMU), v)
            m_i = m_new
        alive = l_i > 0.0  # rows that see no key: output 0, lse +inf (their weights are 0 in the backward)
        out = acc / tl.where(alive, l_i, 1.0)[:, None]
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        lse = tl.where(alive, m_fin + tl.log2(tl.where(alive, l_i, 1.0)), float("inf"))
        omask = (offs_m[:, None] < n_q) & (offs_dv[None, :] < dv)
        tl.store(OUT + b * n_q * dv + offs_m[:, None].to(tl.int64) * dv + offs_dv[None, :],
                 _rnd(out, OUT.dtype.element_ty, EMU).to(OUT.dtype.element_ty), mask=omask)
        tl.store(LSE + b * n_q + offs_m, lse, mask=offs_m < n_q)

    # The backward's half products round dS (and dS X, dS Y) once and use the rounded values on both sides of
    # each difference the expanded form takes: dk_j = scale lam (sum_i dS_ij q_i - (sum_i dS_ij) k_j) sums the
    # same dS_ij in both terms, so the rounding's error is that of sum_i dS_ij (q_i - k_j), of the size of
    # |q_i - k_j|, not of |q_i| and |k_j| (the same for dU_k, dU_q with X, Y). With half inputs (LOWP) the
    # isotropic row constant -scale lam |q_i|^2 / 2, whose gradient terms cancel when sum_j dS_ij = 0, is kept
    # in dq and dlam: rounded, and with D = rowsum(dO * O) from the output as stored, sum_j dS_ij is not 0 to
    # half precision, and dropping the term would leave an error growing with |q_i| (translation invariance).
    # Float32 inputs run the float32 kernels as before (no rounding, the row constant dropped).

    @triton.jit
    def _bwd_dkdv_kernel(Q, K, V, LAM, UK, UQ, MASK, MIDS, MROW, DO, LSE, DR, DK, DV, DUK, DLAM,
                         n_q, n_k, d, dv, rk, rq, smq, smk, smb, smr, smrb, scale, w, G,
                         CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_UK: tl.constexpr,
                         HAS_UQ: tl.constexpr, RK: tl.constexpr, RQ: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, LOWP: tl.constexpr,
                         EMU: tl.constexpr):
        # one program per (key head kb, key block): it sums over the G query heads b = kb G + g that read kb
        kb = tl.program_id(0).to(tl.int64)
        pid_n = tl.program_id(1)
        n0 = pid_n * BN
        offs_n = n0 + tl.arange(0, BN)
        offs_d = tl.arange(0, BD)
        offs_dv = tl.arange(0, BDV)
        DT = Q.dtype.element_ty
        k = _opnd(_load_rows(K + kb * n_k * d, offs_n, n_k, d, offs_d, d), EMU)
        v = _opnd(_load_rows(V + kb * n_k * dv, offs_n, n_k, dv, offs_dv, dv), EMU)
        kf = k.to(tl.float32)
        kk = _rsum(kf * kf, 1)
        uk, kr, uk_k = _factor_rows(K, UK, kb, n0, n_k, d, rk, k, offs_d, HAS_UK, RK, BN, EMU)
        dk = tl.full((BN, BD), 0.0, tl.float32)
        acc_dv = tl.full((BN, BDV), 0.0, tl.float32)
        acc_du = tl.full((RK * BN, BD), 0.0, tl.float32)  # sum_i dS_ij X_t,ij q_i
        cx = tl.full((RK * BN,), 0.0, tl.float32)  # sum_i dS_ij X_t,ij
        acc_y = tl.full((BN, BD), 0.0, tl.float32)  # sum_{i,t} dS_ij Y_t,ij V_i,t
        lo = 0
        if CAUSAL:
            lo = n0  # queries before the block's first key see none of its keys
        for gi in range(0, G):
            b = kb * G + gi
            lam = tl.load(LAM + b).to(tl.float32)
            mask_ptr = _mask_base(MASK, MIDS, b, smb, MASK_KIND)
            mrow_ptr = _mask_base(MROW, MIDS, b, smrb, MASK_KIND)
            acc_g = tl.full((BN, BD), 0.0, tl.float32)  # sum_i dS_ij q_i (this query head: its own lam)
            colsum = tl.full((BN,), 0.0, tl.float32)  # sum_i dS_ij
            colq = tl.full((BN,), 0.0, tl.float32)  # sum_i dS_ij |q_i|^2 (LOWP: the row constant's part of dlam)
            for m0 in range(lo, n_q, BM):
                offs_m = m0 + tl.arange(0, BM)
                q = _opnd(_load_rows(Q + b * n_q * d, offs_m, n_q, d, offs_d, d), EMU)
                do = _opnd(_load_rows(DO + b * n_q * dv, offs_m, n_q, dv, offs_dv, dv), EMU)
                lse = tl.load(LSE + b * n_q + offs_m, mask=offs_m < n_q, other=float("inf"))
                Dr = tl.load(DR + b * n_q + offs_m, mask=offs_m < n_q, other=0.0)
                uq, qr, uq_q = _factor_rows(Q, UQ, b, m0, n_q, d, rq, q, offs_d, HAS_UQ, RQ, BM, EMU)
                s, X, Y = _scores(q, k, kk, uk, uk_k, uq, uq_q, lam, scale, w, offs_m, offs_n, n_q, n_k, mask_ptr,
                                  smq, smk, mrow_ptr, smr, CAUSAL, MASK_KIND, HAS_UK, HAS_UQ, RK, RQ, BM, BN)
                p = tl.exp2(s - lse[:, None])
                acc_dv += _mm(tl.trans(_rnd(p, DT, EMU)), do)
                dp = _mm(do, tl.trans(v))
                ds_op = _rnd(p * (dp - Dr[:, None]), DT, EMU)
                ds = ds_op.to(tl.float32)  # the values the products see
                acc_g += _mm(tl.trans(ds_op), q)
                colsum += _rsum(ds, 0)
                if LOWP:
                    qf = q.to(tl.float32)
                    colq += _rsum(ds * _rsum(qf * qf, 1)[:, None], 0)
                if HAS_UK:
                    dsx = _rnd(tl.reshape(ds[:, None, :] * tl.reshape(X, (BM, RK, BN)), (BM, RK * BN)), DT, EMU)
                    acc_du += _mm(tl.trans(dsx), q)
                    cx += _rsum(dsx.to(tl.float32), 0)
                if HAS_UQ:
                    dsy = _rnd(tl.reshape(ds[None, :, :] * tl.reshape(Y, (RQ, BM, BN)), (RQ * BM, BN)), DT, EMU)
                    acc_y += _mm(tl.trans(dsy), uq)
            dk += (scale * lam) * (acc_g - colsum[:, None] * kf)
            # d s_ij / d lam = scale (q_i . k_j - |k_j|^2 / 2), and - scale |q_i|^2 / 2 from the row constant
            dlam = scale * (_rsum(_rsum(kf * acc_g, 1), 0) - 0.5 * _rsum(colsum * kk, 0))
            if LOWP:
                dlam -= 0.5 * scale * _rsum(colq, 0)
            tl.store(DLAM + b * tl.num_programs(1) + pid_n, dlam)
        if HAS_UK:
            dk += (scale * w) * _rsum(tl.reshape(cx[:, None] * uk.to(tl.float32), (RK, BN, BD)), 0)
            du = -(scale * w) * (acc_du - cx[:, None] * kr)
            offs = tl.arange(0, RK * BN)
            t = offs // BN
            j = n0 + offs % BN
            umask = (t[:, None] < rk) & (j[:, None] < n_k) & (offs_d[None, :] < d)
            tl.store(DUK + kb * rk * n_k * d + (t[:, None] * n_k + j[:, None]).to(tl.int64) * d + offs_d[None, :],
                     _rnd(du, DUK.dtype.element_ty, EMU).to(DUK.dtype.element_ty), mask=umask)
        if HAS_UQ:
            dk += (scale * w) * acc_y
        kmask = (offs_n[:, None] < n_k) & (offs_d[None, :] < d)
        tl.store(DK + kb * n_k * d + offs_n[:, None].to(tl.int64) * d + offs_d[None, :],
                 _rnd(dk, DK.dtype.element_ty, EMU).to(DK.dtype.element_ty), mask=kmask)
        vmask = (offs_n[:, None] < n_k) & (offs_dv[None, :] < dv)
        tl.store(DV + kb * n_k * dv + offs_n[:, None].to(tl.int64) * dv + offs_dv[None, :],
                 _rnd(acc_dv, DV.dtype.element_ty, EMU).to(DV.dtype.element_ty), mask=vmask)

    @triton.jit
    def _bwd_dq_kernel(Q, K, V, LAM, UK, UQ, MASK, MIDS, MROW, DO, LSE, DR, DQ, DUQ,
                       n_q, n_k, d, dv, rk, rq, smq, smk, smb, smr, smrb, scale, w, G,
                       CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_UK: tl.constexpr,
                       HAS_UQ: tl.constexpr, RK: tl.constexpr, RQ: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, LOWP: tl.constexpr,
                       EMU: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        kb = b // G
        m0 = tl.program_id(1) * BM
        offs_m = m0 + tl.arange(0, BM)
        offs_d = tl.arange(0, BD)
        offs_dv = tl.arange(0, BDV)
        DT = Q.dtype.element_ty
        q = _opnd(_load_rows(Q + b * n_q * d, offs_m, n_q, d, offs_d, d), EMU)
        do = _opnd(_load_rows(DO + b * n_q * dv, offs_m, n_q, dv, offs_dv, dv), EMU)
        lse = tl.load(LSE + b * n_q + offs_m, mask=offs_m < n_q, other=float("inf"))
        Dr = tl.load(DR + b * n_q + offs_m, mask=offs_m < n_q, other=0.0)
        lam = tl.load(LAM + b).to(tl.float32)
        mask_ptr = _mask_base(MASK, MIDS, b, smb, MASK_KIND)
        mrow_ptr = _mask_base(MROW, MIDS, b, smrb, MASK_KIND)
        uq, qr, uq_q = _factor_rows(Q, UQ, b, m0, n_q, d, rq, q, offs_d, HAS_UQ, RQ, BM, EMU)
        acc_dq = tl.full((BM, BD), 0.0, tl.float32)
        acc_dvq = tl.full((RQ * BM, BD), 0.0, tl.float32)  # sum_j dS_ij Y_t,ij k_j
        yq = tl.full((RQ * BM,), 0.0, tl.float32)  # sum_j dS_ij Y_t,ij
        rowsum = tl.full((BM,), 0.0, tl.float32)  # sum_j dS_ij (LOWP: the row constant's part of dq)
        hi = n_k
        if CAUSAL:
            hi = tl.minimum(n_k, m0 + BM)
        for n0 in range(0, hi, BN):
            offs_n, k, v, uk, kk, uk_k = _key_tile(K, V, UK, kb, n0, n_k, d, dv, rk, offs_d, offs_dv, HAS_UK, RK,
                                                   BN, EMU)
            s, X, Y = _scores(q, k, kk, uk, uk_k, uq, uq_q, lam, scale, w, offs_m, offs_n, n_q, n_k, mask_ptr, smq,
                              smk, mrow_ptr, smr, CAUSAL, MASK_KIND, HAS_UK, HAS_UQ, RK, RQ, BM, BN)
            p = tl.exp2(s - lse[:, None])
            dp = _mm(do, tl.trans(v))
            ds_op = _rnd(p * (dp - Dr[:, None]), DT, EMU)
            ds = ds_op.to(tl.float32)  # the values the products see
            acc_dq += (scale * lam) * _mm(ds_op, k)
            if LOWP:
                rowsum += _rsum(ds, 1)
            if HAS_UK:
                dsx = _rnd(tl.reshape(ds[:, None, :] * tl.reshape(X, (BM, RK, BN)), (BM, RK * BN)), DT, EMU)
                acc_dq -= (scale * w) * _mm(dsx, uk)
            if HAS_UQ:
                dsy = _rnd(tl.reshape(ds[None, :, :] * tl.reshape(Y, (RQ, BM, BN)), (RQ * BM, BN)), DT, EMU)
                yq += _rsum(dsy.to(tl.float32), 1)
                acc_dvq += _mm(dsy, k)
        if LOWP:
            acc_dq -= (scale * lam) * rowsum[:, None] * q.to(tl.float32)
        if HAS_UQ:
            acc_dq -= (scale * w) * _rsum(tl.reshape(yq[:, None] * uq.to(tl.float32), (RQ, BM, BD)), 0)
            duq = -(scale * w) * (yq[:, None] * qr - acc_dvq)
            offs = tl.arange(0, RQ * BM)
            t = offs // BM
            i = m0 + offs % BM
            umask = (t[:, None] < rq) & (i[:, None] < n_q) & (offs_d[None, :] < d)
            tl.store(DUQ + b * rq * n_q * d + (t[:, None] * n_q + i[:, None]).to(tl.int64) * d + offs_d[None, :],
                     _rnd(duq, DUQ.dtype.element_ty, EMU).to(DUQ.dtype.element_ty), mask=umask)
        qmask = (offs_m[:, None] < n_q) & (offs_d[None, :] < d)
        tl.store(DQ + b * n_q * d + offs_m[:, None].to(tl.int64) * d + offs_d[None, :],
                 _rnd(acc_dq, DQ.dtype.element_ty, EMU).to(DQ.dtype.element_ty), mask=qmask)
