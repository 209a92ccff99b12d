#!/usr/bin/env python3
"""What each CPU detail of the blockwise operator is worth, measured in the same run.

    python benchmarks/bench_attention_ablation.py

Two micro-benchmarks on one tile and the operator's own switches, each timed
alternately against its alternative in ``--reps`` rounds (every round
repeats calls until ``--min-time`` seconds are filled); the median of the
per-round ratios is reported:

* ``exp`` against ``exp2`` on one tile of shifted scores (``[B h, 128, 512]``,
  values in [-12, 0] like real attention rows), one thread;
* the scores of a tile built in a copy (``X[:, :, 0].clone()``, then the
  squares subtracted) against subtracted in place into the product's output;
* a compiled tile: the operator's eager tile (one product, the squares
  subtracted in place, ``exp2`` in place) against the same tile written as
  one function and compiled by ``torch.compile`` (inductor's C++ backend,
  mode ``max-autotune-no-cudagraphs``, which may choose its own C++ GEMM
  template and fuse the elementwise passes into it); ``[4, 128, 512]``
  scores, d = 64, r = 1 and 4, one thread (``--no-compile`` skips it);
* the operator itself (B = 4, h = 4, n = 1024, d = 64, key side, r = 1 and 4,
  forward and forward+backward, one thread by default), called through its
  internal entry ``_blockwise.blockwise_operator`` with one field of its
  ``options`` (``LoopOptions``) changed: the online softmax
  (running maximum, rescaling) against the fixed offset; the row sum as its
  own pass against ``P @ [V | 1]``; the whole batch in every tile against
  chunks of about one batch element per thread; multi-threaded kernels
  against threads over chunks of the batch.

Writes ``results/bench_attention_ablation.{md,json}``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import riemannian_ref as rr
from riemannian_ref._io import atomic_write_text
from riemannian_ref.attention import _blockwise as bw

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


SWITCHES = [  # (what, field of bw.LoopOptions, alternative value; the operator's value is the default)
    ("online softmax vs fixed offset", "fixed_offset", False),
    ("row sum as its own pass vs P @ [V | 1]", "rowsum_in_product", False),
    ("whole batch per tile vs chunks of the batch", "chunk_tile", 0),
    ("multi-threaded kernels vs threads over chunks", "threads_over_chunks", False),
]


def operator_call(q, k, v, Uk, options):
    """``rr.riemannian_attention(q, k, v, U_k=Uk)`` (key side, lam = 1, no mask) run with loop ``options``."""
    B, h, n, d = q.shape
    scale = 1.0 / math.sqrt(d)
    out = bw.blockwise_operator(q.reshape(B * h, n, d), k.reshape(B * h, n, d), v.reshape(B * h, n, -1),
                                q.new_ones(B * h), W=None, Uk=Uk.reshape(B * h, n, d, -1), Uq=None, mask=None,
                                causal=False, scale=scale, ck=math.sqrt(scale / 2), cq=math.sqrt(scale / 2),
                                blocks=bw.block_sizes_for(n, n, 1 + Uk.shape[-1]), batch=(B, h), options=options)
    return out.view(B, h, n, -1)


def compiled_tile_rows(args, gen):
    """The eager tile against ``torch.compile`` of the same tile (product and elementwise passes together)."""
    import torch._inductor.config as inductor_config
    inductor_config.max_autotune_gemm_backends = "CPP,ATEN"  # let it try its C++ GEMM template with fused epilogue
    rows = []
    cb, bq, bk, d = 4, 128, 512, 64
    for r in (1, 4):
        qa = 0.1 * torch.randn(cb, bq, d + 2, generator=gen)
        Kt = 0.1 * torch.randn(cb, d + 2, (1 + r) * bk, generator=gen)
        buf = torch.empty(cb, bq, (1 + r) * bk)

        def eager(r=r, qa=qa, Kt=Kt, buf=buf):  # what the operator's _tile and its caller do
            X = torch.bmm(qa, Kt, out=buf).view(cb, bq, 1 + r, bk)
            S, *Xt = X.unbind(2)
            for x in Xt:
                S.addcmul_(x, x, value=-1.0)
            return S.exp2_()

        def tile(qa, Kt, r=r):
            X = torch.bmm(qa, Kt).view(cb, bq, 1 + r, bk)
            return torch.exp2(X[:, :, 0] - (X[:, :, 1:] * X[:, :, 1:]).sum(2))

        compiled = torch.compile(tile, dynamic=False, mode="max-autotune-no-cudagraphs")
        t0 = time.perf_counter()
        compiled(qa, Kt)
        compile_s = time.perf_counter() - t0
        torch.testing.assert_close(compiled(qa, Kt), eager(), rtol=1e-4, atol=1e-6)
        rows.append(dict(what=f"compiled tile, r = {r}: torch.compile (inductor C++, max-autotune) vs eager",
                         slow="torch.compile(tile)", fast="eager tile (the operator's)", r=r, compile_s=compile_s,
                         **compare(lambda: compiled(qa, Kt), eager, args.reps, args.min_time)))
        print(rows[-1]["what"], f"{rows[-1]['speedup']:.2f}", flush=True)
    return rows


def operator_rows(args, gen):
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for r in (1, 4):
            q, k, v, _, Uk = make_inputs(4, 4, 1024, 64, r, "key", grad=True)
            gout = torch.randn(q.shape, generator=gen)
            for backward in (False, True):
                def call(options, backward=backward, q=q, k=k, v=v, Uk=Uk, gout=gout):
                    with torch.set_grad_enabled(backward):
                        out = operator_call(q, k, v, Uk, options)
                        if backward:
                            out.backward(gout)
                        return out.detach()
                with torch.no_grad():  # the entry computes what the public function does
                    torch.testing.assert_close(call(bw.DEFAULT_LOOP, False),
                                               rr.riemannian_attention(q, k, v, U_k=Uk), rtol=0, atol=0)
                for what, attr, alt in SWITCHES:
                    ours = getattr(bw.DEFAULT_LOOP, attr)

                    def with_(value, attr=attr):
                        return call(dataclasses.replace(bw.DEFAULT_LOOP, **{attr: value}))
                    torch.testing.assert_close(with_(alt), with_(ours), rtol=1e-4, atol=1e-5)
                    rows.append(dict(what=f"operator, {what}: r = {r}, {'fwd+bwd' if backward else 'fwd'}, "
                                     f"{threads} thread(s)", switch=attr, r=r, threads=threads,
                                     passes="fwd+bwd" if backward else "fwd", slow=f"{attr} = {alt}",
                                     fast=f"{attr} = {ours}",
                                     **compare(lambda: with_(alt), lambda: with_(ours), args.reps, args.min_time)))
                    print(rows[-1]["what"], f"{rows[-1]['speedup']:.2f}", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.1)
    p.add_argument("--threads", type=int, nargs="+", default=[1],
                   help="thread counts of the operator rows (default one: the ablation prices work, not scaling)")
    p.add_argument("--no-operator", action="store_true", help="only the tile micro-benchmarks")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled tile (inductor needs a C++ compiler)")
    p.add_argument("--out", default=str(ROOT / "results" / "bench_attention_ablation"))
    args = p.parse_args()
    t_start = time.time()
    torch.set_num_threads(1)
    info = machine_info(args.threads)
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

    if not args.no_compile:
        rows += compiled_tile_rows(args, gen)
    if not args.no_operator:
        rows += operator_rows(args, gen)
    info["load_after"] = os.getloadavg()
    info["wall_s"] = time.time() - t_start
    for row in rows:
        print(f"{row['what']}: {row['slow_ms']:.3f} ms -> {row['fast_ms']:.3f} ms, speedup {row['speedup']:.2f}")
    if args.out:
        out = Path(args.out)
        atomic_write_text(out.with_suffix(".json"), json.dumps({"machine": info, "reps": args.reps, "rows": rows}, indent=1))
        lines = ["# What each CPU detail of the attention operator is worth", "",
                 f"Machine: {info['cpu']} ({info['cores']} cores, shared with other jobs), torch {info['torch']}, "
                 f"float32; inputs from seed 0. Load average (1, 5, 15 min) before: "
                 f"{', '.join(f'{x:.2f}' for x in info['load_before'])}; after: "
                 f"{', '.join(f'{x:.2f}' for x in info['load_after'])}; wall time {info['wall_s'] / 60:.1f} min. "
                 f"Speedup = median over {args.reps} alternating rounds of (time of the alternative) / (time of "
                 "the operator's choice). Command: `python benchmarks/bench_attention_ablation.py`.", "",
                 "| comparison | alternative ms | operator ms | speedup | rounds min-max |",
                 "|:---|---:|---:|---:|:---|"]
        for row in rows:
            rr_ = row["speedup_rounds"]
            lines.append(f"| {row['what']} | {row['slow_ms']:.3f} | {row['fast_ms']:.3f} | {row['speedup']:.2f} | "
                         f"{min(rr_):.2f}-{max(rr_):.2f} |")
        atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
        print(f"wrote {out.with_suffix('.md')} and .json")


if __name__ == "__main__":
    main()
