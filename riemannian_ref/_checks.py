"""Input validation shared by the package: fail early, name the argument.

Every public function checks its inputs with these helpers so that a wrong
shape, dtype or device raises a ``ValueError`` that says which argument was
wrong, what was expected and what was received, instead of broadcasting
silently or failing deep inside a matmul. Also the one dtype policy the
attention and the model share (:func:`autocast_dtype`).
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor

__all__: list[str] = []  # private module


def shape_str(t: Tensor | Sequence[int]) -> str:
    shape = tuple(t.shape) if isinstance(t, Tensor) else tuple(t)
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_tensor(x, name: str, *, min_dim: int = 0, floating: bool = True) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(
            f"{name} must have at least {min_dim} dimensions, got shape {shape_str(x)}"
        )
    if floating and not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def check_same(ref: Tensor, ref_name: str, others: Iterable[tuple[str, Tensor | None]]) -> None:
    """Same dtype and device as ``ref`` for every non-None tensor in ``others``."""
    for name, t in others:
        if t is None or not isinstance(t, Tensor):
            continue
        if t.dtype != ref.dtype:
            raise ValueError(
                f"{name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}; "
                "convert them to one dtype first"
            )
        if t.device != ref.device:
            raise ValueError(
                f"{name} is on device {t.device} but {ref_name} is on {ref.device}; "
                "move them to one device first"
            )


def broadcast_batch(shapes: dict[str, Sequence[int]]) -> torch.Size:
    """Broadcast batch shapes by torch's rules, naming the culprits on failure."""
    try:
        return torch.broadcast_shapes(*[tuple(s) for s in shapes.values()])
    except RuntimeError:
        desc = ", ".join(f"{k} {shape_str(v)}" for k, v in shapes.items())
        raise ValueError(
            f"batch dimensions do not broadcast (torch broadcasting rules): {desc}"
        ) from None


def as_positive(x, name: str, like: Tensor) -> Tensor:
    """A strictly positive float or tensor, returned as a tensor like ``like``.

    A Python number is checked on the host and filled on ``like``'s device
    (no copy from the host, so no sync); a tensor's values are checked with
    :func:`check_values` (asynchronously off the CPU).
    """
    if isinstance(x, Tensor):
        check_same(like, "the inputs", [(name, x)])
        t = x
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"{name} must be finite and > 0 everywhere, got {x!r}")
        return torch.full((), float(x), dtype=like.dtype, device=like.device)
    else:
        raise ValueError(f"{name} must be a positive float or a tensor, got {type(x).__name__}")
    ok = torch.isfinite(t) & (t > 0)
    check_values(ok.all(), f"{name} must be finite and > 0 everywhere",
                 lambda: f", got values such as {t[~ok].flatten()[:3].tolist()}")
    return t


def check_values(ok: Tensor, message: str, detail: Callable[[], str] | None = None) -> None:
    """A check on tensor values: ``ValueError(message + detail())`` unless the bool tensor ``ok`` holds.

    On CPU tensors the check is eager: reading ``ok`` costs nothing there.
    On other devices (CUDA) reading a value would make the host wait for the
    device (a sync per call on the hot path), so the check is queued on the
    device instead (``torch._assert_async``): bad values still fail loudly,
    with a ``RuntimeError`` carrying ``message`` (``detail``, which reads the
    values, is not called), raised when the device runs the check, so
    possibly at a later synchronising call, as CUDA errors are. Set the
    environment variable ``RR_SYNC_CHECKS=1`` to get the eager ``ValueError``
    with its full message on every device (a sync per check; for debugging).

    While ``torch.compile`` (or ``torch.export``) traces, a graph cannot branch
    on values: the check then becomes an assertion inside the graph
    (``torch._assert_async``), which raises a ``RuntimeError`` with
    ``message`` when the compiled code runs on bad values, on every device.
    """
    if torch.compiler.is_compiling() or (reading_syncs(ok) and not sync_checks()):
        torch._assert_async(ok, message)
    elif not ok:
        raise ValueError(message + (detail() if detail is not None else ""))


def reading_syncs(t: Tensor) -> bool:
    """Whether reading a value of ``t`` on the host (``bool(t)``) waits for its device: every device but the CPU."""
    return t.device.type != "cpu"


def sync_checks() -> bool:
    """``RR_SYNC_CHECKS=1`` (or ``true``/``yes``/``on``): value checks read their values eagerly on every device."""
    return os.environ.get("RR_SYNC_CHECKS", "").strip().lower() in ("1", "true", "yes", "on")


# ------------------------------------------------------------ scalar arguments and config fields
F32_MAX = float(torch.finfo(torch.float32).max)  # bound of a config value that becomes a float32 parameter


def check_int(v, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    """An int (not a bool) in ``[minimum, maximum]``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum or (maximum is not None and v > maximum):
        rng = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {rng}, got {v!r}")
    return v


def check_number(v, name: str, *, low: float | None = None, low_open: bool = False, high: float | None = None,
                 high_open: bool = False) -> float:
    """A finite real number (not a bool) in the interval given by ``low`` and ``high``."""
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    if ok and low is not None:
        ok = v > low if low_open else v >= low
    if ok and high is not None:
        ok = v < high if high_open else v <= high
    if not ok:
        lo = "(-inf, " if low is None else f"{'(' if low_open else '['}{low:g}, "
        hi = "inf)" if high is None else f"{high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be a finite number in {lo}{hi}, got {v!r}")
    return v


def check_choice(v, name: str, choices: tuple) -> None:
    """One of ``choices``."""
    if not isinstance(v, (str, type(None), bool, int)) or v not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {v!r}")


def check_bool(v, name: str) -> bool:
    """A bool (not merely truthy)."""
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be a bool, got {v!r}")
    return v


# ------------------------------------------------------------ scores and attention (geometry and attention)
#: The accepted values of ``metric_side``: whose metric :math:`\bar G_{ij}` a
#: score uses, the key's :math:`G_j`, the query's :math:`G_i` or their mean.
METRIC_SIDES = ("key", "query", "mean")


def _check_factor(U: Tensor, name: str, x: Tensor, x_name: str) -> bool:
    """Validate a metric factor against its side's vectors; True if per-token."""
    U = check_tensor(U, name, min_dim=2)
    check_same(x, x_name, [(name, U)])
    d = x.shape[-1]
    n = x.shape[-2]
    if U.dim() == x.dim() + 1:
        if U.shape[-3] != n or U.shape[-2] != d:
            raise ValueError(
                f"{name} must have shape [..., n, d, r] = [..., {n}, {d}, r] to match "
                f"{x_name} {shape_str(x)} (or [..., d, r] for a shared metric), got {shape_str(U)}"
            )
        broadcast_batch({f"{name}.shape[:-3]": U.shape[:-3], f"{x_name}.shape[:-2]": x.shape[:-2]})
        return True
    if U.dim() == x.dim():
        if U.shape[-2] != d:
            raise ValueError(
                f"{name} (shared metric) must have shape [..., d, r] with d = {d}, got {shape_str(U)}"
            )
        broadcast_batch({f"{name}.shape[:-2]": U.shape[:-2], f"{x_name}.shape[:-2]": x.shape[:-2]})
        return False
    raise ValueError(
        f"{name} must have {x.dim() + 1} dims ([..., n, d, r], per-token) or {x.dim()} dims "
        f"([..., d, r], shared) to match {x_name} {shape_str(x)}, got {shape_str(U)}"
    )


def check_score_inputs(q, k, U_q, U_k, lam, metric_side, scale, names=("q", "k")):
    r"""Validate the common arguments of scores and attention; return (lam, scale, per_q, per_k).

    Raises ``ValueError`` naming the argument on any inconsistency.

    Parameters
    ----------
    q, k : Tensor, shape [..., n_q, d] and [..., n_k, d]
        Queries and keys; batch dimensions must broadcast.
    U_q, U_k : Tensor or None, shape [..., n, d, r] (per token) or [..., d, r] (shared)
        Metric factors of the side(s) that ``metric_side`` uses (None there
        means no low-rank part, :math:`G = \lambda I`); None for a side it
        does not use.
    lam : float or Tensor, shape broadcastable to ``q.shape[:-2]``
        Isotropic part :math:`\lambda > 0`.
    metric_side : {"key", "query", "mean"}
        See :data:`METRIC_SIDES`.
    scale : float or None
        Positive score scale; ``None`` means :math:`1/\sqrt d`.
    names : (str, str)
        How error messages call the queries and keys (the caller's argument names).

    Returns
    -------
    lam : Tensor, shape broadcastable to ``q.shape[:-2]``
        ``lam`` as a positive tensor on ``q``'s device and dtype.
    scale : float
    per_q, per_k : bool
        Whether ``U_q`` / ``U_k`` are per-token (``[..., n, d, r]``).
    """
    qn, kn = names
    q = check_tensor(q, qn, min_dim=2)
    k = check_tensor(k, kn, min_dim=2)
    check_same(q, qn, [(kn, k)])
    if q.dim() != k.dim():
        raise ValueError(f"{qn} and {kn} must have the same number of dims, got {qn} {shape_str(q)}, "
                         f"{kn} {shape_str(k)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{qn} and {kn} must share the head dimension d, got {qn} {shape_str(q)}, "
                         f"{kn} {shape_str(k)}")
    broadcast_batch({f"{qn}.shape[:-2]": q.shape[:-2], f"{kn}.shape[:-2]": k.shape[:-2]})
    if metric_side not in METRIC_SIDES:
        raise ValueError(f"metric_side must be one of {METRIC_SIDES}, got {metric_side!r}")
    need_q = metric_side in ("query", "mean")
    need_k = metric_side in ("key", "mean")
    if not need_k and U_k is not None:
        raise ValueError(f"U_k is not used with metric_side={metric_side!r}; pass None or choose 'key'/'mean'")
    if not need_q and U_q is not None:
        raise ValueError(f"U_q is not used with metric_side={metric_side!r}; pass None or choose 'query'/'mean'")
    per_q = _check_factor(U_q, "U_q", q, qn) if U_q is not None else False
    per_k = _check_factor(U_k, "U_k", k, kn) if U_k is not None else False
    if U_q is not None and U_k is not None and U_q.shape[-1] != U_k.shape[-1]:
        # allowed mathematically, but almost always a bug in the caller
        raise ValueError(
            f"U_q and U_k must have the same rank r for metric_side='mean', got "
            f"{U_q.shape[-1]} and {U_k.shape[-1]}"
        )
    lam_t = as_positive(lam, "lam", q)
    broadcast_batch({"lam": lam_t.shape, f"{qn}.shape[:-2]": q.shape[:-2]})
    return lam_t, check_scale(scale, q.shape[-1]), per_q, per_k


def check_scale(scale, d: int) -> float:
    r"""``scale`` as a Python float: ``None`` gives :math:`1/\sqrt d` (1 when ``d = 0``).

    Accepts what ``scaled_dot_product_attention`` accepts as a real number: a
    Python or NumPy int or float, or a 0-d real tensor without gradient (read
    on the host, as SDPA reads it); the value must be finite and ``> 0``.
    With ``d = 0`` every distance is 0, whatever the scale: the weights are
    uniform over the visible keys, SDPA's result there.
    """
    if scale is None:
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    v = scale
    if isinstance(v, Tensor):
        if v.dim() != 0 or v.requires_grad or v.is_complex() or v.dtype == torch.bool or v.device.type == "meta":
            raise ValueError(f"scale must be a finite positive number or None (a tensor: 0-d, real, on a device "
                             f"with values, without gradient), got a tensor of shape {shape_str(v)}, dtype "
                             f"{v.dtype} on {v.device}" + (" that requires grad" if v.requires_grad else ""))
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v > 0):
        raise ValueError(f"scale must be a finite positive number or None, got {scale!r}")
    return float(v)


def autocast_dtype(device_type: str):
    """The dtype ``torch.autocast`` casts to on this device type, or None when it is off (or unknown there)."""
    try:
        on = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta, ...)
        return None
    return torch.get_autocast_dtype(device_type) if on else None


def check_gains_rank(form: str, rank: int, space: int, subspace: bool) -> None:
    """The gains form's ``rank`` directions are orthonormal: they need a space of that many dimensions.

    Past ``space`` Gram-Schmidt would orthonormalise rounding noise, so the extra
    directions would turn with any change of the weights.
    """
    if form == "gains" and rank > space:
        where = f"subspace = {space}" if subspace else f"head_dim = {space}"
        raise ValueError(f"form='gains' needs rank <= {where} (its rank directions are orthonormal in a "
                         f"{space}-dimensional space), got rank={rank}; use a smaller rank or form='factor'")
