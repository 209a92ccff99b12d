#!/usr/bin/env python3
"""Low-rank against dense metric operations: solve, logdet and squared length.

For each head dimension d, one metric G = lam I + U U^T (rank r) and one vector
w are drawn, and each operation is timed along two routes:

- low rank: ``rr.LowRankMetric(lam, U)`` built afresh each call (so the
  Cholesky factor of the r x r capacitance, O(d r^2 + r^3), is included), then
  ``solve`` (Woodbury), ``logdet`` (determinant lemma) or ``quad`` (O(d r));
- dense: from the d x d matrix G already formed (its O(d^2 r) formation is not
  charged), Cholesky + triangular solves for ``solve``, Cholesky for
  ``logdet`` (the best dense route for an SPD matrix), ``w . (G w)`` for
  ``quad`` (O(d^2)).

Each (op, route, d) is timed ``--repeats`` times; a repeat runs the call in a
loop long enough (>= ``--min-time`` CPU seconds) to be above the timer's
resolution, and the per-call time is the loop time divided by its length.
The clock is the process CPU time (the run is single-threaded): on a shared,
loaded machine wall time measures the scheduler as much as the work; wall
times are recorded too.
The table reports medians, the dense/low-rank ratio measured in the same run,
and log-log slopes fitted over ``d >= --fit-min``. Results (with machine,
torch version, threads, load average, repeats, medians and spreads) go to
``--out`` as JSON.

    python3 benchmarks/bench_metric_ops.py                # full table, ~2-5 min on one core
    python3 benchmarks/bench_metric_ops.py --dims 64 128 256 --repeats 3 --out /tmp/t.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import riemannian_ref as rr
from riemannian_ref._io import atomic_write_text

OPS = ("solve", "logdet", "quad")
ROUTES = ("lowrank", "dense")


def make_calls(d: int, r: int, seed: int) -> dict[tuple[str, str], callable]:
    """The six timed callables for one head dimension, on float64 CPU tensors."""
    g = torch.Generator().manual_seed(seed)
    lam = 1.0
    U = torch.randn(d, r, generator=g, dtype=torch.float64) / math.sqrt(r)  # entries of variance 1/r
    w = torch.randn(d, generator=g, dtype=torch.float64)
    G = rr.LowRankMetric(lam, U).dense()  # (d, d), formed once, outside the timing
    w_col = w.unsqueeze(-1)  # (d, 1)

    def dense_solve():
        return torch.cholesky_solve(w_col, torch.linalg.cholesky(G))

    def dense_logdet():
        return 2.0 * torch.log(torch.diagonal(torch.linalg.cholesky(G))).sum()

    return {
        ("solve", "lowrank"): lambda: rr.LowRankMetric(lam, U).solve(w),
        ("solve", "dense"): dense_solve,
        ("logdet", "lowrank"): lambda: rr.LowRankMetric(lam, U).logdet(),
        ("logdet", "dense"): dense_logdet,
        ("quad", "lowrank"): lambda: rr.LowRankMetric(lam, U).quad(w),
        ("quad", "dense"): lambda: w @ (G @ w),
    }


def time_call(fn, repeats: int, min_time: float) -> tuple[list[float], list[float]]:
    """Per-call CPU and wall seconds of ``repeats`` timed loops, each >= ``min_time`` CPU seconds.

    CPU time of this (single-threaded) process is the primary measure: on a
    shared machine, wall time mostly measures how long the scheduler kept us
    waiting.
    """
    fn()  # warm-up (allocations, lazy initialisation)
    t0 = time.process_time()
    fn()
    one = max(time.process_time() - t0, 1e-6)
    number = max(1, int(math.ceil(min_time / one)))
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(number):
            fn()
        cpu.append((time.process_time() - c0) / number)
        wall.append((time.perf_counter() - w0) / number)
    return cpu, wall


def fit_slope(dims, times, fit_min: int) -> float:
    """Least-squares slope of log(time) against log(d) over d >= fit_min."""
    xs = [math.log(d) for d in dims if d >= fit_min]
    ys = [math.log(t) for d, t in zip(dims, times) if d >= fit_min]
    if len(xs) < 2:
        return float("nan")
    return float(np.polyfit(xs, ys, 1)[0])


def machine_info() -> dict:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--rank", type=int, default=8, help="metric rank r")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--min-time", type=float, default=0.02, help="seconds per timed loop")
    p.add_argument("--fit-min", type=int, default=256, help="fit slopes over d >= this")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/metric_ops_timing.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    load_before = os.getloadavg()
    rows = []
    for d in tqdm(args.dims, desc="d"):
        calls = make_calls(d, args.rank, args.seed)
        for (op, route), fn in calls.items():
            ts, wall = time_call(fn, args.repeats, args.min_time)
            q1, q3 = np.percentile(ts, [25, 75])
            rows.append({"op": op, "route": route, "d": d, "median_s": statistics.median(ts),
                         "min_s": min(ts), "max_s": max(ts), "iqr_s": float(q3 - q1), "times_s": ts,
                         "wall_median_s": statistics.median(wall), "wall_times_s": wall})
    load_after = os.getloadavg()

    med = {(r["op"], r["route"], r["d"]): r["median_s"] for r in rows}
    slopes = {op: {route: fit_slope(args.dims, [med[op, route, d] for d in args.dims], args.fit_min)
                   for route in ROUTES} for op in OPS}
    result = {
        "benchmark": "metric_ops", "rank": args.rank, "dtype": "float64", "dims": args.dims,
        "repeats": args.repeats, "min_time_s": args.min_time, "seed": args.seed,
        "fit_min": args.fit_min, "clock": "process CPU time (time.process_time), per call",
        "load_avg_before": load_before, "load_avg_after": load_after,
        **machine_info(), "rows": rows, "slopes": slopes,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")

    info = machine_info()
    print(f"# {info['cpu']}, torch {info['torch']}, {info['threads']} thread(s), r = {args.rank}, "
          f"float64, CPU time per call, median of {args.repeats}; load avg {load_before[0]:.2f} -> {load_after[0]:.2f}")
    head = f"{'d':>6} " + " ".join(f"{op + ' lr':>11} {op + ' dense':>12} {'ratio':>8}" for op in OPS)
    print(head)
    for d in args.dims:
        cells = []
        for op in OPS:
            lr, de = med[op, "lowrank", d], med[op, "dense", d]
            cells.append(f"{lr * 1e6:>9.1f}us {de * 1e6:>10.1f}us {de / lr:>8.1f}")
        print(f"{d:>6} " + " ".join(cells))
    print(f"fitted log-log slopes over d >= {args.fit_min}: " + ", ".join(
        f"{op}: low rank {slopes[op]['lowrank']:.2f}, dense {slopes[op]['dense']:.2f}" for op in OPS))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
