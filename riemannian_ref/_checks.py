"""Input validation shared by the package: fail early, name the argument.

Every public function checks its inputs with these helpers so that a wrong
shape, dtype or device raises a ``ValueError`` that says which argument was
wrong, what was expected and what was received, instead of broadcasting
silently or failing deep inside a matmul.
"""
from __future__ import annotations

import math
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
