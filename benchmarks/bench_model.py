#!/usr/bin/env python3
"""Training-step time and memory of the Fiber Bundle Transformer in each mode, against the Euclidean model.

    nice python benchmarks/bench_model.py            # the table (about 15 min on 2 shared cores)
    python benchmarks/bench_model.py --quick         # a minute

For every sequence length n and mode (``FiberBundleConfig.small`` with width
128 and two heads of dimension 64: 4 layers, metric rank 4, resized by
``match_width`` to the Euclidean model's parameter count), one training step (forward, cross-entropy, backward, AdamW)
on a batch of ``--batch`` random token sequences is timed alternately with the
Euclidean model's step (``--reps`` rounds; the median of the per-round ratios),
on all cores. Metrics are built in the form ``--metric-form`` (default
``factor``, G = lam I + U U^T, the form of the stored results; ``gains`` is
the package default), recorded in the result. Next to it:

* the whole-model FLOP ratio of :func:`riemannian_ref.models.budget.estimate_cost`
  (matrix products and elementwise work, forward and backward), and
  measured / FLOP-predicted;
* the share of the step spent in the attention layers, their metric networks
  and their connection, from the same layers timed alone (forward + backward
  of one block's module on inputs of the step's shape, times the number of
  layers, over the step time), next to the FLOP shares of the model;
* peak extra memory of one step in a fresh process (resident-set high-water
  mark minus the resident set before the step, the second step measured),
  next to what ``estimate_cost`` says a step allocates: activations and
  gradients (the weights and Adam's states exist before the step).

The content connection (the ``"fiber_bundle"`` default) runs on its fused
CPU kernel (nothing pairwise stored); where that kernel is unavailable (no C
compiler) the dense path keeps n^2 d activations per layer, and a row runs
only where ``estimate_cost`` puts them under ``--max-pairwise-gib``. The same
mode with the flat connection ("fiber_bundle/flat") runs at every n.

    python benchmarks/bench_model.py --targets      # the issue's targets (n = 1024; --ns to change)

measures the Fiber Bundle issue's target configuration instead (see
``targets``): ``results/bench_model_targets.{md,json}``. Writes
``results/bench_model_cpu.{md,json}`` (rewritten after every row) with the
load average, seed and wall time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import riemannian_ref as rr
from riemannian_ref._io import atomic_write_text
from riemannian_ref.attention import _content_cpu
from riemannian_ref.models.budget import estimate_cost

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_attention import _status, machine_info  # noqa: E402

MODES = {"euclidean": dict(mode="euclidean"), "riemannian": dict(mode="riemannian"),
         "fiber_bundle": dict(mode="fiber_bundle"),
         "fiber_bundle/flat": dict(mode="fiber_bundle", attention=dict(connection="flat")),
         "fiber_bundle/cumulative": dict(mode="fiber_bundle", attention=dict(connection="cumulative"))}


# The small preset with the head dimension of real models (64; two heads): at the preset's d = 16 every
# kernel is bound by memory traffic rather than arithmetic and no FLOP count predicts time.
BASE = dict(d_model=128, n_heads=2, head_dim=64)


#: ``--metric-form``: the metric parameterisations, the stored results' first.
METRIC_FORMS = ("factor", "gains")
METRIC_FORM_HELP = ("metric parameterisation: factor (G = lam I + U U^T), the form the stored results were made "
                    "with, or gains (bounded gains), the package default")


def config(mode: str, n: int, metric_form: str = "factor") -> rr.FiberBundleConfig:
    """The mode's config at sequence length n, resized to the Euclidean model's parameter count."""
    eu = rr.FiberBundleConfig.small(block_size=n, mode="euclidean", **BASE)
    cfg = rr.FiberBundleConfig.small(block_size=n, **BASE, **MODES[mode]).replace(
        attention=dict(metric_form=metric_form))
    if mode == "euclidean":
        return cfg
    return rr.match_width(cfg, rr.count_parameters(eu)["total"])


def make_step(cfg, batch, seed=0):
    torch.manual_seed(seed)
    model = rr.FiberBundleTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(idx).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        loss.backward()
        opt.step()
        return loss.item()
    return model, step


def seconds(fn, calls=1):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def component_times(model, cfg, batch, reps):
    """Seconds of one block's attention module, metric network and connection (forward + backward), best of reps."""
    attn = model.blocks[0].attn
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, cfg.block_size, cfg.d_model, generator=g, requires_grad=True)
    parts = {"attention layer": lambda: attn(x)[0]}
    if getattr(attn, "metric", None) is not None and attn.metric.proj is not None:
        parts["metric"] = lambda: attn.metric(x)[1]
    if getattr(attn, "rates", None) is not None:
        parts["connection"] = lambda: attn.rates(x)
    out = {}
    for name, f in parts.items():
        def fb(f=f):
            y = f()
            y.backward(torch.ones_like(y))
        fb()
        out[name] = min(seconds(fb) for _ in range(reps))
    return out


def mem_child(mode, n, batch, metric_form):
    torch.set_num_threads(1)
    cfg = config(mode, n, metric_form)
    _, step = make_step(cfg, batch)
    for _ in range(2):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status("VmRSS:")
        step()
        peak = _status("VmHWM:")
    return max(peak - before, 0)


def measure_mem(mode, n, batch, metric_form):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, __file__, "--mem-child", mode, str(n), str(batch),
                          "--metric-form", metric_form], capture_output=True, text=True, env=env, check=True)
    return int(res.stdout.strip().splitlines()[-1])


def step_bytes(cost):
    """What a step allocates beyond what it starts with: activations and gradients (not weights, not Adam)."""
    m = cost["memory"]
    return sum(m["activations"].values()) + m["gradients"]


def flop_shares(cost):
    f = cost["flops"]
    tot = f["total"]["total"]
    return {p: f[p]["total"] / tot for p in ("attention", "metric", "connection")}


# The configuration of the Fiber Bundle issue's targets: the library defaults (metric rank 2, content
# connection, causal) at width 128, two heads of dimension 64, two layers, batch 2, on two threads.
TARGET_MODES = {"euclidean": dict(mode="euclidean"), "riemannian": dict(mode="riemannian"),
                "fiber_bundle": dict(mode="fiber_bundle"),
                "fiber_bundle/flat": dict(mode="fiber_bundle", attention=dict(connection="flat")),
                "fiber_bundle/cumulative": dict(mode="fiber_bundle", attention=dict(connection="cumulative"))}


def target_config(mode: str, n: int, metric_form: str = "factor") -> rr.FiberBundleConfig:
    return rr.FiberBundleConfig(block_size=n, d_model=128, n_heads=2, n_layers=2,
                                **TARGET_MODES[mode]).replace(attention=dict(metric_form=metric_form))


def target_child(mode: str, n: int, steps: int, metric_form: str) -> dict:
    """One process, one mode: median seconds of ``steps`` training steps (after one warm-up) and the peak
    extra resident memory of a step (VmHWM reset before it, minus the resident set before it)."""
    torch.set_num_threads(2)
    _, step = make_step(target_config(mode, n, metric_form), 2)
    step()
    times = []
    for _ in range(steps):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status("VmRSS:")
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        peak = _status("VmHWM:") - before
    return {"seconds": statistics.median(times), "peak_bytes": max(peak, 0)}


def targets(args):
    """The issue's targets: time and memory ratios of one training step, every mode in its own process,
    the modes interleaved round by round (ratios within a round, then the median over rounds)."""
    t_start = time.time()
    info = machine_info(2)
    info.update(load_before=os.getloadavg(), batch=2, rounds=args.reps, seed=0, metric_form=args.metric_form,
                command="python " + " ".join(["benchmarks/bench_model.py"] + sys.argv[1:]))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="2")
    rows = []
    ns = args.ns if args.ns != [256, 512, 1024, 2048, 4096] else [1024]
    for n in ns:
        res = {m: [] for m in TARGET_MODES if m in args.modes or m == "euclidean"}
        steps = 1 if n > 2048 else 3
        for _ in range(args.reps):
            for mode in res:
                out = subprocess.run([sys.executable, __file__, "--target-child", mode, str(n), str(steps),
                                      "--metric-form", args.metric_form],
                                     capture_output=True, text=True, env=env, check=True)
                res[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(n, mode, res[mode][-1], flush=True)
        eu, ri = res["euclidean"], res.get("riemannian")

        def ratio(rs, base, key):  # within each round, then the median; None without the baseline
            if base is None:
                return None
            return statistics.median(r[key] / max(b[key], 1e-12) for r, b in zip(rs, base))

        for mode, rs in res.items():
            rows.append(dict(
                n=n, mode=mode, step_s=statistics.median(r["seconds"] for r in rs),
                peak_MiB=statistics.median(r["peak_bytes"] for r in rs) / 2 ** 20,
                time_vs_euclidean=ratio(rs, eu, "seconds"), time_vs_riemannian=ratio(rs, ri, "seconds"),
                mem_vs_riemannian=ratio(rs, ri, "peak_bytes")))
    info["load_after"] = os.getloadavg()
    info["wall_s"] = time.time() - t_start
    out = Path(args.out).with_name("bench_model_targets")
    atomic_write_text(out.with_suffix(".json"), json.dumps({"machine": info, "rows": rows}, indent=1))
    lines = ["# The Fiber Bundle Transformer's targets: one training step (CPU)", "",
             f"Machine: {info['cpu']} ({info['cores']} cores, shared with other jobs), torch {info['torch']}, "
             "2 threads, float32. `FiberBundleConfig(mode=..., block_size=n, d_model=128, n_heads=2, "
             f"n_layers=2, metric_form=\"{info['metric_form']}\")` (the defaults otherwise: metric rank 2, key "
             "side, causal; `fiber_bundle` with its default content connection), batch 2, AdamW; every mode in "
             "its own process, the modes "
             f"interleaved over {info['rounds']} rounds, ratios within a round, medians over rounds. Peak "
             "memory: the resident-set high-water mark of a step minus the resident set before it. Load "
             f"average before: {', '.join(f'{x:.2f}' for x in info['load_before'])}; after: "
             f"{', '.join(f'{x:.2f}' for x in info['load_after'])}. Wall time {info['wall_s'] / 60:.0f} min. "
             f"Command: `{info['command']}`.", "",
             "Targets: `fiber_bundle` at n = 1024 at most 6x the Euclidean step and at most 2x riemannian "
             "mode's peak memory; the flat content connection (`fiber_bundle/cumulative`) at most 1.3x "
             "riemannian mode's step.", "",
             "| n | mode | step s | time / euclidean | time / riemannian | peak MiB | memory / riemannian |",
             "|---:|:---|---:|---:|---:|---:|---:|"]
    f2 = lambda x: "" if x is None else f"{x:.2f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['n']} | {r['mode']} | {r['step_s']:.2f} | {f2(r['time_vs_euclidean'])} | "
                     f"{f2(r['time_vs_riemannian'])} | {r['peak_MiB']:.0f} | {f2(r['mem_vs_riemannian'])} |")
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ns", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--min-time", type=float, default=0.5, help="seconds of Euclidean steps per round")
    p.add_argument("--max-pairwise-gib", type=float, default=2.0)
    p.add_argument("--no-mem", action="store_true")
    p.add_argument("--metric-form", choices=METRIC_FORMS, default="factor", help=METRIC_FORM_HELP)
    p.add_argument("--quick", action="store_true", help="n = 128, 256; 2 rounds")
    p.add_argument("--out", default=str(ROOT / "results" / "bench_model_cpu"))
    p.add_argument("--mem-child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--targets", action="store_true",
                   help="the issue's target configuration instead of the table (results/bench_model_targets)")
    p.add_argument("--target-child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mem_child:
        mode, n, batch = args.mem_child
        print(mem_child(mode, int(n), int(batch), args.metric_form))
        return
    if args.target_child:
        mode, n, steps = args.target_child
        print(json.dumps(target_child(mode, int(n), int(steps), args.metric_form)))
        return
    if args.targets:
        targets(args)
        return
    if args.quick:
        args.reps, args.min_time = 2, 0.1
    t_start = time.time()
    threads = torch.get_num_threads()
    info = machine_info(threads)
    info.update(load_before=os.getloadavg(), batch=args.batch, reps=args.reps, seed=0, metric_form=args.metric_form,
                command="python " + " ".join(["benchmarks/bench_model.py"] + sys.argv[1:]),
                cuda=torch.cuda.is_available())
    rows = []
    for n in args.ns:
        eu_cfg = config("euclidean", n, args.metric_form)
        eu_model, eu_step = make_step(eu_cfg, args.batch)
        eu_cost = estimate_cost(eu_cfg, n, batch=args.batch)
        for mode in args.modes:
            cfg = config(mode, n, args.metric_form)
            cost = estimate_cost(cfg, n, batch=args.batch, fused_content=_content_cpu.available())
            row = dict(n=n, mode=mode, d_model=cfg.d_model, params=rr.count_parameters(cfg)["total"],
                       flop_ratio=cost["flops"]["total"]["total"] / eu_cost["flops"]["total"]["total"],
                       flop_shares=flop_shares(cost), est_MiB=step_bytes(cost) / 2 ** 20,
                       pairwise_MiB=cost["memory"]["pairwise"] / 2 ** 20)
            if cost["memory"]["pairwise"] > args.max_pairwise_gib * 2 ** 30:
                row["skipped"] = (f"the content connection keeps {cost['memory']['pairwise'] / 2 ** 30:.1f} GiB "
                                  f"of pairwise activations (estimate_cost) > {args.max_pairwise_gib} GiB")
                rows.append(row)
                print(n, mode, "skipped:", row["skipped"], flush=True)
                write(args, info, rows, t_start)
                continue
            model, step = make_step(cfg, args.batch)
            eu_step()
            t_eu, t_mode = seconds(eu_step), seconds(step)
            calls = max(1, math.ceil(args.min_time / max(t_eu, t_mode)))
            te, tm = [], []
            for _ in range(args.reps):
                te.append(seconds(eu_step, calls))
                tm.append(seconds(step, calls))
            ratios = [b / a for a, b in zip(te, tm)]
            comp = component_times(model, cfg, args.batch, args.reps)
            L = cfg.n_layers
            t_step = statistics.median(tm)
            shares = {"attention": L * (comp["attention layer"] - comp.get("metric", 0) - comp.get("connection", 0))
                      / t_step, "metric": L * comp.get("metric", 0) / t_step,
                      "connection": L * comp.get("connection", 0) / t_step}
            row.update(eu_ms=1e3 * statistics.median(te), step_ms=1e3 * t_step, ratio=statistics.median(ratios),
                       ratio_rounds=ratios, shares=shares, load=os.getloadavg()[0])
            row["measured_over_predicted"] = row["ratio"] / row["flop_ratio"]
            if not args.no_mem:
                row["peak_MiB"] = measure_mem(mode, n, args.batch, args.metric_form) / 2 ** 20
            rows.append(row)
            print(f"n={n} {mode}: D={cfg.d_model} step {row['step_ms']:.0f} ms, ratio {row['ratio']:.2f}, "
                  f"FLOP ratio {row['flop_ratio']:.2f}, meas/pred {row['measured_over_predicted']:.2f}, "
                  f"shares {', '.join(f'{k} {v:.0%}' for k, v in shares.items())}"
                  + (f", peak {row['peak_MiB']:.0f} MiB" if "peak_MiB" in row else ""), flush=True)
            write(args, info, rows, t_start)
            del model, step
    write(args, info, rows, t_start)


def write(args, info, rows, t_start):
    info["load_after"] = os.getloadavg()
    info["wall_s"] = time.time() - t_start
    if not args.out:
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out.with_suffix(".json"), json.dumps({"machine": info, "rows": rows}, indent=1))
    lines = ["# Training step of the Fiber Bundle Transformer against the Euclidean model (CPU)", "",
             f"Machine: {info['cpu']} ({info['cores']} cores, shared with other jobs), torch {info['torch']}, "
             f"{info['threads']} threads, float32. `FiberBundleConfig.small(d_model=128, n_heads=2, head_dim=64)` (4 layers, metric "
             f"rank 4, metric form {info['metric_form']}) in each mode, width matched to the Euclidean model's "
             f"parameter count; batch {info['batch']}, seed 0; "
             f"AdamW step. Ratios: medians over {info['reps']} alternating rounds. Load average (1, 5, 15 min) "
             f"before: {', '.join(f'{x:.2f}' for x in info['load_before'])}; after: "
             f"{', '.join(f'{x:.2f}' for x in info['load_after'])}. Wall time {info['wall_s'] / 60:.0f} min. "
             f"Command: `{info['command']}`.", "",
             "No CUDA GPU was available to this run." if not info.get("cuda") else "A CUDA GPU was present; "
             "this table is the CPU one.", "",
             "Shares: measured (one block's module timed alone, times the layers, over the step) / FLOP share of "
             "`estimate_cost`.", "",
             "| n | mode | D | params | step ms | time ratio | FLOP ratio | measured / predicted | attention | "
             "metric | connection | peak MiB | activations + gradients MiB (model) |",
             "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in rows:
        fs = x["flop_shares"]
        if "skipped" in x:
            lines.append(f"| {x['n']} | {x['mode']} | {x['d_model']} | {x['params']:,} | not run: {x['skipped']} "
                         f"| | {x['flop_ratio']:.2f} | | | | | | {x['est_MiB']:.0f} |")
            continue
        sh = x["shares"]
        cell = lambda k: f"{sh[k]:.0%} / {fs[k]:.0%}"  # noqa: E731
        lines.append(f"| {x['n']} | {x['mode']} | {x['d_model']} | {x['params']:,} | {x['step_ms']:.0f} | "
                     f"{x['ratio']:.2f} | {x['flop_ratio']:.2f} | {x['measured_over_predicted']:.2f} | "
                     f"{cell('attention')} | {cell('metric')} | {cell('connection')} | "
                     f"{x.get('peak_MiB', float('nan')):.0f} | {x['est_MiB']:.0f} |")
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
