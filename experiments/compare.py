#!/usr/bin/env python3
"""Euclidean vs Riemannian vs Fiber Bundle Transformer on one task, fairly.

1. Parameter matching: the Euclidean model has the given width; the other
   modes get the width (a multiple of 2 * n_heads) whose parameter count is
   closest to it. All counts are reported.
2. Throughput: every mode's training tokens/s, measured interleaved (mode
   after mode, repeated) in this same process, median over repetitions.
3. Learning rate tuned per mode on a grid (seed 0, full steps; the lowest
   final validation loss wins).
4. Matched parameters: every mode at its tuned rate, ``--seeds`` seeds,
   ``--steps`` steps each.
5. Matched wall-clock: every mode gets the number of steps it runs in the
   time the Euclidean model needs for ``--steps`` (from the throughput of 2.),
   its schedule stretched to that many steps; same seeds.

Writes one JSON (all histories, the grid, counts, throughput, wall time,
load average, thread count) to ``--out``. Run it niced on a shared machine:

    nice -n 10 python experiments/compare.py --out results/compare_recall.json
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import statistics
import sys
import time

import torch
from tqdm.auto import tqdm

import riemannian_ref as rr
from train import MODES, ModelConfig, TaskConfig, build_model, model_config, task_data


def n_params(mc: ModelConfig, V: int, n: int) -> int:
    return rr.count_parameters(model_config(mc, V, n))["total"]


def throughput(mcs: dict, data: rr.TaskData, batch_size: int, reps: int, steps: int, lr: float) -> dict:
    """Median training tokens/s of each mode, measured interleaved."""
    models, opts = {}, {}
    for mode, mc in mcs.items():
        torch.manual_seed(0)
        models[mode] = build_model(mc, data.vocab_size, data.seq_len)
        opts[mode] = torch.optim.AdamW(models[mode].parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    rates = {m: [] for m in mcs}
    for rep in range(reps + 1):  # the first round warms up and is discarded
        for mode, model in models.items():
            b = torch.randint(0, len(data), (batch_size,), generator=g)
            x, y, mk = data.x[b], data.y[b], data.mask[b]
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = rr.training.masked_cross_entropy(model(x).logits, y, mk)
                opts[mode].zero_grad()
                loss.backward()
                opts[mode].step()
            dt = time.perf_counter() - t0
            if rep:
                rates[mode].append(steps * x.numel() / dt)
    return {m: {"median": statistics.median(r), "min": min(r), "max": max(r), "reps": r} for m, r in rates.items()}


def run_one(mc: ModelConfig, tc: TaskConfig, tcfg: rr.TrainConfig, data) -> dict:
    torch.manual_seed(tcfg.seed)  # init seed = data seed
    model = build_model(mc, data[0].vocab_size, data[0].seq_len)
    res = rr.train(model, data[0], data[1], tcfg)
    return {"mode": mc.mode, "d_model": mc.d_model, "lr": tcfg.lr, "seed": tcfg.seed, "steps": tcfg.steps,
            "n_params": res.n_params, "train_time_s": res.train_time_s, "tokens_per_s": res.tokens_per_s,
            "final": res.final, "history": res.history}


def summarise(runs: list[dict]) -> dict:
    out = {}
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:
            continue
        s = {"n_seeds": len(rs), "steps": rs[0]["steps"], "lr": rs[0]["lr"]}
        for k in ("val_loss", "val_accuracy", "val_seq_accuracy"):
            v = [r["final"][k] for r in rs]
            s[k + "_mean"] = statistics.fmean(v)
            s[k + "_std"] = statistics.stdev(v) if len(v) > 1 else 0.0
            s[k + "_min"], s[k + "_max"] = min(v), max(v)
        s["train_time_s_mean"] = statistics.fmean(r["train_time_s"] for r in rs)
        out[mode] = s
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="recall", choices=("recall", "modular", "charlm"))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--metric-rank", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=32)
    ap.add_argument("--n-pairs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--n-train", type=int, default=8192)
    ap.add_argument("--n-val", type=int, default=256)
    ap.add_argument("--eval-max", type=int, default=None, help="evaluate on the first EVAL_MAX validation examples")
    ap.add_argument("--p", type=int, default=59)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--eval-interval", type=int, default=25)
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--no-match-params", action="store_true")
    ap.add_argument("--no-wallclock", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="results/compare_recall.json")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    modes = a.modes.split(",")
    lrs = [float(x) for x in a.lrs.split(",")]
    seeds = [int(x) for x in a.seeds.split(",")]
    tc = TaskConfig(name=a.task, vocab_size=a.vocab_size, n_pairs=a.n_pairs, seq_len=a.seq_len,
                    n_train=a.n_train, n_val=a.n_val, p=a.p)
    data_by_seed = {s: task_data(tc, s) for s in seeds}
    V, n = data_by_seed[seeds[0]][0].vocab_size, data_by_seed[seeds[0]][0].seq_len

    base = ModelConfig(mode="euclidean", d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads,
                       metric_rank=a.metric_rank)
    target = n_params(base, V, n)
    mcs, counts = {}, {}
    for mode in modes:
        mc = dataclasses.replace(base, mode=mode)
        if mode != "euclidean" and not a.no_match_params:
            D = rr.match_width(model_config(mc, V, n), target, widths=range(2 * a.n_heads, a.d_model + 1,
                                                                              2 * a.n_heads)).d_model
            mc = dataclasses.replace(mc, d_model=D)
        mcs[mode] = mc
        counts[mode] = {"d_model": mc.d_model, "n_params": n_params(mc, V, n),
                        "n_params_at_base_width": n_params(dataclasses.replace(base, mode=mode), V, n)}

    thr = throughput(mcs, data_by_seed[seeds[0]][0], a.batch_size, reps=5, steps=3, lr=1e-3)

    def tcfg(lr, seed, steps):
        return rr.TrainConfig(lr=lr, seed=seed, steps=steps, batch_size=a.batch_size,
                              eval_interval=max(1, min(a.eval_interval, steps)), weight_decay=a.weight_decay,
                              warmup_steps=min(20, steps // 10), device=a.device, progress=False,
                              eval_max_examples=a.eval_max)

    jobs = len(modes) * len(lrs) + len(modes) * (len(seeds) - 1)
    jobs += 0 if a.no_wallclock else (len(modes) - 1) * len(seeds)
    bar = tqdm(total=jobs, desc="runs", disable=a.no_progress)

    grid = []  # stage 3: lr grid, seed 0, modes interleaved
    for lr in lrs:
        for mode in modes:
            grid.append(run_one(mcs[mode], tc, tcfg(lr, seeds[0], a.steps), data_by_seed[seeds[0]]))
            bar.update(1)
            bar.set_postfix(mode=mode, lr=lr, loss=f"{grid[-1]['final']['val_loss']:.3f}")
    best_lr = {}
    for mode in modes:
        rs = [r for r in grid if r["mode"] == mode]
        best_lr[mode] = min(rs, key=lambda r: r["final"]["val_loss"]
                            if math.isfinite(r["final"]["val_loss"]) else float("inf"))["lr"]

    matched = [r for r in grid if r["lr"] == best_lr[r["mode"]]]  # stage 4 reuses seed 0
    for seed in seeds[1:]:
        for mode in modes:
            matched.append(run_one(mcs[mode], tc, tcfg(best_lr[mode], seed, a.steps), data_by_seed[seed]))
            bar.update(1)

    wallclock, wc_steps = [], {}
    if not a.no_wallclock:  # stage 5
        ref = thr["euclidean"]["median"]
        for mode in modes:
            wc_steps[mode] = max(1, round(a.steps * thr[mode]["median"] / ref))
        for seed in seeds:
            for mode in modes:
                if wc_steps[mode] == a.steps:
                    wallclock += [r for r in matched if r["mode"] == mode and r["seed"] == seed]
                    continue
                wallclock.append(run_one(mcs[mode], tc, tcfg(best_lr[mode], seed, wc_steps[mode]),
                                         data_by_seed[seed]))
                bar.update(1)
    bar.close()

    record = {
        "task": dataclasses.asdict(tc), "modes": modes, "base": dataclasses.asdict(base),
        "models": {m: dataclasses.asdict(mc) for m, mc in mcs.items()}, "param_counts": counts,
        "lr_grid": lrs, "best_lr": best_lr, "seeds": seeds, "steps": a.steps, "batch_size": a.batch_size,
        "throughput_tokens_per_s": thr, "wallclock_steps": wc_steps,
        "summary_matched_params": summarise(matched),
        "summary_matched_wallclock": summarise(wallclock) if wallclock else None,
        "runs_grid": grid, "runs_matched_params": matched, "runs_matched_wallclock": wallclock,
        "wall_s": time.perf_counter() - t_start, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
        "nice": os.nice(0), "threads": torch.get_num_threads(), "device": a.device,
        "package_version": rr.__version__,
        "model_source_sha256": {m.__name__: hashlib.sha256(open(m.__file__, "rb").read()).hexdigest()
                                for m in (rr.models.transformer, rr.attention.layer, rr.attention.connections)},
        "torch": torch.__version__, "python": sys.version.split()[0], "argv": sys.argv[1:] if argv is None else argv,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(record, f, indent=None, separators=(",", ":"))
    for mode, s in record["summary_matched_params"].items():
        print(f"{mode:13s} params {counts[mode]['n_params']:7d} lr {best_lr[mode]:.0e} "
              f"val_loss {s['val_loss_mean']:.4f}+-{s['val_loss_std']:.4f} "
              f"acc {s['val_accuracy_mean']:.4f}+-{s['val_accuracy_std']:.4f} "
              f"tok/s {thr[mode]['median']:.0f}")
    print(f"wall {record['wall_s']:.0f} s, load {load_start} -> {record['loadavg_end']} -> {a.out}")


if __name__ == "__main__":
    main()
