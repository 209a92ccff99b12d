#!/usr/bin/env python3
"""Riemannian attention against scaled_dot_product_attention, measured in the same run.

    nice python benchmarks/bench_attention.py                    # the full grid (hours on 2 cores)
    python benchmarks/bench_attention.py --quick                 # a minute

For every batch size B, thread count, sequence length n and metric rank r
(d = 64, h = 4, per-token metrics, float32, no mask) and metric side (the key
side on the whole grid, the query and mean sides on ``--side-ns`` at
``--side-B``) it prints and writes (``results/bench_attention_cpu.md`` and
``.json``, rewritten after every row, so an interrupted run keeps its rows):

* time ratio to SDPA, forward and forward+backward: SDPA and the operator are
  timed alternately (each round repeats a call until 0.1 s of SDPA is
  filled), ``--reps`` rounds, and the median of the per-round ratios
  is reported, so a change of machine load between rounds cancels;
* the FLOP-predicted ratio (the package's count,
  :func:`riemannian_ref.models.budget.attention_flops`): matrix products as
  the kernels execute them AND the extra elementwise work (squares of the rank
  products, their gradients, softmax);
* measured / predicted, the number the targets are about (<= 1.3);
* peak extra memory, operator vs SDPA, at the largest n: each configuration
  runs in a fresh subprocess with ``MALLOC_MMAP_THRESHOLD_=65536`` (every
  large tensor is its own mmap, returned to the system when freed, so the
  resident set follows the allocations). The call runs twice (the first
  pages in code); before the second, the kernel's resident-set high-water
  mark is reset (``/proc/self/clear_refs``), and the peak is ``VmHWM`` after
  the call minus ``VmRSS`` before it. Inputs (and the output gradient) are
  allocated before; the output and the gradients of the inputs are allocated
  by the call and counted (the metric factors' gradient is ``r`` times the
  size of ``dk``), and reported separately as the floor no implementation can
  go below.

The load average before and after and the wall time of the run are recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import riemannian_ref as rr
from riemannian_ref._io import atomic_write_text
from riemannian_ref.models.budget import attention_flops

ROOT = Path(__file__).resolve().parents[1]


def predicted(n: int, d: int, r: int, side: str, backward: bool) -> float:
    """The operator's FLOP count over SDPA's (:func:`riemannian_ref.models.budget.attention_flops`)."""
    def work(c):
        return c["matmul_fwd"] + c["elementwise_fwd"] + (c["matmul_bwd"] + c["elementwise_bwd"] if backward else 0)
    return work(attention_flops(n, d, r, metric_side=side)) / work(attention_flops(n, d, kernel="sdpa"))


def make_inputs(B, h, n, d, r, side, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, d, generator=g) for _ in range(3))
    U = torch.randn(B, h, n, d, r, generator=g) / (d ** 0.5)
    Uq = U if side in ("query", "mean") else None
    Uk = U if side in ("key", "mean") else None
    if grad:
        for t in (q, k, v, U):
            t.requires_grad_()
    return q, k, v, Uq, Uk


def run_once(op, inputs, side, backward, gout=None):
    q, k, v, Uq, Uk = inputs
    if op == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v)
    else:
        out = rr.riemannian_attention(q, k, v, U_q=Uq, U_k=Uk, metric_side=side)
    if backward:
        out.backward(gout)
    return out


def timed(op, inputs, side, backward, gout, calls=1):
    """Seconds per call, averaged over ``calls`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        if backward:
            run_once(op, inputs, side, True, gout)
        else:
            with torch.no_grad():
                run_once(op, inputs, side, False)
    return (time.perf_counter() - t0) / calls


def time_pair(B, h, n, d, r, side, backward, reps, min_time=0.1):
    """Alternate SDPA and the operator; per-round ratios.

    Each round times enough back-to-back calls of SDPA (and the same number
    of the operator) to fill ``min_time`` seconds of SDPA, so that small
    problems (a few ms) are not measured from one noisy call. A warm-up call
    of each comes first where a call is short (for calls of seconds it would
    only double the run).
    """
    ins = make_inputs(B, h, n, d, r, side, grad=backward)
    gout = torch.randn(B, h, n, d, generator=torch.Generator().manual_seed(1)) if backward else None
    t_warm = timed("sdpa", ins, side, backward, gout)  # warm-up
    if t_warm < 0.2:
        timed("rr", ins, side, backward, gout)
    calls = max(1, math.ceil(min_time / max(t_warm, 1e-6)))
    ts, to = [], []
    for _ in range(reps):
        ts.append(timed("sdpa", ins, side, backward, gout, calls))
        to.append(timed("rr", ins, side, backward, gout, calls))
    ratios = [b / a for a, b in zip(ts, to)]
    return statistics.median(ratios), min(ts), min(to), ratios


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def mem_child(B, h, n, d, r, side, op, backward):
    """Peak extra resident memory (bytes) of one call, and the bytes of its output and input gradients."""
    torch.set_num_threads(1)
    ins = make_inputs(B, h, n, d, r, side, grad=backward)
    gout = torch.ones(B, h, n, d) if backward else None
    for _ in range(2):  # the first call pages in code and sets up; the second is measured
        for t in ins:
            if t is not None:
                t.grad = None
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the resident-set high-water mark (VmHWM)
        before = _status("VmRSS:")
        if backward:
            out = run_once(op, ins, side, True, gout)
        else:
            with torch.no_grad():
                out = run_once(op, ins, side, False)
        peak = _status("VmHWM:")
    floor = out.numel() * out.element_size()
    if backward:
        floor += sum(t.grad.numel() * t.grad.element_size() for t in ins if t is not None and t.grad is not None)
    return max(peak - before, 0), floor


def measure_mem(args, n, r, op, backward, side="key"):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--mem-child", str(n), str(r), op, str(int(backward)),
           "--B", str(args.mem_B), "--heads", str(args.heads), "--d", str(args.d), "--side", side]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    peak, floor = res.stdout.strip().splitlines()[-1].split()
    return int(peak), int(floor)


def machine_info(threads):
    model = platform.processor() or "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "torch": torch.__version__, "threads": threads,
            "python": platform.python_version()}


def finish(info: dict, t_start: float, out, payload: dict, lines: list[str] | None = None) -> None:
    """Record the load after and the wall time in ``info``, then write ``out``.json (``payload``) and, given
    the table's ``lines``, ``out``.md; ``out`` None or empty writes nothing."""
    info["load_after"] = os.getloadavg()
    info["wall_s"] = time.time() - t_start
    if not out:
        return
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out.with_suffix(".json"), json.dumps(payload, indent=1))
    if lines is not None:
        atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")


def load_text(info: dict) -> str:
    """'Load average before: a, b, c; after: x, y, z. Wall time N min.' for a results file."""
    f = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    return (f"Load average before: {f(info['load_before'])}; after: {f(info['load_after'])}. "
            f"Wall time {info['wall_s'] / 60:.0f} min.")


def plan(args):
    """(side, B, threads, n, r) of every timed configuration, in the order they run.

    Shortest sequences first (all batches, threads, sides and ranks of one n
    before the next n), so that a run cut short for time still covers the
    whole grid up to some n.
    """
    grid = [("key", B, t, n, r) for B in args.B for t in args.threads for n in args.ns for r in args.ranks]
    grid += [(side, args.side_B, t, n, r) for side in args.sides for t in args.threads for n in args.side_ns
             for r in args.ranks]
    return sorted(grid, key=lambda c: (c[3], c[0] != "key", c[1], c[2], c[4]))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="B = 1, 4; n = 512, 1024; r = 1, 4; 2 rounds")
    p.add_argument("--ns", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--B", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--sides", nargs="*", default=["query", "mean"], choices=["query", "mean"],
                   help="metric sides measured besides the key side (at --side-B, --side-ns)")
    p.add_argument("--side-B", type=int, default=4)
    p.add_argument("--side-ns", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--min-time", type=float, default=0.1, help="seconds of SDPA per timing round")
    p.add_argument("--no-mem", action="store_true", help="skip the memory subprocesses")
    p.add_argument("--mem-B", type=int, default=1, help="batch of the memory measurement")
    p.add_argument("--mem-ranks", type=int, nargs="+", help="ranks of the memory measurement (default: --ranks)")
    p.add_argument("--out", default=str(ROOT / "results" / "bench_attention_cpu"),
                   help="write OUT.md and OUT.json ('' to skip)")
    p.add_argument("--mem-child", nargs=4, metavar=("N", "R", "OP", "BWD"), help=argparse.SUPPRESS)
    p.add_argument("--side", default="key", help=argparse.SUPPRESS)  # the memory child's side
    args = p.parse_args()
    if args.mem_child:
        n, r, op, bwd = args.mem_child
        print(*mem_child(args.mem_B, args.heads, int(n), args.d, int(r), args.side, op, bool(int(bwd))))
        return
    if args.quick:
        args.ns, args.ranks, args.reps, args.B, args.side_ns = [512, 1024], [1, 4], 2, [1, 4], [512]
    t_start = time.time()
    info = machine_info(args.threads)
    info["load_before"] = os.getloadavg()
    info.update(h=args.heads, d=args.d, reps=args.reps, dtype="float32", cuda=torch.cuda.is_available(),
                command="python " + " ".join(["benchmarks/bench_attention.py"] + sys.argv[1:]))
    rows, mem = [], []
    print(f"# {info['cpu']}, torch {info['torch']}, load {info['load_before'][0]:.2f}")
    print(f"{'side':>5} {'B':>2} {'thr':>3} {'n':>5} {'r':>2} {'pass':>8} {'SDPA ms':>9} {'ours ms':>9} "
          f"{'ratio':>6} {'pred':>5} {'meas/pred':>9}")
    if not args.no_mem:
        n = max(args.ns)
        for backward in (False, True):
            base, base_floor = measure_mem(args, n, 1, "sdpa", backward)
            for r in args.mem_ranks or args.ranks:
                ours, floor = measure_mem(args, n, r, "rr", backward)
                mem.append(dict(n=n, r=r, B=args.mem_B, passes="fwd+bwd" if backward else "fwd",
                                sdpa_MiB=base / 2 ** 20, ours_MiB=ours / 2 ** 20, ratio=ours / max(base, 1),
                                sdpa_floor_MiB=base_floor / 2 ** 20, floor_MiB=floor / 2 ** 20,
                                floor_ratio=floor / max(base, 1)))
                print(f"memory n={n} r={r} {mem[-1]['passes']}: SDPA {base / 2 ** 20:.1f} MiB, "
                      f"ours {ours / 2 ** 20:.1f} MiB, ratio {ours / max(base, 1):.2f} "
                      f"(output + gradients alone {floor / 2 ** 20:.1f} MiB)", flush=True)
    for side, B, threads, n, r in plan(args):
        torch.set_num_threads(threads)
        for backward in (False, True):
            ratio, ts, to, all_r = time_pair(B, args.heads, n, args.d, r, side, backward, args.reps,
                                              args.min_time)
            pred = predicted(n, args.d, r, side, backward)
            row = dict(side=side, B=B, threads=threads, n=n, r=r, passes="fwd+bwd" if backward else "fwd",
                       sdpa_ms=ts * 1e3, ours_ms=to * 1e3, ratio=ratio, ratio_rounds=all_r, predicted=pred,
                       measured_over_predicted=ratio / pred, load=os.getloadavg()[0])
            rows.append(row)
            print(f"{side:>5} {B:>2} {threads:>3} {n:>5} {r:>2} {row['passes']:>8} {ts * 1e3:9.1f} "
                  f"{to * 1e3:9.1f} {ratio:6.2f} {pred:5.2f} {ratio / pred:9.2f}", flush=True)
        write(args, info, rows, mem, t_start)
    write(args, info, rows, mem, t_start)


def write(args, info, rows, mem, t_start):
    info["load_after"] = os.getloadavg()
    info["wall_s"] = time.time() - t_start
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out.with_suffix(".json"), json.dumps({"machine": info, "time": rows, "memory": mem}, indent=1))
        atomic_write_text(out.with_suffix(".md"), to_markdown(info, rows, mem))


def to_markdown(info, rows, mem):
    meets = [x for x in rows if x["measured_over_predicted"] <= 1.3]
    lines = [
        "# Riemannian attention vs scaled_dot_product_attention (CPU)",
        "",
        f"Machine: {info['cpu']} ({info['cores']} cores, shared with other jobs), torch {info['torch']}, "
        f"float32, h = {info['h']}, d = {info['d']}, per-token metrics, no mask. Load average (1, 5, 15 min) "
        f"before: {', '.join(f'{x:.2f}' for x in info['load_before'])}; after: "
        f"{', '.join(f'{x:.2f}' for x in info['load_after'])} (the 1-minute load at each row is in the JSON). "
        f"Wall time {info['wall_s'] / 60:.0f} min. Ratios are medians over {info['reps']} alternating rounds "
        f"measured in the same run; inputs from seed 0 (`make_inputs`). Command: `{info['command']}`.",
        "",
        "No CUDA GPU was available to this run: no GPU table." if not info.get("cuda") else
        "A CUDA GPU was present; this table is the CPU one.",
        "",
        f"Target measured / predicted <= 1.3: met in {len(meets)} of {len(rows)} rows.",
        "",
        "| side | B | threads | n | r | pass | SDPA ms | ours ms | time ratio | FLOP-predicted | measured / predicted |",
        "|:---|---:|---:|---:|---:|:---|---:|---:|---:|---:|---:|",
    ]
    for x in rows:
        lines.append(f"| {x['side']} | {x['B']} | {x['threads']} | {x['n']} | {x['r']} | {x['passes']} | "
                     f"{x['sdpa_ms']:.1f} | {x['ours_ms']:.1f} | {x['ratio']:.2f} | {x['predicted']:.2f} | "
                     f"{x['measured_over_predicted']:.2f} |")
    if mem:
        lines += ["", "Peak extra memory of one call (B = 1, key side, fresh process, second call, resident-set "
                  "high-water mark minus the resident set before the call; fwd+bwd includes the input gradients). "
                  "'floor' is the output plus the input gradients, which every implementation must allocate "
                  "(the metric factors' gradient alone is r times dk):", "",
                  "| n | r | pass | SDPA MiB | ours MiB | ratio | floor MiB | floor / SDPA |",
                  "|---:|---:|:---|---:|---:|---:|---:|---:|"]
        for x in mem:
            lines.append(f"| {x['n']} | {x['r']} | {x['passes']} | {x['sdpa_MiB']:.1f} | {x['ours_MiB']:.1f} | "
                         f"{x['ratio']:.2f} | {x['floor_MiB']:.1f} | {x['floor_ratio']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
