"""A character-level nanoGPT with Riemannian attention: copy this file into your project.

The model is nanoGPT's (one config, one attention class, one block, one GPT); the
change for Riemannian attention is three lines in ``CausalSelfAttention``, marked
(1), (2), (3): a metric network (``rr.MetricNet``) computes each token's metric
G = lam I + U U^T from its state (by default with every eigenvalue in
[lam, 5 lam], so that the metric cannot sharpen attention without bound), and
``rr.riemannian_attention``, which takes ``scaled_dot_product_attention``'s
arguments, uses it. ``--attention sdpa`` runs the unchanged model, the
baseline. Every evaluation logs each layer's mean attention entropy and the
metric's largest eigenvalue, and warns when a layer's entropy falls below
``--entropy-floor`` (attention collapsing onto single keys). Only the public API of ``riemannian_ref`` is
used; the text is the docstrings of Python's standard library (no download), or
any text file (``--text``).

    python examples/nanogpt_riemannian.py                      # Riemannian attention
    python examples/nanogpt_riemannian.py --attention sdpa     # the baseline
    python examples/nanogpt_riemannian.py --steps 200 --out result.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import riemannian_ref as rr


@dataclass
class GPTConfig:
    block_size: int = 64         # context length
    vocab_size: int = 128        # characters (set from the text)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    attention: str = "riemannian"  # "riemannian" or "sdpa" (the unchanged nanoGPT)
    rank: int = 2                # rank r of each token's metric factor U
    strength: float = 1.0        # size of U at init (rr.MetricNet's default)
    metric_form: str | None = None  # "gains" or "factor" (G = lam I + U U^T); None: rr.MetricNet's default


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.metric = None
        if config.attention == "riemannian":  # (1) lam per head, U [d, r] per token
            form = {} if config.metric_form is None else {"form": config.metric_form}
            self.metric = rr.MetricNet(config.n_embd, config.n_head,
                                       config.n_embd // config.n_head, config.rank,
                                       strength=config.strength, **form)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        hs = C // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0  # q, k, v: (B, nh, T, hs)
        if self.metric is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            lam, U = self.metric(x)  # (2) (nh,), (B, nh, T, hs, r)
            y = rr.riemannian_attention(q, k, v, dropout_p=p, is_causal=True,
                                        U_k=U, lam=lam)  # (3)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(config.n_embd), nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd), nn.Dropout(config.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        for name, p in self.named_parameters():  # nanoGPT's init; the metric networks keep their own
            if "metric" in name:  # (its gain logits start at a negative bias: zeroing it would start them at half)
                continue
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0) -> torch.Tensor:
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            probs = F.softmax(logits[:, -1] / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1)], dim=1)
        return idx


@torch.no_grad()
def attention_diagnostics(model: GPT, idx: torch.Tensor) -> dict:
    """Per layer: the mean entropy of the attention rows (nats) and the metric's mean largest eigenvalue.

    Entropy collapse (a layer attending to one key, entropy near 0 against
    log(T) for uniform attention) is what an unbounded metric does to a
    language model: its size multiplies the temperature. The weights are
    recomputed densely from each layer's input (captured by a forward hook).
    """
    inputs = []
    hooks = [b.attn.register_forward_pre_hook(lambda m, a: inputs.append((m, a[0]))) for b in model.h]
    was = model.training
    model.eval()
    try:
        model(idx)
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    entropy, metric_eig = [], []
    for attn, x in inputs:
        B, T, C = x.shape
        q, k, v = attn.c_attn(x).split(attn.n_embd, dim=2)
        hs = C // attn.n_head
        q, k, v = (t.view(B, T, attn.n_head, hs).transpose(1, 2) for t in (q, k, v))
        if attn.metric is None:
            s = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
            w = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
            metric_eig.append(float("nan"))
        else:
            lam, U = attn.metric(x)
            _, w = rr.riemannian_attention_reference(q, k, v, is_causal=True, U_k=U, lam=lam,
                                                     return_weights=True)
            top = (torch.linalg.eigvalsh(U.mT @ U)[..., -1] if U.shape[-1]  # largest eigenvalue of U U^T
                   else U.new_zeros(U.shape[:-2]))                       # per token (rank 0: none)
            metric_eig.append((lam.view(-1, 1) + top).mean().item())
        entropy.append(-(w * w.clamp_min(1e-30).log()).sum(-1).mean().item())
    return {"attn_entropy": entropy, "metric_eig": metric_eig}


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    text = open(args.text, encoding="utf-8").read() if args.text else rr.data.stdlib_docstring_text()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n = int(0.9 * len(data))
    splits = {"train": data[:n], "val": data[n:]}
    config = GPTConfig(block_size=args.block_size, vocab_size=len(chars), n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, attention=args.attention, rank=args.rank,
                       strength=args.strength, metric_form=args.metric_form)
    model = GPT(config)
    gen = torch.Generator().manual_seed(args.seed)

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        d = splits[split]
        ix = torch.randint(len(d) - config.block_size - 1, (args.batch_size,), generator=gen)
        x = torch.stack([d[i:i + config.block_size] for i in ix])
        return x, torch.stack([d[i + 1:i + 1 + config.block_size] for i in ix])

    @torch.no_grad()
    def estimate_loss() -> dict:
        model.eval()
        out = {s: sum(model(*get_batch(s))[1].item() for _ in range(args.eval_iters)) / args.eval_iters
               for s in splits}
        model.train()
        return out

    metric = [p for name, p in model.named_parameters() if ".metric." in name]
    rest = [p for name, p in model.named_parameters() if ".metric." not in name]
    groups = [{"params": rest, "lr_scale": 1.0}]
    if metric:  # the metric networks may learn at a rate of their own
        groups.append({"params": metric, "lr_scale": args.metric_lr_scale})
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    # a fixed validation batch for the attention diagnostics (its own generator: training is unchanged)
    probe_gen = torch.Generator().manual_seed(1234)
    probe_ix = torch.randint(len(splits["val"]) - config.block_size - 1, (8,), generator=probe_gen)
    probe = torch.stack([splits["val"][i:i + config.block_size] for i in probe_ix])
    warned: set[int] = set()
    curve, t0, c0 = [], time.perf_counter(), time.process_time()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            losses = estimate_loss()
            diag = attention_diagnostics(model, probe)
            curve.append({"step": step, **losses, "time_s": time.perf_counter() - t0, **diag})
            for layer, e in enumerate(diag["attn_entropy"]):
                if args.entropy_floor is not None and e < args.entropy_floor and layer not in warned:
                    warned.add(layer)
                    warnings.warn(f"step {step}: layer {layer}'s attention entropy is {e:.3f} nats (uniform "
                                  f"attention: {math.log(config.block_size):.2f}): its attention has collapsed "
                                  "onto single keys; with a metric this is its size sharpening every row "
                                  "(--entropy-floor sets this threshold)", stacklevel=2)
            if not args.quiet:
                ents = " ".join(f"{e:.2f}" for e in diag["attn_entropy"])
                print(f"step {step:5d}  train {losses['train']:.4f}  val {losses['val']:.4f}  "
                      f"entropy [{ents}]  {curve[-1]['time_s']:.0f} s", flush=True)
        if step == args.steps:
            break
        lr = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr * group["lr_scale"]
        _, loss = model(*get_batch("train"))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    model.eval()
    sample = model.generate(torch.tensor([[stoi.get("T", 0)]]), 200, temperature=0.8)
    return {"config": asdict(config), "args": vars(args), "curve": curve, "val_loss": curve[-1]["val"],
            "train_loss": curve[-1]["train"], "wall_time_s": seconds, "cpu_time_s": cpu_seconds,
            "parameters": sum(p.numel() for p in model.parameters()),
            "sample": "".join(chars[i] for i in sample[0].tolist()),
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "torch": torch.__version__, "threads": torch.get_num_threads(),
                        "cpus": os.cpu_count(),
                        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--attention", choices=["riemannian", "sdpa"], default="riemannian")
    p.add_argument("--rank", type=int, default=2)
    p.add_argument("--strength", type=float, default=1.0, help="size of the metric factors at init")
    p.add_argument("--metric-form", choices=["gains", "factor"],
                   help="metric parameterisation (default: rr.MetricNet's, bounded gains); factor:\n"
                        "G = lam I + U U^T, unbounded (the form of the book's stored runs)")
    p.add_argument("--text", help="a text file (default: docstrings of Python's standard library)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--metric-lr-scale", type=float, default=1.0,
                   help="learning rate of the metric networks relative to --lr")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--entropy-floor", type=float, default=0.1,
                   help="warn when a layer's mean attention entropy (nats) falls below this")
    p.add_argument("--out", help="write the result (losses, wall time, machine) to this JSON file")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    result = train(args)
    print(f"{args.attention}: val loss {result['val_loss']:.4f} after {args.steps} steps, "
          f"{result['wall_time_s']:.0f} s ({result['parameters']:,} parameters)\n{result['sample']}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
