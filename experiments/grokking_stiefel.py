"""Grokking modular addition: StiefelAdam on W_Q, W_K vs AdamW vs frozen frames.

Task: ``a + b mod p`` as sequences ``[a, b, =]``, predict at ``=`` (Power et al.
2022), full-batch training on a random ``train_frac`` of the ``p**2`` pairs.
Model: ``FiberBundleConfig.grokking`` (one pre-norm Euclidean layer), trained
full batch by ``riemannian_ref.train``; ``W_Q`` and ``W_K`` start as the same
Haar frames in every arm. Arms:

* ``adamw``   -- AdamW on every parameter (decoupled weight decay ``wd``);
* ``stiefel`` -- StiefelAdam: ``W_Q, W_K`` frames on St(D, d) (same ``lr``; weight
  decay has zero Riemannian gradient there), AdamW on the rest;
* ``stiefel_lrx`` -- as ``stiefel`` with the frame lr multiplied by
  ``sqrt(D * d)``, so a frame step has the Frobenius length of a typical
  AdamW step on a D x d matrix (whose entries each move about ``lr``);
* ``frozen``  -- ``W_Q, W_K`` fixed at their random frames, AdamW on the rest.

Writes ``results/grokking_stiefel.json``: per arm and seed the validation and
training accuracy over steps, the distance of the frames from initialisation,
final numbers, the wall time and the arguments.

Run (9 runs of 1500 steps; 16 min measured on one thread of the shared, busy
2-core machine -- the JSON records it; `--arms stiefel_lrx` adds the fourth arm):
    nice -n 10 python experiments/grokking_stiefel.py
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

import riemannian_ref as rr

ARMS = ("adamw", "stiefel", "stiefel_lrx", "frozen")


def make_optimizer(model: rr.FiberBundleTransformer, arm: str, lr: float, wd: float, betas):
    frames = model.qk_frame_parameters()
    frame_ids = {id(p) for p in frames}
    rest = [p for p in model.parameters() if id(p) not in frame_ids]
    cfg = model.config
    if arm == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=betas)
    if arm == "frozen":
        for p in frames:
            p.requires_grad_(False)
        return torch.optim.AdamW(rest, lr=lr, weight_decay=wd, betas=betas)
    frame_lr = lr * (math.sqrt(cfg.d_model * cfg.qk_dim) if arm == "stiefel_lrx" else 1.0)
    return rr.StiefelAdam(
        [{"params": frames, "stiefel": True, "lr": frame_lr, "trust_radius": 0.1},
         {"params": rest}],
        lr=lr, weight_decay=wd, betas=betas)


def run_one(arm: str, seed: int, args) -> dict:
    train, val = rr.modular_arithmetic(args.p, op="+", train_fraction=args.train_frac,
                                       generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(1000 + seed)  # the same Haar frames in every arm of a seed
    model = rr.FiberBundleTransformer(rr.FiberBundleConfig.grokking(
        args.p + 1, d_model=args.d_model, n_heads=args.n_heads, head_dim=args.head_dim,
        mlp_ratio=args.d_mlp // args.d_model))
    frames0 = [p.detach().clone() for p in model.qk_frame_parameters()]
    opt = make_optimizer(model, arm, args.lr, args.wd, (0.9, 0.98))
    log = {"step": [], "train_acc": [], "val_acc": [], "train_loss": [], "frame_dist": [], "weight_norm": []}

    def record(step: int, metrics: dict) -> None:
        tr = rr.evaluate(model, train, batch_size=len(train))
        log["step"].append(step)
        log["train_loss"].append(tr["loss"])
        log["train_acc"].append(tr["accuracy"])
        log["val_acc"].append(metrics["val_accuracy"])
        # relative Frobenius distance of W_Q, W_K from their initial frames (mean over heads)
        dist = [((p - p0).flatten(1).norm(dim=1) / p0.flatten(1).norm(dim=1)).mean().item()
                for p, p0 in zip(model.qk_frame_parameters(), frames0)]
        log["frame_dist"].append(sum(dist) / len(dist))
        log["weight_norm"].append(math.sqrt(sum(p.detach().square().sum().item() for p in model.parameters())))

    res = rr.train(model, train, val, rr.TrainConfig(
        lr=args.lr, schedule="constant", grad_clip=None, steps=args.steps, batch_size=None,
        eval_interval=args.eval_every, eval_batch_size=len(val)), optimizer=opt, hooks=[record])
    va = log["val_acc"]
    grok = next((s for s, a in zip(log["step"], va) if a >= 0.95), None)
    return {"arm": arm, "seed": seed, "log": log, "final_val_acc": va[-1], "max_val_acc": max(va),
            "grok_step_95": grok, "final_frame_dist": log["frame_dist"][-1], "wall_s": res.train_time_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--p", type=int, default=31)
    ap.add_argument("--train-frac", type=float, default=0.5)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=8)
    ap.add_argument("--d-mlp", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=["adamw", "stiefel", "frozen"], choices=ARMS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/grokking_stiefel.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runs = []
    t0 = time.perf_counter()
    jobs = [(a, s) for s in args.seeds for a in args.arms]
    for arm, seed in tqdm(jobs, desc="grokking runs"):
        runs.append(run_one(arm, seed, args))
    out = {
        "experiment": "grokking_stiefel",
        "args": vars(args),
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                    "load_avg_at_end": os.getloadavg()},
        "total_wall_s": time.perf_counter() - t0,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
