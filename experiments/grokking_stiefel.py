#!/usr/bin/env python3
"""Query/key optimisers on tasks where attention must tell tokens apart, under ``rr.compare``.

Two tasks, each with one comparison (``--task``):

* ``modular``: ``a - b mod p`` (``--op``; ``"/"`` is ``a * b^-1``) as sequences
  ``[a, b, =]``, predict at ``=``; the pairs split at random (``--train-frac``),
  full-batch training with weight decay (the grokking setting of Power et al.
  2022). The target is not symmetric in ``a, b``: a head that attends
  uniformly to ``a`` and ``b`` sees ``e(a) + e(b)`` and cannot tell
  ``a - b`` from ``b - a``, so the attention pattern must carry the order.
* ``recall``: associative recall in its one-token-per-pair form
  (``rr.pair_lookup``): the query must find the one pair whose key matches.

Model: ``rr.FiberBundleConfig.grokking`` (one pre-norm Euclidean layer whose
query and key maps are stored as frames ``[h, D, d]`` with orthonormal columns
at init); every arm starts from the same frames for a given seed. Arms:

* ``adamw``            AdamW on every parameter, weight decay ``--wd`` on every matrix;
* ``adamw_no_qk_decay`` the same without weight decay on the query/key frames;
* ``stiefel``          RiemannianAdam with the frames on St(D, d) (trust radius 0.1;
  weight decay has zero Riemannian gradient there), AdamW elsewhere, all at
  one rate ``lr``: a frame step has Frobenius length about ``lr``, while
  AdamW moves a ``D x d`` matrix by about ``lr * sqrt(D d)``;
* ``stiefel_scaled``   the same with the frames' step length and trust radius
  multiplied by ``sqrt(D d)`` (as the rank-factored experiment does), so a
  frame step is as long as a typical AdamW step on the same matrix;
* ``frozen``           the frames fixed at their random orthonormal init, AdamW elsewhere.

Each arm's learning rate is tuned on ``--lrs`` with the tuning seeds (fewest
steps to ``--target`` validation accuracy, ties to the lower loss), then every
arm is trained on the evaluation seeds; ``rr.compare`` stores the curves and
the paired statistics of the steps to ``--target`` against ``adamw``. Every
run also records how far its query/key frames moved from their
initialisation (``frame_movement``). A tuned rate on the edge of its grid is
recorded (``tuned[arm]["at_edge"]``, ``at_edge_arms``), reported loudly, and
makes the script exit with status 3 after writing ``--out`` unless
``--allow-edge`` is given: widen the grid and run again. Run niced:

    nice -n 15 env OMP_NUM_THREADS=1 python experiments/grokking_stiefel.py --task recall \\
        --steps 800 --eval-every 25 --out results/grokking_stiefel_recall.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
from tqdm.auto import tqdm

import riemannian_ref as rr
from riemannian_ref._io import atomic_write_text
from riemannian_ref.protocol import Arm

ARMS = ("adamw", "adamw_no_qk_decay", "stiefel", "stiefel_scaled", "frozen")
EDGE_STATUS = 3  # exit status when a tuned rate lies on its grid's edge


def frame_movement(frames: list[torch.Tensor], start: list[torch.Tensor]) -> dict:
    """How far query/key frames ``[h, D, d]`` moved from ``start``.

    ``relative``: mean over the frame tensors of ``|W - W0|_F / |W0|_F``;
    ``subspace``: mean over heads and frames of ``|P - P0|_F / sqrt(2 d)``,
    ``P`` the orthogonal projection onto the column space of ``W`` (0: the
    same subspace, 1: orthogonal subspaces; blind to the frame's scale,
    which weight decay shrinks).
    """
    rel, sub = [], []
    for w, w0 in zip(frames, start):
        w, w0 = w.detach().double(), w0.double()
        rel.append(((w - w0).norm() / w0.norm()).item())
        q, q0 = torch.linalg.qr(w)[0], torch.linalg.qr(w0)[0]
        gap = q @ q.mT - q0 @ q0.mT
        sub += (gap.norm(dim=(-2, -1)) / math.sqrt(2 * w.shape[-1])).tolist()
    return {"relative": statistics.fmean(rel), "subspace": statistics.fmean(sub)}


def make_optimizer(arm: str, wd: float, betas=(0.9, 0.98), record: list | None = None):
    """``(model, lr) -> optimizer`` of an arm (weight decay on matrices only, as rr.train does).

    ``record``: each call appends ``(arm, lr, frames, their initial values)``.
    """

    def build(model: rr.FiberBundleTransformer, lr: float) -> torch.optim.Optimizer:
        frames = model.qk_frame_parameters()
        if record is not None:
            record.append((arm, lr, frames, [f.detach().clone() for f in frames]))
        ids = {id(p) for p in frames}
        rest = [p for p in model.parameters() if id(p) not in ids]
        mats = [p for p in rest if p.dim() >= 2]
        vecs = [p for p in rest if p.dim() < 2]
        groups = [{"params": mats, "weight_decay": wd}, {"params": vecs, "weight_decay": 0.0}]
        if arm == "adamw":
            return torch.optim.AdamW(groups + [{"params": frames, "weight_decay": wd}], lr=lr, betas=betas)
        if arm == "adamw_no_qk_decay":
            return torch.optim.AdamW(groups + [{"params": frames, "weight_decay": 0.0}], lr=lr, betas=betas)
        if arm == "frozen":
            for p in frames:
                p.requires_grad_(False)
            return torch.optim.AdamW(groups, lr=lr, betas=betas)
        if arm in ("stiefel", "stiefel_scaled"):
            rr.optim.constrain_(rr.Stiefel(), *frames)  # the frames are points of St(D, d)
            scale = math.sqrt(frames[0].shape[-2] * frames[0].shape[-1]) if arm == "stiefel_scaled" else 1.0
            return rr.RiemannianAdam([{"params": frames, "lr": lr * scale, "trust_radius": 0.1 * scale}] + groups,
                                     lr=lr, betas=betas)
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")

    return build


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="modular", choices=("modular", "recall"))
    ap.add_argument("--op", default="-", choices=("-", "/"), help="modular: the (non-symmetric) operation")
    ap.add_argument("--p", type=int, default=31)
    ap.add_argument("--train-frac", type=float, default=0.5)
    ap.add_argument("--n-keys", type=int, default=16, help="recall")
    ap.add_argument("--n-values", type=int, default=8, help="recall")
    ap.add_argument("--n-pairs", type=int, default=6, help="recall")
    ap.add_argument("--n-train", type=int, default=20000, help="recall")
    ap.add_argument("--batch-size", type=int, default=64, help="recall (modular is full batch)")
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=8)
    ap.add_argument("--d-mlp", type=int, default=128)
    ap.add_argument("--wd", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2,1e-1")
    ap.add_argument("--tune-seeds", default="1000")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--allow-edge", action="store_true",
                    help="exit 0 even when a tuned rate lies on its grid's edge (it is still recorded)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    if a.task == "modular":
        def data(seed):
            return rr.modular_arithmetic(a.p, op=a.op, train_fraction=a.train_frac,
                                         generator=torch.Generator().manual_seed(seed))
        vocab, block, n_classes, batch = a.p + 1, 3, None, None
    else:
        def data(seed):
            return rr.data.make_task("lookup", seed=seed, n_train=a.n_train, n_val=512, n_keys=a.n_keys,
                                     n_values=a.n_values, n_pairs=a.n_pairs)
        vocab, block, n_classes, batch = a.n_keys * (a.n_values + 1), a.n_pairs + 1, a.n_values, a.batch_size
    cfg = rr.FiberBundleConfig.grokking(vocab, block_size=block, d_model=a.d_model, n_heads=a.n_heads,
                                        head_dim=a.head_dim, mlp_ratio=a.d_mlp // a.d_model, n_classes=n_classes)
    names = a.arms.split(",")
    unknown = sorted(set(names) - set(ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown arm(s) {unknown}; choose from {ARMS}")
    built: list = []  # (arm, lr, frames, initial frames) of every run, in the order rr.compare runs them
    arms = {name: Arm(lambda: rr.FiberBundleTransformer(cfg), optimizer=make_optimizer(name, a.wd, record=built))
            for name in names}
    config = rr.TrainConfig(steps=a.steps, batch_size=batch, eval_interval=a.eval_every, schedule="constant",
                            warmup_steps=0, grad_clip=None, betas=(0.9, 0.98), device=a.device)
    lrs = [float(x) for x in a.lrs.split(",")]
    tune, seeds = [int(x) for x in a.tune_seeds.split(",")], [int(x) for x in a.seeds.split(",")]
    bar = tqdm(total=len(names) * (len(lrs) * len(tune) + len(seeds)), disable=a.no_progress)

    def progress(msg):
        bar.set_description(msg)
        bar.update(1)

    res = rr.compare(arms, data, config, lrs=lrs, tune_seeds=tune, eval_seeds=seeds, select="steps_to_target",
                     target=a.target, progress=progress)
    bar.close()
    # one process runs every job in order, so the i-th optimiser built belongs to the i-th run
    if len(built) != len(res["runs"]):
        raise RuntimeError(f"built {len(built)} optimisers for {len(res['runs'])} runs")
    for run, (arm, lr, frames, start) in zip(res["runs"], built):
        if (arm, lr) != (run["mode"], run["lr"]):
            raise RuntimeError(f"run order mismatch: optimiser for {arm} lr {lr}, run {run['mode']} lr {run['lr']}")
        run["frame_movement"] = frame_movement(frames, start)
    edge = [name for name in names if res["tuned"][name]["at_edge"]]
    out = {"experiment": f"grokking_stiefel_{a.task}", "args": vars(a), "model": cfg.to_dict(), **res,
           "at_edge_arms": edge,
           "wall_s": time.perf_counter() - t0, "python": platform.python_version(),
           "command": "python experiments/grokking_stiefel.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    atomic_write_text(a.out, json.dumps(out, separators=(",", ":")))
    for name in names:
        s = res["summary"]["steps"][name]
        st = s["steps_to_target"]
        moved = statistics.fmean(r["frame_movement"]["relative"] for r in res["runs"]
                                 if r["mode"] == name and r["role"] == "eval")
        print(f"{name:18s} lr {res['tuned'][name]['lr']:.0e}{' (EDGE)' if name in edge else ''} "
              f"reached {s['reached_target']}/{s['n']} steps {'-' if st is None else round(st['mean'])} "
              f"final acc {s['val_acc']['mean']:.3f} frames moved {moved:.3f}")
    print(f"wall {out['wall_s'] / 60:.1f} min -> {a.out}")
    if edge:
        print(f"WARNING: the tuned learning rate of {edge} lies on the edge of its grid {a.lrs}: "
              "the tuning is not established; widen --lrs and run again", file=sys.stderr)
        if not a.allow_edge:
            raise SystemExit(EDGE_STATUS)


if __name__ == "__main__":
    main()
