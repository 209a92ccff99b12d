"""The configuration of the training loop and what it returns (private: the public home is :mod:`riemannian_ref.training`).

:class:`TrainConfig` is a frozen dataclass validated on construction: a bad
value raises ``ValueError`` naming the field, the expected range and the
value given. :func:`lr_at` is the learning-rate schedule it defines.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

import torch

from ._checks import check_bool, check_choice, check_int, check_number

__all__: list[str] = []  # private module: TrainConfig, TrainResult and lr_at are public in riemannian_ref.training


@dataclass(frozen=True)
class TrainConfig:
    r"""Everything :func:`train` needs besides the model and the data (frozen; validated on construction).

    A bad value raises ``ValueError`` naming the field, the expected range and
    the value given; :meth:`replace` gives a changed copy.

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
        Global batch size: under DDP or FSDP2 each of the ranks takes
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
        Seed of the batch order, in ``[0, 2**44]`` (independent of the model); it does not seed
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
        evaluations; None: no checkpoints. The path is checked for writing
        when training starts, before any step (a ``ValueError`` naming it).
        Each write goes to a temporary file in the same directory that is
        renamed over the previous checkpoint, so a process killed while
        writing leaves the previous checkpoint complete; a checkpoint is never
        written with non-finite parameters. The file holds only tensors and
        plain values and is read back with ``weights_only=True``: no code
        stored in a checkpoint runs.
    resume : bool, default False
        Continue from ``checkpoint_path`` if that file exists (it must be set);
        the resumed run reproduces the uninterrupted one. The whole file is
        checked before anything is loaded, and then the model, the optimiser,
        the batch sampler and torch's global RNG are restored together, or
        none of them: any refusal is a ``ValueError`` naming the file and the
        field, and leaves the caller's model, optimiser and RNG as they were.
        A checkpoint of another run is refused, listing the differences: the
        fields of this config that define the run (all but ``device``,
        ``progress``, ``checkpoint_path``, ``resume``, ``resume_hparams``,
        ``stop_at_step``, ``eval_batch_size``, ``diagnostics``,
        ``entropy_floor`` and ``parallel``), the model's ``config`` when
        it has one, its parameter and buffer names and shapes, the optimiser's
        class, the sizes of its parameter groups and their hyper-parameters
        (see ``resume_hparams``), and the number of processes. A damaged file
        is refused too: RNG or sampler states a CPU generator does not accept,
        a history that is not one the loop writes, a step beyond ``steps``, a
        non-finite time or parameter, or optimiser state whose keys or shapes
        are not those the optimiser keeps for the parameters.
    stop_at_step : int or None, default None
        Stop after this step (in ``[1, steps]``), saving a checkpoint there
        if ``checkpoint_path`` is set, e.g. before a job's time limit; the
        schedule is still that of ``steps``. None: run to ``steps``.
    diagnostics : int, default 8
        At every evaluation, record each attention layer's mean attention
        entropy and metric size (:func:`attention_diagnostics`) on the first
        this many validation examples, in the history's ``"attn_entropy"``
        and ``"metric_eig"``; 0: none (only layers built from
        :class:`~riemannian_ref.attention.layer.RiemannianAttention` are seen).
    entropy_floor : float or None, default 0.1
        Warn (``UserWarning``, once per layer) when a layer's mean attention
        entropy falls below this many nats: attention collapsing onto single
        keys, which in a language model is a sign that something sharpens
        every row (chapter 13 of the book: an unbounded metric does). Tasks
        that need one-hot attention (retrieval) reach it legitimately: set
        None there. Needs ``diagnostics > 0``.
    parallel : {"ddp", "fsdp"}, default "ddp"
        How :func:`train` spreads the model over more than one process:
        ``"ddp"`` wraps it in
        :class:`~torch.nn.parallel.DistributedDataParallel`; ``"fsdp"``
        shards it with FSDP2's ``fully_shard`` (each module of
        ``model.blocks``, then the root, as torchtitan does), or takes a
        model the caller sharded. The same function is computed either way,
        and a checkpoint of one resumes under the other, so it does not
        define the run. Ignored by a single process.
    resume_hparams : {"refuse", "new", "checkpoint"}, default "refuse"
        What a resume does when the optimiser's hyper-parameters differ from
        the checkpoint's (every key of every parameter group except
        ``params``, ``param_names`` and ``lr``, which the schedule sets from
        the group's peak rate ``peak_lr``; for the built-in optimiser these
        are ``lr``, ``weight_decay``, ``betas`` and ``momentum`` of this
        config). ``"refuse"``: a ``ValueError`` listing every differing value.
        ``"new"``: the caller's values apply from the resumed step on;
        ``"checkpoint"``: the checkpoint's values apply and the caller's are
        discarded. Both of these warn (``UserWarning``), listing the
        differences; with them, a changed ``lr``, ``weight_decay``, ``betas``
        or ``momentum`` of this config is not refused as another run. It does
        not define the run (it is left out of :meth:`run_fields`).
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
    resume_hparams: str = "refuse"  # changed optimiser hyper-parameters at a resume: "refuse", "new", "checkpoint"
    diagnostics: int = 8  # validation examples for the attention entropy and metric size at every evaluation
    entropy_floor: float | None = 0.1  # warn once per layer when its mean attention entropy (nats) falls below
    parallel: str = "ddp"  # over several processes: "ddp" (DistributedDataParallel) or "fsdp" (FSDP2 fully_shard)

    def __post_init__(self):
        if isinstance(self.betas, list):  # from JSON
            object.__setattr__(self, "betas", tuple(self.betas))
        if isinstance(self.checkpoint_path, os.PathLike):
            object.__setattr__(self, "checkpoint_path", os.fspath(self.checkpoint_path))
        if isinstance(self.device, torch.device):  # kept as a plain str (checkpoints, result files)
            object.__setattr__(self, "device", str(self.device))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field, its expected range and the value given."""
        check_choice(self.optimizer, "optimizer", ("adamw", "sgd"))
        check_choice(self.schedule, "schedule", ("constant", "cosine"))
        check_number(self.lr, "lr", low=0.0, low_open=True)
        check_number(self.weight_decay, "weight_decay", low=0.0)
        if not (isinstance(self.betas, tuple) and len(self.betas) == 2):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        for i, b in enumerate(self.betas):
            check_number(b, f"betas[{i}]", low=0.0, high=1.0, high_open=True)
        check_number(self.momentum, "momentum", low=0.0, high=1.0, high_open=True)
        check_number(self.min_lr_ratio, "min_lr_ratio", low=0.0, high=1.0)
        if self.grad_clip is not None:
            check_number(self.grad_clip, "grad_clip", low=0.0, low_open=True)
        for name in ("steps", "eval_interval", "eval_batch_size", "batch_size", "eval_max_examples"):
            if getattr(self, name) is not None or name in ("steps", "eval_interval", "eval_batch_size"):
                check_int(getattr(self, name), name, 1)
        check_int(self.warmup_steps, "warmup_steps", 0, self.steps - 1)
        check_int(self.seed, "seed", 0, _MAX_SEED)
        if not isinstance(self.device, (str, torch.device)):
            raise ValueError(f"device must be a str such as 'cpu' or 'cuda:0', got {self.device!r}")
        _as_device(self.device)
        check_bool(self.progress, "progress")
        check_bool(self.resume, "resume")
        if self.checkpoint_path is not None and not (isinstance(self.checkpoint_path, str) and self.checkpoint_path):
            raise ValueError(f"checkpoint_path must be a non-empty path or None, got {self.checkpoint_path!r}")
        if self.resume and not self.checkpoint_path:
            raise ValueError("resume=True needs a checkpoint_path")
        if self.stop_at_step is not None:
            check_int(self.stop_at_step, "stop_at_step", 1, self.steps)
        check_choice(self.resume_hparams, "resume_hparams", ("refuse", "new", "checkpoint"))
        check_int(self.diagnostics, "diagnostics", 0)
        if self.entropy_floor is not None:
            check_number(self.entropy_floor, "entropy_floor", low=0.0)
        check_choice(self.parallel, "parallel", ("ddp", "fsdp"))

    def run_fields(self) -> dict:
        """The fields that define the run, as a dict: all but where it runs, how it reports, where it is
        saved, when this process stops, the evaluation batch size, what a resume does with changed
        optimiser hyper-parameters, and how processes share the model (``device``, ``progress``,
        ``checkpoint_path``, ``resume``, ``stop_at_step``, ``eval_batch_size``, ``resume_hparams``,
        ``diagnostics``, ``entropy_floor``, ``parallel``).
        A resume compares them."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in _NON_RUN_FIELDS}

    def replace(self, **changes) -> "TrainConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


# what does not change what is computed (TrainConfig.run_fields leaves these out)
_NON_RUN_FIELDS = ("device", "progress", "checkpoint_path", "resume", "stop_at_step", "eval_batch_size",
                   "resume_hparams", "diagnostics", "entropy_floor", "parallel")

#: Largest ``TrainConfig.seed``: the batch sampler's seed ``seed * 1_000_003 + rank`` stays within 64 bits.
_MAX_SEED = 2 ** 44


@dataclass
class TrainResult:
    """What :func:`train` returns.

    ``history`` maps ``"step"``, ``"lr"``, ``"train_loss"`` (mean over the
    steps since the previous evaluation; ``nan`` at step 0), ``"val_loss"``,
    ``"val_accuracy"`` (scored positions), ``"val_seq_accuracy"`` (examples
    with every scored position right), ``"tokens_per_s"`` (input tokens of all
    ranks per second of training, evaluation excluded) and ``"time_s"``
    (cumulative training seconds) to lists, one entry per evaluation, and
    ``"attn_entropy"`` and ``"metric_eig"`` to lists of per-layer lists
    (:func:`attention_diagnostics`; empty lists without diagnostics).

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


def _as_device(device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must name a torch device such as 'cpu' or 'cuda:0', got {device!r} "
                         f"({str(exc).splitlines()[0]})") from None


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
