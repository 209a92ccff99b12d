#!/usr/bin/env python3
"""Intrinsic query-key rank: the sweeps behind chapters/12_intrinsic_rank.

``--part surrogate`` (default) writes ``--out`` (results/intrinsic_rank.json)
with five seeded experiments in the linear-attention surrogate and on score
matrices:

1. deficiency/achievability: students of rank r = 1..d imitate a rank-r*
   teacher; final population risk against the Eckart-Young bound;
2. recovery: a full-rank student from small init, energy effective rank of
   its kernel over training (linear and softmax heads), for an exact
   flat-spectrum teacher and for a decaying-spectrum teacher whose outputs
   carry Gaussian label noise (``--noise``);
3. data-only estimation: the effective rank of the kernel statistic before
   training, over teacher scale;
4. score effective rank: row-centred energy effective rank of dot-product and
   Riemannian score matrices over metric strength, metric rank and side,
   several seeds.

``--part trainability`` writes ``--out`` (results/compare_lookup_headdim.json):
one-head associative recall (``rr.pair_lookup``, ``rr.RecallHead``) for
dot-product, distance and metric heads at several head dimensions (metrics in
the form ``--metric-form``, default ``factor``, G = lam I + U U^T, that of
the stored results; ``gains`` is the package default), compared under
``rr.compare`` (learning rate tuned per arm on a tuning seed, five evaluation
seeds, steps to 95% validation accuracy).

    nice -n 15 env OMP_NUM_THREADS=1 python experiments/intrinsic_rank.py --out results/intrinsic_rank.json
    nice -n 15 env OMP_NUM_THREADS=1 python experiments/intrinsic_rank.py --part trainability \\
        --out results/compare_lookup_headdim.json
    nice -n 15 env OMP_NUM_THREADS=1 python experiments/intrinsic_rank.py --part trainability \\
        --kinds dot --head-dims 2 3 --lrs 1e-4,3e-4,1e-3,3e-3,1e-2 --recall-steps 3000 \\
        --out results/compare_lookup_dot_long.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import torch
from tqdm import tqdm

import riemannian_ref as rr
from riemannian_ref._io import atomic_write_text
from riemannian_ref.analysis.intrinsic import FitConfig, best_rank_risk, kernel_statistic, population_risk
from riemannian_ref.protocol import Arm


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
                h = rr.fit_low_rank_kernel(Xq, Xc, Y, r, FitConfig(steps=args.steps), generator=g)
                rows.append(dict(r_star=r_star, seed=seed, r=r, risk=float(population_risk(h["W"], W_star, args.n)),
                                 bound=float(best_rank_risk(W_star, r, args.n)), train_loss=h["loss"][-1],
                                 erank=h["erank"][-1]))
                bar.update()
    return rows


def exp_recovery(args, bar):
    """Flat exact teacher, and decaying-spectrum teachers with label noise."""
    rows = []
    teachers = [("flat", 0.0)] + [("decaying", s) for s in args.noise]
    for spectrum, noise in teachers:
        r_star = args.recovery_r_star if spectrum == "flat" else args.decay_r_star
        for attention in ("linear", "softmax"):
            for seed in range(args.seeds):
                g = torch.Generator().manual_seed(7 + seed)
                W_star = rr.teacher_kernel(args.d, r_star, generator=g, scale=2.0, spectrum=spectrum)
                Xq, Xc = draw(args, g)
                Y = rr.kernel_attention(Xq, Xc, W_star, attention=attention)
                if noise:
                    Y = Y + noise * Y.std() * torch.randn(Y.shape, generator=g, dtype=Y.dtype)
                h = rr.fit_low_rank_kernel(Xq, Xc, Y, args.d, FitConfig(steps=args.steps, attention=attention,
                                                                        log_every=10), generator=g)
                rows.append(dict(spectrum=spectrum, noise=noise, attention=attention, seed=seed, r_star=r_star,
                                 steps=h["steps"], loss=h["loss"], erank=h["erank"],
                                 teacher_erank=float(rr.energy_effective_rank(W_star)),
                                 teacher_svals=[float(x) for x in torch.linalg.svdvals(W_star)],
                                 student_svals=[float(x) for x in torch.linalg.svdvals(h["W"])],
                                 rel_error=float((h["W"] - W_star).norm() / W_star.norm())))
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
                    M = kernel_statistic(Xq, Xc, rr.kernel_attention(Xq, Xc, W_star, attention=attention))
                    rows.append(dict(attention=attention, scale=scale, r_star=r_star, seed=seed,
                                     erank=float(rr.energy_effective_rank(M)),
                                     rel_error=float((M - W_star).norm() / W_star.norm())))
                    bar.update()
    return rows


def row_centred_erank(S):
    return float(rr.energy_effective_rank(S - S.mean(-1, keepdim=True)))


def exp_score_erank(args, bar):
    """Effective rank of score matrices over metric strength (U = strength * N(0, 1) / sqrt(r))."""
    rows = []
    n, d = args.score_tokens, args.score_head_dim
    for seed in range(args.seeds):
        g = torch.Generator().manual_seed(500 + seed)
        q = torch.randn(n, d, generator=g, dtype=torch.float64)
        k = torch.randn(n, d, generator=g, dtype=torch.float64)
        dot = row_centred_erank(q @ k.T / math.sqrt(d))
        for r in args.score_ranks:
            base = torch.randn(n, d, r, generator=g, dtype=torch.float64) / math.sqrt(r)
            for strength in args.strengths:
                U = strength * base
                for side in ("key", "mean"):
                    S = rr.riemannian_scores(q, k, U, U, metric_side=side) if side == "mean" \
                        else rr.riemannian_scores(q, k, U_k=U)
                    rows.append(dict(seed=seed, r=r, strength=strength, side=side, erank=row_centred_erank(S),
                                     dot_erank=dot))
                bar.update()
    return rows


def trainability(args) -> dict:
    task = dict(n_keys=args.n_keys, n_values=args.n_values, n_pairs=args.n_pairs)

    def data(seed):
        return rr.data.make_task("lookup", seed=seed, n_train=args.n_train, n_val=1024, **task)

    arms = {}
    for head, scores, metric_rank, dims in (("dot", "dot", 0, args.head_dims), ("distance", "metric", 0, args.head_dims),
                                            ("metric", "metric", args.metric_rank, args.metric_head_dims)):
        if head not in args.kinds:
            continue
        for hd in dims:
            arms[f"{head}-d{hd}"] = Arm(lambda s=scores, r=metric_rank, h=hd: rr.RecallHead(
                args.n_keys, args.n_values, args.d_model, h, scores=s,
                attention=dict(rank=r, metric_form=args.metric_form)))
    config = rr.TrainConfig(steps=args.recall_steps, batch_size=args.recall_batch, eval_interval=args.eval_every,
                            schedule="constant", warmup_steps=0, grad_clip=None, betas=(0.9, 0.999),
                            device=args.device)
    lrs = [float(x) for x in args.lrs.split(",")]
    bar = tqdm(total=len(arms) * (len(lrs) + args.seeds), disable=args.no_progress)

    def progress(msg):
        bar.set_description(msg)
        bar.update()

    widest_dot = f"dot-d{max(args.head_dims)}"
    res = rr.compare(arms, data, config, lrs=lrs, tune_seeds=(1000,), eval_seeds=tuple(range(args.seeds)),
                     reference=widest_dot if widest_dot in arms else next(iter(arms)), select="steps_to_target",
                     target=0.95,
                     progress=progress)
    bar.close()
    return {"experiment": "compare_lookup_headdim", "task": task, "d_model": args.d_model, **res}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="surrogate", choices=("surrogate", "trainability"))
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--d", type=int, default=8)
    p.add_argument("--n", type=int, default=32, help="context length")
    p.add_argument("--m", type=int, default=16, help="queries per context")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--r-stars", type=int, nargs="+", default=[2, 4])
    p.add_argument("--recovery-r-star", type=int, default=3)
    p.add_argument("--decay-r-star", type=int, default=8, help="rank of the decaying-spectrum teacher")
    p.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.3],
                   help="label noise of the decaying teacher, relative to the outputs' std")
    p.add_argument("--scales", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    p.add_argument("--score-tokens", type=int, default=256)
    p.add_argument("--score-head-dim", type=int, default=8)
    p.add_argument("--score-ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--strengths", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 4.0])
    p.add_argument("--head-dims", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    p.add_argument("--metric-head-dims", type=int, nargs="+", default=[1, 2])
    p.add_argument("--kinds", nargs="+", choices=("dot", "distance", "metric"), default=["dot", "distance", "metric"],
                   help="trainability: which heads to train (e.g. --kinds dot --head-dims 2 3: a longer budget or "
                        "a wider grid for the dot-product heads alone)")
    p.add_argument("--metric-rank", type=int, default=2)
    p.add_argument("--metric-form", choices=("factor", "gains"), default="factor",
                   help="trainability: the metric heads' parameterisation: factor (G = lam I + U U^T), the form "
                        "the stored results were made with, or gains (bounded gains), the package default; "
                        "gains needs --metric-rank <= every --metric-head-dims (orthonormal directions)")
    p.add_argument("--n-keys", type=int, default=32)
    p.add_argument("--n-values", type=int, default=16)
    p.add_argument("--n-pairs", type=int, default=8)
    p.add_argument("--n-train", type=int, default=50000)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--recall-steps", type=int, default=1000)
    p.add_argument("--recall-batch", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t0 = time.time()
    load0 = os.getloadavg()
    if args.part == "trainability":
        out = trainability(args)
    else:
        total = (len(args.r_stars) * args.seeds * args.d + 2 * args.seeds * (1 + len(args.noise))
                 + 2 * len(args.scales) * len(args.r_stars) * args.seeds
                 + args.seeds * len(args.score_ranks) * len(args.strengths))
        with tqdm(total=total, disable=args.no_progress, desc="intrinsic rank") as bar:
            out = dict(deficiency=exp_deficiency(args, bar), recovery=exp_recovery(args, bar),
                       data_only=exp_data_only(args, bar), score_erank=exp_score_erank(args, bar))
    out["meta"] = dict(args=vars(args), wall_seconds=round(time.time() - t0, 1), torch=torch.__version__,
                       python=platform.python_version(), threads=torch.get_num_threads(),
                       loadavg_start=load0, loadavg_end=os.getloadavg(),
                       command="python experiments/intrinsic_rank.py " + " ".join(sys.argv[1:]))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    atomic_write_text(args.out, json.dumps(out, separators=(",", ":")))
    print(f"wrote {args.out} in {out['meta']['wall_seconds']} s")


if __name__ == "__main__":
    main()
