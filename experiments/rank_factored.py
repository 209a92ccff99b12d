"""Rank-factored Riemannian optimisation of W_Q W_K^T vs AdamW on a character LM.

Task: next-character prediction on ``riemannian_ref.char_lm`` (docstrings of
standard-library modules; ships with Python, no download), the last 10% held
out. Model: ``FiberBundleConfig.grokking`` with two layers and a context of
``--n-ctx``, trained by ``riemannian_ref.train``. Each head's bilinear form
:math:`W_Q^h (W_K^h)^\\top` (rank ``d`` in ``D x D``) is a point of

* ``adamw``    -- nothing: AdamW on every parameter (the baseline);
* ``embedded`` -- the embedded fixed-rank manifold (LowRankAdam, truncated-SVD
  retraction), AdamW on the rest;
* ``factored`` -- the factored quotient geometry (LowRankAdam, scaled gradient,
  balanced retraction), AdamW on the rest;
* ``stiefel``  -- the partial-isometry geometry: W_Q, W_K as Stiefel frames
  (StiefelAdam), AdamW on the rest.

Tuning: the AdamW lr is chosen on ``--adamw-grid`` (by validation loss, seed 0);
the other arms keep that lr for their ordinary parameters and tune the
geometry's lr (a Frobenius step length per matrix) on ``--geo-grid``. The best
lr of each arm is then rerun with the remaining seeds. Weight decay is 0 for
all arms (short runs; it would act differently on each parametrisation).

Writes ``results/rank_factored.json``. Run (19 runs of 300 steps; 7 min measured on
one thread of the shared, busy 2-core machine; `--arms` adds ``stiefel``):
    nice -n 10 python experiments/rank_factored.py
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

import riemannian_ref as rr

ARMS = ("adamw", "embedded", "factored", "stiefel")


def make_optimizer(model, arm, lr_adamw, lr_geo):
    frames = model.qk_frame_parameters()
    ids = {id(p) for p in frames}
    rest = [p for p in model.parameters() if id(p) not in ids]
    if arm == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr_adamw, weight_decay=0.0)
    if arm == "stiefel":
        return rr.StiefelAdam([{"params": frames, "stiefel": True, "lr": lr_geo, "trust_radius": 2 * lr_geo},
                               {"params": rest}], lr=lr_adamw)
    # frames come as [W_Q^1, W_K^1, W_Q^2, W_K^2, ...]: pairs (A, B) with W = A B^T per head
    return rr.LowRankAdam([{"params": frames, "geometry": arm, "lr": lr_geo, "trust_radius": 2 * lr_geo},
                           {"params": rest}], lr=lr_adamw)


def run_one(arm, seed, lr_adamw, lr_geo, data, args):
    train, val = data
    torch.manual_seed(100 + seed)
    model = rr.FiberBundleTransformer(rr.FiberBundleConfig.grokking(
        train.vocab_size, block_size=args.n_ctx, d_model=args.d_model, n_heads=args.n_heads,
        head_dim=args.head_dim, n_layers=args.n_layers))
    opt = make_optimizer(model, arm, lr_adamw, lr_geo)
    # linear warm-up over 5% of the steps, then cosine decay to 10%, for every group
    res = rr.train(model, train, val, rr.TrainConfig(
        lr=lr_adamw, schedule="cosine", warmup_steps=max(1, args.steps // 20), min_lr_ratio=0.1, grad_clip=None,
        steps=args.steps, batch_size=args.batch, eval_interval=args.eval_every, eval_max_examples=args.val_windows,
        seed=seed), optimizer=opt)
    curve = {"step": res.history["step"], "val_loss": res.history["val_loss"]}
    return {"arm": arm, "seed": seed, "lr_adamw": lr_adamw, "lr_geo": lr_geo, "curve": curve,
            "final_val_loss": curve["val_loss"][-1], "wall_s": res.train_time_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-ctx", type=int, default=48)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=8)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--val-windows", type=int, default=64, help="validation windows evaluated")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--adamw-grid", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2, 1e-1])
    ap.add_argument("--geo-grid", type=float, nargs="+", default=[0.1, 0.3, 1.0, 3.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=["adamw", "embedded", "factored"], choices=ARMS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/rank_factored.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    train, val, info = rr.char_lm(block_size=args.n_ctx, val_fraction=0.1)
    data = (train, val)
    t0 = time.perf_counter()
    runs, tuning = [], []
    bar = tqdm(total=len(args.adamw_grid) + (len(args.arms) - 1) * len(args.geo_grid)
               + len(args.arms) * (len(args.seeds) - 1), desc="rank-factored runs")
    # 1. tune AdamW on seed args.seeds[0]
    s0 = args.seeds[0]
    for lr in args.adamw_grid:
        tuning.append(run_one("adamw", s0, lr, None, data, args))
        bar.update()
    best_adamw = min((r for r in tuning if r["arm"] == "adamw"), key=lambda r: r["final_val_loss"])["lr_adamw"]
    best = {"adamw": (best_adamw, None)}
    # 2. tune each geometry's lr with the AdamW lr fixed for the other parameters
    for arm in [a for a in args.arms if a != "adamw"]:
        here = []
        for lr in args.geo_grid:
            here.append(run_one(arm, s0, best_adamw, lr, data, args))
            bar.update()
        tuning += here
        best[arm] = (best_adamw, min(here, key=lambda r: r["final_val_loss"])["lr_geo"])
    # 3. the remaining seeds at the chosen lrs (seed s0's tuning run is reused)
    for arm in args.arms:
        la, lg = best[arm]
        runs.append(next(r for r in tuning if r["arm"] == arm and r["lr_adamw"] == la and r["lr_geo"] == lg))
        for seed in args.seeds[1:]:
            runs.append(run_one(arm, seed, la, lg, data, args))
            bar.update()
    bar.close()
    out = {
        "experiment": "rank_factored",
        "corpus": f"{info['source']} ({info['n_chars']} characters, vocabulary {len(info['chars'])})",
        "args": vars(args),
        "best_lr": {a: {"lr_adamw": la, "lr_geo": lg} for a, (la, lg) in best.items()},
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                    "load_avg_at_end": os.getloadavg()},
        "total_wall_s": time.perf_counter() - t0,
        "tuning": [{k: r[k] for k in ("arm", "seed", "lr_adamw", "lr_geo", "final_val_loss", "wall_s")} for r in tuning],
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
