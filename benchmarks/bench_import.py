#!/usr/bin/env python3
"""What ``import riemannian_ref`` costs on top of ``import torch``.

Each round starts two fresh interpreters, one running ``import torch`` and one
``import riemannian_ref`` (which imports torch first), in alternating order,
and times each process from start to exit (wall clock, so interpreter start
and exit count in both). The report gives the medians over ``--runs`` rounds,
the package's extra time (the difference of the medians) and that extra as a
fraction of ``import torch``'s time; the package aims at 0.25 or less. It also
lists which of the heavy optional modules (``torch._dynamo``, ``triton``,
``scipy.stats``, ``sympy``, ``matplotlib``, ``transformers``) the import
left loaded. Nothing is asserted: on a shared machine the numbers move with
the load, so read the ratio, not a single time.

    python3 benchmarks/bench_import.py               # 5 rounds
    python3 benchmarks/bench_import.py --runs 11 --out /tmp/import.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch._dynamo", "triton", "scipy.stats", "sympy", "matplotlib", "transformers")


def timed(code: str, env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="rounds (one process of each kind per round)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs must be >= 1, got {args.runs}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep))
    times = {"torch": [], "riemannian_ref": []}
    for i in range(args.runs):
        order = ["torch", "riemannian_ref"] if i % 2 == 0 else ["riemannian_ref", "torch"]
        for mod in order:
            times[mod].append(timed(f"import {mod}", env))
    probe = ("import json, sys, riemannian_ref; "
             f"print(json.dumps({{'file': riemannian_ref.__file__, 'loaded': [m for m in {HEAVY!r} "
             "if m in sys.modules]}))")
    info = json.loads(subprocess.run([sys.executable, "-c", probe], check=True, env=env, cwd=ROOT,
                                     capture_output=True, text=True).stdout)
    med = {m: statistics.median(t) for m, t in times.items()}
    extra = med["riemannian_ref"] - med["torch"]
    res = {"median_s": med, "times_s": times, "extra_s": extra, "extra_over_torch": extra / med["torch"],
           "target_extra_over_torch": 0.25, "heavy_loaded": info["loaded"], "package": info["file"],
           "machine": {"python": platform.python_version(), "platform": platform.platform(),
                       "cpu_count": os.cpu_count(), "load_after": list(os.getloadavg()), "runs": args.runs}}
    print(f"import torch           median {med['torch']:.3f} s  ({args.runs} runs)")
    print(f"import riemannian_ref  median {med['riemannian_ref']:.3f} s")
    print(f"extra                  {extra:+.3f} s = {res['extra_over_torch']:.1%} of import torch "
          f"(target <= {res['target_extra_over_torch']:.0%})")
    print(f"heavy modules loaded by the import: {', '.join(info['loaded']) or 'none'}")
    if args.out is not None:
        from riemannian_ref._io import atomic_write_text  # here: the parent process measures nothing
        atomic_write_text(args.out, json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
