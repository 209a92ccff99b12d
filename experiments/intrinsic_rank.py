#!/usr/bin/env python3
"""Intrinsic query-key rank: the full sweep behind chapters/12_intrinsic_rank.

Four experiments, all seeded, written to one small JSON file:

1. deficiency/achievability: linear-attention students of rank r = 1..d
   imitate a rank-r* teacher; final population risk vs the Eckart-Young bound;
2. recovery: a full-rank student from small init; the energy effective rank
   of its kernel over training (linear and softmax heads);
3. data-only estimation: the energy effective rank of the kernel statistic
   before training, linear vs softmax heads, over teacher scale;
4. recall: the smallest head dimension at which one attention head solves
   associative recall, for dot-product, distance and per-token-metric heads.

    python experiments/intrinsic_rank.py --seeds 3 --out results/intrinsic_rank.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from tqdm import tqdm

import riemannian_ref as rr


def draw(args, g):
    """Independent Gaussian queries [batch, m, d] and contexts [batch, n, d]."""
    Xq = torch.randn(args.batch, args.m, args.d, generator=g, dtype=torch.float64)
    Xc = torch.randn(args.batch, args.n, args.d, generator=g, dtype=torch.float64)
    return Xq, Xc


def exp_deficiency(args, bar):
    rows = []
    for r_star in args.r_stars:
        for seed in range(args.seeds):
            g = torch.Generator().manual_seed(1000 * r_star + seed)
            W_star = rr.teacher_kernel(args.d, r_star, generator=g)
            Xq, Xc = draw(args, g)
            Y = rr.kernel_attention(Xq, Xc, W_star)
            for r in range(1, args.d + 1):
                h = rr.fit_low_rank_kernel(Xq, Xc, Y, r, rr.analysis.intrinsic.FitConfig(steps=args.steps), generator=g)
                rows.append(dict(r_star=r_star, seed=seed, r=r,
                                 risk=float(rr.analysis.intrinsic.population_risk(h["W"], W_star, args.n)),
                                 bound=float(rr.analysis.intrinsic.best_rank_risk(W_star, r, args.n)),
                                 train_loss=h["loss"][-1], erank=h["erank"][-1]))
                bar.update()
    return rows


def exp_recovery(args, bar):
    rows = []
    for attention in ("linear", "softmax"):
        for seed in range(args.seeds):
            g = torch.Generator().manual_seed(7 + seed)
            W_star = rr.teacher_kernel(args.d, args.recovery_r_star, generator=g, scale=2.0)
            Xq, Xc = draw(args, g)
            Y = rr.kernel_attention(Xq, Xc, W_star, attention=attention)
            h = rr.fit_low_rank_kernel(Xq, Xc, Y, args.d, rr.analysis.intrinsic.FitConfig(steps=args.steps, attention=attention,
                                                                  log_every=10), generator=g)
            rows.append(dict(attention=attention, seed=seed, r_star=args.recovery_r_star,
                             steps=h["steps"], loss=h["loss"], erank=h["erank"]))
            bar.update()
    return rows


def exp_data_only(args, bar):
    rows = []
    for attention in ("linear", "softmax"):
        for scale in args.scales:
            for r_star in args.r_stars:
                for seed in range(args.seeds):
                    g = torch.Generator().manual_seed(31 * r_star + seed)
                    W_star = rr.teacher_kernel(args.d, r_star, generator=g, scale=scale)
                    Xq, Xc = draw(args, g)
                    M = rr.analysis.intrinsic.kernel_statistic(Xq, Xc, rr.kernel_attention(Xq, Xc, W_star, attention=attention))
                    s = torch.linalg.svdvals(M)
                    rows.append(dict(attention=attention, scale=scale, r_star=r_star, seed=seed,
                                     erank=float(rr.energy_effective_rank(M)),
                                     rel_error=float((M - W_star).norm() / W_star.norm()),
                                     svals=[round(float(x), 6) for x in s]))
                    bar.update()
    return rows


def recall_accuracy(scores, head_dim, metric_rank, seed, args):
    task = dict(n_keys=args.n_keys, n_values=args.n_values, n_pairs=args.n_pairs)
    train = rr.pair_lookup(args.recall_steps * args.recall_batch, generator=torch.Generator().manual_seed(seed),
                           **task)  # as many examples as the run draws (with replacement)
    test = rr.pair_lookup(4000, generator=torch.Generator().manual_seed(10_000 + seed), **task)
    torch.manual_seed(seed)
    model = rr.RecallHead(args.n_keys, args.n_values, args.d_model, head_dim, scores=scores,
                          metric_rank=metric_rank)
    res = rr.train(model, train, test, rr.TrainConfig(
        lr=args.recall_lr, betas=(0.9, 0.999), schedule="constant", grad_clip=None, steps=args.recall_steps,
        batch_size=args.recall_batch, eval_interval=args.recall_steps, seed=seed))
    return res.final["val_accuracy"]


def exp_recall(args, bar):
    rows = []
    heads = [("dot product", "dot", 0), ("distance, shared metric", "metric", 0),
             ("distance, per-key metrics", "metric", args.metric_rank)]
    for label, scores, metric_rank in heads:
        for head_dim in args.head_dims:
            for seed in range(args.seeds):
                acc = recall_accuracy(scores, head_dim, metric_rank, seed, args)
                rows.append(dict(head=label, head_dim=head_dim, seed=seed, accuracy=acc))
                bar.update()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--d", type=int, default=8)
    p.add_argument("--n", type=int, default=32, help="context length")
    p.add_argument("--m", type=int, default=16, help="queries per context")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--r-stars", type=int, nargs="+", default=[2, 4])
    p.add_argument("--recovery-r-star", type=int, default=3)
    p.add_argument("--scales", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    p.add_argument("--head-dims", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    p.add_argument("--metric-rank", type=int, default=2)
    p.add_argument("--n-keys", type=int, default=32)
    p.add_argument("--n-values", type=int, default=16)
    p.add_argument("--n-pairs", type=int, default=8)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--recall-steps", type=int, default=300)
    p.add_argument("--recall-batch", type=int, default=128)
    p.add_argument("--recall-lr", type=float, default=3e-3)
    p.add_argument("--out", default="results/intrinsic_rank.json")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    total = (len(args.r_stars) * args.seeds * args.d + 2 * args.seeds
             + 2 * len(args.scales) * len(args.r_stars) * args.seeds + 3 * len(args.head_dims) * args.seeds)
    t0 = time.time()
    with tqdm(total=total, disable=args.no_progress, desc="intrinsic rank") as bar:
        out = dict(deficiency=exp_deficiency(args, bar), recovery=exp_recovery(args, bar),
                   data_only=exp_data_only(args, bar), recall=exp_recall(args, bar))
    out["meta"] = dict(args=vars(args), wall_seconds=round(time.time() - t0, 1),
                       torch=torch.__version__, python=platform.python_version(),
                       machine=platform.machine(), threads=torch.get_num_threads(),
                       loadavg=os.getloadavg()[0])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out} in {out['meta']['wall_seconds']} s")


if __name__ == "__main__":
    main()
