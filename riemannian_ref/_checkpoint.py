"""The training loop's checkpoints: write atomically, read safely, refuse another run's file (private).

A checkpoint is one :func:`torch.save` file holding only tensors and plain
Python values (dicts, lists, strings, numbers). :func:`read` loads it with
``weights_only=True``, so no code stored in a file ever runs: a file holding
a pickled callable or any other object is refused before anything in it is
called. Every problem is a ``ValueError`` that names the file and says what
is wrong with it:

- it cannot be read (missing, truncated, not a torch file, or holding objects
  other than tensors and plain values);
- it is not a training checkpoint of this package, or a field is missing or
  of the wrong type (:func:`read` checks the schema);
- it belongs to another run (:func:`check_same_run`): the :class:`TrainConfig`
  fields that define the run, the model's configuration, its parameter and
  buffer names and shapes, the optimiser's class and parameter groups, or the
  number of processes differ. Nothing is continued partially: the message
  lists every difference and what to do.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__: list[str] = []  # private module

#: Tag of the checkpoint layout written by :func:`write`.
FORMAT = "riemannian_ref.train/1"

# key -> (accepted types, what it is); read() checks each one
_SCHEMA: dict[str, tuple[tuple[type, ...], str]] = {
    "format": ((str,), "the layout tag"),
    "step": ((int,), "the last optimiser step"),
    "model": ((dict,), "the model's state dict"),
    "model_config": ((dict, type(None)), "the model's configuration"),
    "optimizer": ((dict,), "the optimiser's state dict"),
    "optimizer_class": ((str,), "the optimiser's class"),
    "sampler": ((list,), "the batch samplers' states"),
    "torch_rng": ((Tensor,), "torch's global RNG state"),
    "history": ((dict,), "the metrics history"),
    "train_time_s": ((float, int), "the training time"),
    "tokens_seen": ((int,), "the tokens seen"),
    "world_size": ((int,), "the number of processes"),
    "loss_since": ((float, int), "the loss accumulated since the last evaluation"),
    "n_since": ((int,), "the steps since the last evaluation"),
    "config": ((dict,), "the TrainConfig"),
}


def optimizer_class(opt: torch.optim.Optimizer) -> str:
    """The optimiser's class as ``module.QualifiedName``."""
    return f"{type(opt).__module__}.{type(opt).__qualname__}"


def _plain(v) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _plain(x) for k, x in v.items())
    return False


def model_config(module: nn.Module) -> dict | None:
    """The model's dataclass ``config`` as a dict of plain values (None if it has none, or not plain)."""
    cfg = getattr(module, "config", None)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        d = dataclasses.asdict(cfg)
        return d if _plain(d) else None
    return None


def write(path: str, payload: dict[str, Any]) -> None:
    """Save ``payload`` (the keys of the schema, ``format`` added here) to ``path`` atomically.

    The file is written next to ``path`` and renamed over it, so an
    interrupted write leaves the previous checkpoint intact.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save({"format": FORMAT, **payload}, tmp)
    os.replace(tmp, path)


def read(path: str, map_location=None) -> dict[str, Any]:
    """Load and schema-check a checkpoint written by :func:`write`; no code from the file runs.

    Raises
    ------
    ValueError
        Naming ``path``, if the file cannot be read safely, is not a training
        checkpoint of this package, or lacks a field or has one of the wrong type.
    """
    try:
        blob = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # missing, truncated, foreign, or holding objects other than tensors and plain values
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"checkpoint {path!r} cannot be read safely (only tensors and plain values are "
                         f"loaded, nothing in the file is run): {first}") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        got = blob.get("format") if isinstance(blob, dict) else type(blob).__name__
        raise ValueError(f"checkpoint {path!r} is not a riemannian_ref training checkpoint "
                         f"(format {FORMAT!r} expected, got {got!r})")
    for key, (types, what) in _SCHEMA.items():
        if key not in blob:
            raise ValueError(f"checkpoint {path!r} is damaged: {key!r} ({what}) is missing")
        val = blob[key]
        if not isinstance(val, types) or (isinstance(val, bool) and bool not in types):
            names = " or ".join(t.__name__ for t in types)
            raise ValueError(f"checkpoint {path!r} is damaged: {key!r} ({what}) should be {names}, "
                             f"got {type(val).__name__}")
    for name, t in blob["model"].items():
        if not isinstance(name, str) or not isinstance(t, Tensor):
            raise ValueError(f"checkpoint {path!r} is damaged: the model's state dict maps {name!r} to "
                             f"{type(t).__name__}, not a tensor")
    if not all(isinstance(s, Tensor) and s.dtype == torch.uint8 for s in blob["sampler"]):
        raise ValueError(f"checkpoint {path!r} is damaged: 'sampler' must hold uint8 generator states")
    if len(blob["sampler"]) != blob["world_size"] or blob["step"] < 0:
        raise ValueError(f"checkpoint {path!r} is damaged: {len(blob['sampler'])} sampler states for world "
                         f"size {blob['world_size']}, step {blob['step']}")
    return blob


def _shapes(state: dict[str, Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


def _diff_dicts(saved: dict, now: dict, label: str, limit: int = 6) -> list[str]:
    keys = sorted(set(saved) | set(now))
    out = []
    for k in keys:
        a, b = saved.get(k, "<absent>"), now.get(k, "<absent>")
        if isinstance(a, list):
            a = tuple(a)  # a tuple round-trips through the file as a tuple, but be lenient
        if isinstance(b, list):
            b = tuple(b)
        if a != b:
            out.append(f"{label}{k}: checkpoint {a!r}, now {b!r}")
    return out[:limit] + ([f"... and {len(out) - limit} more {label or 'fields'}"] if len(out) > limit else [])


def check_same_run(blob: dict, path: str, *, config, module: nn.Module, optimizer: torch.optim.Optimizer,
                   world_size: int) -> None:
    """Refuse to resume from a checkpoint of another run.

    Compares the :class:`TrainConfig` fields that define the run
    (:meth:`TrainConfig.run_fields`), the model's configuration when it has one, the
    names and shapes of its parameters and buffers, the optimiser's class and
    the sizes of its parameter groups, and the number of processes.

    Raises
    ------
    ValueError
        Naming ``path`` and listing every difference.
    """
    now_cfg = config.run_fields()
    saved_cfg = {k: v for k, v in blob["config"].items() if k in now_cfg or k not in dataclasses.asdict(config)}
    diffs = _diff_dicts(saved_cfg, now_cfg, "TrainConfig.")
    mc = model_config(module)
    if mc is not None or blob["model_config"] is not None:
        diffs += _diff_dicts(blob["model_config"] or {}, mc or {}, "model config ")
    diffs += _diff_dicts(_shapes(blob["model"]), _shapes(module.state_dict()), "model tensor ")
    if blob["optimizer_class"] != optimizer_class(optimizer):
        diffs.append(f"optimizer: checkpoint {blob['optimizer_class']}, now {optimizer_class(optimizer)}")
    else:
        groups = blob["optimizer"].get("param_groups")
        saved = [len(g.get("params", ())) for g in groups] if isinstance(groups, list) else None
        now = [len(g["params"]) for g in optimizer.param_groups]
        if saved != now:
            diffs.append(f"optimizer parameter groups: checkpoint sizes {saved}, now {now}")
        else:  # the same class, but a group lacking a hyper-parameter the optimiser reads
            for i, (g_saved, g_now) in enumerate(zip(groups, optimizer.param_groups)):
                missing = sorted(set(g_now) - set(g_saved) - {"params", "peak_lr"})
                if missing:
                    diffs.append(f"optimizer parameter group {i}: the checkpoint lacks {missing}")
    if blob["world_size"] != world_size:
        diffs.append(f"world size: checkpoint {blob['world_size']}, now {world_size}")
    if diffs:
        raise ValueError(
            f"checkpoint {path!r} belongs to another run; refusing to resume from it (nothing was loaded): "
            + "; ".join(diffs)
            + ". Resume with the same configuration, or give this run its own checkpoint_path.")


def restore(blob: dict, path: str, *, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the model's and the optimiser's states, or neither, turning torch's errors into ones naming ``path``."""
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    try:
        module.load_state_dict(blob["model"])
    except (RuntimeError, KeyError, ValueError) as exc:
        module.load_state_dict(before)
        raise ValueError(f"checkpoint {path!r}: the model's state does not load: {exc}") from None
    try:
        optimizer.load_state_dict(blob["optimizer"])
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
        module.load_state_dict(before)  # all or nothing
        raise ValueError(f"checkpoint {path!r}: the optimiser's state does not load "
                         f"({type(exc).__name__}: {exc})") from None


def save(path: str, *, config, module: nn.Module, optimizer: torch.optim.Optimizer, sampler: torch.Generator,
         rank: int, world_size: int, progress: dict[str, Any]) -> None:
    """Write the run's state (rank 0 writes; every rank's batch-sampler state is gathered first).

    ``progress`` holds ``history``, ``step``, ``train_time_s``, ``tokens_seen``,
    ``loss_since`` and ``n_since``.
    """
    states = [sampler.get_state()]
    if world_size > 1:  # every rank's batch-order state, so resume is exact on all ranks
        states = [torch.empty_like(states[0]) for _ in range(world_size)]
        dist.all_gather_object(states, sampler.get_state())
    if rank == 0:
        write(path, {"model": module.state_dict(), "model_config": model_config(module),
                     "optimizer": optimizer.state_dict(), "optimizer_class": optimizer_class(optimizer),
                     "sampler": states, "torch_rng": torch.get_rng_state(), "world_size": world_size,
                     "config": dataclasses.asdict(config), **progress})
    if world_size > 1:
        dist.barrier()


def resume(path: str, *, config, module: nn.Module, optimizer: torch.optim.Optimizer, sampler: torch.Generator,
           rank: int, world_size: int, device) -> dict[str, Any]:
    """Read ``path`` safely, refuse another run's file, then restore the model, optimiser and RNG states.

    Returns the checkpoint, whose ``history``, ``step``, ``train_time_s``,
    ``tokens_seen``, ``loss_since`` and ``n_since`` continue the run.
    """
    ck = read(path, map_location=device)
    check_same_run(ck, path, config=config, module=module, optimizer=optimizer, world_size=world_size)
    restore(ck, path, module=module, optimizer=optimizer)
    sampler.set_state(ck["sampler"][rank])
    torch.set_rng_state(ck["torch_rng"].cpu())
    return ck


def diverged(step: int, what: str, path: str | None, last_saved: int | None, *,
             after_step: bool = False) -> FloatingPointError:
    """The error that stops a run at a non-finite loss or gradient (before the optimiser step), or at
    non-finite parameters (after it)."""
    if path is None:
        kept = "no checkpoint is written (checkpoint_path is None)"
    elif last_saved is None:
        kept = f"no checkpoint was written yet ({path!r} was left as it was)"
    else:
        kept = f"the last good checkpoint, of step {last_saved}, is kept in {path!r}"
    where = ("stopped after the optimiser step (the model's parameters are no longer finite)" if after_step else
             f"stopped before the optimiser step (the model holds the parameters it had before step {step})")
    return FloatingPointError(f"training diverged at step {step}: {what}; {where}, {kept}. A smaller lr, a "
                              f"longer warm-up or grad_clip usually help.")
