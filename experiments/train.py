#!/usr/bin/env python3
"""Train one model on one task; write the metrics history to a JSON result file.

Single process on CPU or CUDA:

    python experiments/train.py --task recall --mode riemannian --steps 500 \
        --out results/train_recall_riemannian.json

and, unchanged, with DistributedDataParallel (gloo on CPU, NCCL on CUDA),
each rank training on its own shard of the examples:

    torchrun --nproc_per_node 2 experiments/train.py --task recall --mode euclidean ...

or with the model sharded by FSDP2 (``fully_shard``: each block, then the root) instead of replicated:

    torchrun --nproc_per_node 2 experiments/train.py --task recall --mode fiber_bundle ... --fsdp

Configs can also come from a small JSON file (``--config cfg.json``) holding
``{"task": {...}, "model": {...}, "train": {...}}``; command-line flags given
explicitly override it. Checkpoints go to ``checkpoints/`` (git-ignored);
``--resume`` continues an interrupted run exactly, and refuses a checkpoint
written by a run with another configuration.

The model is a :class:`riemannian_ref.FiberBundleConfig` (in a config file: its fields, the
attention options nested as ``"attention": {...}``); its vocabulary, context and classes come
from the task. Metric models are built with ``--metric-form`` (default ``factor``,
G = lam I + U U^T, the form of the stored results; ``gains``, bounded gains, is the package
default).

Default file names carry a short hash of everything that defines the run
(task, model, the training fields of :meth:`riemannian_ref.TrainConfig.run_fields`
and the initialisation seed), ``train_<task>_<mode>_s<seed>_<hash>``, so runs
that differ in any of them (model size, learning rate, ...) never share a
result or a checkpoint, while a run stopped with ``--stop-at-step`` and its
``--resume`` (or the same run on another device) share both.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

import riemannian_ref as rr
from riemannian_ref._io import atomic_write_text

MODES = rr.models.MODES
#: ``--metric-form``: the metric parameterisations, the stored results' first.
METRIC_FORMS = ("factor", "gains")
METRIC_FORM_HELP = ("metric parameterisation: factor (G = lam I + U U^T), the form the stored results were made "
                    "with, or gains (bounded gains), the package default")


@dataclass
class TaskConfig:
    name: str = "recall"  # "recall", "lookup", "modular" or "charlm"
    vocab_size: int = 32  # recall
    n_pairs: int = 8  # recall, lookup
    seq_len: int = 32  # recall: sequence length; charlm: block size
    n_train: int = 4096  # recall, lookup
    n_val: int = 512  # recall, lookup
    n_keys: int = 16  # lookup: key symbols
    n_values: int = 8  # lookup: value symbols (the answer classes)
    corpus: str = "reference"  # charlm: "reference" (Python language reference) or "docstrings"
    p: int = 59  # modular
    op: str = "+"  # modular: "+", "-" or "/"
    train_fraction: float = 0.4  # modular


def default_model() -> rr.FiberBundleConfig:
    """The script's model: Euclidean, metrics (in the metric modes) of the factor form G = lam I + U U^T, the
    form the stored results were made with (``"gains"``, bounded gains, is the package default)."""
    return rr.FiberBundleConfig(mode="euclidean", attention=dict(metric_form="factor"))


@dataclass
class RunConfig:
    task: TaskConfig = field(default_factory=TaskConfig)
    model: rr.FiberBundleConfig = field(default_factory=default_model)  # vocab, context, classes: from the task
    train: rr.TrainConfig = field(default_factory=rr.TrainConfig)
    model_seed: int = 0  # initialisation seed (the data seed is train.seed)


def task_data(tc: TaskConfig, seed: int, *, tune_fraction: float = 0.0,
              split: str = "val") -> tuple[rr.TaskData, rr.TaskData]:
    """Train and held-out data of the task (identical on every rank).

    ``charlm`` only: ``tune_fraction`` holds that fraction of the characters
    out for tuning (whole topics, disjoint from training and validation) and
    ``split`` ("val" or "tune") picks the held-out part returned; see
    :func:`riemannian_ref.data.char_lm`. Keywords rather than ``TaskConfig``
    fields, so that the run ids of earlier runs do not change.
    """
    if tc.name != "charlm" and (tune_fraction != 0 or split != "val"):
        raise ValueError(f"tune_fraction and split apply to the charlm task only, got task {tc.name!r} with "
                         f"tune_fraction={tune_fraction!r}, split={split!r}")
    if tc.name == "recall":
        return rr.data.make_task("recall", seed=seed, n_train=tc.n_train, n_val=tc.n_val,
                                 vocab_size=tc.vocab_size, n_pairs=tc.n_pairs, seq_len=tc.seq_len)
    if tc.name == "lookup":
        return rr.data.make_task("lookup", seed=seed, n_train=tc.n_train, n_val=tc.n_val, n_keys=tc.n_keys,
                                 n_values=tc.n_values, n_pairs=tc.n_pairs)
    if tc.name == "modular":
        return rr.data.make_task("modular", seed=seed, p=tc.p, op=tc.op, train_fraction=tc.train_fraction)
    if tc.name == "charlm":
        return rr.data.make_task("charlm", block_size=tc.seq_len, corpus=tc.corpus,
                                 tune_fraction=tune_fraction, split=split)
    raise ValueError(f"task must be one of 'recall', 'lookup', 'modular', 'charlm', got {tc.name!r}")


def model_config(mc: rr.FiberBundleConfig, vocab_size: int, block_size: int,
                 n_classes: int | None = None) -> rr.FiberBundleConfig:
    """The model config ``mc`` sized for the task's data.

    ``n_classes`` (a classification task such as ``lookup``) gives an untied head of that many outputs.
    """
    head = {} if n_classes is None else {"n_classes": n_classes, "tie_weights": False}
    return mc.replace(vocab_size=vocab_size, block_size=block_size, **head)


def build_model(mc: rr.FiberBundleConfig, vocab_size: int, block_size: int,
                n_classes: int | None = None) -> rr.FiberBundleTransformer:
    """A :class:`riemannian_ref.FiberBundleTransformer` of config ``mc`` sized for the task's data."""
    return rr.FiberBundleTransformer(model_config(mc, vocab_size, block_size, n_classes))


def _merge(dc, updates: dict):
    """A copy of dataclass ``dc`` with ``updates`` applied (recursing into nested dataclasses)."""
    if isinstance(dc, rr.FiberBundleConfig):  # merges an "attention" dict; old flat names say where they moved
        try:
            return dc.replace(**updates)
        except TypeError as exc:
            raise ValueError(f"unknown config keys for FiberBundleConfig: {exc}") from None
    out = {}
    for f in dataclasses.fields(dc):
        cur = getattr(dc, f.name)
        if f.name in updates:
            new = updates[f.name]
            out[f.name] = _merge(cur, new) if dataclasses.is_dataclass(cur) and isinstance(new, dict) else new
        else:
            out[f.name] = cur
    bad = set(updates) - {f.name for f in dataclasses.fields(dc)}
    if bad:
        raise ValueError(f"unknown config keys for {type(dc).__name__}: {sorted(bad)}")
    if "betas" in out and isinstance(out["betas"], list):
        out["betas"] = tuple(out["betas"])
    return type(dc)(**out)


def run_id(cfg: RunConfig) -> str:
    """Ten hex digits of a hash of what defines the run: task, model, training run fields, init seed."""
    blob = {"task": asdict(cfg.task), "model": cfg.model.to_dict(), "train": cfg.train.run_fields(),
            "model_seed": cfg.model_seed}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:10]


def default_paths(cfg: RunConfig) -> tuple[str, str]:
    """The default result file and checkpoint of a run: ``results/train_<tag>.json``, ``checkpoints/train_<tag>.pt``."""
    tag = f"{cfg.task.name}_{cfg.model.mode}_s{cfg.train.seed}_{run_id(cfg)}"
    return os.path.join("results", f"train_{tag}.json"), os.path.join("checkpoints", f"train_{tag}.pt")


def parse_args(argv=None) -> tuple[RunConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="JSON file with {task: {...}, model: {...}, train: {...}}; model: fields of "
                                     "FiberBundleConfig, its attention options as attention: {...}")
    ap.add_argument("--task", choices=("recall", "lookup", "modular", "charlm"))
    ap.add_argument("--mode", choices=MODES)
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--n-layers", type=int)
    ap.add_argument("--n-heads", type=int)
    ap.add_argument("--metric-rank", type=int)
    ap.add_argument("--metric-form", choices=METRIC_FORMS, help=METRIC_FORM_HELP + " (default factor)")
    ap.add_argument("--vocab-size", type=int, help="recall vocabulary")
    ap.add_argument("--n-pairs", type=int, help="recall/lookup key-value pairs")
    ap.add_argument("--n-keys", type=int, help="lookup key symbols")
    ap.add_argument("--n-values", type=int, help="lookup value symbols")
    ap.add_argument("--corpus", choices=rr.data.CORPORA, help="charlm text")
    ap.add_argument("--seq-len", type=int, help="recall sequence length / charlm block size")
    ap.add_argument("--p", type=int, help="modular modulus")
    ap.add_argument("--op", choices=("+", "-", "/"), help="modular operation")
    ap.add_argument("--optimizer", choices=("adamw", "sgd"))
    ap.add_argument("--lr", type=float)
    ap.add_argument("--weight-decay", type=float)
    ap.add_argument("--schedule", choices=("constant", "cosine"))
    ap.add_argument("--warmup-steps", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--eval-interval", type=int)
    ap.add_argument("--seed", type=int, help="data/batch-order seed and (unless --model-seed) init seed")
    ap.add_argument("--model-seed", type=int)
    ap.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--out", help="result JSON (default results/train_<task>_<mode>_s<seed>_<run hash>.json)")
    ap.add_argument("--checkpoint", help="checkpoint path (default checkpoints/train_<task>_<mode>_s<seed>_<run hash>.pt)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--resume-hparams", choices=["refuse", "new", "checkpoint"], default="refuse",
                    help="at --resume, optimiser hyper-parameters that differ from the checkpoint's: refuse "
                         "(default), apply the new ones, or keep the checkpoint's")
    ap.add_argument("--stop-at-step", type=int, help="stop early, checkpointed (resume later)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--fsdp", action="store_true",
                    help="under torchrun, shard the model with FSDP2 (fully_shard) instead of DDP")
    a = ap.parse_args(argv)

    cfg = RunConfig()
    if a.config:
        with open(a.config) as f:
            cfg = _merge(cfg, json.load(f))
    task = {"name": a.task, "vocab_size": a.vocab_size, "n_pairs": a.n_pairs, "seq_len": a.seq_len, "p": a.p,
            "op": a.op, "n_keys": a.n_keys, "n_values": a.n_values, "corpus": a.corpus}
    model = {"mode": a.mode, "d_model": a.d_model, "n_layers": a.n_layers, "n_heads": a.n_heads}
    attention = {k: v for k, v in (("rank", a.metric_rank), ("metric_form", a.metric_form)) if v is not None}
    train = {"optimizer": a.optimizer, "lr": a.lr, "weight_decay": a.weight_decay, "schedule": a.schedule,
             "warmup_steps": a.warmup_steps, "steps": a.steps, "batch_size": a.batch_size,
             "eval_interval": a.eval_interval, "seed": a.seed, "device": a.device,
             "stop_at_step": a.stop_at_step, "parallel": "fsdp" if a.fsdp else None}
    upd = {"task": {k: v for k, v in task.items() if v is not None},
           "model": {k: v for k, v in {**model, "attention": attention or None}.items() if v is not None},
           "train": {k: v for k, v in train.items() if v is not None}}
    if a.model_seed is not None:
        upd["model_seed"] = a.model_seed
    elif a.seed is not None:
        upd["model_seed"] = a.seed
    cfg = _merge(cfg, upd)
    return cfg, a


def main(argv=None) -> dict:
    cfg, a = parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = cfg.train.device
    if device == "cpu" and a.device is None and torch.cuda.is_available():
        device = "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if distributed:
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
            device = f"cuda:{local_rank}"
        dist.init_process_group(backend)
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    try:
        tc, mc = cfg.task, cfg.model
        out, checkpoint = default_paths(cfg)
        out, tag = a.out or out, os.path.splitext(os.path.basename(a.out or out))[0]
        cfg = dataclasses.replace(cfg, train=cfg.train.replace(
            device=device, checkpoint_path=a.checkpoint or checkpoint, resume=a.resume,
            resume_hparams=a.resume_hparams,
            progress=not a.no_progress and rank == 0))
        train_data, val_data = task_data(tc, cfg.train.seed)
        torch.manual_seed(cfg.model_seed)
        model = build_model(mc, train_data.vocab_size, train_data.seq_len, train_data.n_classes)
        t0 = time.perf_counter()
        res = rr.train(model, train_data, val_data, cfg.train)
        wall = time.perf_counter() - t0
        record = {
            "task": asdict(tc), "model": model.config.to_dict(), "train": res.config, "model_seed": cfg.model_seed,
            "run_id": run_id(cfg),
            "world_size": world, "n_params": res.n_params, "steps_done": res.steps_done,
            "train_time_s": res.train_time_s, "wall_s": wall, "tokens_per_s": res.tokens_per_s,
            "final": res.final, "history": res.history,
            "torch": torch.__version__, "python": sys.version.split()[0],
            "threads": torch.get_num_threads(),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        }
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            atomic_write_text(out, json.dumps(record, indent=1))
            print(f"{tag}: val_loss {res.final['val_loss']:.4f} val_acc {res.final['val_accuracy']:.4f} "
                  f"({res.n_params} params, {res.tokens_per_s:.0f} tok/s, world {world}) -> {out}")
        return record
    finally:
        if distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
