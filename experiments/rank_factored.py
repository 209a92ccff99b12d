"""Rank-factored Riemannian optimisation of W_Q W_K^T vs AdamW on a character LM, under ``rr.compare``.

Task: next-character prediction on ``rr.char_lm`` (the Python language
reference of ``pydoc_data.topics``, split by topic; ships with Python, no
download). Model: ``FiberBundleConfig.grokking`` with two layers and a context
of ``--n-ctx``, trained by ``rr.train``. Each head's bilinear form
:math:`W_Q^h (W_K^h)^\\top` (rank ``d`` in ``D x D``) is a point of

* ``adamw``    -- nothing: AdamW on every parameter (the baseline);
* ``embedded`` -- the embedded fixed-rank manifold (``rr.optim.FixedRankEmbedded``,
  truncated-SVD retraction), AdamW on the rest;
* ``factored`` -- the factored quotient geometry (``rr.optim.FixedRankFactored``,
  scaled gradient, balanced retraction), AdamW on the rest;
* ``stiefel``  -- the partial-isometry geometry: W_Q, W_K as Stiefel frames,
  AdamW on the rest;

all with one ``rr.RiemannianAdam``.

Every arm has one learning rate ``lr``, tuned per arm by ``rr.compare`` on the
tuning seed (lowest final validation loss): AdamW's for the ordinary
parameters, and ``lr * sqrt(D d)`` as the Frobenius step length of the
geometry's matrices, so that a geometry step is as long as a typical AdamW step
on a ``D x d`` matrix (whose entries each move about ``lr``). Weight decay is 0
for all arms (it would act differently on each parametrisation). Five
evaluation seeds; ``rr.compare`` stores the curves and the paired differences
against AdamW.

Writes ``--out``. Run niced:
    nice -n 15 env OMP_NUM_THREADS=1 python experiments/rank_factored.py --out results/rank_factored.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import torch
from tqdm import tqdm

import riemannian_ref as rr
from riemannian_ref._io import atomic_write_text
from riemannian_ref.protocol import Arm

ARMS = ("adamw", "embedded", "factored", "stiefel")


def make_optimizer(arm: str, geo_scale: float):
    """``(model, lr) -> optimizer``: AdamW at ``lr``; the geometry's matrices at ``lr * geo_scale``."""

    def build(model, lr):
        frames = model.qk_frame_parameters()
        ids = {id(p) for p in frames}
        rest = [p for p in model.parameters() if id(p) not in ids]
        lr_geo = lr * geo_scale
        if arm == "adamw":
            return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        if arm == "stiefel":
            rr.optim.constrain_(rr.Stiefel(), *frames)
        else:  # frames come as [W_Q^1, W_K^1, W_Q^2, W_K^2, ...]: pairs (A, B) with W = A B^T per head
            geometry = rr.optim.FixedRankEmbedded if arm == "embedded" else rr.optim.FixedRankFactored
            for A, B in zip(frames[0::2], frames[1::2]):
                rr.optim.constrain_(geometry(), A, B)  # one manifold instance per pair
        return rr.RiemannianAdam([{"params": frames, "lr": lr_geo, "trust_radius": 2 * lr_geo},
                                  {"params": rest}], lr=lr)

    return build


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-ctx", type=int, default=48)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=8)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--val-windows", type=int, default=128, help="validation windows evaluated")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--lrs", default="1e-2,3e-2,1e-1")
    ap.add_argument("--tune-seeds", default="1000")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--arms", default="adamw,embedded,factored")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t0 = time.perf_counter()
    train, val, info = rr.char_lm(block_size=a.n_ctx)
    cfg = rr.FiberBundleConfig.grokking(train.vocab_size, block_size=a.n_ctx, d_model=a.d_model,
                                        n_heads=a.n_heads, head_dim=a.head_dim, n_layers=a.n_layers)
    geo_scale = math.sqrt(a.d_model * a.head_dim)
    names = a.arms.split(",")
    arms = {n: Arm(lambda: rr.FiberBundleTransformer(cfg), optimizer=make_optimizer(n, geo_scale)) for n in names}
    # linear warm-up over 5% of the steps, then cosine decay to 10%, for every group
    config = rr.TrainConfig(steps=a.steps, batch_size=a.batch, eval_interval=a.eval_every, schedule="cosine",
                            warmup_steps=max(1, a.steps // 20), min_lr_ratio=0.1, grad_clip=None,
                            eval_max_examples=a.val_windows, device=a.device)
    lrs = [float(x) for x in a.lrs.split(",")]
    tune, seeds = [int(x) for x in a.tune_seeds.split(",")], [int(x) for x in a.seeds.split(",")]
    bar = tqdm(total=len(names) * (len(lrs) * len(tune) + len(seeds)), disable=a.no_progress)

    def progress(msg):
        bar.set_description(msg)
        bar.update()

    res = rr.compare(arms, lambda seed: (train, val), config, lrs=lrs, tune_seeds=tune, eval_seeds=seeds,
                     accuracy=False, progress=progress)
    bar.close()
    out = {"experiment": "rank_factored",
           "corpus": f"{info['source']} ({info['n_chars']} characters, vocabulary {len(info['chars'])})",
           "args": vars(a), "geo_scale": geo_scale, **res, "wall_s": time.perf_counter() - t0,
           "python": platform.python_version(),
           "command": "python experiments/rank_factored.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    atomic_write_text(a.out, json.dumps(out, separators=(",", ":")))
    for n in names:
        s = res["summary"]["steps"][n]
        print(f"{n:9s} lr {res['tuned'][n]['lr']:.0e} val loss {s['val_loss']['mean']:.4f} +- {s['val_loss']['sd']:.4f}")
    print(f"wall {out['wall_s'] / 60:.1f} min -> {a.out}")


if __name__ == "__main__":
    main()
