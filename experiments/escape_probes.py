#!/usr/bin/env python3
"""What the surviving residual of chapter 9's escape routes carries: MLP probes, and one trained stack.

Chapter 9's linear probes find that no escape route (value transport, rotary
keys) lets a linear read-out recover the input symbol at its position from a
deep pure stack at initialisation. This script asks the two questions that
statement leaves open, on the stacks of `rank_collapse_controlled.py` (same
variants, seeds and entropy-matched gains, read from its result file):

1. ``mlp``: a stronger decoder. At depth `--depth`, a two-layer perceptron
   (`riemannian_ref.analysis.mlp_probe_accuracy`, on float32 states) and the
   linear probe read each token's input symbol from its state, for balanced
   symbol sequences through a random N(0, 1) table (as the chapter's probe),
   with `--train` / `--test` sequences, at initialisation, seeds 0..`--seeds`-1.
2. ``trained``: a trained stack. The same pure stack (float32, no skip, no MLP,
   no norm; the embedding table fixed) with a linear read-out is trained with
   AdamW to predict every token's own symbol (cross-entropy over positions),
   `--steps` steps of batches of `--batch` fresh sequences. The learning rate
   is chosen on the tuning seed 1000 from `--lrs` (final training loss; a rate
   whose loss or weights go non-finite is recorded as diverged); the
   evaluation seeds report the test accuracy of the trained read-out and the
   relative residual at the last layer before and after training.

    OMP_NUM_THREADS=1 python experiments/escape_probes.py --out results/escape_probes.json
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rank_collapse_controlled as rcc  # noqa: E402
import riemannian_ref as rr  # noqa: E402
from riemannian_ref._io import atomic_write_text  # noqa: E402
from riemannian_ref.analysis import linear_probe_accuracy, mlp_probe_accuracy  # noqa: E402

VARIANTS = ["euclidean", "transport-flat", "rope-keys"]


def stack_args(meta: dict, depth: int) -> Namespace:
    """The controlled sweep's stack settings (its result file's meta) at `depth` layers."""
    return Namespace(d_model=meta["d_model"], heads=meta["heads"], depth=depth, n=meta["n"],
                     vocab=meta["probe"]["vocab"], metric_form=meta.get("metric_form", "factor"))


def data(args: Namespace, seed: int, n_seq: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    toks = rcc.balanced_sequences(n_seq, args, g)  # (N, n)
    return table[toks], toks


@torch.no_grad()
def mlp_part(name: str, seed: int, gain: float, sa: Namespace, a) -> dict:
    model = rcc.build(name, seed, gain, sa)
    table = torch.randn(sa.vocab, sa.d_model, generator=torch.Generator().manual_seed(30_000 + seed),
                        dtype=torch.float64)
    X, toks = data(sa, 40_000 + seed, a.train + a.test, table)
    H = torch.cat([model(embeds=x, return_hidden=True).hidden[-1] for x in X.split(64)])  # (N, n, D)
    F32 = H.float().reshape(-1, sa.d_model)
    y = toks.reshape(-1)
    cut = a.train * sa.n
    lin = linear_probe_accuracy(F32[:cut].double(), y[:cut], F32[cut:].double(), y[cut:], rel_tol=1e-6)
    mlp = mlp_probe_accuracy(F32[:cut], y[:cut], F32[cut:], y[cut:], hidden=a.hidden, steps=a.probe_steps, seed=seed)
    res = torch.log10(rr.relative_residual(H).clamp_min(1e-300)).mean().item()
    return {"linear": round(lin, 4), "mlp": round(mlp, 4), "log10_res": round(res, 3)}


def train_part(name: str, seed: int, gain: float, sa: Namespace, a, lr: float) -> dict:
    model = rcc.build(name, seed, gain, sa).float().train()
    torch.manual_seed(50_000 + seed)
    head = torch.nn.Linear(sa.d_model, sa.vocab)
    table = torch.randn(sa.vocab, sa.d_model, generator=torch.Generator().manual_seed(30_000 + seed))
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(60_000 + seed)
    Xte, yte = data(sa, 70_000 + seed, a.test, table)

    @torch.no_grad()
    def evaluate():
        H = model(embeds=Xte, return_hidden=True).hidden
        acc = (head(H[-1]).argmax(-1) == yte).float().mean().item()
        return acc, torch.log10(rr.relative_residual(H[-1].double()).clamp_min(1e-300)).mean().item()

    acc0, res0 = evaluate()
    losses = []
    for _ in range(a.steps):
        toks = rcc.balanced_sequences(a.batch, sa, g)
        try:
            H = model(embeds=table[toks], return_hidden=True).hidden[-1]
        except ValueError:  # the metric's weights went non-finite: the package refuses them
            H = None
        loss = F.cross_entropy(head(H).reshape(-1, sa.vocab), toks.reshape(-1)) if H is not None else None
        if loss is None or not torch.isfinite(loss):
            # diverged at this rate: recorded as such, never selected
            return {"lr": lr, "diverged_at": len(losses), "final_train_loss": None, "loss_curve": [],
                    "test_acc_init": round(acc0, 4), "test_acc": None,
                    "log10_res_init": round(res0, 3), "log10_res": None}
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *head.parameters()], 1.0)
        opt.step()
        losses.append(loss.item())
    acc, res = evaluate()
    tail = max(1, a.steps // 10)
    return {"lr": lr, "diverged_at": None, "final_train_loss": round(float(np.mean(losses[-tail:])), 4),
            "loss_curve": [round(float(np.mean(losses[i:i + tail])), 4) for i in range(0, a.steps, tail)],
            "test_acc_init": round(acc0, 4), "test_acc": round(acc, 4),
            "log10_res_init": round(res0, 3), "log10_res": round(res, 3)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", type=Path, default=Path("results/rank_collapse_controlled.json"),
                   help="the controlled sweep's result file (stack settings and entropy-matched gains)")
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=list(rcc.VARIANTS))
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--train", type=int, default=512, help="mlp: training sequences")
    p.add_argument("--test", type=int, default=128, help="test sequences (both parts)")
    p.add_argument("--hidden", type=int, default=64, help="mlp: hidden width of the probe")
    p.add_argument("--probe-steps", type=int, default=500, help="mlp: full-batch Adam steps of the probe")
    p.add_argument("--steps", type=int, default=200, help="trained: training steps")
    p.add_argument("--batch", type=int, default=16, help="trained: sequences per step")
    p.add_argument("--lrs", default="3e-4,1e-3,3e-3,1e-2", help="trained: learning rates tried on the tuning seed")
    p.add_argument("--parts", nargs="+", default=["mlp", "trained"], choices=["mlp", "trained"])
    p.add_argument("--out", type=Path, default=Path("results/escape_probes.json"))
    a = p.parse_args(argv)
    if not a.sweep.exists():
        p.error(f"--sweep: no such file {a.sweep}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sweep = json.loads(a.sweep.read_text())
    meta, calib = sweep["meta"], sweep["calibration"]
    sa = stack_args(meta, a.depth)
    lrs = [float(x) for x in a.lrs.split(",")]
    t0 = time.perf_counter()
    out = {"mlp": {}, "trained": {}, "tuned_lr": {}, "at_edge": {}}
    for name in a.variants:
        gain = calib[name]["gain"]
        if "mlp" in a.parts:
            out["mlp"][name] = [mlp_part(name, s, gain, sa, a) for s in range(a.seeds)]
            print(f"{name:>16} mlp: " + ", ".join(f"{k} {np.mean([r[k] for r in out['mlp'][name]]):.3f}"
                                                  for k in ("linear", "mlp", "log10_res")), file=sys.stderr)
        if "trained" in a.parts:
            tune = {lr: train_part(name, 1000, gain, sa, a, lr) for lr in lrs}
            finite = [lr for lr in lrs if tune[lr]["final_train_loss"] is not None]
            if not finite:
                raise SystemExit(f"{name}: every learning rate of --lrs diverged on the tuning seed")
            best = min(finite, key=lambda lr: tune[lr]["final_train_loss"])
            out["tuned_lr"][name] = {"lr": best, "grid": {f"{lr:g}": tune[lr]["final_train_loss"] for lr in lrs}}
            out["at_edge"][name] = best in (min(lrs), max(lrs))
            out["trained"][name] = [train_part(name, s, gain, sa, a, best) for s in range(a.seeds)]
            print(f"{name:>16} trained (lr {best:g}): test acc "
                  f"{np.mean([r['test_acc'] for r in out['trained'][name]]):.3f}", file=sys.stderr)
    out["meta"] = {
        "wall_s": round(time.perf_counter() - t0, 1), "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.machine(), "depth": a.depth, "seeds": list(range(a.seeds)), "tune_seed": 1000,
        "train": a.train, "test": a.test, "hidden": a.hidden, "probe_steps": a.probe_steps, "steps": a.steps,
        "batch": a.batch, "lrs": lrs, "vocab": sa.vocab, "n": sa.n, "d_model": sa.d_model,
        "gains": {k: calib[k]["gain"] for k in a.variants}, "chance": 1 / sa.vocab,
        "command": "python experiments/escape_probes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(a.out, json.dumps(out, separators=(",", ":")))
    print(f"wrote {a.out} in {out['meta']['wall_s']:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
