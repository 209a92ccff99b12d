#!/usr/bin/env python3
"""Pair distance vs interpolated-segment length vs geodesic, as metric heterogeneity grows.

For every (strength, seed): a freshly initialised ``rr.MetricNet`` (model width
``D``, head dimension ``d``, rank ``r``, lam = 1, the given strength, the form
``--metric-form``: default ``factor``, G = lam I + U U^T, that of the stored
sweeps, while ``gains`` is the package default; weights from
``torch.manual_seed(seed)``) gives the metrics of two tokens whose states and
positions k, q in R^d are drawn from ``torch.Generator().manual_seed(seed)``.
We record

    a = pair_distance(q, k, G_q, G_k, "mean")
    b = segment_length(q, k, G_q, G_k)            (linear interpolation, closed form)
    c = shortest_path(k, q, MetricField([k, q], weights="segment")).length

and write one row per case to a JSON file (chapter 05 plots it and re-runs a
few cases live, which must reproduce these rows). The book's two sweeps:

    OMP_NUM_THREADS=1 .venv/bin/python experiments/geodesic_gap.py --out results/geodesic_gap.json
    OMP_NUM_THREADS=1 .venv/bin/python experiments/geodesic_gap.py --D 64 --d 64 --r 4 \
        --out results/geodesic_gap_d64.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from tqdm import tqdm

import riemannian_ref as rr
from riemannian_ref._io import atomic_write_text

F64 = torch.float64


def gap_case(strength: float, seed: int, n_points: int, steps: int, D: int = 8, d: int = 2,
             r: int = 2, form: str = "factor") -> tuple[float, float, float]:
    """(a, b, c) for one two-token configuration; the chapter repeats this code inline.

    ``form`` is the metric network's parameterisation (``rr.MetricNet(form=...)``):
    ``"factor"``, that of the stored sweeps, unless told.
    """
    torch.manual_seed(seed)
    net = rr.MetricNet(D, n_heads=1, head_dim=d, rank=r, lam_init=1.0, strength=strength, form=form).to(F64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lam, U = net(torch.randn(1, 2, D, generator=g, dtype=F64))  # (1,), (1, 1, 2, d, r)
    kq = torch.randn(2, d, generator=g, dtype=F64)  # rows: k, q
    M_k, M_q = rr.LowRankMetric(lam[0], U[0, 0, 0]), rr.LowRankMetric(lam[0], U[0, 0, 1])
    a = rr.pair_distance(kq[1], kq[0], M_q, M_k, "mean").item()
    b = rr.segment_length(kq[1], kq[0], M_q, M_k).item()
    field = rr.MetricField(kq, rr.LowRankMetric(lam[0].expand(2), U[0, 0]), weights="segment")
    c = rr.shortest_path(kq[0], kq[1], field, n_points=n_points, steps=steps).length.item()
    return a, b, c


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strengths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    ap.add_argument("--seeds", type=int, default=16, help="seeds 0 .. SEEDS-1 per strength")
    ap.add_argument("--D", type=int, default=8, help="width of the token states fed to the metric net")
    ap.add_argument("--d", type=int, default=2, help="head dimension (where k, q and the metrics live)")
    ap.add_argument("--r", type=int, default=2, help="metric rank")
    ap.add_argument("--n-points", type=int, default=32, help="polyline vertices of the geodesic")
    ap.add_argument("--steps", type=int, default=50, help="L-BFGS iterations per coarse-to-fine level")
    ap.add_argument("--metric-form", choices=("factor", "gains"), default="factor",
                    help="metric parameterisation: factor (G = lam I + U U^T), the form the stored results were "
                         "made with, or gains (bounded gains), the package default")
    ap.add_argument("--out", default="results/geodesic_gap.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    rows = []
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    cases = [(s, seed) for s in args.strengths for seed in range(args.seeds)]
    for s, seed in tqdm(cases, desc=f"geodesics d={args.d}"):
        a, b, c = gap_case(s, seed, args.n_points, args.steps, args.D, args.d, args.r, args.metric_form)
        rows.append({"strength": s, "seed": seed, "pair_mean": a, "segment": b, "geodesic": c})
    out = {
        "description": "a = pair distance (mean metric), b = straight segment under linear interpolation, "
                       "c = geodesic of the 'segment' metric field; see experiments/geodesic_gap.py",
        "config": {"n_points": args.n_points, "steps": args.steps, "D": args.D, "d": args.d, "r": args.r,
                   "lam": 1.0, "strengths": args.strengths, "seeds": args.seeds,
                   "metric_form": args.metric_form},
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "seconds": round(time.perf_counter() - t0, 1),
                    "load_avg_before": [round(x, 2) for x in load_before],
                    "load_avg_after": [round(x, 2) for x in os.getloadavg()]},
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    atomic_write_text(args.out, json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
