#!/usr/bin/env python3
"""Rank collapse of pure attention stacks with and without a causal mask, at several temperatures.

The controlled sweep of `rank_collapse_controlled.py` (same variants, same
pairing, same calibration by bisection on tuning seeds), repeated

* for both masks, `--masks none causal` (bidirectional, and the causal mask of
  a decoder: token i attends to tokens 1..i), and
* at several target entropies: for each `--ref-gains` g, every variant is
  calibrated to the mean first-layer attention entropy that dot-product
  attention has at gain g *under the same mask*, on the tuning seeds
  (numbered from 1000); the evaluation seeds 0..`--seeds`-1 never enter the
  calibration.

For every (mask, gain, variant) the file stores the batch-mean log10 relative
residual (composite norm, mean form) at every depth 0..`--depth` and seed. The
default depth (48) is twice the bidirectional sweep's, so that the causal stacks,
which collapse at an exponential rather than a doubly exponential rate, reach
the 1e-6 level of the collapse depth. It also stores, per mask, the one-layer
certificate of every variant at the largest gain (`certificate` of
`rank_collapse_controlled.py`: the fitted exponent of rho_out = C rho_in^p
over `--eps-decades` decades). The bound of the collapse theorem assumes no
mask; for causal layers its fields are null.

    OMP_NUM_THREADS=1 python experiments/rank_collapse_causal.py \
        --out results/rank_collapse_causal.json

Float64, one thread; the file records the wall time, CPU time, seeds and the
load average of the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from argparse import Namespace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rank_collapse_controlled as rcc  # noqa: E402
from riemannian_ref._io import atomic_write_text  # noqa: E402
from riemannian_ref.analysis import collapse_depth  # noqa: E402

#: The variants whose metric is computed from the tokens (the theorem's hypothesis), with
#: G = lam I ("l2") to separate the distance form from the per-token metric.
SWEEP = ["euclidean", "l2", "shared", "hetero-key", "hetero-query", "hetero-mean", "hetero-query-s4",
         "bias-key"]
#: One-layer certificates: the sweep's variants and the escape routes of chapter 9.
CERTIFY = SWEEP + ["position-key", "rope-keys", "transport-flat"]
MASKS = ("none", "causal")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=20, help="evaluation seeds 0..seeds-1")
    p.add_argument("--tune-seeds", type=int, default=5, help="tuning seeds 1000.. (calibration only)")
    p.add_argument("--depth", type=int, default=48)
    p.add_argument("--n", type=int, default=32, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="Gaussian input sequences per seed")
    p.add_argument("--ref-gains", type=float, nargs="+", default=[1.0, 2.0, 4.0],
                   help="dot-product gains whose first-layer entropies are the targets")
    p.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    p.add_argument("--bisect-steps", type=int, default=24)
    p.add_argument("--variants", nargs="+", default=SWEEP, choices=list(rcc.VARIANTS))
    p.add_argument("--certify", nargs="*", default=CERTIFY, choices=list(rcc.VARIANTS),
                   help="variants whose one-layer map is certified (at the largest gain)")
    p.add_argument("--eps-top", type=float, default=-1.0, help="log10 of the largest radius of the certificate")
    p.add_argument("--eps-decades", type=float, default=3.0)
    p.add_argument("--eps-points", type=int, default=13)
    p.add_argument("--metric-form", choices=("factor", "gains"), default="factor",
                   help="metric parameterisation: factor (G = lam I + U U^T), the form of chapter 9's other "
                        "results, or gains (bounded gains), the package default")
    p.add_argument("--out", type=Path, default=Path("results/rank_collapse_causal.json"))
    args = p.parse_args(argv)
    if "euclidean" not in args.variants:
        p.error("--variants must include euclidean (the reference of the calibration)")
    if any(g <= 0 for g in args.ref_gains):
        p.error(f"--ref-gains must be positive, got {args.ref_gains}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t0, c0 = time.perf_counter(), time.process_time()
    names = ["euclidean"] + [v for v in args.variants if v != "euclidean"]
    tune, evals = range(1000, 1000 + args.tune_seeds), range(args.seeds)
    calib, sweep, certs, targets, timing = {}, {}, {}, {}, {}
    for mask in args.masks:
        ns = Namespace(**vars(args), causal=mask == "causal")
        calib[mask], sweep[mask], targets[mask] = {}, {}, {}
        for g in args.ref_gains:
            key = f"{g:g}"
            target = rcc.first_layer_entropy("euclidean", g, tune, ns)
            targets[mask][key] = round(target, 5)
            calib[mask][key], sweep[mask][key] = {}, {}
            for name in names:
                t = time.perf_counter()
                if name == "euclidean":
                    gain, ent = g, target
                else:
                    gain, ent = rcc.calibrate(name, target, tune, ns)
                calib[mask][key][name] = {"gain": round(gain, 5), "entropy": round(ent, 5),
                                          "entropy_eval_seeds": round(rcc.first_layer_entropy(name, gain, evals,
                                                                                              ns), 5)}
                sweep[mask][key][name] = [rcc.depth_curve(name, s, gain, ns) for s in evals]
                d = collapse_depth(torch.tensor(sweep[mask][key][name])).mean().item()
                timing[f"{mask}/{key}/{name}"] = round(time.perf_counter() - t, 1)
                print(f"{mask:>6} gain {key:>3} {name:>16}: gain {gain:6.3f} entropy {ent:.4f} "
                      f"(target {target:.4f}), collapse depth {d:.2f}", file=sys.stderr)
        certs[mask] = {}
        gmax = max(args.ref_gains)
        for name in args.certify:
            t = time.perf_counter()
            # collapse_bound refuses a causal layer, so certificate() leaves its bound fields null
            rows = [rcc.certificate(name, s, gmax, ns) for s in evals]
            certs[mask][name] = rows
            timing[f"certificate/{mask}/{name}"] = round(time.perf_counter() - t, 1)
            print(f"{mask:>6} certificate {name:>16}: exponent "
                  f"{np.mean([r['exponent'] for r in rows]):.3f}", file=sys.stderr)
    wall = time.perf_counter() - t0
    meta = {
        **rcc.run_record(t0, c0, timing),
        "eval_seeds": list(evals), "tune_seeds": list(tune), "masks": args.masks,
        "ref_gains": args.ref_gains, "target_entropy": targets, "certificate_gain": max(args.ref_gains),
        "depth": args.depth, "n": args.n, "d_model": args.d_model, "heads": args.heads, "batch": args.batch,
        "dtype": "float64", "metric_form": args.metric_form,
        "input": "iid N(0, 1) token states",
        "residual": "relative residual, composite norm, mean form; batch mean of log10",
        "pairing": "seed s: same input batch and the same w_q, w_k, v_proj, out_proj for every variant and mask",
        "eps": {"top": args.eps_top, "decades": args.eps_decades, "points": args.eps_points},
        "variants": {k: rcc.VARIANTS[k] for k in dict.fromkeys(names + list(args.certify))},
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "command": "python experiments/rank_collapse_causal.py "
                   + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps({"meta": meta, "calibration": calib, "sweep": sweep,
                                            "certificates": certs}, separators=(",", ":")))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB) in {wall:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
