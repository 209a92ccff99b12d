#!/usr/bin/env python3
"""The exact reductions of Riemannian attention to SDPA, against SDPA at the same head dimension, in one run.

    nice python benchmarks/bench_reductions.py          # B = 4, h = 4, n = 1024, d = 64, two threads
    python benchmarks/bench_reductions.py --quick       # a smoke run: B = 1, h = 2, n = 256, 2 rounds

Calls whose score is a dot product in disguise can run on
``scaled_dot_product_attention``. Two kinds, each timed forward+backward
(float32, causal and not) against SDPA on plain queries and keys of the same
head dimension ``d``:

* **one metric** (no per-token factor): distance attention (``G = lam I``)
  and a shared metric (``G = lam I + W W^T``, rank ``--shared-rank``), by
  each of the three exact routes of ``riemannian_attention`` (forced with the
  private ``_force_backend``): ``operator``, the blockwise operator itself;
  ``sdpa_bias``, SDPA with the key term ``-scale/2 k^T G k`` as an additive
  float mask (which needs its gradient, so SDPA runs its math kernel);
  ``sdpa_lifted``, SDPA on lifted inputs ``[G q, 1] . [k, -k^T G k / 2]``
  (head size ``d + 1``, the values zero-padded to it);
* **factors in a shared subspace** (``SubspaceFactors``, ``U_j = B C_j``,
  ``m = 1..4``, ``r = m``): ``sdpa_lifted``, SDPA on the lifted inputs of
  width ``d + m(m+1)/2 + 1``, and for comparison ``operator``, the same
  metric as dense per-token factors on the blockwise operator.

Every round times SDPA and then each route of the row (each repeating calls
until ``--min-time`` seconds of SDPA are filled), alternately, ``--reps``
rounds; a row reports the median over rounds of the per-round time ratio to
SDPA, next to the FLOP-predicted ratio (``models.budget.attention_flops``: SDPA at
the lifted head size for the lifted routes, the operator's count for the
operator, SDPA plus the mask's additions for ``sdpa_bias``) and measured /
predicted. The load average before and after, and at every row, is recorded;
the summary names the fastest exact route of each kind on this machine next
to the one the dispatch table (``functional._EXACT_ROUTES``) picks. Writes
``results/bench_reductions.{md,json}`` (``--out`` to change, ``''`` to skip).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import riemannian_ref as rr
from riemannian_ref._io import atomic_write_text
from riemannian_ref.attention import functional
from riemannian_ref.models.budget import attention_flops

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_attention import machine_info  # noqa: E402

ONE_METRIC_ROUTES = ("operator", "sdpa_bias", "sdpa_lifted")
FORCE = {"operator": "blockwise", "sdpa_bias": "sdpa_bias", "sdpa_lifted": "sdpa_lifted"}


def make_inputs(B, h, n, d, case, seed=0):
    """Queries, keys, values, the output gradient and the metric keywords of one case, float32, leaves with grad."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, gout = (torch.randn(B, h, n, d, generator=g) for _ in range(4))
    lam = torch.rand(h, generator=g) + 0.5
    kw, leaves = dict(lam=lam), [q, k, v, lam]
    kind, size = case
    if kind == "shared":
        W = torch.randn(1, h, d, size, generator=g) / math.sqrt(d)
        kw["U_k"], leaves = W, leaves + [W]
    elif kind == "subspace":
        S = rr.SubspaceFactors(torch.randn(1, h, d, size, generator=g) / math.sqrt(size),
                               torch.randn(B, h, n, size, size, generator=g) / math.sqrt(size))
        kw["U_k"], leaves = S, leaves + [S.basis, S.coef]
    for t in leaves:
        t.requires_grad_()
    return q, k, v, gout, kw, leaves


def contender(route, inputs, causal):
    """A closure that runs one forward+backward of ``route`` (``"sdpa"``: plain SDPA on q, k, v)."""
    q, k, v, gout, kw, leaves = inputs
    if route == "sdpa":
        def run():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            torch.autograd.grad(out, (q, k, v), gout)
        return run
    if route == "operator" and isinstance(kw.get("U_k"), rr.SubspaceFactors):  # the same metric, multiplied out
        S = kw["U_k"]

        def run():
            out = rr.riemannian_attention(q, k, v, is_causal=causal, lam=kw["lam"], U_k=S.dense())
            torch.autograd.grad(out, leaves, gout)
        return run

    def run():
        with functional._force_backend(FORCE[route]):
            out = rr.riemannian_attention(q, k, v, is_causal=causal, **kw)
        torch.autograd.grad(out, leaves, gout)
    return run


def per_call(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def time_row(fns: dict, reps: int, min_time: float) -> dict:
    """Interleaved rounds: SDPA, then every route; per-round ratios to SDPA. ``fns`` has ``"sdpa"`` first."""
    for fn in fns.values():  # warm-up (first calls pay allocation and dispatch)
        fn()
    calls = max(1, math.ceil(min_time / max(per_call(fns["sdpa"], 1), 1e-6)))
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(per_call(fn, calls))
    out = {"sdpa_ms": statistics.median(times["sdpa"]) * 1e3, "calls_per_round": calls, "routes": {}}
    for name in fns:
        if name == "sdpa":
            continue
        ratios = [t / s for t, s in zip(times[name], times["sdpa"])]
        out["routes"][name] = dict(ms=statistics.median(times[name]) * 1e3, ratio=statistics.median(ratios),
                                   ratio_rounds=ratios)
    return out


def predicted(route, case, n, d):
    """FLOP-predicted time ratio to SDPA at head size d, forward+backward (causal halves both sides alike)."""
    sdpa = sum(attention_flops(n, d, kernel="sdpa").values())
    kind, size = case
    if route == "sdpa_lifted":
        width = d + 1 + (size * (size + 1) // 2 if kind == "subspace" else 0)
        return sum(attention_flops(n, width, kernel="sdpa").values()) / sdpa
    if route == "sdpa_bias":  # the same products; the mask added to the scores and its gradient reduced
        return (sdpa + 2.0 * n * n) / sdpa
    return sum(attention_flops(n, d, size if kind == "subspace" else 0).values()) / sdpa  # the operator


def case_name(case):
    kind, size = case
    return {"distance": "distance (G = lam I)", "shared": f"shared metric, r = {size}",
            "subspace": f"subspace, m = {size}, r = {size}"}[kind]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: B = 1, h = 2, n = 256, 2 rounds, short rounds")
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shared-rank", type=int, default=4)
    p.add_argument("--ms", type=int, nargs="+", default=[1, 2, 3, 4], help="subspace dimensions m")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.5, help="seconds of SDPA per timing round")
    p.add_argument("--out", default=str(ROOT / "results" / "bench_reductions"),
                   help="write OUT.md and OUT.json ('' to skip)")
    args = p.parse_args()
    if args.quick:
        args.B, args.heads, args.n, args.reps, args.min_time = 1, 2, 256, 2, 0.02
    torch.set_num_threads(args.threads)
    t_start = time.time()
    info = machine_info(args.threads)
    info["load_before"] = os.getloadavg()
    info.update(B=args.B, h=args.heads, n=args.n, d=args.d, reps=args.reps, min_time=args.min_time,
                dtype="float32", cuda=torch.cuda.is_available(), table=functional._EXACT_ROUTES.get("cpu"),
                command="python " + " ".join(["benchmarks/bench_reductions.py"] + sys.argv[1:]))
    cases = [("distance", 0), ("shared", args.shared_rank)] + [("subspace", m) for m in args.ms]
    rows = []
    print(f"# {info['cpu']}, torch {info['torch']}, {args.threads} threads, load {info['load_before'][0]:.2f}")
    print(f"{'case':<26} {'causal':>6} {'route':>12} {'SDPA ms':>8} {'ms':>8} {'ratio':>6} {'pred':>5} "
          f"{'meas/pred':>9}")
    for case in cases:
        routes = ONE_METRIC_ROUTES if case[0] != "subspace" else ("sdpa_lifted", "operator")
        for causal in (False, True):
            ins = make_inputs(args.B, args.heads, args.n, args.d, case)
            fns = {"sdpa": contender("sdpa", ins, causal)}
            fns.update({rt: contender(rt, ins, causal) for rt in routes})
            res = time_row(fns, args.reps, args.min_time)
            for rt, x in res["routes"].items():
                pred = predicted(rt, case, args.n, args.d)
                row = dict(case=case_name(case), kind="one_metric" if case[0] != "subspace" else "subspace",
                           m=case[1] if case[0] == "subspace" else None, causal=causal, route=rt,
                           sdpa_ms=res["sdpa_ms"], ms=x["ms"], ratio=x["ratio"], ratio_rounds=x["ratio_rounds"],
                           predicted=pred, measured_over_predicted=x["ratio"] / pred, load=os.getloadavg()[0])
                rows.append(row)
                print(f"{row['case']:<26} {str(causal):>6} {rt:>12} {row['sdpa_ms']:8.1f} {row['ms']:8.1f} "
                      f"{row['ratio']:6.2f} {pred:5.2f} {row['measured_over_predicted']:9.2f}", flush=True)
            write(args, info, rows, t_start)
    summary = write(args, info, rows, t_start)
    for kind, s in summary.items():
        print(f"{kind}: fastest exact route {s['fastest']} (geometric mean of its ratios {s['gmean']:.2f}); "
              f"the dispatch table picks {s['table']}")


def summarise(rows, table) -> dict:
    """Per kind of call, the route with the smallest geometric mean of its ratios to SDPA over the rows."""
    out = {}
    for kind, key in (("one_metric", "no_factor"), ("subspace", "subspace")):
        by = {}
        for x in rows:
            if x["kind"] == kind:
                by.setdefault(x["route"], []).append(x["ratio"])
        if not by:
            continue
        g = {rt: math.exp(statistics.fmean(math.log(v) for v in vs)) for rt, vs in by.items()}
        best = min(g, key=g.get)
        out[kind] = dict(fastest=best, gmean=g[best], gmeans=g, table=(table or {}).get(key))
    return out


def write(args, info, rows, t_start) -> dict:
    info["load_after"] = os.getloadavg()
    info["wall_s"] = time.time() - t_start
    summary = summarise(rows, info["table"])
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out.with_suffix(".json"), json.dumps({"machine": info, "rows": rows, "summary": summary},
                                                       indent=1))
        atomic_write_text(out.with_suffix(".md"), to_markdown(info, rows, summary))
    return summary


def to_markdown(info, rows, summary) -> str:
    lines = [
        "# Exact reductions of Riemannian attention to SDPA (CPU)",
        "",
        f"Machine: {info['cpu']} ({info['cores']} cores, shared with other jobs), torch {info['torch']}, "
        f"{info['threads']} threads, float32, forward+backward, B = {info['B']}, h = {info['h']}, "
        f"n = {info['n']}, d = {info['d']}. Load average (1, 5, 15 min) before: "
        f"{', '.join(f'{x:.2f}' for x in info['load_before'])}; after: "
        f"{', '.join(f'{x:.2f}' for x in info['load_after'])} (the 1-minute load at each row is in the JSON). "
        f"Wall time {info['wall_s'] / 60:.1f} min. Ratios to SDPA at head dimension d are medians over "
        f"{info['reps']} interleaved rounds measured in the same run. Command: `{info['command']}`.",
        "",
        "No CUDA GPU was available to this run: no GPU table." if not info.get("cuda") else
        "A CUDA GPU was present; this table is the CPU one.",
        "",
        "| case | causal | route | SDPA ms | route ms | time ratio | FLOP-predicted | measured / predicted |",
        "|:---|:---|:---|---:|---:|---:|---:|---:|",
    ]
    for x in rows:
        lines.append(f"| {x['case']} | {'yes' if x['causal'] else 'no'} | {x['route']} | {x['sdpa_ms']:.1f} | "
                     f"{x['ms']:.1f} | {x['ratio']:.2f} | {x['predicted']:.2f} | "
                     f"{x['measured_over_predicted']:.2f} |")
    lines.append("")
    for kind, s in summary.items():
        means = ", ".join(f"{rt} {g:.2f}" for rt, g in sorted(s["gmeans"].items(), key=lambda t: t[1]))
        what = "calls without per-token factors" if kind == "one_metric" else "factors in a shared subspace"
        lines.append(f"- {what}: fastest exact route `{s['fastest']}` (geometric mean of the ratios: {means}); "
                     f"the dispatch table picks `{s['table']}` on CPU.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
