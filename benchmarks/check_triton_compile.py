"""Compile the Triton kernels of riemannian_attention for a GPU target on a machine without a GPU.

Triton's whole pipeline down to the cubin (ptxas ships with triton) runs
without a device, so this checks that the kernels compile for a GPU (the
interpreter tests in tests/test_triton.py cannot: they run the kernels in
numpy) and prints the shared memory of each kernel, which is where the
default block sizes of ``riemannian_ref.attention._triton.default_blocks``
come from, and the matrix (tensor-core) instructions of each kernel's PTX:
float16/bfloat16 inputs multiply on f16/bf16 operands, float32 inputs
without them (no TF32). It measures no speed. About 10 s per kernel on one CPU core.

    python benchmarks/check_triton_compile.py --arch 90 --d 64 --rk 2
"""
import argparse
import collections
import re
import warnings

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from riemannian_ref.attention import _triton as T


def compile_kernel(kern, ptrs: dict, consts: dict, arch: int):
    signature = {a: "constexpr" if a in consts else ptrs.get(a, "fp32" if a in ("scale", "w") else "i32")
                 for a in kern.arg_names}
    return triton.compile(ASTSource(fn=kern, signature=signature, constexprs=dict(consts)),
                          target=GPUTarget("cuda", arch, 32))


def tensor_core_ops(ptx: str) -> str:
    """The matrix instructions in a kernel's PTX, by operand type: ``mma.sync`` (sm_80) and ``wgmma`` (sm_90)."""
    found = collections.Counter()
    types = r"(?:f16|bf16|tf32|f32|f64)"
    for m in re.finditer(rf"\b(mma\.sync|wgmma\.mma_async)\.[\w.]*?\.{types}\.({types})\b", ptx):  # D, A types
        found[f"{m.group(1)} {m.group(2)}"] += 1
    return "matrix instructions: " + (", ".join(f"{k} x{v}" for k, v in sorted(found.items())) or "none")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability times 10 (80: A100, 90: H100)")
    p.add_argument("--d", type=int, default=64, help="head dimension (and value dimension)")
    p.add_argument("--rk", type=int, default=2, help="rank of the key factors (0: none)")
    p.add_argument("--rq", type=int, default=0, help="rank of the query factors (0: none)")
    p.add_argument("--dtype", default="bf16", choices=["fp16", "bf16", "fp32"])
    p.add_argument("--mask", type=int, default=1, choices=[0, 1, 2], help="0 none, 1 boolean, 2 float")
    p.add_argument("--blocks", type=int, nargs=2, default=None, help="BLOCK_M BLOCK_N (default: the rule)")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    bm, bn = a.blocks or T.default_blocks(a.d, a.d, a.rk, a.rq)
    r = lambda n: triton.next_power_of_2(max(n, 1))  # noqa: E731
    bd = max(16, triton.next_power_of_2(a.d))
    consts = dict(CAUSAL=True, MASK_KIND=a.mask, HAS_UK=a.rk > 0, HAS_UQ=a.rq > 0, RK=r(a.rk), RQ=r(a.rq),
                  BM=bm, BN=bn, BD=bd, BDV=bd, LOWP=a.dtype != "fp32", EMU=False)
    t = f"*{a.dtype}"
    fwd = dict(Q=t, K=t, V=t, LAM=t, UK=t, UQ=t, MASK="*i8" if a.mask == 1 else t, MIDS="*i32", OUT=t,
               LSE="*fp32")
    bwd = dict(fwd, DO=t, DR="*fp32", DK=t, DV=t, DUK=t, DLAM="*fp32", DQ=t, DUQ=t)
    print(f"sm_{a.arch}, d={a.d}, rk={a.rk}, rq={a.rq}, {a.dtype}, mask kind {a.mask}, blocks ({bm}, {bn})")
    for name, kern, ptrs in (("forward", T._fwd_kernel, fwd), ("dK/dV/dU_k", T._bwd_dkdv_kernel, bwd),
                             ("dQ/dU_q", T._bwd_dq_kernel, bwd)):
        c = compile_kernel(kern, ptrs, consts, a.arch)
        print(f"  {name:11s} compiled, shared memory {c.metadata.shared / 1024:.0f} KiB, "
              f"{tensor_core_ops(c.asm['ptx'])}", flush=True)


if __name__ == "__main__":
    main()
