r"""The blockwise operator as ``torch.library`` custom ops (private): what ``torch.compile`` traces.

:func:`riemannian_ref.attention.functional.riemannian_attention` runs the
operator of :mod:`riemannian_ref.attention._blockwise` one of two ways:

- **eagerly** (not tracing): ``_RiemannianAttentionFn.apply``, the autograd
  Function itself;
- **while ``torch.compile`` or ``torch.export`` traces**
  (:func:`torch.compiler.is_compiling`): :class:`TracedRiemannianAttentionFn`,
  whose ``apply`` calls the custom op ``riemannian_ref::attention``, which
  the tracer records as one node of the graph. Its fake implementation gives
  the output shapes without computing, and its autograd formula
  (:func:`torch.library.register_autograd`) calls a second custom op,
  ``riemannian_ref::attention_backward``, so the backward graph holds one
  opaque node too. ``torch.compile(model, fullgraph=True)``
  therefore traces a model through the attention instead of breaking the
  graph around it.

Both ways run the same code: the ops' implementations call
``_RiemannianAttentionFn.forward`` and ``.backward`` with a stand-in for the
autograd context (:class:`_Ctx`), so on the same inputs (and thread count)
the numbers are those of the eager operator, bit for bit. The eager path does not go through the op because
torch wraps every kernel of a Python custom op in ``torch._disable_dynamo``,
whose first call imports ``torch._dynamo`` (and, through it, ``triton`` when
installed; 1.3 s on the development machine): an eager user would pay the
compiler's import for nothing. Defining the ops here imports nothing and
takes about a millisecond, so it happens when this module is imported.

The op's arguments are those of ``_RiemannianAttentionFn.apply``, flattened
over the batch (see its docstring); ``None`` factors and masks are ``Tensor?``
arguments. The forward op also returns the row log-sum-exp (base 2) that the
backward needs; the backward op returns every gradient, with an empty tensor
where there is none (``torch.library`` refuses optional outputs), which the
autograd formula turns back into ``None``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ._blockwise import DEFAULT_LOOP, _RiemannianAttentionFn

__all__: list[str] = []  # private: called by riemannian_ref.attention.functional

_NS = "riemannian_ref"


class _Ctx:
    """The parts of an autograd context that ``_RiemannianAttentionFn.forward``/``.backward`` use."""

    def __init__(self, saved=(), consts=None, needs_input_grad=()):
        self.saved_tensors = tuple(saved)
        self.consts = consts
        self.needs_input_grad = tuple(needs_input_grad)
        self.options = DEFAULT_LOOP  # the custom op runs the default loop

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


@torch.library.custom_op(f"{_NS}::attention", mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, W: Optional[Tensor], Uk: Optional[Tensor],
               Uq: Optional[Tensor], mask: Optional[Tensor], causal: bool, scale: float, ck: float, cq: float,
               blocks: Sequence[int], batch: Sequence[int], kv_group: int,
               mask_rows: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """The forward of the blockwise operator: (output (Bf, n_q, dv), row log-sum-exp in base 2 (Bf, n_q))."""
    ctx = _Ctx()
    out = _RiemannianAttentionFn.forward(ctx, q, k, v, lam, W, Uk, Uq, mask, causal, scale, ck, cq, tuple(blocks),
                                         tuple(batch), kv_group, mask_rows)
    return out, ctx.saved_tensors[9]  # the row log-sum-exp (saved after the inputs and the output)


@_attention.register_fake
def _attention_fake(q, k, v, lam, W, Uk, Uq, mask, causal, scale, ck, cq, blocks, batch, kv_group, mask_rows):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(q.shape[0], q.shape[1])


@torch.library.custom_op(f"{_NS}::attention_backward", mutates_args=())
def _attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, W: Optional[Tensor],
                        Uk: Optional[Tensor], Uq: Optional[Tensor], mask: Optional[Tensor], out: Tensor, lse: Tensor,
                        causal: bool, scale: float, ck: float, cq: float, blocks: Sequence[int],
                        batch: Sequence[int], kv_group: int, mask_rows: Optional[Tensor], need_lam: bool,
                        need_mask: bool) -> list[Tensor]:
    """Gradients ``[dq, dk, dv, dlam, dW, dUk, dUq, dmask]``; an empty tensor where there is none."""
    needs = (True, True, True, need_lam, W is not None, Uk is not None, Uq is not None, need_mask)
    ctx = _Ctx((q, k, v, lam, W, Uk, Uq, mask, out, lse, mask_rows),
               (causal, scale, ck, cq, tuple(blocks), tuple(batch), kv_group), needs)
    with torch.no_grad():  # the operator's backward refuses to run with grad mode on (no double backward)
        grads = _RiemannianAttentionFn.backward(ctx, dout)[:8]
    return [g if g is not None else q.new_empty(0) for g in grads]


@_attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, lam, W, Uk, Uq, mask, out, lse, causal, scale, ck, cq, blocks, batch,
                             kv_group, mask_rows, need_lam, need_mask):
    # the layouts of the real gradients: *_like keeps a dense input's strides, as the operator's buffers do
    def like(t, need):
        return torch.empty_like(t) if need and t is not None else q.new_empty(0)

    dmask = mask.new_empty(mask.shape) if need_mask and mask is not None else q.new_empty(0)
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), like(lam, need_lam), like(W, True),
            like(Uk, True), like(Uq, True), dmask]


def _setup_context(ctx, inputs, output):
    q, k, v, lam, W, Uk, Uq, mask, causal, scale, ck, cq, blocks, batch, kv_group, mask_rows = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, lam, W, Uk, Uq, mask, out, lse, mask_rows)
    ctx.consts = (causal, scale, ck, cq, tuple(blocks), tuple(batch), kv_group)
    ctx.need_lam = ctx.needs_input_grad[3]
    ctx.need_mask = ctx.needs_input_grad[7]
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    if torch.is_grad_enabled():  # backward(create_graph=True): the same refusal as the eager operator
        raise RuntimeError(
            "riemannian_attention: the blockwise operator has no double backward "
            "(create_graph=True, e.g. a gradient penalty); use "
            "riemannian_ref.attention.riemannian_attention_reference, the dense path, for that")
    q, k, v, lam, W, Uk, Uq, mask, out, lse, mask_rows = ctx.saved_tensors
    causal, scale, ck, cq, blocks, batch, kv_group = ctx.consts
    g = _attention_backward(dout, q, k, v, lam, W, Uk, Uq, mask, out, lse, causal, scale, ck, cq, list(blocks),
                            list(batch), kv_group, mask_rows, ctx.need_lam, ctx.need_mask)
    present = (True, True, True, ctx.need_lam, W is not None, Uk is not None, Uq is not None, ctx.need_mask)
    grads = [t if p else None for t, p in zip(g, present)]
    return (*grads, None, None, None, None, None, None, None, None)


_attention.register_autograd(_backward, setup_context=_setup_context)


class TracedRiemannianAttentionFn:
    """``_RiemannianAttentionFn`` for a trace: ``apply`` takes the same arguments and calls the custom op.

    :func:`~riemannian_ref.attention.functional.riemannian_attention` uses it
    while :func:`torch.compiler.is_compiling` (the compiled graph then holds
    one ``riemannian_ref::attention`` node, whose autograd formula is the
    operator's backward), and ``_RiemannianAttentionFn`` itself otherwise.
    """

    @staticmethod
    def apply(q, k, v, lam, W, Uk, Uq, mask, causal, scale, ck, cq, blocks, batch, kv_group, mask_rows) -> Tensor:
        return _attention(q, k, v, lam, W, Uk, Uq, mask, causal, scale, ck, cq, list(blocks), list(batch), kv_group,
                          mask_rows)[0]
