#!/usr/bin/env python3
"""Drop-in parity in a ``transformers`` model: a Llama built from a config, SDPA against the Riemannian backend.

A user who switches a Hugging Face model to Riemannian attention with the
module's three lines (``rr_hf.attach(model)``, then
``model.set_attn_implementation("riemannian")``) should not get a worse
model. This script trains a small Llama (rotary positions, grouped-query
attention off) from a config, on characters of the Python language
reference split by topic (the text of ``experiments/metric_parameterisation.py``),
with the recipe of that study: AdamW lr 3e-3, betas (0.9, 0.99), weight decay
0.1, 5% linear warm-up and cosine decay, gradient clipping at 1, batch 32,
block 64, 300 steps. Arms, built from the same seed (the metric networks are
attached after the model's own initialisation, so the shared weights start
equal):

* ``sdpa``        -- the unchanged model (``attn_implementation="sdpa"``);
* ``riemannian``  -- ``rr_hf.attach(model)`` with its defaults (rank 2,
  bounded gains), then the ``"riemannian"`` backend;
* ``factor``      -- the same with ``form="factor"``, the unbounded metric
  of package versions up to 0.3 (optional).

The final validation loss is measured on ``--final-batches`` fixed batches of
the validation topics (the same for every arm and seed); each seed is a
paired comparison. Writes ``--out`` (JSON: command, settings, per-run curves
and final losses, wall times, machine, a summary with paired differences).

    OMP_NUM_THREADS=1 python experiments/hf_parity.py --seeds 10 11 12 --out results/hf_parity.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from metric_parameterisation import add_setting_args, batch, load_text, lr_at  # noqa: E402  (same text, recipe)

from riemannian_ref._io import atomic_write_text, check_writable  # noqa: E402
from riemannian_ref.integrations import transformers as rr_hf  # noqa: E402

ARMS = ("sdpa", "riemannian", "factor")


def build(arm: str, vocab: int, seed: int, a: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=a.n_embd, intermediate_size=4 * a.n_embd,
                      num_hidden_layers=a.n_layer, num_attention_heads=a.n_head, num_key_value_heads=a.n_head,
                      max_position_embeddings=a.block_size, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    if arm == "sdpa":
        model.set_attn_implementation("sdpa")
    else:
        rr_hf.attach(model, rank=a.rank, **({"form": "factor"} if arm == "factor" else {}))
        model.set_attn_implementation(rr_hf.NAME)
    return model


@torch.no_grad()
def val_loss(model, batches) -> float:
    model.eval()
    out = sum(_loss(model, x, y) for x, y in batches)
    model.train()
    return out / len(batches)


def _loss(model, x, y) -> float:
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).item()


def run_one(arm: str, seed: int, data, vocab: int, a: argparse.Namespace) -> dict:
    model = build(arm, vocab, seed, a)
    gen = torch.Generator().manual_seed(seed)
    vgen = torch.Generator().manual_seed(a.val_seed)
    vbatches = [batch(data["val"], a.block_size, a.batch_size, vgen) for _ in range(a.eval_batches)]
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.99), weight_decay=0.1)
    curve, t0, c0 = [], time.perf_counter(), time.process_time()
    for step in range(a.steps + 1):
        if step % a.log_every == 0 or step == a.steps:
            curve.append({"step": step, "val": val_loss(model, vbatches), "time_s": time.perf_counter() - t0})
            if not a.quiet:
                print(f"  {arm:10s} seed {seed} step {step:4d} val {curve[-1]['val']:.4f} "
                      f"{curve[-1]['time_s']:.0f} s", flush=True)
        if step == a.steps:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        x, y = batch(data["train"], a.block_size, a.batch_size, gen)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    fgen = torch.Generator().manual_seed(a.val_seed + 1)
    final = val_loss(model, [batch(data["val"], a.block_size, a.batch_size, fgen) for _ in range(a.final_batches)])
    return {"arm": arm, "seed": seed, "curve": curve, "final_val_loss": final,
            "wall_time_s": time.perf_counter() - t0, "cpu_time_s": time.process_time() - c0,
            "parameters": sum(p.numel() for p in model.parameters()),
            "load_avg_1min_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def summarise(runs: list[dict]) -> dict:
    by = {}
    for r in runs:
        by.setdefault(r["arm"], {})[r["seed"]] = r["final_val_loss"]
    out = {}
    base = by.get("sdpa", {})
    for arm, vals in by.items():
        v = list(vals.values())
        m = statistics.fmean(v)
        entry = {"seeds": sorted(vals), "mean": m, "min": min(v), "max": max(v)}
        paired = [vals[s] - base[s] for s in vals if s in base]
        if arm != "sdpa" and paired:
            bm = statistics.fmean(base[s] for s in vals if s in base)
            entry.update(pct_vs_sdpa=100 * (m / bm - 1), paired_diffs=paired,
                         paired_mean=statistics.fmean(paired),
                         paired_sd=statistics.stdev(paired) if len(paired) > 1 else None)
        out[arm] = entry
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", nargs="+", default=["sdpa", "riemannian"], choices=list(ARMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[10, 11, 12])
    add_setting_args(p, log_every=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke-chars", type=int, default=None, help="cut each split to this many characters (tests)")
    p.add_argument("--out", required=True)
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    check_writable(a.out, "--out")
    torch.set_num_threads(a.threads)
    data, vocab, meta = load_text(a.block_size, a.smoke_chars)
    cmd = "python experiments/hf_parity.py " + " ".join(sys.argv[1:] if argv is None else argv)
    import transformers
    record = {"experiment": "hf_parity", "model": "LlamaForCausalLM from LlamaConfig", "command": cmd,
              "settings": {k: v for k, v in vars(a).items() if k not in ("out", "quiet", "threads")},
              "data": meta, "machine": {"platform": platform.platform(), "torch": torch.__version__,
                                        "transformers": transformers.__version__, "python": sys.version.split()[0],
                                        "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                                        "nice": os.nice(0)}}
    runs, t0 = [], time.perf_counter()
    for seed in a.seeds:
        for arm in a.arms:
            runs.append(run_one(arm, seed, data, vocab, a))
            r = runs[-1]
            print(f"{arm:10s} seed {seed}: final val {r['final_val_loss']:.4f}  {r['wall_time_s']:.0f} s", flush=True)
            record.update(runs=runs, summary=summarise(runs), wall_s=time.perf_counter() - t0,
                          complete=False)
            atomic_write_text(a.out, json.dumps(record, separators=(",", ":")))
    record["complete"] = True
    atomic_write_text(a.out, json.dumps(record, separators=(",", ":")))
    return record


if __name__ == "__main__":
    main()
