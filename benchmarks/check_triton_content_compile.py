"""Compile the content connections' Triton kernels for a GPU target on a machine without a GPU.

Triton's pipeline down to PTX runs without a device, and the ``ptxas`` that
ships with triton assembles it, so this checks that the kernels of
``riemannian_ref.attention._triton_content`` compile for a GPU (the
interpreter tests in tests/test_triton_content.py run them in numpy, which
cannot) and prints each kernel's shared memory, registers and spills, which is
where the default block sizes of ``_triton_content.default_blocks`` come from.
It measures no speed. A few seconds per kernel on one CPU core.

    python benchmarks/check_triton_content_compile.py --arch 90 --d 64 --rk 2
"""
import argparse
import os
import subprocess
import tempfile
import warnings

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from riemannian_ref.attention import _triton_content as TC

INTS = ("n", "H", "d", "rk", "dv", "smq", "smb")


def compile_kernel(kern, consts: dict, arch: int, warps: int):
    signature = {}
    for a in kern.arg_names:
        if a in consts:
            signature[a] = "constexpr"
        elif a in ("scale", "wk"):
            signature[a] = "fp32"
        elif a in INTS:
            signature[a] = "i32"
        else:
            signature[a] = "*i32" if a == "MIDS" else "*fp32"
    return triton.compile(ASTSource(fn=kern, signature=signature, constexprs=dict(consts)),
                          target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps))


def ptxas_info(ptx: str, arch: int) -> str:
    """Registers and spills as ptxas -v reports them (the newest ptxas that ships with triton)."""
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        exe = os.path.join(bindir, name)
        if not os.path.exists(exe):
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        done = subprocess.run([exe, "-v", f"--gpu-name={gpu}", f.name, "-o", os.devnull], capture_output=True,
                              text=True)
        os.unlink(f.name)
        if done.returncode == 0:
            lines = [ln.split(":", 1)[-1].strip() for ln in done.stderr.splitlines()
                     if "registers" in ln or "spill" in ln]
            return "; ".join(lines)
    return "(no ptxas could assemble the PTX)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability times 10 (80: A100, 90: H100)")
    p.add_argument("--d", type=int, default=64, help="head dimension (and value dimension)")
    p.add_argument("--rk", type=int, default=2, help="rank of the key factors (0: none)")
    p.add_argument("--blocks", type=int, nargs=2, default=None, help="BLOCK_M BLOCK_N (default: the rule)")
    p.add_argument("--warps", type=int, default=4)
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    bm, bn = a.blocks or TC.default_blocks(a.d)
    print(f"sm_{a.arch}, d={a.d}, rk={a.rk}, blocks ({bm}, {bn}), {a.warps} warps")
    for label, flags in (("metric scores, transported values, causal, mask",
                          dict(CAUSAL=True, SOURCE=False, DOT=False, TV=True, HAS_UK=a.rk > 0, HAS_MASK=True)),
                         ("dot scores, plain values (tl.dot), source rule",
                          dict(CAUSAL=False, SOURCE=True, DOT=True, TV=False, HAS_UK=False, HAS_MASK=False))):
        consts = dict(flags, RK=TC._pow2(a.rk, 2), HP=TC._pow2(a.d // 2, 2), BDV=TC._pow2(a.d, 16), BM=bm, BN=bn)
        print(f"  {label}")
        for name, kern in (("forward", TC._content_fwd_kernel), ("dq", TC._content_bwd_q_kernel),
                           ("dk/dU/dv", TC._content_bwd_k_kernel)):
            c = compile_kernel(kern, consts, a.arch, a.warps)
            print(f"    {name:9s} shared {c.metadata.shared / 1024:.0f} KiB; {ptxas_info(c.asm['ptx'], a.arch)}",
                  flush=True)


if __name__ == "__main__":
    main()
