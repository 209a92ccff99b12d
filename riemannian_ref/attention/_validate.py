"""Argument checks shared by every attention entry point (private).

One place decides what a valid call is, so the blockwise operator, the dense
reference and the plain blockwise version accept and refuse the same inputs,
with errors that name the argument. Each public call validates once, at its
entry; what it calls inside (the operator's dense branches, the reference's
scores, every tile of ``blockwise_attention``, the operator under
``connection_attention``) takes the validated arguments unchecked
(``functional._attention``, ``reference._reference_attention``,
``geometry.scores.scores_unchecked``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._checks import broadcast_batch, check_same, check_score_inputs, check_tensor, check_values, shape_str
from .. import _checks

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


def check_attention_inputs(q, k, v, attn_mask, dropout_p, is_causal, scale, U_q, U_k, lam, metric_side, *,
                           full_range: bool = False):
    """Validate a call; return ``(lam, scale, per_q, per_k, batch)``.

    ``full_range``: the range rule over the data too (the dense references), else over ``lam`` and
    ``scale`` alone (the operators: no extra pass over the inputs); see :func:`check_score_range`.

    ``batch`` is the broadcast batch shape of query, key, value and the metric
    factors. ``lam`` and ``attn_mask`` must broadcast *to* it: they may not
    grow the output's batch (a silent broadcast there is almost always a bug).
    """
    lam_t, scale, per_q, per_k = check_score_inputs(q, k, U_q, U_k, lam, metric_side, scale,
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
    check_score_range(q, k, U_q, U_k, lam_t, scale, metric_side, data=full_range)
    return lam_t, scale, per_q, per_k, batch


#: The margin below the largest finite number of the compute dtype that :func:`check_score_range` keeps for the
#: sums the backends form (the expanded distance, the row offsets, the backward's products).
RANGE_MARGIN = 16.0


def check_score_range(q: Tensor, k: Tensor, U_q, U_k, lam_t: Tensor, scale: float, metric_side: str, *,
                      data: bool = True) -> None:
    r"""Refuse a call whose distances or scores could overflow the compute dtype, naming ``lam`` and ``scale``.

    With ``data=False`` (the operators) only :math:`\max(1, \text{scale}/2)\max\lambda` is
    bounded: no extra pass over the inputs on the hot path. Scores that overflow because the inputs are huge then give NaN rows, as they do in
    ``scaled_dot_product_attention``. With ``data=True`` (the dense references) the whole bound
    :math:`R = \max(1, \text{scale}/2)\,(\max\lambda + w\max|U_k|_F^2 + w\max|U_q|_F^2)
    \,(\max_i|q_i| + \max_j|k_j|)^2` (:math:`w = 1/2` for ``"mean"``, else 1) is checked: it
    holds every squared distance :math:`(q_i-k_j)^\top G (q_i-k_j)` and every score, so a
    reference never answers from an overflowed score (which it would read as a masked key, giving
    0). Either bound must stay below the largest finite number of the compute dtype (float32 for
    half-precision inputs) over ``RANGE_MARGIN``. Checked like ``lam``'s values
    (:func:`~riemannian_ref._checks.check_values`: eager on CPU, queued on the device elsewhere,
    no host sync); NaN inputs pass (NaN out, as SDPA); meta tensors and empty
    inputs are not checked.
    """
    if q.device.type == "meta" or q.numel() == 0 or k.numel() == 0:
        return
    ct = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    limit = torch.finfo(ct).max / RANGE_MARGIN
    w = 0.5 if metric_side == "mean" else 1.0
    if not data:
        if not _checks.reading_syncs(lam_t) and not torch.compiler.is_compiling():  # a host read is free here
            top = float(lam_t.detach().amax()) if lam_t.numel() > 1 else float(lam_t.detach())
            if not top * max(1.0, scale / 2) <= limit:
                raise ValueError(f"lam and scale are too large for {ct}: max(1, scale/2) * max lam must stay "
                                 f"below {limit:.3g}, or the scores overflow; lower lam or scale, or compute in "
                                 f"float64 (lam up to {top:.3g}, scale {scale:g})")
            return
        with torch.no_grad():
            R = lam_t.detach().to(ct).amax() * max(1.0, scale / 2)
            ok = ~(R > limit)
        check_values(ok, f"lam and scale are too large for {ct}: max(1, scale/2) * max lam must stay below "
                         f"{limit:.3g}, or the scores overflow; lower lam or scale, or compute in float64",
                     lambda: f" (lam up to {float(lam_t.detach().amax()):.3g}, scale {scale:g})")
        return
    with torch.no_grad():
        norm = lambda x, dims: torch.linalg.vector_norm(x.detach(), dim=dims, dtype=ct).amax()  # noqa: E731
        iso = lam_t.detach().to(ct).amax()
        for U in (U_q, U_k):
            if isinstance(U, Tensor) and U.numel():
                iso = iso + w * norm(U, (-2, -1)).square()
        # factors first: (|q| + |k|)^2 of huge inputs overflows alone, and inf is refused too
        R = iso * (norm(q, -1) + norm(k, -1)).square() * max(1.0, scale / 2)
        ok = ~(R > limit)
    what = f"{ct}" if ct == q.dtype else f"{q.dtype} inputs (lam held in {q.dtype}, computed in {ct})"
    check_values(ok, f"lam, scale and the inputs are too large for {what}: the squared distances or scores could "
                     f"overflow (bound max(1, scale/2) * (max lam + |U|^2) * (max|query| + max|key|)^2 must stay "
                     f"below {limit:.3g}); lower lam or scale, or compute in float64",
                 lambda: f" (bound {float(R):.3g}, lam up to {float(lam_t.detach().amax()):.3g}, scale {scale:g})")



def check_subspace(U, name: str, x: Tensor, x_name: str, *, same_dtype: bool = True) -> None:
    """Validate :class:`~riemannian_ref.geometry.metric.SubspaceFactors` given as ``name`` for the tokens of ``x``.

    ``basis`` [..., d, m] with the dims of ``x`` [..., n, d] (the layout of a
    shared factor), ``coef`` [..., n, m, r] with one dim more (the layout of
    per-token factors), batch dims broadcasting together, on ``x``'s device
    (and dtype, unless ``same_dtype`` is False: under autocast, before the
    cast). The rest (batch against the other inputs, ``r`` against the other
    side) is checked on the dense shape by :func:`check_attention_inputs`.
    """
    x = check_tensor(x, x_name, min_dim=2)
    basis = check_tensor(U.basis, f"{name}.basis", min_dim=2)
    coef = check_tensor(U.coef, f"{name}.coef", min_dim=3)
    n, d = x.shape[-2], x.shape[-1]
    if basis.dim() != x.dim() or basis.shape[-2] != d or basis.shape[-1] < 1:
        raise ValueError(f"{name}.basis must have shape [..., d, m] with d = {d}, m >= 1 and {x.dim()} dims like "
                         f"{x_name} {shape_str(x)} (one basis per head: [1, h, d, m] for inputs [B, h, n, d]), "
                         f"got {shape_str(basis)}")
    m = basis.shape[-1]
    if coef.dim() != x.dim() + 1 or coef.shape[-3] != n or coef.shape[-2] != m:
        raise ValueError(f"{name}.coef must have shape [..., n, m, r] with {x.dim() + 1} dims, n = {n} (the tokens "
                         f"of {x_name}) and m = {m} (the columns of {name}.basis), got {shape_str(coef)}")
    broadcast_batch({f"{name}.basis.shape[:-2]": basis.shape[:-2], f"{name}.coef.shape[:-3]": coef.shape[:-3]})
    for part, t in (("basis", basis), ("coef", coef)):
        if t.device != x.device:
            raise ValueError(f"{name}.{part} is on device {t.device} but {x_name} is on {x.device}; move them to "
                             "one device first")
    if same_dtype:
        check_same(x, x_name, [(f"{name}.basis", basis), (f"{name}.coef", coef)])


def _broadcasts_to(shape, batch) -> bool:
    """Whether ``shape`` broadcasts to ``batch`` without enlarging it (False, not an error, if it does not broadcast)."""
    try:
        return torch.broadcast_shapes(batch, shape) == batch
    except RuntimeError:
        return False


# ------------------------------------------------------------------ the dispatch rules shared by every backend
# Mask entries at or below this dominate any score: s + m rounds to m in float32 and float64 alike for every
# |s| < 2^67 (the ulp of 2^120 in float64 is 2^68), so SDPA's result for such a row is the softmax of the mask
# alone. It holds every torch.finfo(dtype).min (transformers' masking value) but float16's (-65504, which
# SDPA on CPU adds to the scores in float32 without losing them).
DOMINANT_MASK = -2.0 ** 120


def mask_row_max(mask: Tensor, is_causal: bool, n_q: int, n_k: int) -> Tensor:
    """The largest entry of every row of a float mask over the keys the row sees, 0 where it sees none.

    ``mask`` [*mb, 1|n_q, 1|n_k]; returns [*mb, 1|n_q] (``n_q`` rows when
    ``is_causal`` makes rows differ), computed without gradient. A key-padding
    mask ``[B, 1, 1, n_k]`` with ``is_causal`` gives ``[B, 1, n_q]`` (a running
    maximum), never a ``[B, 1, n_q, n_k]`` tensor.
    """
    with torch.no_grad():
        m = mask.detach()
        if not is_causal or m.shape[-1] == 1:  # a per-query column: key 0 is visible to every causal row
            c = m.amax(-1)
        elif m.shape[-2] == 1:  # [*mb, 1, n_k]: row i sees keys 0..i, the running maximum at min(i, n_k - 1)
            rows = torch.arange(n_q, device=m.device).clamp_max(n_k - 1)
            c = m.cummax(-1).values[..., 0, :].index_select(-1, rows)
        else:
            keep = torch.ones(n_q, n_k, dtype=torch.bool, device=m.device).tril()
            c = m.masked_fill(~keep, float("-inf")).amax(-1)
        return c.masked_fill(torch.isneginf(c), 0.0)


def group_heads(query: Tensor, key: Tensor, value: Tensor, attn_mask, U_q, U_k, lam):
    """Grouped-query attention as views: the batch [..., h_q] becomes [..., h_kv, g], the key side [..., h_kv, 1].

    Returns ``(g, query, key, value, attn_mask, U_q, U_k, lam)``: with ``g = 1``
    the arguments unchanged, else views of them (nothing is copied). ``U_k``
    and ``U_q`` may have ``h_kv`` (key side only), ``h_q`` or 1 heads;
    ``lam`` a last dimension of ``h_q``, ``h_kv`` or 1; ``attn_mask`` 1 or
    ``h_q`` heads (dimension -3), as SDPA's.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() < 3:
            raise ValueError(f"enable_gqa=True needs {name} of shape [..., heads, n, d], got "
                             f"{shape_str(t) if isinstance(t, Tensor) else type(t).__name__}")
    hq, hk = query.shape[-3], key.shape[-3]
    if value.shape[-3] != hk or hq % hk or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(f"enable_gqa=True needs key and value with the same number of heads, dividing the "
                         f"query heads {hq}; got key {shape_str(key)}, value {shape_str(value)}")
    g = hq // hk
    if g == 1:
        return 1, query, key, value, attn_mask, U_q, U_k, lam

    def split(t: Tensor, dim: int, name: str, allowed: tuple[int, ...]) -> Tensor:
        """Head dimension ``dim`` of size h_q to (h_kv, g), of size h_kv or 1 to (., 1)."""
        dim = dim % t.dim()
        h = t.shape[dim]
        if h == hq:
            return t.unflatten(dim, (hk, g))
        if h in allowed:
            return t.unsqueeze(dim + 1)
        want = " or ".join(str(a) for a in (hq, *allowed))
        raise ValueError(f"with enable_gqa=True, {name} must have {want} heads in dimension {dim - t.dim()} "
                         f"(query heads {hq}, key heads {hk}), got {shape_str(t)}")

    def factor(U, x: Tensor, name: str, allowed):
        if U is None:
            return None
        U = check_tensor(U, name, min_dim=2)
        if U.dim() not in (x.dim(), x.dim() + 1):
            raise ValueError(f"{name} must have {x.dim() + 1} dims ([..., n, d, r], per-token) or {x.dim()} dims "
                             f"([..., d, r], shared) to match {'query' if x is query else 'key'} "
                             f"{shape_str(x)}, got {shape_str(U)}")
        return split(U, -4 if U.dim() == x.dim() + 1 else -3, name, allowed)

    U_k = factor(U_k, key, "U_k", (hk, 1))
    U_q = factor(U_q, query, "U_q", (1,))
    if isinstance(lam, Tensor) and lam.dim() > 0:
        lam = split(lam, -1, "lam", (hk, 1))
    if isinstance(attn_mask, Tensor) and attn_mask.dim() >= 3:
        attn_mask = split(attn_mask, -3, "attn_mask", (1,))
    return g, query.unflatten(-3, (hk, g)), key.unsqueeze(-3), value.unsqueeze(-3), attn_mask, U_q, U_k, lam
