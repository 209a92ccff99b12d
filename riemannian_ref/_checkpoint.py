"""The training loop's checkpoints: write atomically, read safely, validate fully, restore all or nothing (private).

A checkpoint is one :func:`torch.save` file holding only tensors and plain
Python values (dicts, lists, strings, numbers). :func:`write` goes through the
package's one atomic writer (:func:`riemannian_ref._io.atomic_write`: a
temporary file in the same directory, flushed to disk, renamed over the
target), so a process killed while writing leaves the previous checkpoint
intact. :func:`read` loads a file with ``weights_only=True``, so no code
stored in a file ever runs: a file holding a pickled callable or any other
object is refused before anything in it is called.

The file holds the whole model and optimiser state as one process writes
them (``state_dict()``, parameters by index), also for a model sharded by
FSDP2's ``fully_shard``: its state is gathered to rank 0 to be written and
scattered again at a resume (torch's ``get_model_state_dict`` family), so a
checkpoint moves between one process, DDP and FSDP2. Each rank's batch-sampler
and global RNG states are kept.

:func:`resume` checks the whole file before anything is loaded into the
caller's objects, then restores the model, the optimiser, the batch sampler
and torch's global RNG together, or none of them. Every problem is a
``ValueError`` that names the file and the field, and says what is wrong:

- it cannot be read (missing, truncated, not a torch file, or holding objects
  other than tensors and plain values);
- it is not a training checkpoint of this package, or a field is missing or
  of the wrong type (:func:`read` checks the schema);
- it belongs to another run (:func:`check_same_run`): the :class:`TrainConfig`
  fields that define the run, the model's configuration, its parameter and
  buffer names and shapes, the optimiser's class, the sizes of its parameter
  groups and their hyper-parameters (unless ``TrainConfig.resume_hparams``
  says otherwise), or the number of processes differ; the message lists every
  difference;
- a value is damaged (:func:`validate`): RNG or batch-sampler states that a
  CPU generator does not accept, a history whose lists differ in length or
  whose steps are not those the loop evaluates at, a step beyond
  ``TrainConfig.steps``, a negative or non-finite time, non-finite parameters,
  or optimiser state whose keys or shapes differ from those the optimiser
  creates for the same parameters.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._io import atomic_write
from .models.config import MOVED_FIELDS, FiberBundleConfig, nest_flat



def _loaded_type(module: str, name: str) -> type | tuple:
    """``module.name`` if that module is imported, else ``()`` (``isinstance(x, ())`` is False).

    FSDP2's module and DTensor classes are looked up only once something has
    imported them (``fully_shard`` does): no instance can exist before, and
    importing them eagerly would pull sympy into ``import riemannian_ref``.
    """
    return getattr(sys.modules.get(module), name, ())

__all__: list[str] = []  # private module

#: Tag of the checkpoint layout written by :func:`write`. Version 1 held a FiberBundleConfig's attention
#: options as flat fields of its ``model_config``; :func:`read` nests them (:func:`_nested_model_config`).
FORMAT = "riemannian_ref.train/2"
_FORMAT_1 = "riemannian_ref.train/1"

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


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is sharded by FSDP2's ``fully_shard`` (its state is then spread over the ranks)."""
    return isinstance(module, _loaded_type("torch.distributed.fsdp", "FSDPModule"))


def full(t: Tensor) -> Tensor:
    """The whole tensor: a DTensor's shards gathered (a collective: every rank calls it), any other as is."""
    return t.full_tensor() if isinstance(t, _loaded_type("torch.distributed.tensor", "DTensor")) else t


def nonfinite_params(module: nn.Module) -> list[tuple[str, int, int]]:
    """``(name, non-finite entries, entries)`` of every parameter with a non-finite entry; a sharded
    module's counts are summed over the ranks (a collective)."""
    params = [(n, p.detach()) for n, p in module.named_parameters() if p.is_floating_point()]
    dtensor = _loaded_type("torch.distributed.tensor", "DTensor")
    counts = torch.tensor([int((~torch.isfinite(p.to_local() if isinstance(p, dtensor) else p)).sum())
                           for _, p in params], dtype=torch.int64)
    if is_sharded(module):
        dist.all_reduce(counts)
    return [(n, int(k), p.numel()) for (n, p), k in zip(params, counts) if k]


def _full_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def model_state(module: nn.Module) -> dict[str, Tensor]:
    """The module's whole state dict; a sharded module's is gathered to rank 0's CPU (every rank calls it)."""
    if not is_sharded(module):
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_full_options(cpu_offload=True))


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()``; for a sharded module the whole state, gathered to rank 0's CPU (every
    rank calls it) and keyed by parameter index as a single process writes it."""
    if not is_sharded(module):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(module, optimizer, options=_full_options(cpu_offload=True))
    if not osd:  # ranks other than 0 receive nothing
        return osd
    index = {name: i for i, name in enumerate(n for g in osd["param_groups"] for n in g["params"])}
    return {"state": {index[n]: v for n, v in osd["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]}


def _load_model_state(module: nn.Module, state: dict[str, Tensor]) -> None:
    if not is_sharded(module):
        module.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(module, state, options=_full_options())  # every rank holds the whole file


def _load_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    if not is_sharded(module):
        optimizer.load_state_dict(saved)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = {id(p): n for n, p in module.named_parameters()}
    name = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]  # by index, as saved
    keys = [set(g) for g in optimizer.param_groups]  # torch's loader takes no key the groups lack (peak_lr)
    osd = {"state": {name[i]: v for i, v in saved["state"].items()},
           "param_groups": [{k: (v if k != "params" else [name[i] for i in v]) for k, v in g.items() if k in mine}
                            for g, mine in zip(saved["param_groups"], keys)]}
    set_optimizer_state_dict(module, optimizer, osd, options=_full_options())
    for g, s in zip(optimizer.param_groups, saved["param_groups"]):  # every saved key, as load_state_dict does
        g.update({k: v for k, v in s.items() if k != "params"})


def _nested_model_config(mc):
    """A format-1 ``model_config`` as format 2 records it: a flat FiberBundleConfig's attention options nested."""
    if isinstance(mc, dict) and set(mc) & set(MOVED_FIELDS):
        try:
            return dataclasses.asdict(FiberBundleConfig(**nest_flat(mc)))
        except (TypeError, ValueError):  # not a FiberBundleConfig of then: compared as it is
            return mc
    return mc


def write(path: str, payload: dict[str, Any]) -> None:
    """Save ``payload`` (the keys of the schema, ``format`` added here) to ``path`` atomically.

    Through :func:`riemannian_ref._io.atomic_write`: a temporary file next
    to ``path`` is written, flushed to disk and renamed over it, so an
    interrupted write leaves the previous checkpoint intact.
    """
    blob = {"format": FORMAT, **payload}
    atomic_write(path, lambda tmp: torch.save(blob, tmp), "checkpoint_path")


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
    if isinstance(blob, dict) and blob.get("format") == _FORMAT_1:
        blob = {**blob, "format": FORMAT, "model_config": _nested_model_config(blob.get("model_config"))}
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
    rngs = blob.get("torch_rngs", [torch.zeros(0, dtype=torch.uint8)] * blob["world_size"])  # absent from older files
    if not (isinstance(rngs, list) and len(rngs) == blob["world_size"]
            and all(isinstance(s, Tensor) and s.dtype == torch.uint8 for s in rngs)):
        raise ValueError(f"checkpoint {path!r} is damaged: 'torch_rngs' must hold one uint8 generator state "
                         f"per rank ({blob['world_size']})")
    if len(blob["sampler"]) != blob["world_size"] or blob["step"] < 0:
        raise ValueError(f"checkpoint {path!r} is damaged: {len(blob['sampler'])} sampler states for world "
                         f"size {blob['world_size']}, step {blob['step']}")
    return blob


def _shapes(state: dict[str, Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


def _comparable(v):
    """A value ``==`` can compare: tensors as lists, lists as tuples (a tuple round-trips as a tuple)."""
    if isinstance(v, Tensor):
        return ("tensor", tuple(v.shape), v.detach().cpu().tolist())
    if isinstance(v, (list, tuple)):
        return tuple(_comparable(x) for x in v)
    return v


def _diff_dicts(saved: dict, now: dict, label: str, limit: int = 6) -> list[str]:
    keys = sorted(set(saved) | set(now))
    out = []
    for k in keys:
        a, b = saved.get(k, "<absent>"), now.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):  # a nested config (a model's attention): field by field
            out += _diff_dicts(a, b, f"{label}{k}.", limit=len(a) + len(b))
        elif _comparable(a) != _comparable(b):
            a, b = (tuple(x) if isinstance(x, list) else x for x in (a, b))
            out.append(f"{label}{k}: checkpoint {a!r}, now {b!r}")
    return out[:limit] + ([f"... and {len(out) - limit} more {label or 'fields'}"] if len(out) > limit else [])


#: Keys of an optimiser's parameter group that are not hyper-parameters compared at a resume: the
#: parameters themselves, their names, and ``lr``, which the loop sets at every step from ``peak_lr``.
_GROUP_NOT_HPARAMS = ("params", "param_names", "lr")

#: TrainConfig fields that only set the built-in optimiser's hyper-parameters; with
#: ``resume_hparams`` "new" or "checkpoint" they are compared as the groups' values instead.
_OPTIMIZER_FIELDS = ("lr", "weight_decay", "betas", "momentum")


def group_hparams(group: dict) -> dict:
    """A parameter group's hyper-parameters: every key but ``params``, ``param_names`` and ``lr``, with
    ``peak_lr`` (the group's peak rate, which the loop's schedule scales) defaulting to ``lr``."""
    out = {k: v for k, v in group.items() if k not in _GROUP_NOT_HPARAMS}
    if "lr" in group:
        out.setdefault("peak_lr", group["lr"])
    return out


def hparam_diffs(blob: dict, optimizer: torch.optim.Optimizer) -> list[str]:
    """Every hyper-parameter of every group that differs between the checkpoint and ``optimizer``."""
    groups = blob["optimizer"].get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        return []  # reported as a difference of group sizes
    out = []
    for i, (g_saved, g_now) in enumerate(zip(groups, optimizer.param_groups)):
        if isinstance(g_saved, dict):
            out += _diff_dicts(group_hparams(g_saved), group_hparams(g_now), f"optimizer group {i} ", limit=10**9)
    return out


def check_same_run(blob: dict, path: str, *, config, module: nn.Module, optimizer: torch.optim.Optimizer,
                   world_size: int) -> list[str]:
    """Refuse to resume from a checkpoint of another run; return the differing optimiser hyper-parameters.

    Compares the :class:`TrainConfig` fields that define the run
    (:meth:`TrainConfig.run_fields`), the model's configuration when it has one, the
    names and shapes of its parameters and buffers, the optimiser's class,
    the sizes of its parameter groups and, with ``config.resume_hparams ==
    "refuse"``, every hyper-parameter of every group (:func:`group_hparams`),
    and the number of processes. With ``resume_hparams`` "new" or
    "checkpoint", the differing hyper-parameters (and the config's ``lr``,
    ``weight_decay``, ``betas`` and ``momentum``, which only set them) are not
    refused but returned, for :func:`restore` to apply and report.

    Raises
    ------
    ValueError
        Naming ``path`` and listing every difference.
    """
    now_cfg = config.run_fields()
    saved_cfg = {k: v for k, v in blob["config"].items() if k in now_cfg or k not in dataclasses.asdict(config)}
    refuse_hparams = getattr(config, "resume_hparams", "refuse") == "refuse"
    if not refuse_hparams:
        now_cfg = {k: v for k, v in now_cfg.items() if k not in _OPTIMIZER_FIELDS}
        saved_cfg = {k: v for k, v in saved_cfg.items() if k not in _OPTIMIZER_FIELDS}
    diffs = _diff_dicts(saved_cfg, now_cfg, "TrainConfig.")
    mc = model_config(module)
    if mc is not None or blob["model_config"] is not None:
        diffs += _diff_dicts(blob["model_config"] or {}, mc or {}, "model config ")
    diffs += _diff_dicts(_shapes(blob["model"]), _shapes(module.state_dict()), "model tensor ")
    hdiffs: list[str] = []
    if blob["optimizer_class"] != optimizer_class(optimizer):
        diffs.append(f"optimizer: checkpoint {blob['optimizer_class']}, now {optimizer_class(optimizer)}")
    else:
        groups = blob["optimizer"].get("param_groups")
        saved = ([len(g.get("params", ())) if isinstance(g, dict) else None for g in groups]
                 if isinstance(groups, list) else None)
        now = [len(g["params"]) for g in optimizer.param_groups]
        if saved != now:
            diffs.append(f"optimizer parameter groups: checkpoint sizes {saved}, now {now}")
        else:
            hdiffs = hparam_diffs(blob, optimizer)
            if refuse_hparams and hdiffs:
                diffs += hdiffs[:6] + ([f"... and {len(hdiffs) - 6} more hyper-parameters"] if len(hdiffs) > 6
                                       else [])
                diffs.append("(TrainConfig(resume_hparams='new') applies the new hyper-parameters, "
                             "resume_hparams='checkpoint' keeps the checkpoint's)")
    if blob["world_size"] != world_size:
        diffs.append(f"world size: checkpoint {blob['world_size']}, now {world_size}")
    if diffs:
        raise ValueError(
            f"checkpoint {path!r} belongs to another run; refusing to resume from it (nothing was loaded): "
            + "; ".join(diffs)
            + ". Resume with the same configuration, or give this run its own checkpoint_path.")
    return hdiffs


_HISTORY_KEYS = ("step", "lr", "train_loss", "val_loss", "val_accuracy", "val_seq_accuracy", "tokens_per_s",
                 "time_s")
#: Per-layer attention diagnostics, lists of lists (absent from checkpoints written before they existed).
_DIAG_KEYS = ("attn_entropy", "metric_eig")


def eval_steps(step: int, config) -> list[int]:
    """The steps the loop has evaluated at when it has done ``step`` steps: 0, every ``eval_interval``,
    and ``config.steps``."""
    out = list(range(0, step + 1, config.eval_interval))
    if step == config.steps and out[-1] != step:
        out.append(step)
    return out


def _damaged(path: str, field: str, what: str) -> ValueError:
    return ValueError(f"checkpoint {path!r} is damaged: {field} {what}; refusing to resume from it "
                      f"(nothing was loaded)")


def _check_generator_state(state: Tensor, path: str, field: str) -> None:
    """A state a CPU :class:`torch.Generator` accepts (size and content), checked on a throwaway one."""
    size = torch.Generator().get_state().numel()
    if state.dtype != torch.uint8 or state.dim() != 1 or state.numel() != size:
        raise _damaged(path, field, f"should be a CPU generator state (uint8, {size} bytes), got "
                                    f"{state.dtype} of shape {tuple(state.shape)}")
    try:
        torch.Generator().set_state(state.cpu())
    except (RuntimeError, ValueError, TypeError) as exc:
        raise _damaged(path, field, f"is not a valid CPU generator state ({str(exc).splitlines()[0]})") from None


def _structure(v):
    """The shape of a state value: tensors by shape, lists/tuples element-wise, other values by type."""
    if isinstance(v, Tensor):
        return ("tensor", tuple(v.shape))
    if isinstance(v, (list, tuple)):
        return ("list", tuple(_structure(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((str(k), _structure(x)) for k, x in v.items())))
    if isinstance(v, bool) or v is None:
        return type(v).__name__
    if isinstance(v, (int, float)):
        return "number"
    return type(v).__name__


def _tensors(v):
    if isinstance(v, Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _tensors(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _tensors(x)


def _copy_bound_to_clones(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A deep copy of ``optimizer`` whose groups hold clones of its parameters (the caller's are untouched)."""
    from .optim.manifold import ManifoldParameter

    memo = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if isinstance(p, ManifoldParameter):  # its copy keeps the manifold (a factor pair's stays shared)
                copy.deepcopy(p, memo)
            elif id(p) not in memo:
                memo[id(p)] = p.detach().clone().requires_grad_(p.requires_grad)
    return copy.deepcopy(optimizer, memo)


def _reference_state(optimizer: torch.optim.Optimizer) -> dict | None:
    """The state one step of a copy of ``optimizer`` creates for every parameter (zero gradients, on
    clones); None if the optimiser cannot be copied or stepped that way (e.g. it needs a closure)."""
    try:
        dry = _copy_bound_to_clones(optimizer)
        for g in dry.param_groups:
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        type(dry).step(dry)  # the class's step: an instance attribute may close over the caller's objects
        return dry.state_dict()["state"]
    except Exception:  # noqa: BLE001 - no reference: the shape check is skipped, the trial load still runs
        return None


def _check_optimizer_state(blob: dict, path: str, optimizer: torch.optim.Optimizer) -> None:
    saved = blob["optimizer"]
    state = saved.get("state")
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {path!r} is damaged: the optimiser's state does not load ('optimizer' has no "
                         f"'state' dict); refusing to resume from it (nothing was loaded)")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ref = _reference_state(optimizer)
    for idx, entry in state.items():
        field = f"'optimizer' state of parameter {idx!r}"
        if isinstance(idx, int) and not isinstance(idx, bool):
            if not 0 <= idx < len(params):
                raise _damaged(path, field, f"names no parameter (the optimiser has {len(params)})")
        for t in _tensors(entry):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise _damaged(path, field, "holds non-finite values")
        if ref is None or idx not in ref:
            continue
        want = ref[idx]
        if not isinstance(entry, dict) or not isinstance(want, dict):
            if _structure(entry) != _structure(want):
                raise _damaged(path, field, f"is {type(entry).__name__}, the optimiser keeps "
                                            f"{type(want).__name__}")
            continue
        missing, extra = sorted(set(want) - set(entry), key=str), sorted(set(entry) - set(want), key=str)
        if missing or extra:
            raise _damaged(path, field, f"has keys {sorted(entry, key=str)}, the optimiser keeps "
                                        f"{sorted(want, key=str)} (shape {tuple(params[idx].shape)})")
        for key in want:
            a, b = _structure(entry[key]), _structure(want[key])
            if a != b:
                raise _damaged(path, f"{field}, key {key!r},",
                               f"has {_describe(entry[key])}, the optimiser keeps {_describe(want[key])} for a "
                               f"parameter of shape {tuple(params[idx].shape)}")
    try:
        trial = _copy_bound_to_clones(optimizer)
    except Exception:  # noqa: BLE001 - an optimiser that cannot be copied: restore() still loads all or nothing
        return
    try:  # torch's own checks, on the throwaway copy
        trial.load_state_dict(saved)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"checkpoint {path!r}: the optimiser's state does not load ({type(exc).__name__}: "
                         f"{exc}); refusing to resume from it (nothing was loaded)") from None


def _describe(v) -> str:
    if isinstance(v, Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_describe(x) for x in v) + "]"
    return type(v).__name__


def validate(blob: dict, path: str, *, config, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Check every value of a schema-checked checkpoint of this run before anything is loaded.

    The RNG and batch-sampler states must be states a CPU generator accepts
    (checked on throwaway generators); ``step`` must lie in ``[0,
    config.steps]``; the history must hold every key the loop writes, as lists
    of numbers of one length, evaluated at the steps the loop evaluates at
    (0, every ``eval_interval``, and ``steps``) up to ``step``, with
    ``n_since`` the steps after the last of them; the times, token count and
    accumulated loss must be finite and non-negative where they count; the
    model's parameters must be finite; and the optimiser's per-parameter state
    must have the keys and shapes that one step of a copy of ``optimizer``
    (on clones of the parameters, with zero gradients) creates, and load into
    another copy.

    Raises
    ------
    ValueError
        Naming ``path`` and the field.
    """
    _check_generator_state(blob["torch_rng"], path, "'torch_rng' (torch's global RNG state)")
    for r, s in enumerate(blob.get("torch_rngs", ())):
        _check_generator_state(s, path, f"'torch_rngs' state of rank {r}")
    for r, s in enumerate(blob["sampler"]):
        _check_generator_state(s, path, f"'sampler' state of rank {r}")
    step = blob["step"]
    if not 0 <= step <= config.steps:
        raise _damaged(path, "'step'", f"is {step}, outside [0, steps={config.steps}]")
    hist = blob["history"]
    if isinstance(hist, dict) and not set(_DIAG_KEYS) & set(hist) and isinstance(hist.get("step"), list):
        # written before the loop recorded attention diagnostics: none were recorded at those evaluations
        hist.update({k: [[] for _ in hist["step"]] for k in _DIAG_KEYS})
    keys = set(hist)
    every = (*_HISTORY_KEYS, *_DIAG_KEYS)
    if keys != set(every):
        missing, extra = sorted(set(every) - keys, key=str), sorted(keys - set(every), key=str)
        raise _damaged(path, "'history'", f"should have the keys {list(every)}"
                       + (f"; missing {missing}" if missing else "") + (f"; unexpected {extra}" if extra else ""))

    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    for k in _HISTORY_KEYS:
        v = hist[k]
        if not isinstance(v, list) or not all(number(x) for x in v):
            raise _damaged(path, f"'history' list {k!r}", "should be a list of numbers")
    for k in _DIAG_KEYS:
        v = hist[k]
        if not isinstance(v, list) or not all(isinstance(x, list) and all(number(y) for y in x) for x in v):
            raise _damaged(path, f"'history' list {k!r}", "should be a list of lists of numbers (one per layer)")
    lengths = {k: len(hist[k]) for k in every}
    if len(set(lengths.values())) != 1:
        raise _damaged(path, "'history'", f"has lists of different lengths {lengths}")
    want = eval_steps(step, config)
    if hist["step"] != want:
        raise _damaged(path, "'history' list 'step'", f"is {hist['step']}, but a run at step {step} with "
                       f"eval_interval={config.eval_interval} and steps={config.steps} has evaluated at {want}")
    if blob["n_since"] != step - want[-1]:
        raise _damaged(path, "'n_since'", f"is {blob['n_since']}, but step {step} is {step - want[-1]} steps "
                       f"after the last evaluation")
    for key in ("train_time_s", "loss_since"):
        v = blob[key]
        if not (math.isfinite(v) and v >= 0):
            raise _damaged(path, repr(key), f"is {v}, expected a finite number >= 0")
    if blob["tokens_seen"] < 0:
        raise _damaged(path, "'tokens_seen'", f"is {blob['tokens_seen']}, expected >= 0")
    param_names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    for name, t in blob["model"].items():
        if name in param_names and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise _damaged(path, f"model parameter {name!r}", f"is not finite ({bad} of {t.numel()} entries)")
    _check_optimizer_state(blob, path, optimizer)


def restore(blob: dict, path: str, *, config, module: nn.Module, optimizer: torch.optim.Optimizer,
            sampler: torch.Generator, rank: int, hdiffs: list[str] = ()) -> None:
    """Load the model, optimiser, batch-sampler and global RNG states, all of them or none.

    With ``hdiffs`` (the hyper-parameters that differ, from
    :func:`check_same_run`) and ``config.resume_hparams == "new"``, the
    optimiser's groups keep the caller's hyper-parameters; with
    ``"checkpoint"`` they take the checkpoint's. Either way a warning lists
    the differences. Torch's errors become ones naming ``path``.
    """
    before_model = {k: v.detach().clone() for k, v in module.state_dict().items()}
    before_opt = copy.deepcopy(optimizer.state_dict())
    now_groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in optimizer.param_groups]
    before_sampler, before_rng = sampler.get_state(), torch.get_rng_state()
    stage = "the model's state"
    try:
        if is_sharded(module):  # torch's loader steps a fresh optimiser once (lr 0): the weights load after
            stage = "the optimiser's state"
            _load_optimizer_state(module, optimizer, blob["optimizer"])
            stage = "the model's state"
        _load_model_state(module, blob["model"])
        if not is_sharded(module):
            stage = "the optimiser's state"
            optimizer.load_state_dict(blob["optimizer"])
        if hdiffs and config.resume_hparams == "new":
            for g, mine in zip(optimizer.param_groups, now_groups):
                lr = g.get("lr")
                for k in [k for k in g if k not in ("params", "param_names")]:
                    del g[k]
                g.update(mine)
                g.setdefault("peak_lr", mine.get("lr"))
                if lr is not None:
                    g["lr"] = lr
        stage = "the batch sampler's state"
        sampler.set_state(blob["sampler"][rank].cpu())
        stage = "torch's global RNG state"
        torch.set_rng_state(blob.get("torch_rngs", [blob["torch_rng"]] * (rank + 1))[rank].cpu())
    except Exception as exc:  # all or nothing
        module.load_state_dict(before_model)
        optimizer.load_state_dict(before_opt)
        sampler.set_state(before_sampler)
        torch.set_rng_state(before_rng)
        raise ValueError(f"checkpoint {path!r}: {stage} does not load ({type(exc).__name__}: {exc}); nothing "
                         f"was loaded") from None
    if hdiffs:
        kept = ("the new values apply" if config.resume_hparams == "new" else
                "the checkpoint's values apply, the new ones are discarded")
        warnings.warn(f"resuming from {path!r} with changed optimiser hyper-parameters "
                      f"(resume_hparams={config.resume_hparams!r}: {kept}): " + "; ".join(hdiffs),
                      UserWarning, stacklevel=4)


def save(path: str, *, config, module: nn.Module, optimizer: torch.optim.Optimizer, sampler: torch.Generator,
         rank: int, world_size: int, progress: dict[str, Any]) -> None:
    """Write the run's state (rank 0 writes; every rank's batch-sampler and RNG states are gathered first).

    ``progress`` holds ``history``, ``step``, ``train_time_s``, ``tokens_seen``,
    ``loss_since`` and ``n_since``.

    Raises
    ------
    FloatingPointError
        Naming the parameters, if one is not finite: nothing is written, the
        previous checkpoint stays as it was.
    """
    bad = [n for n, _, _ in nonfinite_params(module)]
    if bad:
        raise FloatingPointError(f"refusing to write checkpoint {path!r}: parameter(s) {bad[:5]} are not finite; "
                                 f"the previous checkpoint is left as it was")
    states = [(sampler.get_state(), torch.get_rng_state())]
    if world_size > 1:  # every rank's batch-order and RNG states, so resume is exact on all ranks
        mine, states = states[0], [None] * world_size
        dist.all_gather_object(states, mine)
    model, opt = model_state(module), optimizer_state(module, optimizer)  # gathered to rank 0 when sharded
    if rank == 0:
        write(path, {"model": model, "model_config": model_config(module),
                     "optimizer": opt, "optimizer_class": optimizer_class(optimizer),
                     "sampler": [s for s, _ in states], "torch_rng": states[0][1],
                     "torch_rngs": [r for _, r in states], "world_size": world_size,
                     "config": dataclasses.asdict(config), **progress})
    if world_size > 1:
        dist.barrier()


def resume(path: str, *, config, module: nn.Module, optimizer: torch.optim.Optimizer, sampler: torch.Generator,
           rank: int, world_size: int, device) -> dict[str, Any]:
    """Read ``path`` safely, refuse another run's file, validate every value, then restore the model,
    optimiser, batch-sampler and RNG states (all or nothing).

    Returns the checkpoint, whose ``history``, ``step``, ``train_time_s``,
    ``tokens_seen``, ``loss_since`` and ``n_since`` continue the run.
    """
    ck = read(path, map_location=device)
    _vector_scalars(ck, module, optimizer)
    hdiffs = check_same_run(ck, path, config=config, module=module, optimizer=optimizer, world_size=world_size)
    validate(ck, path, config=config, module=module, optimizer=optimizer)
    restore(ck, path, config=config, module=module, optimizer=optimizer, sampler=sampler, rank=rank, hdiffs=hdiffs)
    return ck


def _vector_scalars(blob: dict, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Reshape to (1,) the 0-d parameters of an older checkpoint that are (1,) now, and their optimiser state.

    FSDP2 shards no 0-d parameter, so the fibre-bundle block's ``eta`` became
    (1,): the same one number. An optimiser-state tensor is reshaped where the
    optimiser now keeps a (1,) tensor (one dry step on clones tells), not a
    step count.
    """
    state, ref = blob["optimizer"].get("state"), None
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    for name, p in module.named_parameters():
        t = blob["model"].get(name)
        if not (isinstance(t, Tensor) and t.dim() == 0 and tuple(p.shape) == (1,)):
            continue
        blob["model"][name] = t.reshape(1)
        entry = state.get(index.get(id(p))) if isinstance(state, dict) else None
        if isinstance(entry, dict):
            ref = _reference_state(optimizer) if ref is None else ref
            want = (ref or {}).get(index[id(p)], {})
            for k, v in entry.items():
                if isinstance(v, Tensor) and v.dim() == 0 and isinstance(want.get(k), Tensor) \
                        and tuple(want[k].shape) == (1,):
                    entry[k] = v.reshape(1)


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
