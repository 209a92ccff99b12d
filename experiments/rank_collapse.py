#!/usr/bin/env python3
"""Rank collapse of attention stacks: Euclidean vs Riemannian variants, by depth.

For every variant and architecture, each seed builds one random depth-L stack
(`FiberBundleConfig.attention_stack`), feeds it a batch of Gaussian token states
and records, for every depth 0..L, the relative residual (mean form, composite
and Frobenius norms), the stable rank and the energy effective rank of the
hidden states, and the relative residual of the product of head-0 attention
matrices (the distance of a path product to rank one). Per seed the values are
averaged over the batch (log10 for residuals); the file stores the per-seed
values so the chapters can compute means and intervals.

Metrics are built in the form `--metric-form` (default `factor`, G = lam I + U U^T,
the form of the stored results; `gains` is the package default).

Part "trained" trains a depth-`--train-depth` classifier on the counting task
for `--train-steps` Adam steps (`riemannian_ref.train`) and records the same
profile on held-out inputs before and after training.

    python experiments/rank_collapse.py --seeds 10 --depth 24 --train-seeds 10 --out results/rank_collapse.json

The committed file took 13.4 min of CPU on one thread of this book's 2-core
machine (recorded in its meta). Runs on one thread (`OMP_NUM_THREADS=1`); float64 so that residuals can be
followed down to ~1e-15 before rounding sets the floor.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import riemannian_ref as rr
from riemannian_ref._io import atomic_write_text

ARCHS = {  # name: (skip, mlp, layer_norm)
    "pure": (False, False, False),
    "skip": (True, False, False),
    "mlp": (False, True, False),
    "block": (True, True, True),
}


def variant_grid(ranks, strengths, sides, connections=("trivial", "flat", "content")):
    """Name -> FiberBundleConfig overrides for the attention variants (the attention options nested)."""
    metric = dict(mode="riemannian")
    v = {"euclidean": dict(mode="euclidean"),
         "l2": dict(metric, attention=dict(rank=0, strength=0.0))}  # G = lam I: distance, not dot product
    for s in strengths:
        v[f"shared-r4-s{s:g}"] = dict(metric, attention=dict(metric="shared", rank=4, strength=s))
    for side in sides:
        for r in ranks:
            v[f"hetero-{side}-r{r}-s1"] = dict(metric, attention=dict(metric_side=side, rank=r, strength=1.0))
        for s in strengths:
            v[f"hetero-{side}-r4-s{s:g}"] = dict(metric, attention=dict(metric_side=side, rank=4, strength=s))
    for c in connections:
        v[f"fiber-{c}-key-r4-s1"] = dict(metric, attention=dict(connection=c, metric_side="key", rank=4,
                                                                strength=1.0))
    return v


def _log10(x: torch.Tensor) -> torch.Tensor:
    return torch.log10(x.clamp_min(1e-300))


@torch.no_grad()
def profile(H: torch.Tensor, W: torch.Tensor | None) -> dict[str, list[float]]:
    """Batch-averaged measures per depth from hidden states [L+1, B, n, D] and weights [L, B, h, n, n]."""
    out = {
        "log10_res_comp": _log10(rr.relative_residual(H, "composite")).mean(-1),
        "log10_res_fro": _log10(rr.relative_residual(H, "fro")).mean(-1),
        "stable_rank": rr.stable_rank(H).mean(-1),
        "eff_rank": rr.energy_effective_rank(H).mean(-1),
    }
    if W is not None:
        P = rr.attention_path_products(W)  # (L, B, n, n)
        path = _log10(rr.relative_residual(P, "fro")).mean(-1)  # (L,)
        out["log10_path_res"] = torch.cat([torch.zeros(1, dtype=path.dtype), path])  # depth 0: identity
    return {k: [round(float(x), 3) for x in v] for k, v in out.items()}


def init_jobs(args, variants):
    """(arch, gain, name) triples: Euclidean on every architecture, the other variants on --archs."""
    jobs = []
    for gain in sorted(set(args.gains) | set(args.euclid_gains)):
        for arch in ARCHS:
            for name in variants:
                if name == "euclidean":
                    ok = arch in args.euclid_archs and gain in args.euclid_gains
                else:
                    ok = arch in args.archs and gain in args.gains
                if ok:
                    jobs.append((arch, gain, name))
    return jobs


def run_init(args, variants, jobs, bar) -> dict:
    res = {}
    for arch, gain, name in jobs:
            over = variants[name]
            skip, mlp, ln = ARCHS[arch]
            runs = []
            for seed in range(args.seeds):
                torch.manual_seed(seed)
                cfg = rr.FiberBundleConfig.attention_stack(d_model=args.d_model, n_heads=args.heads,
                                                           n_layers=args.depth, skip=skip, mlp=mlp, layer_norm=ln,
                                                           **over).replace(
                    attention=dict(qk_gain=gain, metric_form=args.metric_form))
                stack = rr.FiberBundleTransformer(cfg).double()
                g = torch.Generator().manual_seed(10_000 + seed)
                X = torch.randn(args.batch, args.n, args.d_model, generator=g, dtype=torch.float64)
                with torch.no_grad():
                    out = stack(embeds=X, return_hidden=True, return_weights=True)
                H, W = out.hidden, out.weights
                runs.append(profile(H, W))
                bar.update(1)
            res[f"{arch}/g{gain:g}/{name}"] = {k: [r[k] for r in runs] for k in runs[0]}
    return res


def run_trained(args, variants, archs, bar) -> dict:
    res = {}
    for arch in archs:
        skip, mlp, ln = ARCHS[arch]
        for name, over in variants.items():
            runs = {"init": [], "trained": [], "final_loss": [], "accuracy": []}
            for seed in range(args.train_seeds):
                torch.manual_seed(seed)
                cfg = rr.FiberBundleConfig.attention_stack(
                    d_model=args.train_d_model, n_heads=args.heads, n_layers=args.train_depth, skip=skip,
                    mlp=mlp, layer_norm=ln, vocab_size=args.train_vocab, n_classes=args.train_n,
                    **over).replace(attention=dict(metric_form=args.metric_form))
                model = rr.FiberBundleTransformer(cfg)
                task = dict(seq_len=args.train_n, vocab_size=args.train_vocab)
                train = rr.counting(args.train_examples, generator=torch.Generator().manual_seed(30_000 + seed),
                                    **task)
                held = rr.counting(256, generator=torch.Generator().manual_seed(20_000 + seed), **task)
                with torch.no_grad():
                    runs["init"].append(profile(model(held.x, return_hidden=True).hidden.double(), None))
                res_train = rr.train(model, train, held, rr.TrainConfig(
                    lr=args.lr, steps=args.train_steps, batch_size=args.train_batch, schedule="constant",
                    grad_clip=None, betas=(0.9, 0.999), eval_interval=min(20, args.train_steps), seed=seed))
                with torch.no_grad():
                    runs["trained"].append(profile(model(held.x, return_hidden=True).hidden.double(), None))
                runs["accuracy"].append(round(res_train.final["val_accuracy"], 4))
                runs["final_loss"].append(round(res_train.history["train_loss"][-1], 4))  # mean of the last 20 steps
                bar.update(1)
            res[f"{arch}/g1/{name}"] = runs
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=10, help="random stacks per point (init part)")
    p.add_argument("--depth", type=int, default=24, help="deepest stack; all depths 0..L are recorded")
    p.add_argument("--n", type=int, default=32, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="input sequences per seed")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--strengths", type=float, nargs="+", default=[0.25, 1.0, 4.0])
    p.add_argument("--sides", nargs="+", default=["key", "query", "mean"])
    p.add_argument("--gains", type=float, nargs="+", default=[4.0],
                   help="qk_gain values for the non-Euclidean variants (W_Q, W_K init multiplier; "
                        "scores scale with its square)")
    p.add_argument("--euclid-gains", type=float, nargs="+", default=[1.0, 4.0])
    p.add_argument("--archs", nargs="+", default=["pure", "block"], choices=list(ARCHS),
                   help="architectures for the non-Euclidean variants")
    p.add_argument("--euclid-archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    p.add_argument("--variants", nargs="*", default=None,
                   help="restrict to these variant names (default: the whole grid)")
    p.add_argument("--train-variants", nargs="*",
                   default=["euclidean", "l2", "shared-r4-s1", "hetero-key-r4-s1", "hetero-mean-r4-s1",
                            "fiber-flat-key-r4-s1"])
    p.add_argument("--train-archs", nargs="+", default=["pure", "block"], choices=list(ARCHS))
    p.add_argument("--train-seeds", type=int, default=10)
    p.add_argument("--train-depth", type=int, default=6)
    p.add_argument("--train-d-model", type=int, default=32)
    p.add_argument("--train-batch", type=int, default=32)
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument("--train-n", type=int, default=16)
    p.add_argument("--train-vocab", type=int, default=8)
    p.add_argument("--train-examples", type=int, default=8192, help="counting sequences to train on")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--metric-form", choices=("factor", "gains"), default="factor",
                   help="metric parameterisation: factor (G = lam I + U U^T), the form the stored results were "
                        "made with, or gains (bounded gains), the package default")
    p.add_argument("--out", type=Path, default=Path("results/rank_collapse.json"))
    args = p.parse_args(argv)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    variants = variant_grid(args.ranks, args.strengths, args.sides)
    if args.variants is not None:
        unknown = set(args.variants) - set(variants)
        if unknown:
            p.error(f"unknown variants {sorted(unknown)}; known: {sorted(variants)}")
        variants = {k: variants[k] for k in args.variants}
    full = variant_grid([1, 2, 4, 8], [0.25, 1.0, 4.0] + list(args.strengths), ["key", "query", "mean"])
    unknown = set(args.train_variants) - set(full)
    if unknown:
        p.error(f"unknown train variants {sorted(unknown)}")
    train_variants = {k: full[k] for k in args.train_variants}
    jobs = init_jobs(args, variants)
    total = len(jobs) * args.seeds + len(args.train_archs) * len(train_variants) * args.train_seeds
    t0, c0 = time.perf_counter(), time.process_time()
    with tqdm(total=total, desc="stacks") as bar:
        init = run_init(args, variants, jobs, bar)
        trained = run_trained(args, train_variants, args.train_archs, bar) if args.train_steps > 0 else {}
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    meta = {
        "wall_s": round(wall, 1),
        # CPU time of this (single-threaded) process: what the wall time would be on an idle core
        "cpu_s": round(cpu, 1),
        "seeds": args.seeds, "depth": args.depth, "n": args.n, "d_model": args.d_model, "heads": args.heads,
        "batch": args.batch, "dtype": "float64", "input": "iid N(0, 1) token states", "gains": args.gains,
        "metric_form": args.metric_form,
        "euclid_gains": args.euclid_gains,
        "train": {"seeds": args.train_seeds, "depth": args.train_depth, "steps": args.train_steps,
                  "d_model": args.train_d_model, "n": args.train_n, "vocab": args.train_vocab, "lr": args.lr,
                  "batch": args.train_batch, "dtype": "float32", "variants": list(train_variants),
                  "task": "histogram (count of each token's symbol)"},
        "archs": {a: dict(zip(("skip", "mlp", "layer_norm"), ARCHS[a])) for a in ARCHS},
        "variants": {k: v for k, v in variants.items()},
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "command": "python experiments/rank_collapse.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps({"meta": meta, "init": init, "trained": trained}, separators=(",", ":")))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB) in {wall:.0f} s")


if __name__ == "__main__":
    main()
