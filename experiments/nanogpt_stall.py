#!/usr/bin/env python3
"""Where the nanoGPT example's Riemannian model stalls: distance form or learned metric?

Chapter 13's example (``examples/nanogpt_riemannian.py``) trains a character
model whose Riemannian version stays near the loss of character frequencies
while the unchanged model goes on. This script separates the candidate causes
with short runs of the same example (2 layers, 300 steps, seed 0, everything
else at the example's defaults):

* ``sdpa``: the unchanged model;
* ``distance``: Riemannian attention with metric rank 0 (``G = lam I``: the
  distance form alone, a learned lambda per head);
* ``metric``: rank 2 at the example's default strength 1;
* ``metric-small-init``: rank 2 started at strength 0.01;
* ``metric-slow``: rank 2, the metric networks at a tenth of the learning rate.

Every variant builds its metric networks in the form ``--metric-form``
(default ``factor``, G = lam I + U U^T, the form of the stored results;
``gains``, bounded gains, is the package default and the example's). One seed
and 300 steps: a diagnosis, not a comparison. Writes ``--out`` (small
JSON: every run's curve, final losses and times). Run it niced on a shared
machine:

    nice -n 15 env OMP_NUM_THREADS=1 python experiments/nanogpt_stall.py --out results/nanogpt_stall.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import nanogpt_riemannian as example  # noqa: E402
from riemannian_ref._io import atomic_write_text  # noqa: E402

VARIANTS = {
    "sdpa": ["--attention", "sdpa"],
    "distance": ["--attention", "riemannian", "--rank", "0"],
    "metric": ["--attention", "riemannian", "--rank", "2"],
    "metric-small-init": ["--attention", "riemannian", "--rank", "2", "--strength", "0.01"],
    "metric-slow": ["--attention", "riemannian", "--rank", "2", "--metric-lr-scale", "0.1"],
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--metric-form", choices=("factor", "gains"), default="factor",
                    help="metric parameterisation: factor (G = lam I + U U^T), the form the stored results were "
                         "made with, or gains (bounded gains), the package default")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    runs = {}
    for name in a.variants:
        args = example.parse_args(VARIANTS[name] + ["--steps", str(a.steps), "--n-layer", str(a.n_layer),
                                                    "--eval-every", str(a.eval_every), "--metric-form", a.metric_form,
                                                    "--quiet"])
        res = example.train(args)
        res.pop("sample", None)
        runs[name] = res
        print(f"{name:18s} val {res['val_loss']:.4f}  train {res['train_loss']:.4f}  "
              f"{res['wall_time_s']:.0f} s", flush=True)
    record = {"experiment": "nanogpt_stall", "steps": a.steps, "n_layer": a.n_layer, "seed": 0,
              "metric_form": a.metric_form,
              "variants": {k: VARIANTS[k] for k in a.variants}, "runs": runs,
              "wall_s": time.perf_counter() - t0, "nice": os.nice(0),
              "command": "python experiments/nanogpt_stall.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(a.out), json.dumps(record, separators=(",", ":")))
    print(f"wrote {a.out} in {record['wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
