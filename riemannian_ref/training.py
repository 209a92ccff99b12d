r"""The package's one training loop, for every model on a :class:`~riemannian_ref.data.TaskData`.

``train(model, train_data, val_data, config)`` minimises the masked
cross-entropy

.. math:: \mathcal{L} = \frac{1}{|M|} \sum_{(b, t) \in M} -\log \mathrm{softmax}(\mathrm{logits}_{b t})_{y_{b t}}

over the scored positions :math:`M` (``mask``), with AdamW or SGD, a constant
or warm-up-plus-cosine learning rate, gradient clipping, periodic evaluation,
evaluation hooks, checkpoints and exact resumption. It returns the metrics
history as a dict of lists.

What it guarantees:

- Before the first step (and before the step-0 evaluation) it refuses, with a
  ``ValueError`` naming the argument: examples with no scored position, token
  ids or targets the model cannot take, non-finite parameters (named), and a
  ``checkpoint_path`` that cannot be written.
- Checkpoints are written atomically (a temporary file renamed over the
  previous one): a process killed while writing leaves the previous
  checkpoint complete, and resuming from it reproduces the uninterrupted run
  bitwise. A checkpoint is never written with non-finite parameters.
- A resume checks the whole file before anything is loaded (another run's
  file, changed optimiser hyper-parameters unless
  ``TrainConfig.resume_hparams`` allows them, damaged values), then restores
  the model, the optimiser, the batch sampler and torch's global RNG together
  or none of them; every refusal is a ``ValueError`` naming the file and the
  field.
- The first non-finite loss or gradient stops the run before the optimiser
  step (``FloatingPointError`` naming the step); a parameter made non-finite
  by an optimiser step stops it too, and is reported as such only then.

The model interface is ``model(idx) -> logits`` of shape ``[B, n, V]``; a
model returning a tuple ``(logits, ...)`` or a dict with ``"logits"`` is
accepted too.

Distributed data parallel: when ``torch.distributed`` is initialised with
more than one process, :func:`train` wraps the model in
:class:`~torch.nn.parallel.DistributedDataParallel`, each rank draws its
batches from its own shard of the training examples (``rank::world_size``),
``batch_size`` is the global batch (split evenly across ranks), and losses
and metrics are all-reduced so every rank returns the same history. With
``TrainConfig(parallel="fsdp")`` it shards the model with FSDP2's
``fully_shard`` instead (each module of ``model.blocks``, then the root;
rank 0's initial weights, as DDP takes them), with the same batches, losses
and history; checkpoints hold the whole model and optimiser state, as a
single process writes them. Nothing here prints; a ``tqdm`` bar is drawn
only when ``config.progress`` is true (and only on rank 0).
"""
from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import asdict
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from . import _checkpoint
from ._checks import check_int
from ._train_config import TrainConfig, TrainResult, _as_device, lr_at
from .data import TaskData

__all__ = ["TrainConfig", "TrainResult", "train", "evaluate"]

Hook = Callable[[int, dict], None]
for _obj in (TrainConfig, TrainResult, lr_at):  # defined in a private module; this is their public home
    _obj.__module__ = __name__


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


@torch.no_grad()
def attention_diagnostics(model: nn.Module, *args, **kwargs) -> dict[str, list[float]]:
    r"""Per-layer attention entropy and metric size of a model on one batch (entropy collapse shows here).

    Runs ``model(*args, **kwargs)`` once in eval mode, recording the inputs
    of every :class:`~riemannian_ref.attention.layer.RiemannianAttention` in
    it (module order) and running each such layer again on them with
    ``return_weights=True`` (within its forward, where an FSDP2 model's
    weights are gathered: every rank calls it then). Nothing changes in the
    model (its training mode is restored) and nothing is drawn from any RNG.

    Parameters
    ----------
    model : nn.Module
        A model whose attention layers are ``RiemannianAttention`` modules
        (every model of this package); other layers are not seen.
    *args, **kwargs
        A batch, as the model's forward takes it.

    Returns
    -------
    dict
        ``"attn_entropy"``: for every layer, the mean entropy of its attention
        rows in nats (over batch, heads and rows; between 0, one key, and
        :math:`\log n`, uniform); ``"metric_eig"``: for every layer, the mean
        over heads and tokens of the largest eigenvalue of the metric that
        measures a pair (:math:`\lambda` plus the largest eigenvalue of
        :math:`U^\top U`, the temperature folded in), ``nan`` for dot-product
        layers. A layer whose entropy falls far below its start while its
        metric grows is sharpening attention through the metric's size:
        chapter 13 of the book.
    """
    from .attention.layer import RiemannianAttention
    from .analysis.collapse import attention_entropy

    _check_module(model)
    ent, eig, busy = [], [], []

    def measure(mod, a, kw, out):  # within the layer's forward: an FSDP2 unit's weights are gathered there
        if busy:  # the measuring call itself
            return
        busy.append(mod)
        try:
            _, A = mod(*a, **{**kw, "return_weights": True})
            ent.append(float(attention_entropy(A.float()).mean()))
            eig.append(_metric_top_eig(mod, a, kw))
        finally:
            busy.pop()

    handles = [m.register_forward_hook(measure, with_kwargs=True)
               for m in model.modules() if isinstance(m, RiemannianAttention)]
    was = model.training
    try:
        model.eval()
        model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    return {"attn_entropy": ent, "metric_eig": eig}


def _metric_top_eig(mod: nn.Module, a: tuple, kw: dict) -> float:
    """Mean over heads and tokens of the largest eigenvalue of a RiemannianAttention layer's metric."""
    if mod.config.scores != "metric":
        return float("nan")
    x = a[0] if a else kw["x"]
    context = a[1] if len(a) > 1 else kw.get("context")
    lam, U_q, U_k, _ = mod.geometry(x, context)
    U = U_k if mod.config.metric_side != "query" else U_q
    U = U.dense() if hasattr(U, "dense") else U
    if U is None or U.shape[-1] == 0:
        return float(lam.float().mean())
    top = torch.linalg.eigvalsh(U.float().mT @ U.float())[..., -1]  # r x r: the nonzero spectrum of U U^T
    lam = lam.float().view(-1, *([1] * (top.dim() - 2)))  # per head: dim 1 of top's layout [B|1, h, (n)]
    return float((lam + top).mean())


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
    # half precision is upcast to float32; float32 and float64 keep their precision
    return F.cross_entropy(sel.to(torch.promote_types(sel.dtype, torch.float32)), y[mask], reduction=reduction)


def _check_module(model) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module mapping token ids [B, n] to logits, got "
                         f"{type(model).__name__}")


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
    unwrapped first. A model sharded by FSDP2's ``fully_shard`` gathers its
    weights in every forward, so every rank must call this, and every rank
    runs as many forwards (a shorter shard repeats one example, uncounted).

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
    _check_module(model)
    if not isinstance(data, TaskData):
        raise ValueError(f"data must be a TaskData, got {type(data).__name__}")
    check_int(batch_size, "batch_size", 1)
    if max_examples is not None:
        check_int(max_examples, "max_examples", 1)
    device = _as_device(device)
    rank, world = _dist()
    # Evaluate the bare module: a DDP forward may run collectives (buffer broadcast),
    # which would hang when the ranks' shards give different numbers of batches.
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    n = len(data) if max_examples is None else min(len(data), max_examples)
    idx = torch.arange(rank, n, world)
    # FSDP2 gathers weights from every rank in each forward: all ranks run rank 0's number of batches
    n_batches = math.ceil((math.ceil(n / world) if _checkpoint.is_sharded(model) else len(idx)) / batch_size)
    was_training = model.training
    model.eval()
    loss_sum = correct = seq_right = n_scored = 0.0
    for start in range(0, n_batches * batch_size, batch_size):
        b = idx[start:start + batch_size]
        if len(b) == 0:  # this rank's shard is done: a forward for the other ranks' sake
            model(data.x[:1].to(device))
            continue
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


def _total_norm(tensors: list[Tensor], ord: float = 2.0) -> Tensor:
    """The ``ord``-norm of all ``tensors`` together, a 0-dim tensor (NaN if any entry is NaN)."""
    if not tensors:
        return torch.zeros(())
    total = getattr(nn.utils, "get_total_norm", None)  # torch >= 2.6: one fused pass
    if total is not None:
        return _checkpoint.full(total(tensors, norm_type=ord))  # of DTensors (FSDP2): reduced over the ranks
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float(), ord) for t in tensors]), ord)


def _empty_history() -> dict[str, list]:
    return {k: [] for k in ("step", "lr", "train_loss", "val_loss", "val_accuracy",
                            "val_seq_accuracy", "tokens_per_s", "time_s", "attn_entropy", "metric_eig")}


def _check_scored(data: TaskData, name: str) -> None:
    """Refuse examples with no scored position: they make an all-unscored batch's loss 0/0."""
    empty = ~data.mask.any(dim=1)
    k = int(empty.sum())
    if k:
        first = torch.nonzero(empty)[:5, 0].tolist()
        raise ValueError(
            f"{name} has {k} of {len(data)} examples with no scored position (their mask is all false, e.g. "
            f"examples {first}); a batch of only such examples has no loss to minimise, and in evaluation they "
            f"would count as exact sequences. Drop them first: {name}.subset({name}.mask.any(dim=1))")


def _check_checkpoint_path(path: str, rank: int, world: int) -> None:
    """``checkpoint_path`` must be writable before any step (rank 0 checks; every rank raises)."""
    from ._io import check_writable

    msg = None
    if rank == 0:
        try:
            check_writable(path, "checkpoint_path")
        except ValueError as exc:
            msg = str(exc)
    if world > 1:
        box = [msg]
        dist.broadcast_object_list(box, src=0)
        msg = box[0]
    if msg is not None:
        raise ValueError(msg + "; nothing was trained")


def _check_finite_params(module: nn.Module) -> None:
    """Refuse non-finite parameters before any step or evaluation, naming them."""
    bad = _checkpoint.nonfinite_params(module)
    if bad:
        names = ", ".join(f"{n!r} ({k} of {m} entries)" for n, k, m in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        what = f"model parameter {names} is" if len(bad) == 1 else f"model parameters {names}{more} are"
        raise ValueError(f"{what} not finite (inf or NaN) before training; nothing was trained. Re-initialise "
                         f"the model or load finite weights")


def _check_outputs(module: nn.Module, train_data: TaskData, val_data: TaskData, device: torch.device, *,
                   loaded_later: bool) -> None:
    """Refuse data whose token ids or targets the model cannot take, before any step.

    Token ids are checked against the model's ``config.vocab_size`` when it
    has one. The number of outputs per position is read from one forward of
    one training example (eval mode, no gradients, the global RNG restored
    afterwards, so the run is unchanged); every scored target must be below it.
    """
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    for name, d in (("train_data", train_data), ("val_data", val_data)):
        if isinstance(vocab, int) and not isinstance(vocab, bool) and d.x.numel() and int(d.x.max()) >= vocab:
            raise ValueError(f"{name} holds token ids up to {int(d.x.max())} (vocab_size {d.vocab_size}), but the "
                             f"model's vocab_size is {vocab}")
    was_training = module.training
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            module.eval()
            out = logits_of(module(train_data.x[:1].to(device)))
    except Exception:  # noqa: BLE001
        if loaded_later:  # e.g. non-finite weights the resume replaces: the checkpoint is checked instead
            return
        raise
    finally:
        module.train(was_training)
    if not isinstance(out, Tensor) or out.dim() != 3:
        return  # masked_cross_entropy names the shape at the first step
    n_out = out.shape[-1]
    for name, d in (("train_data", train_data), ("val_data", val_data)):
        scored = d.y[d.mask]
        top = int(scored.max()) if scored.numel() else -1
        if top >= n_out:
            raise ValueError(f"{name} has {d.out_dim} classes (targets up to {top}), but the model outputs "
                             f"{n_out} per position; build the model with as many outputs as {name}.out_dim")


def _fully_shard(model: nn.Module, device: torch.device, world: int) -> None:
    """FSDP2 as torchtitan applies it, in place: each module of ``model.blocks`` is a unit, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .optim.manifold import Euclidean, ManifoldParameter

    curved = [n for n, p in model.named_parameters()
              if isinstance(p, ManifoldParameter) and not isinstance(p.manifold, Euclidean)]
    if curved:  # fully_shard replaces every parameter by a plain one: the tag, and the geometry, would be lost
        raise ValueError(f"parallel='fsdp' cannot shard parameters on a manifold ({', '.join(curved[:3])}"
                         f"{', ...' if len(curved) > 3 else ''}): a Riemannian step needs the whole point on one "
                         f"rank; train this model with parallel='ddp'")
    for t in (*model.parameters(), *model.buffers()):  # rank 0's initial weights, as DDP takes them
        dist.broadcast(t.detach(), 0)
    mesh = init_device_mesh(device.type, (world,))
    blocks = getattr(model, "blocks", None)
    for block in blocks if isinstance(blocks, nn.ModuleList) else ():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train(model: nn.Module, train_data: TaskData, val_data: TaskData, config: TrainConfig, *,
          optimizer: torch.optim.Optimizer | None = None, hooks: Sequence[Hook] = ()) -> TrainResult:
    """Train ``model`` on ``train_data``, evaluating on ``val_data``.

    Parameters
    ----------
    model : nn.Module
        ``model(idx [B, n]) -> logits [B, n, C]`` (or a tuple or dict holding
        them, :func:`logits_of`); moved to ``config.device``. Under DDP pass
        the plain module: it is wrapped here. Under ``parallel="fsdp"`` pass
        the plain module (sharded here, in place) or one the caller sharded
        with ``fully_shard``, which ``parallel="ddp"`` refuses.
    train_data, val_data : TaskData
    config : TrainConfig
    optimizer : torch.optim.Optimizer, optional
        Built by the caller over the model's parameters (e.g. a
        :class:`~riemannian_ref.RiemannianAdam` over frames on Stiefel;
        under ``parallel="fsdp"`` over the sharded model's, so the caller
        shards it first);
        each group's ``lr`` is its peak rate, which the schedule of ``config``
        scales (warm-up, cosine); each group gets a ``peak_lr`` key holding it.
        None: AdamW or SGD as ``config`` says, with no weight decay on
        vectors. At a resume its class, group sizes and hyper-parameters are
        compared with the checkpoint's (see ``TrainConfig.resume_hparams``),
        and the checkpoint's per-parameter state must have the keys and
        shapes that one step of a copy of this optimiser creates (on clones
        of the parameters; the caller's are not touched).
    hooks : sequence of callables ``hook(step, metrics)``
        Called (on every rank) after each evaluation with the step and the dict
        of that evaluation's metrics (the last entry of every history list).
        A hook must leave the parameters finite (a ``ValueError`` names the
        step otherwise, and nothing is saved).

    Returns
    -------
    TrainResult
        The history (dict of lists), the final metrics, steps done, training
        time, throughput and parameter count. With ``checkpoint_path`` the
        model, optimiser, batch-sampler and global RNG states and the history
        are saved (atomically) at every evaluation; ``resume=True`` continues
        from there and reproduces the uninterrupted run exactly (same batches,
        same schedule, same random draws), also after a process was killed
        while writing a checkpoint (the previous one is then resumed).

    Raises
    ------
    ValueError
        Before any step or evaluation: for a bad argument (naming it);
        ``train_data`` or ``val_data`` holding examples with no scored
        position (the message gives the count and the fix); data with token
        ids beyond the model's ``config.vocab_size`` or scored targets beyond
        the model's outputs per position (read from one forward of one
        example, which draws nothing from the global RNG); a parameter that is
        not finite (naming it); a ``checkpoint_path`` that cannot be written
        (naming it; checked on rank 0). At a resume: a checkpoint that cannot
        be read safely, is damaged, belongs to another run, or whose
        optimiser hyper-parameters differ while ``resume_hparams="refuse"``
        (naming the file and the field); the whole file is checked before
        anything is loaded, so the model, the optimiser and torch's global
        RNG are then as they were. After an evaluation: a hook that made a
        parameter non-finite.
    FloatingPointError
        At the first step whose training loss (or, the loss being finite, its
        gradient norm) is not finite, naming the step: the optimiser step is
        not taken, so the model keeps the last finite parameters. Also when
        an optimiser step turns a parameter non-finite (an overflowing
        update). The checkpoint file keeps the last evaluation's state: a
        checkpoint is never written with non-finite parameters.

    Warns
    -----
    UserWarning
        At a resume with ``resume_hparams`` "new" or "checkpoint" whose
        optimiser hyper-parameters differ, listing the differences and which
        values apply.
    """
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
    config.validate()
    _check_module(model)
    for name, d in (("train_data", train_data), ("val_data", val_data)):
        if not isinstance(d, TaskData):
            raise ValueError(f"{name} must be a TaskData, got {type(d).__name__}")
    hooks = tuple(hooks) if isinstance(hooks, (list, tuple)) else hooks
    if not isinstance(hooks, tuple) or not all(callable(h) for h in hooks):
        raise ValueError(f"hooks must be a list or tuple of callables hook(step, metrics), got {hooks!r}")
    for name, d in (("train_data", train_data), ("val_data", val_data)):
        _check_scored(d, name)
    device = torch.device(config.device)
    rank, world = _dist()
    if config.checkpoint_path is not None:
        _check_checkpoint_path(config.checkpoint_path, rank, world)
    if config.batch_size is not None and config.batch_size % world:
        raise ValueError(f"batch_size={config.batch_size} must be divisible by the world size {world}")
    local_bs = None if config.batch_size is None else config.batch_size // world
    shard = torch.arange(rank, len(train_data), world)
    if len(shard) == 0:
        raise ValueError(f"rank {rank} has no training examples ({len(train_data)} examples, world {world})")

    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    if _checkpoint.is_sharded(model) and config.parallel != "fsdp":
        raise ValueError("model is sharded by fully_shard (FSDP2): train it with TrainConfig(parallel='fsdp')")
    if isinstance(model, nn.parallel.DistributedDataParallel) and config.parallel != "ddp":
        raise ValueError("model is wrapped in DistributedDataParallel: pass the plain module to shard it with "
                         "parallel='fsdp'")
    model.to(device)
    module = model
    if world > 1 and config.parallel == "fsdp" and not _checkpoint.is_sharded(model):
        _fully_shard(model, device, world)
    elif world > 1 and config.parallel == "ddp" and not isinstance(model, nn.parallel.DistributedDataParallel):
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
        module = model.module
    sharded = _checkpoint.is_sharded(module)
    own = {id(p) for p in module.parameters()} if sharded and optimizer is not None else None
    if own is not None and any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("optimizer must be built over the sharded model's parameters (fully_shard replaces "
                         "them): with parallel='fsdp' shard the model before building it, or pass none")
    n_params = _count_params(module)
    opt = optimizer if optimizer is not None else _make_optimizer(module, config)
    sampler = torch.Generator().manual_seed(config.seed * 1_000_003 + rank)
    history = _empty_history()
    start_step, train_time, tokens_seen = 0, 0.0, 0
    loss_since, n_since = 0.0, 0  # training loss accumulated since the last evaluation

    resuming = config.resume and os.path.exists(config.checkpoint_path)
    if not resuming:  # a resume loads (checked) parameters from the file
        _check_finite_params(module)
    _check_outputs(module, train_data, val_data, device, loaded_later=resuming)
    last_saved = None  # the step of the last checkpoint written or resumed from
    if resuming:
        # weights only (no code from the file runs); the whole file is checked first, then everything
        # is restored together or nothing is (another run's file or a damaged one is refused)
        ck = _checkpoint.resume(config.checkpoint_path, config=config, module=module, optimizer=opt,
                                sampler=sampler, rank=rank, world_size=world, device=device)
        history, start_step = ck["history"], ck["step"]
        train_time, tokens_seen = ck["train_time_s"], ck["tokens_seen"]
        loss_since, n_since = ck["loss_since"], ck["n_since"]
        last_saved = start_step
    for g in opt.param_groups:  # the schedule scales every group's own peak rate
        g.setdefault("peak_lr", g["lr"])

    def params_finite() -> bool:
        if sharded:  # a rank's shard of a small parameter may be empty, which has no inf-norm
            return not _checkpoint.nonfinite_params(module)
        return math.isfinite(float(_total_norm([p.detach() for p in module.parameters()], math.inf)))

    def overflowed(at: int) -> FloatingPointError:
        # the parameters were finite before training, after every evaluation's hooks, and (checked) at a
        # resume; so an optimiser step of this process made them non-finite
        return _checkpoint.diverged(at, "the optimiser step made a parameter non-finite", config.checkpoint_path,
                                    last_saved, after_step=True)

    def save(step: int) -> None:
        nonlocal last_saved
        if config.checkpoint_path and not params_finite():  # never overwrite the last good state with inf/NaN
            raise overflowed(step)
        if config.checkpoint_path:
            _checkpoint.save(config.checkpoint_path, config=config, module=module, optimizer=opt, sampler=sampler,
                             rank=rank, world_size=world,
                             progress={"history": history, "step": step, "train_time_s": train_time,
                                       "tokens_seen": tokens_seen, "loss_since": loss_since, "n_since": n_since})
            last_saved = step

    def log_eval(step: int, loss_since: float, n_since: int) -> dict:
        m = evaluate(model, val_data, batch_size=config.eval_batch_size, device=device,
                     max_examples=config.eval_max_examples)
        entry = {"step": step, "lr": opt.param_groups[0]["peak_lr"] * lr_at(max(step - 1, 0), config) / config.lr,
                 "train_loss": loss_since / n_since if n_since else float("nan"),
                 "val_loss": m["loss"], "val_accuracy": m["accuracy"], "val_seq_accuracy": m["seq_accuracy"],
                 "tokens_per_s": tokens_seen / train_time if train_time > 0 else float("nan"),
                 "time_s": train_time}
        diag = {"attn_entropy": [], "metric_eig": []}
        if config.diagnostics:
            diag = attention_diagnostics(module, val_data.x[:config.diagnostics].to(device))
            for layer, e in enumerate(diag["attn_entropy"]):
                if config.entropy_floor is not None and e < config.entropy_floor and layer not in warned \
                        and rank == 0:
                    warned.add(layer)
                    warnings.warn(f"step {step}: attention layer {layer} has mean attention entropy {e:.3f} nats "
                                  f"(below entropy_floor={config.entropy_floor}): its rows attend to single keys. "
                                  "In a language model that is entropy collapse (with an unbounded metric, its "
                                  "size sharpens every row: metric_form='gains' bounds it); a retrieval task may "
                                  "need it (TrainConfig(entropy_floor=None) silences this)", stacklevel=3)
        entry.update(diag)
        for k, v in entry.items():
            history[k].append(v)
        for hook in hooks:
            hook(step, dict(entry))
        if hooks and not params_finite():
            bad = [n for n, _, _ in _checkpoint.nonfinite_params(module)]
            raise ValueError(f"an evaluation hook made parameter(s) {bad[:5]} non-finite at step {step} (hooks "
                             f"must not change the parameters' values to inf or NaN); no optimiser step did")
        return entry

    warned: set[int] = set()  # layers whose low entropy was reported
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
        try:
            loss = masked_cross_entropy(logits_of(model(x)), y, m)
        except Exception as exc:  # e.g. a metric's lam refused: was it the previous update that overflowed?
            if not params_finite():
                raise overflowed(step - 1) from exc
            raise
        loss_value = _all_sum([loss.item()], device)[0] / world  # the same on every rank
        if not math.isfinite(loss_value):
            if not params_finite():
                raise overflowed(step - 1)
            raise _checkpoint.diverged(step, f"the training loss is {loss_value}", config.checkpoint_path, last_saved)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip is not None:  # the norm comes for free
            gnorm = _checkpoint.full(nn.utils.clip_grad_norm_(module.parameters(), config.grad_clip))
        else:
            gnorm = _total_norm([p.grad for p in module.parameters() if p.grad is not None])
        if not math.isfinite(float(gnorm)):  # the loss was finite, its gradient is not
            raise _checkpoint.diverged(step, f"the gradient norm is {float(gnorm)} (loss {loss_value:.6g})",
                                       config.checkpoint_path, last_saved)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_time += time.perf_counter() - t0
        tokens_seen += x.numel() * world
        loss_since += loss_value
        n_since += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}")
        if step % config.eval_interval == 0 or step == config.steps:
            if not params_finite():  # before the hooks see them, and before the save
                raise overflowed(step)
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
