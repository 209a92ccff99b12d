r"""The package's one training loop, for every model on a :class:`~riemannian_ref.data.TaskData`.

``train(model, train_data, val_data, config)`` minimises the masked
cross-entropy

.. math:: \mathcal{L} = \frac{1}{|M|} \sum_{(b, t) \in M} -\log \mathrm{softmax}(\mathrm{logits}_{b t})_{y_{b t}}

over the scored positions :math:`M` (``mask``), with AdamW or SGD, a constant
or warm-up-plus-cosine learning rate, gradient clipping, periodic evaluation,
evaluation hooks, checkpoints and exact resumption. It returns the metrics
history as a dict of lists.

The model interface is ``model(idx) -> logits`` of shape ``[B, n, V]``; a
model returning a tuple ``(logits, ...)`` or a dict with ``"logits"`` is
accepted too.

Distributed data parallel: when ``torch.distributed`` is initialised with
more than one process, :func:`train` wraps the model in
:class:`~torch.nn.parallel.DistributedDataParallel`, each rank draws its
batches from its own shard of the training examples (``rank::world_size``),
``batch_size`` is the global batch (split evenly across ranks), and losses
and metrics are all-reduced so every rank returns the same history. Nothing
here prints; a ``tqdm`` bar is drawn only when ``config.progress`` is true
(and only on rank 0).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .data import TaskData

__all__ = [
    "TrainConfig",
    "TrainResult",
    "train",
    "evaluate",
    "masked_cross_entropy",
    "logits_of",
    "lr_at",
    "seed_everything",
]

Hook = Callable[[int, dict], None]


@dataclass
class TrainConfig:
    r"""Everything :func:`train` needs besides the model and the data.

    :func:`train` calls :meth:`validate`, which raises ``ValueError`` naming
    the first bad field.

    Parameters
    ----------
    optimizer : {"adamw", "sgd"}, default "adamw"
        :class:`torch.optim.AdamW` or :class:`torch.optim.SGD`.
    lr : float, default 1e-3
        Peak learning rate :math:`\eta` (positive, finite); the schedule is
        :func:`lr_at`.
    weight_decay : float, default 0.0
        Decoupled weight decay for AdamW, an L2 term for SGD; applied only to
        parameters with two or more dimensions (not to biases, norms' gains
        or other vectors).
    betas : (float, float), default (0.9, 0.98)
        AdamW's moment coefficients (unused by SGD).
    momentum : float, default 0.9
        SGD's momentum (unused by AdamW).
    schedule : {"constant", "cosine"}, default "cosine"
        Learning rate after the warm-up: constant :math:`\eta`, or a cosine
        decay to ``lr * min_lr_ratio`` at the last step.
    warmup_steps : int, default 0
        Linear warm-up length :math:`W`, in ``[0, steps)``: step
        :math:`s < W` uses :math:`\eta (s + 1) / W`.
    min_lr_ratio : float, default 0.1
        :math:`\rho \in [0, 1]`: the cosine schedule ends at :math:`\rho\eta`.
    grad_clip : float or None, default 1.0
        Clip the global gradient norm (over all parameters) to this; None:
        no clipping.
    steps : int, default 1000
        Total optimiser steps; defines the schedule and the final evaluation.
    batch_size : int or None, default 32
        Global batch size: under DDP each of the ranks takes
        ``batch_size / world_size`` (it must divide). Batches are drawn
        uniformly with replacement from the (rank's shard of the) training
        examples. None: full batch, every step uses all (the rank's shard of
        the) training examples, in order.
    eval_interval : int, default 100
        Evaluate at step 0, every ``eval_interval`` steps and at ``steps``.
    eval_batch_size : int, default 256
        Batch size of :func:`evaluate`, per rank.
    eval_max_examples : int or None, default None
        Evaluate on the first this many validation examples; None: all.
    seed : int, default 0
        Seed of the batch order (independent of the model); it does not seed
        the model's initialisation or torch's global generator (use
        :func:`seed_everything` before building the model).
    device : str, default "cpu"
        Where the model and batches go: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...
    progress : bool, default False
        Draw a ``tqdm`` progress bar (on rank 0 only).
    checkpoint_path : str or None, default None
        Save model, optimiser, batch-sampler and global RNG states and the
        history here (atomically, on rank 0) after every evaluation but the
        one at step 0, and at the stop when ``stop_at_step`` falls between
        evaluations; None: no checkpoints.
    resume : bool, default False
        Continue from ``checkpoint_path`` if that file exists (it must be set);
        the resumed run reproduces the uninterrupted one.
    stop_at_step : int or None, default None
        Stop after this step (in ``[1, steps]``), saving a checkpoint there
        if ``checkpoint_path`` is set, e.g. before a job's time limit; the
        schedule is still that of ``steps``. None: run to ``steps``.
    """

    optimizer: str = "adamw"  # "adamw" or "sgd"
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.0  # decoupled for AdamW, L2 for SGD
    betas: tuple[float, float] = (0.9, 0.98)  # AdamW
    momentum: float = 0.9  # SGD
    schedule: str = "cosine"  # "constant" or "cosine" (both after linear warm-up)
    warmup_steps: int = 0  # linear warm-up from lr / warmup_steps
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    grad_clip: float | None = 1.0  # max global gradient norm; None: no clipping
    steps: int = 1000  # total optimiser steps (defines the schedule)
    batch_size: int | None = 32  # global batch (divided across DDP ranks); None: full batch
    eval_interval: int = 100  # evaluate at step 0, every eval_interval steps and at the end
    eval_batch_size: int = 256  # per rank
    eval_max_examples: int | None = None  # evaluate on a prefix of val (None: all of it)
    seed: int = 0  # batch order only (not the model's init, not torch's global RNG)
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    progress: bool = False  # draw a tqdm bar (rank 0 only)
    checkpoint_path: str | None = None  # save here at every evaluation and at the end
    resume: bool = False  # continue from checkpoint_path if it exists
    stop_at_step: int | None = None  # stop early (after checkpointing), e.g. a job time limit

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"schedule must be 'constant' or 'cosine', got {self.schedule!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip!r}")
        for name in ("steps", "eval_interval", "eval_batch_size") + (("batch_size",) if self.batch_size is not None else ()):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) \
                or not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be an int in [0, steps={self.steps}), got {self.warmup_steps!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio!r}")
        if self.resume and not self.checkpoint_path:
            raise ValueError("resume=True needs a checkpoint_path")
        if self.stop_at_step is not None and not 1 <= self.stop_at_step <= self.steps:
            raise ValueError(f"stop_at_step must be in [1, steps={self.steps}] or None, got {self.stop_at_step!r}")
        if self.eval_max_examples is not None and self.eval_max_examples < 1:
            raise ValueError(f"eval_max_examples must be >= 1 or None, got {self.eval_max_examples!r}")


@dataclass
class TrainResult:
    """What :func:`train` returns.

    ``history`` maps ``"step"``, ``"lr"``, ``"train_loss"`` (mean over the
    steps since the previous evaluation; ``nan`` at step 0), ``"val_loss"``,
    ``"val_accuracy"`` (scored positions), ``"val_seq_accuracy"`` (examples
    with every scored position right), ``"tokens_per_s"`` (input tokens of all
    ranks per second of training, evaluation excluded) and ``"time_s"``
    (cumulative training seconds) to lists, one entry per evaluation.

    Parameters
    ----------
    history : dict of str to list
        The metrics of every evaluation, as above.
    final : dict of str to float
        ``val_loss``, ``val_accuracy`` and ``val_seq_accuracy`` of the last
        evaluation.
    steps_done : int
        The last optimiser step taken (``stop_at_step`` when stopped early).
    train_time_s : float
        Seconds spent in training steps (evaluation excluded), including
        those before a resume.
    tokens_per_s : float
        Input tokens of all ranks per training second over the whole run;
        ``nan`` if no step was timed.
    n_params : int
        Number of trainable parameters of the model.
    config : dict, default {}
        The :class:`TrainConfig` as a dict (:func:`dataclasses.asdict`).
    """

    history: dict[str, list]
    final: dict[str, float]
    steps_done: int
    train_time_s: float
    tokens_per_s: float
    n_params: int
    config: dict = field(default_factory=dict)


def _count_params(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def seed_everything(seed: int) -> None:
    """Seed torch's global CPU and CUDA generators (for initialisation).

    Calls :func:`torch.manual_seed`; Python's :mod:`random` and NumPy are
    not seeded.

    Parameters
    ----------
    seed : int
        The seed.
    """
    torch.manual_seed(seed)


def lr_at(step: int, config: TrainConfig) -> float:
    r"""Learning rate for optimiser step ``step`` (0-based).

    Linear warm-up :math:`\eta (s+1)/W` for :math:`s < W`, then ``constant``
    :math:`\eta`, or ``cosine``
    :math:`\eta\,(\rho + (1-\rho)\tfrac12(1 + \cos \pi t))`, with
    :math:`t = (s - W)/(S - 1 - W)` going from 0 to 1 over the remaining steps
    and :math:`\rho` = ``min_lr_ratio``. Here :math:`\eta` = ``lr``,
    :math:`W` = ``warmup_steps``, :math:`S` = ``steps``; if no step follows
    the warm-up (:math:`S - 1 \le W`) the rate stays :math:`\eta`, and
    :math:`t` is capped at 1 for steps beyond :math:`S - 1`.

    Parameters
    ----------
    step : int
        Optimiser step :math:`s \ge 0` (0-based: :func:`train` passes
        ``step - 1`` for its step ``step``).
    config : TrainConfig
        Supplies ``lr``, ``schedule``, ``warmup_steps``, ``min_lr_ratio``
        and ``steps``.

    Returns
    -------
    float
    """
    W, S, eta = config.warmup_steps, config.steps, config.lr
    if step < W:
        return eta * (step + 1) / W
    if config.schedule == "constant" or S - 1 - W <= 0:
        return eta
    t = min(1.0, (step - W) / (S - 1 - W))
    rho = config.min_lr_ratio
    return eta * (rho + (1 - rho) * 0.5 * (1 + math.cos(math.pi * t)))


def logits_of(out) -> Tensor:
    """The logits in a model's output: the tensor itself, ``out[0]`` or ``out["logits"]``.

    Parameters
    ----------
    out : Tensor, tuple, list or dict
        A model's output: the logits ``[B, n, V]``, a tuple or list whose
        first item is them, or a dict with the key ``"logits"``. Anything
        else raises ``ValueError``; the shape is not checked here.

    Returns
    -------
    Tensor, shape [B, n, V]
    """
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    if isinstance(out, dict) and "logits" in out:
        return out["logits"]
    raise ValueError(f"the model must return logits [B, n, V] (or a tuple/dict holding them), got {type(out).__name__}")


def masked_cross_entropy(logits: Tensor, y: Tensor, mask: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy of ``logits`` against ``y`` on the positions where ``mask`` is true.

    Parameters
    ----------
    logits : Tensor, shape [B, n, V]
    y : Tensor, shape [B, n], int64
    mask : Tensor, shape [B, n], bool
    reduction : "mean" or "sum"
    """
    if logits.dim() != 3 or logits.shape[:2] != y.shape:
        raise ValueError(f"logits must have shape [B, n, V] with [B, n] = {tuple(y.shape)}, got {tuple(logits.shape)}")
    sel = logits[mask]  # (M, V)
    return F.cross_entropy(sel.float(), y[mask], reduction=reduction)


def _dist() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_sum(values: list[float], device: torch.device) -> list[float]:
    rank, world = _dist()
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate(model: nn.Module, data: TaskData, *, batch_size: int = 256, device: str | torch.device = "cpu",
             max_examples: int | None = None) -> dict[str, float]:
    """Masked loss and accuracies of ``model`` on ``data`` (all-reduced under DDP).

    Under an initialised process group each rank evaluates its shard
    ``rank::world_size`` of the (first ``max_examples``) examples and the sums
    are all-reduced, so every rank returns the metrics of the whole set.
    Runs without gradients in eval mode and restores the model's
    training/eval mode afterwards; a ``DistributedDataParallel`` wrapper is
    unwrapped first.

    Parameters
    ----------
    model : nn.Module
        ``model(x [B, n]) -> logits [B, n, V]`` (or a tuple/dict holding
        them, see :func:`logits_of`), already on ``device``.
    data : TaskData
    batch_size : int, default 256
        Examples per forward pass (per rank).
    device : str or torch.device, default "cpu"
        Where the batches are moved.
    max_examples : int or None, default None
        Evaluate on the first this many examples; None: all.

    Returns
    -------
    dict of str to float
        ``loss`` (mean cross-entropy over scored positions), ``accuracy``
        (fraction of scored positions whose argmax is the target),
        ``seq_accuracy`` (fraction of examples with every scored position
        right) and ``n_scored`` (number of scored positions).

    Raises
    ------
    ValueError
        If no position is scored (empty data or an all-false mask).
    """
    device = torch.device(device)
    rank, world = _dist()
    # Evaluate the bare module: a DDP forward may run collectives (buffer broadcast),
    # which would hang when the ranks' shards give different numbers of batches.
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    n = len(data) if max_examples is None else min(len(data), max_examples)
    idx = torch.arange(rank, n, world)
    was_training = model.training
    model.eval()
    loss_sum = correct = seq_right = n_scored = 0.0
    for start in range(0, len(idx), batch_size):
        b = idx[start:start + batch_size]
        x, y, m = data.x[b].to(device), data.y[b].to(device), data.mask[b].to(device)
        logits = logits_of(model(x))
        loss_sum += masked_cross_entropy(logits, y, m, reduction="sum").item()
        hit = (logits.argmax(-1) == y) | ~m  # (B, n) true where right or not scored
        correct += (hit & m).sum().item()
        seq_right += hit.all(dim=1).sum().item()
        n_scored += m.sum().item()
    model.train(was_training)
    loss_sum, correct, seq_right, n_scored, n_ex = _all_sum([loss_sum, correct, seq_right, n_scored, len(idx)], device)
    if n_scored == 0:
        raise ValueError("evaluate: no scored positions (empty data or an all-false mask)")
    return {"loss": loss_sum / n_scored, "accuracy": correct / n_scored,
            "seq_accuracy": seq_right / n_ex, "n_scored": n_scored}


def _make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    # No weight decay on biases, norms' gains and other vectors (nanoGPT's rule).
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)


def _empty_history() -> dict[str, list]:
    return {k: [] for k in ("step", "lr", "train_loss", "val_loss", "val_accuracy",
                            "val_seq_accuracy", "tokens_per_s", "time_s")}


def train(model: nn.Module, train_data: TaskData, val_data: TaskData, config: TrainConfig, *,
          optimizer: torch.optim.Optimizer | None = None, hooks: Sequence[Hook] = ()) -> TrainResult:
    """Train ``model`` on ``train_data``, evaluating on ``val_data``.

    Parameters
    ----------
    model : nn.Module
        ``model(idx [B, n]) -> logits [B, n, C]`` (or a tuple or dict holding
        them, :func:`logits_of`); moved to ``config.device``. Under DDP pass
        the plain module: it is wrapped here.
    train_data, val_data : TaskData
    config : TrainConfig
    optimizer : torch.optim.Optimizer, optional
        Built by the caller over the model's parameters (e.g. a
        :class:`~riemannian_ref.optim.adam.StiefelAdam` with its own groups);
        each group's ``lr`` is its peak rate, which the schedule of ``config``
        scales (warm-up, cosine). None: AdamW or SGD as ``config`` says, with
        no weight decay on vectors.
    hooks : sequence of callables ``hook(step, metrics)``
        Called (on every rank) after each evaluation with the step and the dict
        of that evaluation's metrics (the last entry of every history list).

    Returns
    -------
    TrainResult
        The history (dict of lists), the final metrics, steps done, training
        time, throughput and parameter count. With ``checkpoint_path`` the
        model, optimiser, batch-sampler state and history are saved at every
        evaluation; ``resume=True`` continues from there and reproduces the
        uninterrupted run exactly (same batches, same schedule).
    """
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
    config.validate()
    if not isinstance(train_data, TaskData) or not isinstance(val_data, TaskData):
        raise ValueError("train_data and val_data must be TaskData")
    device = torch.device(config.device)
    rank, world = _dist()
    if config.batch_size is not None and config.batch_size % world:
        raise ValueError(f"batch_size={config.batch_size} must be divisible by the world size {world}")
    local_bs = None if config.batch_size is None else config.batch_size // world
    shard = torch.arange(rank, len(train_data), world)
    if len(shard) == 0:
        raise ValueError(f"rank {rank} has no training examples ({len(train_data)} examples, world {world})")

    model.to(device)
    module = model
    if world > 1 and not isinstance(model, nn.parallel.DistributedDataParallel):
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
        module = model.module
    n_params = _count_params(module)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    opt = optimizer if optimizer is not None else _make_optimizer(module, config)
    for g in opt.param_groups:  # the schedule scales every group's own peak rate
        g.setdefault("peak_lr", g["lr"])
    sampler = torch.Generator().manual_seed(config.seed * 1_000_003 + rank)
    history = _empty_history()
    start_step, train_time, tokens_seen = 0, 0.0, 0
    loss_since, n_since = 0.0, 0  # training loss accumulated since the last evaluation

    if config.resume and config.checkpoint_path and os.path.exists(config.checkpoint_path):
        ck = torch.load(config.checkpoint_path, map_location=device, weights_only=False)
        if ck.get("world_size", 1) != world:
            raise ValueError(f"checkpoint was written with world size {ck.get('world_size')}, now {world}")
        module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sampler.set_state(ck["sampler"][rank])
        torch.set_rng_state(ck["torch_rng"])
        history, start_step = ck["history"], ck["step"]
        train_time, tokens_seen = ck["train_time_s"], ck["tokens_seen"]
        loss_since, n_since = ck["loss_since"], ck["n_since"]

    def save(step: int) -> None:
        if not config.checkpoint_path:
            return
        states = [sampler.get_state()]
        if world > 1:  # every rank's batch-order state, so resume is exact on all ranks
            states = [torch.empty_like(states[0]) for _ in range(world)]
            dist.all_gather_object(states, sampler.get_state())
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(config.checkpoint_path)), exist_ok=True)
            tmp = config.checkpoint_path + ".tmp"
            torch.save({"model": module.state_dict(), "optimizer": opt.state_dict(), "sampler": states,
                        "torch_rng": torch.get_rng_state(), "history": history, "step": step,
                        "train_time_s": train_time, "tokens_seen": tokens_seen, "world_size": world,
                        "loss_since": loss_since, "n_since": n_since,
                        "config": asdict(config)}, tmp)
            os.replace(tmp, config.checkpoint_path)
        if world > 1:
            dist.barrier()

    def log_eval(step: int, loss_since: float, n_since: int) -> dict:
        m = evaluate(model, val_data, batch_size=config.eval_batch_size, device=device,
                     max_examples=config.eval_max_examples)
        entry = {"step": step, "lr": opt.param_groups[0]["peak_lr"] * lr_at(max(step - 1, 0), config) / config.lr,
                 "train_loss": loss_since / n_since if n_since else float("nan"),
                 "val_loss": m["loss"], "val_accuracy": m["accuracy"], "val_seq_accuracy": m["seq_accuracy"],
                 "tokens_per_s": tokens_seen / train_time if train_time > 0 else float("nan"),
                 "time_s": train_time}
        for k, v in entry.items():
            history[k].append(v)
        for hook in hooks:
            hook(step, dict(entry))
        return entry

    if start_step == 0:
        log_eval(0, 0.0, 0)
    stop = config.steps if config.stop_at_step is None else config.stop_at_step
    bar = None
    if config.progress and rank == 0:
        from tqdm.auto import tqdm
        bar = tqdm(total=config.steps, initial=start_step, desc="train", leave=False)
    model.train()
    step = start_step
    for step in range(start_step + 1, stop + 1):
        t0 = time.perf_counter()
        factor = lr_at(step - 1, config) / config.lr
        for g in opt.param_groups:
            g["lr"] = g["peak_lr"] * factor
        b = shard if local_bs is None else shard[torch.randint(0, len(shard), (local_bs,), generator=sampler)]
        x, y, m = (train_data.x[b].to(device), train_data.y[b].to(device), train_data.mask[b].to(device))
        loss = masked_cross_entropy(logits_of(model(x)), y, m)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip is not None:
            nn.utils.clip_grad_norm_(module.parameters(), config.grad_clip)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_time += time.perf_counter() - t0
        tokens_seen += x.numel() * world
        loss_since += _all_sum([loss.item()], device)[0] / world
        n_since += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % config.eval_interval == 0 or step == config.steps:
            entry = log_eval(step, loss_since, n_since)
            loss_since, n_since = 0.0, 0
            if bar is not None:
                bar.set_postfix(val_loss=f"{entry['val_loss']:.3f}")
            save(step)
    if bar is not None:
        bar.close()
    if step > start_step and history["step"][-1] != step:  # stopped between evaluations
        save(step)
    final = {k: history[k][-1] for k in ("val_loss", "val_accuracy", "val_seq_accuracy")}
    return TrainResult(history=history, final=final, steps_done=step, train_time_s=train_time,
                       tokens_per_s=tokens_seen / train_time if train_time > 0 else float("nan"),
                       n_params=n_params, config=asdict(config))
