#!/usr/bin/env python3
"""Rank collapse with the temperature controlled, the one-layer map, and what survives it.

Three parts, all on pure self-attention stacks at random initialisation
(`FiberBundleConfig.attention_stack`: no skip, no MLP, no norm), float64:

1. ``calibration``: for every variant, the `qk_gain` (scores scale with its
   square) at which the mean entropy of the first layer's attention rows on
   Gaussian tokens equals that of dot-product attention at `--ref-gain`
   (bisection; entropy is non-increasing in the gain), on the tuning seeds
   only (`--tune-seeds`, numbered from 1000).
2. ``sweep``: on the evaluation seeds 0..`--seeds`-1, the log10 relative
   residual (composite norm, mean form) at every depth 0..`--depth`, twice:
   every variant at `--ref-gain` ("unmatched", the setting of
   results/rank_collapse.json) and every variant at its calibrated gain
   ("matched"). Seed s is shared by all variants: the same input batch and the
   same query, key, value and output weights (copied from the dot-product
   stack of seed s, then multiplied by the variant's gain); only the score
   function, the metric network and the connection differ. The chapter
   computes paired statistics from these curves.
3. ``certificates``: for every variant and evaluation seed, the first layer
   (at `--ref-gain`) applied to X = 1 xbar^T + eps R over `--eps-decades`
   decades of eps: the fitted exponent of rho_out = C rho_in^p and the
   measured constant, next to the bound's p and C at eps -> 0
   (`riemannian_ref.analysis.collapse_bound`).
4. ``probe``: for every variant at its calibrated gain and `--probe-seeds`
   seeds, token sequences of `--n` tokens in which each of `--vocab` symbols
   appears equally often (so the mean token carries no information about
   which symbol sits where), embedded by a random Gaussian table; at depths
   `--probe-depths`, the test accuracy of linear probes
   (`riemannian_ref.analysis.linear_probe_accuracy`) for the input symbol of
   each token and for its position, at relative precision 1e-6 (about float32)
   and 1e-13 (about float64), and the fraction of the residual's energy that
   changes with the input symbols (the rest is the same for every sequence:
   a positional signal).

    OMP_NUM_THREADS=1 python experiments/rank_collapse_controlled.py \
        --out results/rank_collapse_controlled.json

Metrics are built in the form `--metric-form` (default `factor`, G = lam I + U U^T,
the form of the stored results; `gains` is the package default), recorded in
the file's meta. Runs on one thread; the committed file records its wall time, CPU time,
seeds and the load average of the machine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

import riemannian_ref as rr
from riemannian_ref._io import atomic_write_text
from riemannian_ref.analysis import (attention_entropy, collapse_bound, collapse_depth, collapse_map,
                                     linear_probe_accuracy)

DT = torch.float64
_METRIC = dict(rank=4, strength=1.0)  # the attention options of the metric variants
#: name -> FiberBundleConfig.attention_stack overrides (the attention options nested). The first block's
#: metrics are computed from the tokens (the theorem's hypothesis); the "escape" ones are not, or transport.
VARIANTS = {
    "euclidean": dict(mode="euclidean"),
    "l2": dict(mode="riemannian", attention=dict(rank=0, strength=0.0)),
    "shared": dict(mode="riemannian", attention=dict(_METRIC, metric="shared")),
    "hetero-key": dict(mode="riemannian", attention=dict(_METRIC, metric_side="key")),
    "hetero-query": dict(mode="riemannian", attention=dict(_METRIC, metric_side="query")),
    "hetero-mean": dict(mode="riemannian", attention=dict(_METRIC, metric_side="mean")),
    "hetero-query-s4": dict(mode="riemannian", attention=dict(_METRIC, metric_side="query", strength=4.0)),
    "fiber-trivial": dict(mode="fiber_bundle", precondition_ffn=False,
                          attention=dict(_METRIC, connection="trivial")),
    "bias-key": dict(mode="riemannian", attention=dict(_METRIC, metric_bias=True)),
    "position-key": dict(mode="riemannian", attention=dict(_METRIC, metric="position")),
    "transport-flat": dict(mode="riemannian", attention=dict(_METRIC, connection="flat")),
    "transport-content": dict(mode="riemannian", attention=dict(_METRIC, connection="content")),
    "rope-keys": dict(mode="euclidean", attention=dict(connection="flat", transport_values=False)),
}
ESCAPES = ("position-key", "transport-flat", "transport-content", "rope-keys")
SHARED_PARAMS = ("attn.w_q", "attn.w_k", "attn.v_proj.weight", "attn.v_proj.bias", "attn.out_proj.weight",
                 "attn.out_proj.bias")


def build(name: str, seed: int, gain: float, args, depth: int | None = None) -> rr.FiberBundleTransformer:
    """Variant `name` with seed `seed`'s shared weights (those of the dot-product stack), frames times `gain`.

    Metrics in the form `args.metric_form`; a namespace without it (one made from a result file written
    before the option existed) gets "factor", the form those files were made with. A causal mask where
    `args.causal` is true (experiments/rank_collapse_causal.py); without it, bidirectional.
    """
    kw = dict(d_model=args.d_model, n_heads=args.heads, n_layers=depth or args.depth, block_size=max(args.n, 64),
              causal=getattr(args, "causal", False))
    form = getattr(args, "metric_form", "factor")
    torch.manual_seed(seed)
    ref = rr.FiberBundleTransformer(rr.FiberBundleConfig.attention_stack(**kw, **VARIANTS["euclidean"]))
    torch.manual_seed(seed)
    cfg = rr.FiberBundleConfig.attention_stack(**kw, **VARIANTS[name]).replace(attention=dict(metric_form=form))
    model = rr.FiberBundleTransformer(cfg)
    with torch.no_grad():
        for blk, rblk in zip(model.blocks, ref.blocks):
            own, theirs = blk.state_dict(), rblk.state_dict()
            for key in SHARED_PARAMS:
                own[key].copy_(theirs[key])
            blk.attn.w_q.mul_(gain)
            blk.attn.w_k.mul_(gain)
    return model.to(DT).eval()


def gaussian_tokens(seed: int, args, batch: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randn(batch or args.batch, args.n, args.d_model, generator=g, dtype=DT)


@torch.no_grad()
def first_layer_entropy(name: str, gain: float, seeds, args) -> float:
    """Mean entropy (nats) of the first layer's attention rows on Gaussian tokens, over `seeds`."""
    H = []
    for s in seeds:
        model = build(name, s, gain, args, depth=1)  # block 0 of any depth: the same draws
        _, A = model.blocks[0].attn(gaussian_tokens(s, args), return_weights=True)
        H.append(attention_entropy(A).mean().item())
    return float(np.mean(H))


def calibrate(name: str, target: float, seeds, args) -> tuple[float, float]:
    """The gain whose first-layer entropy is `target` (bisection on log gain), and the entropy reached."""
    lo, hi = math.log(0.05), math.log(64.0)
    for _ in range(args.bisect_steps):
        mid = 0.5 * (lo + hi)
        if first_layer_entropy(name, math.exp(mid), seeds, args) > target:
            lo = mid  # too flat: sharpen
        else:
            hi = mid
    gain = math.exp(0.5 * (lo + hi))
    return gain, first_layer_entropy(name, gain, seeds, args)


@torch.no_grad()
def depth_curve(name: str, seed: int, gain: float, args) -> list[float]:
    """Batch mean of the log10 relative residual (composite, mean form) at depths 0..L."""
    H = build(name, seed, gain, args)(embeds=gaussian_tokens(seed, args), return_hidden=True).hidden
    u = torch.log10(rr.relative_residual(H).clamp_min(1e-300)).mean(-1)  # (L + 1,)
    return [round(float(v), 3) for v in u]


@torch.no_grad()
def certificate(name: str, seed: int, gain: float, args) -> dict:
    attn = build(name, seed, gain, args, depth=1).blocks[0].attn
    g = torch.Generator().manual_seed(20_000 + seed)
    xbar = torch.randn(args.d_model, generator=g, dtype=DT)  # a typical token: |xbar| about sqrt(D)
    R = torch.randn(args.n, args.d_model, generator=g, dtype=DT)
    eps = torch.logspace(args.eps_top - args.eps_decades, args.eps_top, args.eps_points, dtype=DT)
    rho_in, rho_out = collapse_map(attn, xbar, R, eps)
    li, lo = np.log10(rho_in.numpy()), np.log10(rho_out.numpy())
    slope, icpt = np.polyfit(li, lo, 1)
    out = {"log10_rho_in": [round(float(v), 4) for v in li], "log10_rho_out": [round(float(v), 4) for v in lo],
           "exponent": round(float(slope), 4), "log10_C_fit": round(float(icpt), 4),
           "center_norm": round(float(xbar.norm()), 3)}
    try:
        p, C0 = collapse_bound(attn, xbar, 0.0, n=args.n)
        out.update(bound_power=p, log10_C_bound=round(math.log10(C0.item()), 4),
                   log10_C_measured=round(float(np.mean(lo[:3] - p * li[:3])), 4))
    except ValueError:  # a transport: outside the bound's hypothesis
        out.update(bound_power=None, log10_C_bound=None, log10_C_measured=None)
    return out


def balanced_sequences(n_seq: int, args, g: torch.Generator) -> torch.Tensor:
    """[n_seq, n] symbols, each of `vocab` symbols `n / vocab` times, in random order."""
    base = torch.arange(args.vocab).repeat_interleave(args.n // args.vocab)  # (n,)
    return torch.stack([base[torch.randperm(args.n, generator=g)] for _ in range(n_seq)])


@torch.no_grad()
def probe(name: str, seed: int, gain: float, args) -> dict:
    model = build(name, seed, gain, args, depth=max(args.probe_depths))
    g = torch.Generator().manual_seed(30_000 + seed)
    table = torch.randn(args.vocab, args.d_model, generator=g, dtype=DT)
    toks = balanced_sequences(args.probe_train + args.probe_test, args, g)  # (N, n)
    hidden = torch.cat([model(embeds=table[t], return_hidden=True).hidden
                        for t in toks.split(64)], dim=1)  # (L + 1, N, n, D)
    pos = torch.arange(args.n).expand_as(toks)
    tr, te = slice(0, args.probe_train), slice(args.probe_train, None)
    out = {"token": {}, "position": {}, "token_f64": {}, "log10_res": {}, "token_fraction": {}}
    for l in args.probe_depths:
        H = hidden[l]
        F_tr, F_te = H[tr].reshape(-1, args.d_model), H[te].reshape(-1, args.d_model)
        for key, y, tol in (("token", toks, 1e-6), ("position", pos, 1e-6), ("token_f64", toks, 1e-13)):
            acc = linear_probe_accuracy(F_tr, y[tr].reshape(-1), F_te, y[te].reshape(-1), rel_tol=tol)
            out[key][str(l)] = round(acc, 4)
        out["log10_res"][str(l)] = round(float(torch.log10(rr.relative_residual(H).clamp_min(1e-300)).mean()), 3)
        # the residual's energy that changes with the input symbols (the rest is the same for every sequence)
        R = H - H.mean(1, keepdim=True)  # per-sequence residual                 (N, n, D)
        T = R - R.mean(0, keepdim=True)  # minus its part common to all sequences (positional)
        out["token_fraction"][str(l)] = round(float(T.pow(2).sum() / R.pow(2).sum().clamp_min(1e-300)), 4)
    return out


def run_record(t0: float, c0: float, timing: dict) -> dict:
    """Wall and CPU time since `t0` / `c0` (perf_counter, process_time), the per-part times and the load."""
    return {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
            "timing_s": timing, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
            "cpu_count": os.cpu_count()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=20, help="evaluation seeds 0..seeds-1 (sweep, certificates)")
    p.add_argument("--tune-seeds", type=int, default=5, help="tuning seeds 1000.. (calibration only)")
    p.add_argument("--probe-seeds", type=int, default=10)
    p.add_argument("--depth", type=int, default=24)
    p.add_argument("--n", type=int, default=32, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="Gaussian input sequences per seed")
    p.add_argument("--ref-gain", type=float, default=4.0, help="dot-product gain whose entropy is the target")
    p.add_argument("--bisect-steps", type=int, default=24)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--eps-top", type=float, default=-1.0, help="log10 of the largest radius of the certificate")
    p.add_argument("--eps-decades", type=float, default=3.0)
    p.add_argument("--eps-points", type=int, default=13)
    p.add_argument("--vocab", type=int, default=8, help="probe: symbols (must divide --n)")
    p.add_argument("--probe-train", type=int, default=128, help="probe: training sequences")
    p.add_argument("--probe-test", type=int, default=64, help="probe: test sequences")
    p.add_argument("--probe-depths", type=int, nargs="+", default=[0, 1, 2, 3, 4, 6, 8, 12, 16],
                   help="probe: depths (the probed stacks are as deep as the largest)")
    p.add_argument("--metric-form", choices=("factor", "gains"), default="factor",
                   help="metric parameterisation: factor (G = lam I + U U^T), the form the stored results were "
                        "made with, or gains (bounded gains), the package default")
    p.add_argument("--out", type=Path, default=Path("results/rank_collapse_controlled.json"))
    args = p.parse_args(argv)
    if args.n % args.vocab:
        p.error(f"--vocab must divide --n, got {args.vocab} and {args.n}")
    if max(args.probe_depths) > args.depth:
        p.error("--probe-depths must not exceed --depth")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t0, c0 = time.perf_counter(), time.process_time()
    names = ["euclidean"] + [v for v in args.variants if v != "euclidean"]
    tune = range(1000, 1000 + args.tune_seeds)
    evals = range(args.seeds)
    target = first_layer_entropy("euclidean", args.ref_gain, tune, args)
    calib, timing = {}, {}
    for name in names:
        t = time.perf_counter()
        gain, ent = calibrate(name, target, tune, args)
        calib[name] = {"gain": round(gain, 5), "entropy": round(ent, 5),
                       "entropy_at_ref_gain": round(first_layer_entropy(name, args.ref_gain, tune, args), 5),
                       "entropy_eval_seeds": round(first_layer_entropy(name, gain, evals, args), 5)}
        timing[f"calibrate/{name}"] = round(time.perf_counter() - t, 1)
        print(f"{name:>18}: gain {gain:.3f} -> entropy {ent:.4f} (target {target:.4f})", file=sys.stderr)
    sweep = {"unmatched": {}, "matched": {}}
    for name in names:
        t = time.perf_counter()
        sweep["unmatched"][name] = [depth_curve(name, s, args.ref_gain, args) for s in evals]
        sweep["matched"][name] = [depth_curve(name, s, calib[name]["gain"], args) for s in evals]
        d = collapse_depth(torch.tensor(sweep["matched"][name])).mean().item()
        timing[f"sweep/{name}"] = round(time.perf_counter() - t, 1)
        print(f"{name:>18}: matched collapse depth {d:.2f}", file=sys.stderr)
    certs = {}
    for name in names:
        t = time.perf_counter()
        certs[name] = [certificate(name, s, args.ref_gain, args) for s in evals]
        timing[f"certificates/{name}"] = round(time.perf_counter() - t, 1)
    probes = {}
    for name in names:
        t = time.perf_counter()
        probes[name] = [probe(name, s, calib[name]["gain"], args) for s in range(args.probe_seeds)]
        timing[f"probe/{name}"] = round(time.perf_counter() - t, 1)
        last = str(max(args.probe_depths))
        print(f"{name:>18}: token probe at depth {last}: "
              f"{np.mean([r['token'][last] for r in probes[name]]):.3f}", file=sys.stderr)
    wall = time.perf_counter() - t0
    meta = {
        **run_record(t0, c0, timing),
        "eval_seeds": list(evals), "tune_seeds": list(tune), "probe_seeds": list(range(args.probe_seeds)),
        "depth": args.depth, "n": args.n, "d_model": args.d_model, "heads": args.heads, "batch": args.batch,
        "ref_gain": args.ref_gain, "target_entropy": round(target, 5), "dtype": "float64",
        "metric_form": args.metric_form,
        "input": "iid N(0, 1) token states (sweep); balanced symbol sequences through a N(0, 1) table (probe)",
        "residual": "relative residual, composite norm, mean form; batch mean of log10",
        "pairing": "seed s: same input batch and the same w_q, w_k, v_proj, out_proj for every variant",
        "eps": {"top": args.eps_top, "decades": args.eps_decades, "points": args.eps_points},
        "probe": {"vocab": args.vocab, "train": args.probe_train, "test": args.probe_test,
                  "depths": args.probe_depths, "rel_tol": {"token": 1e-6, "position": 1e-6, "token_f64": 1e-13}},
        "variants": {k: VARIANTS[k] for k in names}, "escapes": [e for e in ESCAPES if e in names],
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "command": "python experiments/rank_collapse_controlled.py "
                   + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps({"meta": meta, "calibration": calib, "sweep": sweep, "certificates": certs,
                                    "probe": probes}, separators=(",", ":")))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB) in {wall:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
