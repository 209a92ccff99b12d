"""Rank-factored Riemannian optimisation of W_Q W_K^T vs AdamW on a character LM.

Task: next-character prediction on the source text of the standard-library
module ``argparse`` (``inspect.getsource``; ships with Python, no download),
first 90% for training, last 10% for validation. Model:
:class:`riemannian_ref.TinyTransformer`, two layers. Each head's bilinear form
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
import math
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
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


def batches(tokens, n_ctx, batch, g):
    idx = torch.randint(0, tokens.numel() - n_ctx - 1, (batch,), generator=g)
    x = torch.stack([tokens[i:i + n_ctx] for i in idx.tolist()])  # (B, n)
    y = torch.stack([tokens[i + 1:i + n_ctx + 1] for i in idx.tolist()])  # (B, n)
    return x, y


@torch.no_grad()
def val_loss(model, tokens, n_ctx, n_windows=64):
    starts = torch.linspace(0, tokens.numel() - n_ctx - 2, n_windows).long().tolist()
    x = torch.stack([tokens[i:i + n_ctx] for i in starts])
    y = torch.stack([tokens[i + 1:i + n_ctx + 1] for i in starts])
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()


def run_one(arm, seed, lr_adamw, lr_geo, data, args):
    train, val, vocab = data
    cfg = rr.TinyTransformerConfig(vocab=vocab, n_ctx=args.n_ctx, d_model=args.d_model, n_heads=args.n_heads,
                                   head_dim=args.head_dim, d_mlp=4 * args.d_model, n_layers=args.n_layers)
    model = rr.TinyTransformer(cfg, generator=torch.Generator().manual_seed(100 + seed))
    opt = make_optimizer(model, arm, lr_adamw, lr_geo)
    base = [gr["lr"] for gr in opt.param_groups]
    g = torch.Generator().manual_seed(seed)
    curve = {"step": [], "val_loss": []}
    t0 = time.perf_counter()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0:
            model.eval()
            curve["step"].append(step)
            curve["val_loss"].append(val_loss(model, val, args.n_ctx))
            model.train()
        if step == args.steps:
            break
        # linear warm-up over 5% of the steps, then cosine decay to 10%, for every group
        w = min(1.0, (step + 1) / max(1, args.steps // 20))
        c = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for gr, b in zip(opt.param_groups, base):
            gr["lr"] = b * w * c
        x, y = batches(train, args.n_ctx, args.batch, g)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {"arm": arm, "seed": seed, "lr_adamw": lr_adamw, "lr_geo": lr_geo, "curve": curve,
            "final_val_loss": curve["val_loss"][-1], "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--module", default="argparse")
    ap.add_argument("--n-ctx", type=int, default=48)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=8)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
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
    tokens, chars = rr.stdlib_char_corpus(args.module)
    cut = int(0.9 * tokens.numel())
    data = (tokens[:cut], tokens[cut:], len(chars))
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
        "corpus": f"inspect.getsource({args.module}) ({tokens.numel()} characters, vocabulary {len(chars)})",
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
