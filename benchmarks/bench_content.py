#!/usr/bin/env python3
"""Where the content connection's time goes: the fused CPU kernel, piece by piece, against SDPA.

    python benchmarks/bench_content.py            # n = 512, 1024, 2048 (about 10 min on 2 shared cores)
    python benchmarks/bench_content.py --quick    # a smoke run

For the per-layer attention of the Fiber Bundle issue's configuration (batch 2,
2 heads of dimension 64, metric rank 2 on the key side, causal, the ``"content"``
connection with transported values), forward + backward of:

* ``kernel``: ``connection_attention`` as the model calls it (the fused kernel);
* ``kernel, values not transported``, ``kernel, rank 0`` (no metric factors) and
  ``kernel, dot scores, values not transported`` (the angles, their cosines
  and sines and one product per pair: the floor of any content connection);
  the differences price value transport and the metric's rank products;
* ``layer``: the whole ``RiemannianAttention`` module (projections, metric and
  rate networks, the kernel; the metric in the form ``--metric-form``, default
  ``factor``, G = lam I + U U^T, that of the stored results, while ``gains`` is
  the package default); ``layer - kernel`` is the matrix products around it;
* ``dense path`` (``RR_DISABLE_CKERNEL=1``, n <= 512 only: it keeps n^2 d
  activations), ``flat connection`` (the common frame and the blockwise
  operator), ``riemannian`` (the same metric, no connection) and ``sdpa``.

Each is timed in interleaved rounds (median; ratios to SDPA within a round);
the load average is recorded. Writes ``results/bench_content_cpu.{md,json}``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import riemannian_ref as rr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_attention import finish, load_text, machine_info  # noqa: E402


def inputs(n, B=2, h=2, d=64, r=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s, c=1.0: (c * torch.randn(*s, generator=g)).requires_grad_()  # noqa: E731
    return dict(q=t(B, h, n, d), k=t(B, h, n, d), v=t(B, h, n, d), U=t(B, h, n, d, r, c=0.1),
                rates=(0.02 * torch.rand(B, h, n, d // 2, generator=g)).requires_grad_(),
                lam=torch.ones(h, requires_grad=True))


def cases(x, n, metric_form="factor"):
    def conn(**kw):
        base = dict(is_causal=True, U_k=x["U"], lam=x["lam"], connection="content", rates=x["rates"])
        base.update(kw)
        return lambda: rr.connection_attention(x["q"], x["k"], x["v"], **base)

    cfg = rr.AttentionConfig(d_model=128, n_heads=2, head_dim=64, rank=2, connection="content", causal=True,
                             metric_form=metric_form)
    torch.manual_seed(0)
    layer = rr.RiemannianAttention(cfg)
    xs = torch.randn(2, n, 128, requires_grad=True)
    out = {
        "kernel": conn(),
        "kernel, values not transported": conn(transport_values=False),
        "kernel, rank 0": conn(U_k=None),
        "kernel, dot scores, values not transported": conn(U_k=None, scores="dot", transport_values=False),
        "layer": lambda: layer(xs)[0],
        "flat connection": conn(connection="flat", rates=None),
        "riemannian": lambda: rr.riemannian_attention(x["q"], x["k"], x["v"], is_causal=True, U_k=x["U"],
                                                      lam=x["lam"]),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True),
    }
    if n <= 512:
        def dense():
            os.environ["RR_DISABLE_CKERNEL"] = "1"
            try:
                return conn()()
            finally:
                del os.environ["RR_DISABLE_CKERNEL"]
        out["dense path"] = dense
    return out


def fwd_bwd(f):
    y = f()
    y.backward(torch.ones_like(y))


def seconds(f, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fwd_bwd(f)
    return (time.perf_counter() - t0) / calls


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ns", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--metric-form", choices=("factor", "gains"), default="factor",
                   help="the layer's metric parameterisation: factor (G = lam I + U U^T), the form the stored "
                        "results were made with, or gains (bounded gains), the package default")
    p.add_argument("--out", default=str(ROOT / "results" / "bench_content_cpu"))
    args = p.parse_args()
    if args.quick:
        args.ns, args.reps = [64], 2
    torch.set_num_threads(args.threads)
    t_start = time.time()
    info = machine_info(args.threads)
    info.update(load_before=os.getloadavg(), reps=args.reps, metric_form=args.metric_form,
                command="python " + " ".join(["benchmarks/bench_content.py"] + sys.argv[1:]))
    rows = []
    for n in args.ns:
        fs = cases(inputs(n), n, args.metric_form)
        for f in fs.values():
            fwd_bwd(f)  # warm up (and build the kernel)
        rounds = {name: [] for name in fs}
        for _ in range(args.reps):
            for name, f in fs.items():
                rounds[name].append(seconds(f, 1))
        for name, ts in rounds.items():
            rows.append(dict(n=n, what=name, ms=1e3 * statistics.median(ts),
                             vs_sdpa=statistics.median(t / s for t, s in zip(ts, rounds["sdpa"])),
                             vs_kernel=statistics.median(t / s for t, s in zip(ts, rounds["kernel"]))))
            print(n, name, f"{rows[-1]['ms']:.1f} ms", f"{rows[-1]['vs_sdpa']:.1f}x sdpa", flush=True)
    lines = ["# The content connection's time, piece by piece (CPU)", "",
             f"Machine: {info['cpu']} ({info['cores']} cores, shared with other jobs), torch {info['torch']}, "
             f"{info['threads']} threads, float32. Batch 2, 2 heads of dimension 64, metric rank 2 (key side), "
             f"causal, forward + backward (the layer's metric form: {info['metric_form']}); medians over "
             f"{info['reps']} interleaved rounds, ratios within a "
             "round. LOAD "
             f"Command: `{info['command']}`.", "",
             "| n | what | ms | / sdpa | / kernel |", "|---:|:---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['what']} | {r['ms']:.1f} | {r['vs_sdpa']:.1f} | {r['vs_kernel']:.2f} |")
    finish(info, t_start, None, {})  # the load after and the wall time, for the header
    lines[2] = lines[2].replace("LOAD", load_text(info))
    finish(info, t_start, args.out, {"machine": info, "rows": rows}, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
