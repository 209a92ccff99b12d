#!/usr/bin/env python3
r"""The Triton kernels' round-off per input dtype, against the float64 dense reference, in Triton's interpreter.

    python benchmarks/check_triton_precision.py [--quick]

Runs ``riemannian_attention`` on the Triton kernels (forced onto CPU tensors
in Triton's interpreter, ``TRITON_INTERPRET=1``; no GPU needed) for float16,
bfloat16 and float32 inputs over a few shapes, ranks, metric sides, masks,
causal and grouped-query cases, and compares the output and every gradient
with :func:`riemannian_ref.attention.riemannian_attention_reference` in
float64 on the same inputs (the inputs are drawn in float64 and rounded to
the dtype first, so the reference sees exactly what the kernels see: what is
measured is the kernels' own round-off). Each entry's error is compared with
the first-order bound of :func:`bounds` and the table reports, per dtype and
tensor, the largest error relative to the tensor's largest entry and the
largest ratio error / bound over the cases. Writes
``results/triton_precision.md`` (``--quick``: three cases, printed only
unless ``--out`` is given). About 10 s per case and dtype on one CPU core
(the interpreter runs every program in numpy).

The interpreter computes what a GPU computes, to the order of the
float32 accumulation: float16 products run ``tl.dot`` on float16 operands
(numpy multiplies them exactly in float32), bfloat16 ones on the float32
values of the bfloat16 operands (the interpreter has no bfloat16 product;
the kernels round to bfloat16 to nearest even themselves there), and the
tensor cores also form each product exactly and accumulate in float32; the
order of the float32 sums differs.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import riemannian_ref as rr  # noqa: E402
from riemannian_ref._io import atomic_write_text  # noqa: E402
from riemannian_ref.attention import functional  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
U32 = 2.0 ** -24  # float32's unit roundoff
TENSORS = ("out", "q", "k", "v", "lam", "U_q", "U_k")


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next number: 2**-11 (float16), 2**-8 (bfloat16), 2**-24 (float32)."""
    return torch.finfo(dtype).eps / 2


@dataclass(frozen=True)
class Case:
    name: str
    side: str = "key"
    B: int = 2
    h: int = 2  # query heads
    h_kv: int = 2  # key heads (h // h_kv query heads per key head: grouped-query attention)
    n: int = 33
    d: int = 16
    r: int = 2
    mask: str = "none"  # none, padding (bool, per sequence), float (additive, no grad)
    causal: bool = False
    offset: float = 0.0  # queries and keys moved by one common vector of this size per coordinate


CASES = [
    Case("key, causal", "key", causal=True),
    Case("key, padding, offset 4", "key", n=48, d=32, r=1, mask="padding", offset=4.0),
    Case("query, causal", "query", r=2, causal=True),
    Case("mean, float mask, causal, offset 4", "mean", n=40, mask="float", causal=True, offset=4.0),
    Case("key, GQA 4/2, padding, causal", "key", h=4, h_kv=2, mask="padding", causal=True),
    Case("mean, n 64, d 32", "mean", B=1, n=64, d=32, r=1),
]
QUICK = [  # smaller versions of three of them, for the tests
    Case("key, padding, offset 4", "key", d=32, r=1, mask="padding", offset=4.0),
    Case("mean, float mask, causal, offset 4", "mean", B=1, mask="float", causal=True, offset=4.0),
    Case("key, GQA 4/2, padding, causal", "key", B=1, h=4, h_kv=2, mask="padding", causal=True),
]


def make_inputs(case: Case, dtype: torch.dtype, seed: int = 0) -> dict:
    """Inputs drawn in float64 and rounded to ``dtype`` (as ``dtype`` tensors), a mask and an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    B, h, hk, n, d, r = case.B, case.h, case.h_kv, case.n, case.d, case.r
    f64 = dict(generator=g, dtype=torch.float64)
    shift = case.offset * torch.randn(d, **f64)
    ins = dict(q=torch.randn(B, h, n, d, **f64) + shift, k=torch.randn(B, hk, n, d, **f64) + shift,
               v=torch.randn(B, hk, n, d, **f64), lam=torch.rand(hk, **f64) + 0.5,
               U_q=0.5 * torch.randn(B, h, n, d, r, **f64) if case.side in ("query", "mean") else None,
               U_k=0.5 * torch.randn(B, hk, n, d, r, **f64) if case.side in ("key", "mean") else None)
    ins = {name: t.to(dtype) if t is not None else None for name, t in ins.items()}
    mask = None
    if case.mask == "padding":  # [B, 1, 1, n]: the last keys of each sequence padded (key 0 stays)
        mask = torch.ones(B, 1, 1, n, dtype=torch.bool)
        for b in range(B):
            mask[b, ..., int(torch.randint(1, n, (1,), generator=g)):] = False
    elif case.mask == "float":
        mask = torch.randn(B, 1, n, n, **f64).to(dtype)
    grad = torch.randn(B, h, n, d, **f64).to(dtype)
    return dict(ins=ins, mask=mask, grad=grad)


def _call(fn, ins: dict, mask, grad, case: Case, **kw):
    leaves = {name: t.detach().clone().requires_grad_() for name, t in ins.items() if t is not None}
    out = fn(leaves["q"], leaves["k"], leaves["v"], mask, is_causal=case.causal, lam=leaves["lam"],
             U_q=leaves.get("U_q"), U_k=leaves.get("U_k"), metric_side=case.side, **kw)
    grads = torch.autograd.grad(out, list(leaves.values()), grad)
    return dict(out=out.detach(), **dict(zip(leaves, grads)))


def triton_results(case: Case, data: dict) -> dict:
    """Output and gradients of the Triton kernels (blocks of 16: several tiles, partial ones)."""
    with functional._force_backend("triton"):
        return _call(rr.riemannian_attention, data["ins"], data["mask"], data["grad"], case,
                     enable_gqa=case.h != case.h_kv, block_sizes=(16, 16))


def _repeat_heads(ins: dict, g: int) -> dict:
    """Key-side tensors repeated to one per query head (the reference has no grouped-query attention)."""
    return {name: t.repeat_interleave(g, dim=0 if name == "lam" else 1) if name in ("k", "v", "lam", "U_k")
            and t is not None else t for name, t in ins.items()}


def reference_results(case: Case, data: dict) -> tuple[dict, dict]:
    """Float64 output and gradients of the dense reference, and what :func:`bounds` needs."""
    g = case.h // case.h_kv
    ins = {name: t.double() if t is not None else None for name, t in data["ins"].items()}
    mask = data["mask"].double() if data["mask"] is not None and data["mask"].is_floating_point() else data["mask"]
    res = _call(rr.riemannian_attention_reference, _repeat_heads(ins, g), mask, data["grad"].double(), case)
    for name in ("k", "v", "lam", "U_k"):  # sum the repeated heads' gradients back
        if name in res:
            t = res[name]
            res[name] = t.view(case.h_kv, g).sum(1) if name == "lam" else t.unflatten(1, (case.h_kv, g)).sum(2)
    rep = _repeat_heads(ins, g)
    _, P = rr.riemannian_attention_reference(rep["q"], rep["k"], rep["v"], mask, is_causal=case.causal,
                                             lam=rep["lam"], U_q=rep["U_q"], U_k=rep["U_k"],
                                             metric_side=case.side, return_weights=True)
    return res, dict(ins=rep, P=P, G=data["grad"].double(), O=res["out"], mask=mask)


def bounds(case: Case, dtype: torch.dtype, aux: dict) -> dict:
    r"""First-order bounds on every entry's error of the output and gradients (float64, the reference's shapes).

    To first order in the unit roundoffs: u is the dtype's (:func:`unit_roundoff`),
    u32 = 2**-24 float32's. A product of two numbers, one rounded with relative
    error u, is off by u times its absolute value, and a float32 sum of K terms
    by K u32 times the sum of their absolute values (Higham, *Accuracy and
    Stability of Numerical Algorithms*, 2nd ed., section 3.1). So every entry's
    error is at most the absolute values of the terms that make it, weighted
    by the roundings each went through:

    - half inputs round the probabilities P before ``P V`` and ``P^T dO``
      (relative error u), the score gradients dS before their products, and
      dS X, dS Y once more (2u). D = rowsum(dO O) uses the stored output,
      which carries u (sum_j P |v_j| + |O|): dS_ij moves by P_ij u W_i,
      W_i = sum_c |dO_ic| (sum_j P_ij |v_jc| + |O_ic|). So each gradient
      entry's error is at most u times sum_ij (|dS_ij| + P_ij W_i) c |J_ij|,
      where J_ij is the derivative of s_ij in the difference form
      (|q_i - k_j|, |X|, |Y|, |U|: the kernels use the same rounded dS on both
      sides of each expanded difference, and keep the row constant's term)
      and c counts the roundings (1 for the isotropic part, 2 for the rank
      parts; 2 for dlam, whose per-sequence values are rounded before autograd
      sums them over the batch). Float16 also rounds the smallest of them
      among its subnormals: eta = 2**-24 more per visible pair (absolute);
    - float32 arithmetic (every dtype): a score s_ij is a sum of about
      d + 8 rounded float32 terms (the products over d, the squares, scale,
      log2 e, exp2), in error at most sigma_i = (d + 8) u32 max_j S_ij with
      S_ij the sum of the absolute values of its terms; the softmax turns
      that into a relative error 2 sigma_i of P. The sums over keys, queries
      and d add K = n_k + g n_q + d + d_v roundings. Together, a relative
      level eps_i = 2 sigma_i + K u32 on the expanded terms (|q_i| + |k_j|,
      |q_i| . |k_j| + |k_j|^2/2 + |q_i|^2/2) of |dS_ij| + P_ij (|dO_i| . |v_j| + W'_i),
      W'_i = sum_c |dO_ic| sum_j P_ij |v_jc| + |dO_i| . |O_i|;

    plus, added by :func:`measure`, u |T| (and 2**-25 for a float16 subnormal)
    for storing the result. The key-side bounds sum over the g query heads of
    each key head, lam's over the batch and its heads.
    """
    u = unit_roundoff(dtype)
    half = dtype != torch.float32
    ins, P, G, O = aux["ins"], aux["P"], aux["G"], aux["O"]
    q, k, v, Uq, Uk = ins["q"], ins["k"], ins["v"], ins["U_q"], ins["U_k"]
    n_q, n_k, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    g = case.h // case.h_kv
    scale = 1.0 / math.sqrt(d)
    w = 0.5 if case.side == "mean" else 1.0
    lam = ins["lam"].view(1, -1, 1, 1)
    aq, ak, av, aG, aO = q.abs(), k.abs(), v.abs(), G.abs(), O.abs()
    Dl = q[..., :, None, :] - k[..., None, :, :]  # [B, h, n_q, n_k, d]
    aD = Dl.abs()
    dP = G @ v.transpose(-1, -2)
    dS = P * (dP - (G * O).sum(-1, keepdim=True))
    Pv = P @ av  # sum_j P_ij |v_j|
    W = (aG * (Pv + aO)).sum(-1)  # D's error per unit roundoff of the stored output
    # float16 rounds the smallest probabilities and score gradients to its subnormals: an absolute error up to
    # eta / 2 more per rounding, eta = 2**-24 its smallest step (bfloat16 has float32's exponent range)
    eta = 2.0 ** -24 / u if dtype == torch.float16 else 0.0  # in units of u, per visible pair
    seen = (P > 0).double()
    E = dS.abs() + P * W[..., None] + eta * seen
    # float32: the scores' absolute terms, sigma_i, and the relative level eps_i (over the keys row i sees)
    S = scale * lam * (aq @ ak.transpose(-1, -2) + 0.5 * (ak * ak).sum(-1)[..., None, :])
    zeros = torch.zeros(*Dl.shape[:-1], 1, dtype=torch.float64)
    X = torch.einsum("bhijd,bhjdt->bhijt", Dl, Uk) if Uk is not None else zeros
    Y = torch.einsum("bhijd,bhidt->bhijt", Dl, Uq) if Uq is not None else zeros
    aUk = Uk.abs() if Uk is not None else torch.zeros(*k.shape, 1, dtype=torch.float64)
    aUq = Uq.abs() if Uq is not None else torch.zeros(*q.shape, 1, dtype=torch.float64)
    Xa = torch.einsum("bhid,bhjdt->bhijt", aq, aUk) + torch.einsum("bhjd,bhjdt->bhjt", ak, aUk)[..., None, :, :]
    Ya = torch.einsum("bhid,bhidt->bhit", aq, aUq)[..., :, None, :] + torch.einsum("bhjd,bhidt->bhijt", ak, aUq)
    S = S + scale * w * ((X.abs() * Xa).sum(-1) + (Y.abs() * Ya).sum(-1))
    if aux["mask"] is not None and aux["mask"].is_floating_point():  # added relative to the row's largest entry
        S = S + aux["mask"].abs() + aux["mask"].abs().amax(-1, keepdim=True)
    sigma = (d + 8) * U32 * torch.where(P > 0, S, torch.zeros_like(S)).amax(-1)
    eps = (2 * sigma + (n_k + g * n_q + d + dv) * U32)[..., None]  # [B, h, n_q, 1]
    E32 = eps * (dS.abs() + P * (aG @ av.transpose(-1, -2) + ((aG * Pv).sum(-1) + (aG * aO).sum(-1))[..., None]))

    # the derivatives' absolute values: difference form (half rounding) and expanded form (float32)
    J = scale * (lam[..., None] * aD + 2 * w * torch.einsum("bhijt,bhjdt->bhijd", X.abs(), aUk)
                 + 2 * w * torch.einsum("bhijt,bhidt->bhijd", Y.abs(), aUq))
    J32 = scale * (lam[..., None] * (aq[..., :, None, :] + ak[..., None, :, :])
                   + w * torch.einsum("bhijt,bhjdt->bhijd", X.abs(), aUk)
                   + w * torch.einsum("bhijt,bhidt->bhijd", Y.abs(), aUq))
    Eh = E if half else torch.zeros_like(E)
    b = {}
    b["out"] = (u * (Pv + eta * seen @ av) if half else 0) + eps * Pv
    b["q"] = torch.einsum("bhij,bhijd->bhid", Eh, u * J) + torch.einsum("bhij,bhijd->bhid", E32, J32)
    b["k"] = torch.einsum("bhij,bhijd->bhjd", Eh, u * J) + torch.einsum("bhij,bhijd->bhjd", E32, J32)
    b["v"] = (u * (P + eta * seen).transpose(-1, -2) @ aG if half else 0) + (eps * P).transpose(-1, -2) @ aG
    dist2 = (Dl * Dl).sum(-1)
    expd = aq @ ak.transpose(-1, -2) + 0.5 * (ak * ak).sum(-1)[..., None, :] + 0.5 * (aq * aq).sum(-1)[..., None]
    b["lam"] = (scale * (u * Eh * dist2 + E32 * expd)).sum((-1, -2))
    if Uk is not None:
        b["U_k"] = scale * w * (torch.einsum("bhij,bhijt,bhijd->bhjdt", Eh, 2 * u * X.abs(), aD)
                                + torch.einsum("bhij,bhijt,bhijd->bhjdt", E32, X.abs(),
                                               aq[..., :, None, :] + ak[..., None, :, :]))
    if Uq is not None:
        b["U_q"] = scale * w * (torch.einsum("bhij,bhijt,bhijd->bhidt", Eh, 2 * u * Y.abs(), aD)
                                + torch.einsum("bhij,bhijt,bhijd->bhidt", E32, Y.abs(),
                                               aq[..., :, None, :] + ak[..., None, :, :]))
    for name in ("k", "v", "U_k"):  # the kernels sum the g query heads of each key head
        if name in b:
            b[name] = b[name].unflatten(1, (case.h_kv, g)).sum(2)
    b["lam"] = b["lam"].sum(0).view(case.h_kv, g).sum(1)
    return b


def measure(case: Case, dtype: torch.dtype, seed: int = 0, data: dict | None = None) -> dict:
    """Per tensor: the largest error, the largest reference entry, and the largest ratio error / bound.

    ``data``: inputs as :func:`make_inputs` returns them (default: drawn for the case)."""
    data = make_inputs(case, dtype, seed) if data is None else data
    tri = triton_results(case, data)
    ref, aux = reference_results(case, data)
    bnd = bounds(case, dtype, aux)
    u = unit_roundoff(dtype)
    tiny = 2.0 ** -25 if dtype == torch.float16 else 0.0  # a float16 result among its subnormals
    rows = {}
    for name, r in ref.items():
        t = tri[name]
        assert t.dtype == dtype and t.shape == r.shape, name
        err = (t.double() - r).abs()
        bound = bnd[name] + u * r.abs() + tiny  # + storing the result in the dtype
        ratio = torch.where(err == 0, 0.0, err / bound)  # an entry with bound 0 (a padded key) must be exact
        rows[name] = dict(err=err.max().item(), ref=r.abs().max().item(), ratio=ratio.max().item())
    return rows


def table(results: dict) -> str:
    """Markdown, per (dtype, offset) and tensor over the cases: the largest error / the largest |reference
    entry|, and the largest ratio error / bound of an entry."""
    head = "| dtype | u | offset | " + " | ".join(TENSORS) + " |"
    rule = "|:---|---:|---:|" + "---:|" * len(TENSORS)
    rel, ratio = [head, rule], [head, rule]
    def largest(rows, name, value, fmt):
        found = [value(r[name]) for r in rows if name in r]
        return format(max(found), fmt) if found else "-"

    for (key, offset), rows in results.items():
        u = f"| {key} | {unit_roundoff(DTYPES[key]):.1e} | {offset:g} | "
        rel.append(u + " | ".join(largest(rows, n, lambda v: v["err"] / v["ref"], ".1e") for n in TENSORS) + " |")
        ratio.append(u + " | ".join(largest(rows, n, lambda v: v["ratio"], ".2g") for n in TENSORS) + " |")
    return ("Largest error / largest reference entry:\n\n" + "\n".join(rel)
            + "\n\nLargest error / first-order bound (at most 1: asserted by the tests):\n\n" + "\n".join(ratio))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="three cases (the test's), printed only unless --out")
    p.add_argument("--out", type=Path, default=None, help="markdown file (default results/triton_precision.md)")
    a = p.parse_args()
    import triton

    torch.set_num_threads(1)
    cases = QUICK if a.quick else CASES
    out = a.out if a.out is not None or a.quick else ROOT / "results" / "triton_precision.md"
    results = {}  # (dtype, offset): the cases' rows
    for key, dtype in DTYPES.items():
        for case in sorted(cases, key=lambda c: c.offset):
            rows = measure(case, dtype)
            results.setdefault((key, case.offset), []).append(rows)
            print(f"{key} {case.name}: " + ", ".join(f"{n} {v['err'] / v['ref']:.1e} ({v['ratio']:.2f})"
                                                      for n, v in rows.items()), flush=True)
    text = table(results)
    print(text)
    if out is not None:
        cmd = "python benchmarks/check_triton_precision.py" + (" --quick" if a.quick else "")
        listing = "\n".join(f"- {c.name}: side {c.side}, B = {c.B}, heads {c.h}/{c.h_kv}, n = {c.n}, "
                            f"d = {c.d}, r = {c.r}" for c in cases)
        atomic_write_text(out, 
            "# Round-off of the Triton kernels per input dtype\n\n"
            f"Command: `{cmd}` (Triton's interpreter on CPU, torch {torch.__version__}, triton "
            f"{triton.__version__}; no GPU). Inputs drawn in "
            "float64 and rounded to the dtype; the reference is the dense float64 definition on those inputs, so "
            "the errors are the kernels' own. Each entry: the largest error of the tensor (output, or the gradient "
            "of the named input for a fixed random upstream gradient) over the cases, divided by the tensor's "
            "largest reference entry; u is the dtype's unit roundoff; offset: the cases whose queries and keys "
            "share a shift of that size per coordinate (|q|, |k| about 16-23 against |q - k| about 6-8), which "
            "changes no score but costs float32's expanded distance digits. The second table: the largest ratio of an "
            "entry's error to its first-order bound (`bounds` in the script), a worst case that sums absolute "
            "values (loose for lam's gradient, one sum over every pair of a head, and in float32). Blocks of "
            "16.\n\n"
            f"{text}\n\nCases:\n\n{listing}\n")


if __name__ == "__main__":
    main()
