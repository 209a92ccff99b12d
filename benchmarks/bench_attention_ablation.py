#!/usr/bin/env python3
"""What each CPU detail of the blockwise operator is worth, measured in the same run.

    OMP_NUM_THREADS=1 python benchmarks/bench_attention_ablation.py

Three comparisons (d = 64, h = 4, B = 1, per-token key-side metrics, float32,
forward), each timed alternately against its alternative in ``--reps`` rounds
(every round repeats calls until ``--min-time`` seconds are filled); the
median of the per-round ratios is reported:

* ``exp`` against ``exp2`` on one tile of shifted scores (``[B h, 128, 512]``,
  values in [-12, 0] like real attention rows);
* the scores of a tile built in a copy (``X[:, :, 0].clone()``, then the
  squares subtracted) against subtracted in place into the product's output;
* the whole operator at ``n = 512`` with two key blocks (``block_sizes =
  (128, 256)``: the online softmax rescales once per row) against one key
  block (``(128, 512)``: nothing to rescale), which prices the rescaling.

Writes ``results/bench_attention_ablation.{md,json}``.
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

import riemannian_ref as rr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_attention import machine_info, make_inputs  # noqa: E402


def per_call(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def compare(slow, fast, reps: int, min_time: float) -> dict:
    """Alternate ``slow`` and ``fast``; per-round time ratios slow / fast."""
    slow(), fast()
    calls = max(1, math.ceil(min_time / max(per_call(fast, 1), 1e-7)))
    ts, tf = [], []
    for _ in range(reps):
        ts.append(per_call(slow, calls))
        tf.append(per_call(fast, calls))
    ratios = [a / b for a, b in zip(ts, tf)]
    return dict(slow_ms=1e3 * min(ts), fast_ms=1e3 * min(tf), speedup=statistics.median(ratios),
                speedup_rounds=ratios)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--min-time", type=float, default=0.1)
    p.add_argument("--out", default=str(ROOT / "results" / "bench_attention_ablation"))
    args = p.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))
    torch.set_num_threads(threads)
    info = machine_info(threads)
    info["load_before"] = os.getloadavg()
    gen = torch.Generator().manual_seed(0)
    rows = []

    S = -12.0 * torch.rand(4, 128, 512, generator=gen)
    buf = torch.empty_like(S)
    rows.append(dict(what="exp vs exp2, one tile [4, 128, 512]", slow="torch.exp", fast="torch.exp2",
                     **compare(lambda: torch.exp(S, out=buf), lambda: torch.exp2(S, out=buf), args.reps,
                               args.min_time)))

    for r in (1, 4):
        X0 = torch.randn(4, 128, 1 + r, 512, generator=gen)
        work = torch.empty_like(X0)

        def copied(r=r, X0=X0, work=work):
            work.copy_(X0)
            S = work[:, :, 0].clone()
            for t in range(1, r + 1):
                S.addcmul_(work[:, :, t], work[:, :, t], value=-1.0)
            return S

        def in_place(r=r, X0=X0, work=work):
            work.copy_(X0)
            S = work[:, :, 0]
            for t in range(1, r + 1):
                S.addcmul_(work[:, :, t], work[:, :, t], value=-1.0)
            return S

        assert torch.equal(copied(), in_place())
        rows.append(dict(what=f"tile scores, r = {r}: copy then subtract vs in place",
                         slow="clone + addcmul_", fast="addcmul_ into X[:, :, 0]",
                         **compare(copied, in_place, args.reps, args.min_time)))

    for r in (1, 4):
        q, k, v, _, Uk = make_inputs(1, 4, 512, 64, r, "key")

        def two_blocks(q=q, k=k, v=v, Uk=Uk):
            with torch.no_grad():
                return rr.riemannian_attention(q, k, v, U_k=Uk, block_sizes=(128, 256))

        def one_block(q=q, k=k, v=v, Uk=Uk):
            with torch.no_grad():
                return rr.riemannian_attention(q, k, v, U_k=Uk, block_sizes=(128, 512))

        torch.testing.assert_close(two_blocks(), one_block(), rtol=1e-5, atol=1e-5)
        rows.append(dict(what=f"operator n = 512, r = {r}, forward: two key blocks (128, 256) vs one (128, 512)",
                         slow="two key blocks (online rescaling)", fast="one key block (no rescaling)",
                         **compare(two_blocks, one_block, args.reps, args.min_time)))

    info["load_after"] = os.getloadavg()
    for row in rows:
        print(f"{row['what']}: {row['slow_ms']:.3f} ms -> {row['fast_ms']:.3f} ms, speedup {row['speedup']:.2f}")
    if args.out:
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps({"machine": info, "reps": args.reps, "rows": rows}, indent=1))
        lines = ["# What each CPU detail of the attention operator is worth", "",
                 f"Machine: {info['cpu']} ({info['cores']} cores, shared), torch {info['torch']}, "
                 f"{info['threads']} thread(s), float32. Speedup = median over {args.reps} alternating rounds "
                 "of (time of the alternative) / (time of the other). Command: "
                 "`OMP_NUM_THREADS=1 python benchmarks/bench_attention_ablation.py`.", "",
                 "| comparison | alternative ms | operator ms | speedup | rounds min-max |",
                 "|:---|---:|---:|---:|:---|"]
        for row in rows:
            rr_ = row["speedup_rounds"]
            lines.append(f"| {row['what']} | {row['slow_ms']:.3f} | {row['fast_ms']:.3f} | {row['speedup']:.2f} | "
                         f"{min(rr_):.2f}-{max(rr_):.2f} |")
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print(f"wrote {out.with_suffix('.md')} and .json")


if __name__ == "__main__":
    main()
