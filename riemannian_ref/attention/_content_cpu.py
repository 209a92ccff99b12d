r"""Attention along a content connection in O(n d) memory on CPU (private).

The content connections turn every (query, key) pair by its own angles
:math:`\phi_{ij} = (p_i - p_j)\,\omega_{ij}`, so unlike the flat connection the
transport cannot be moved into one common frame. The dense path
(:func:`riemannian_ref.attention.connections._content_attention`, the readable
reference and the tests' oracle) materialises the rotated queries of every
pair, ``[..., n, n, d]`` tensors. This operator computes the same function a
query row at a time in a small C kernel (``_content_kernel.c``): the row's
angles, their cosines and sines, the rank products and the softmax live in
``O(n (d + r))`` scratch per thread, and the backward recomputes them from the
inputs (the row maximum and sum again), as FlashAttention recomputes its tiles
:cite:`dao2022flashattention`. Nothing pairwise is stored, in either pass.

The kernel is plain C (no Python or torch headers): it is compiled on first
use with the system C compiler (``cc``, or ``$CC``) into a per-user cache
(``$RR_CACHE_DIR``, default ``~/.cache/riemannian_ref``), keyed by the source,
the compiler and the CPU, and loaded with :mod:`ctypes`, which releases the
GIL, so the package's thread pool runs batch chunks in parallel. It is built
without fast-math or FP contraction and sums in fixed lanes, so its results do
not depend on the CPU's vector width. Where no compiler works (or
``RR_DISABLE_CKERNEL=1``) :func:`available` is False and the dense path runs.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

__all__: list[str] = []

_SRC = Path(__file__).with_name("_content_kernel.c")
_LIBS: dict[torch.dtype, ctypes.CDLL | None] = {}
_LOCK = threading.Lock()
_ERROR: list[str] = []  # why the kernel is unavailable (for error messages and the tests)

CAUSAL, SOURCE, DOT, TV = 1, 2, 4, 8
LANES = 8  # the kernel's vector width in numbers (LANES in _content_kernel.c)


def _disabled() -> bool:
    return os.environ.get("RR_DISABLE_CKERNEL", "").strip().lower() in ("1", "true", "yes", "on")


def _cpu_id() -> str:
    """What the compiled code depends on besides the source: the machine and its CPU flags (-march=native)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{platform.system()}|{flags}"


def _cache_dir() -> Path:
    root = os.environ.get("RR_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "riemannian_ref"


def _compile(dtype: torch.dtype, native: bool = True) -> ctypes.CDLL | None:
    """Build (or find in the cache) and load the kernel; ``native=False`` targets the baseline ISA (tests)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        _ERROR.append("no C compiler (cc, gcc or clang) on PATH")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        _ERROR.append(f"{cc} --version failed: {exc}")
        return None
    real = "double" if dtype == torch.float64 else "float"
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-Wno-psabi", f"-DRR_REAL={real}"]
    if dtype == torch.float64:
        flags.append("-DRR_DOUBLE")
    if native and platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64"):
        flags.insert(1, "-march=native" if platform.machine().lower() in ("x86_64", "amd64") else "-mcpu=native")
    key = hashlib.sha256("\0".join([_SRC.read_text(), version, " ".join(flags), _cpu_id(), sys.platform])
                         .encode()).hexdigest()[:20]
    suffix = ".dll" if os.name == "nt" else ".so"
    target = _cache_dir() / f"content_{real}_{key}{suffix}"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            # build beside the target and rename: a concurrent process never loads half a library
            fd, tmp = tempfile.mkstemp(suffix=suffix, dir=target.parent)
            os.close(fd)
            done = subprocess.run([cc, *flags, str(_SRC), "-o", tmp, "-lm"], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode != 0:
                os.unlink(tmp)
                _ERROR.append(f"compiling {_SRC.name} with {cc} failed: {done.stderr.strip()[-400:]}")
                return None
            os.replace(tmp, target)
        except (OSError, subprocess.SubprocessError) as exc:
            _ERROR.append(f"could not build the content kernel in {target.parent}: {exc}")
            return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        _ERROR.append(f"could not load {target}: {exc}")
        return None
    i64, ptr, dbl, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double, ctypes.c_int
    common = [i64] * 8 + [ptr] * 13 + [ptr, i64, dbl, dbl, dbl, cint]
    lib.rr_content_forward.argtypes = common + [ptr, ptr]
    lib.rr_content_backward.argtypes = common + [ptr] * 3 + [ptr] * 11
    lib.rr_content_forward.restype = lib.rr_content_backward.restype = cint
    return lib


def library(dtype: torch.dtype) -> ctypes.CDLL | None:
    """The compiled kernel for float32 or float64, built on first use; None where it cannot be."""
    if _disabled() or dtype not in (torch.float32, torch.float64):
        return None
    with _LOCK:
        if dtype not in _LIBS:
            _LIBS[dtype] = _compile(dtype)
        return _LIBS[dtype]


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the fused CPU kernel runs for this dtype (compiling it now if needed)."""
    return library(dtype) is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True or was not asked yet)."""
    if _disabled():
        return "RR_DISABLE_CKERNEL is set"
    return _ERROR[-1] if _ERROR else None


def _p(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _run(fn, B: int, work: int) -> None:
    """``fn(b0, b1)`` over the batch: in chunks on the package's thread pool when there are threads to use."""
    from ._blockwise import _pool

    threads = torch.get_num_threads()
    workers = min(threads, B)
    if workers <= 1 or work < 2 ** 16:
        if fn(0, B) != 0:
            raise MemoryError("riemannian_ref content kernel: out of memory for its row buffers")
        return
    bounds = [round(B * w / workers) for w in range(workers + 1)]
    futures = [_pool(workers).submit(fn, b0, b1) for b0, b1 in zip(bounds[:-1], bounds[1:]) if b1 > b0]
    if any(f.result() != 0 for f in futures):
        raise MemoryError("riemannian_ref content kernel: out of memory for its row buffers")


class ContentAttentionFn(torch.autograd.Function):
    """The fused row kernel with its backward; inputs flat over the batch, contiguous, one dtype.

    The keys are zero-padded to ``np``, a multiple of 8, and the key-side
    arrays are block-major (``_blocks``). q [B, n, d]; KW [B, np/8, 1+rk, d/2,
    2, 8] (``[k_j | U_kj]``); Uq [B, n, rq, d] or None; VT [B, np/8, d/2, 2, 8]
    (transported values) or [B, np/8, dv, 8]; rates [B, n, d/2]; pos [B, np];
    lam [B]; qq [B, n], kk [B, np]
    (:math:`|q_i|^2`, :math:`|k_j|^2`); cK [B, rk, np] (:math:`U_{kj}^\\top k_j`);
    eQ [B, n, rq] (:math:`U_{qi}^\\top q_i`); mask [Bm, 1|n, n] additive (or
    None) with ``mask_id`` [B] its row per batch element. ``flags``: CAUSAL |
    SOURCE | DOT | TV. The caller builds KW, cK, ... from q, k, U with autograd,
    so their gradients reach the user's tensors through torch.
    """

    @staticmethod
    def forward(ctx, q, KW, Uq, VT, rates, pos, lam, qq, kk, cK, eQ, mask, mask_id, scale, wk, wq, flags):
        B, n, d = q.shape
        H, rk, np_ = d // 2, KW.shape[2] - 1, KW.shape[1] * LANES
        rq = Uq.shape[2] if Uq is not None else 0
        dv = d if flags & TV else VT.shape[2]
        lib = library(q.dtype)
        ratesT = _blocks(_pad(rates.transpose(1, 2), np_))  # [B, np/8, H, 8]
        out = q.new_empty(B, n, dv)
        seen = q.new_empty(B, n)
        mrows = mask.shape[1] if mask is not None else 0
        ptrs = (_p(q), _p(KW), _p(Uq), _p(VT), _p(rates), _p(ratesT), _p(pos), _p(lam), _p(qq), _p(kk), _p(cK),
                _p(eQ), _p(mask), _p(mask_id), mrows, scale, wk, wq, flags)

        def fwd(b0, b1):
            return lib.rr_content_forward(b0, b1, n, np_, H, rk, rq, dv, *ptrs, _p(out), _p(seen))

        _run(fwd, B, n * n * H)
        ctx.save_for_backward(q, KW, Uq, VT, rates, ratesT, pos, lam, qq, kk, cK, eQ, mask, mask_id, out, seen)
        ctx.consts = (scale, wk, wq, flags)
        return out

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "connection_attention: the fused content-connection kernel has no double backward "
                "(create_graph=True); set RR_DISABLE_CKERNEL=1 to run the dense path, which has one")
        q, KW, Uq, VT, rates, ratesT, pos, lam, qq, kk, cK, eQ, mask, mask_id, out, seen = ctx.saved_tensors
        scale, wk, wq, flags = ctx.consts
        B, n, d = q.shape
        H, rk, np_ = d // 2, KW.shape[2] - 1, KW.shape[1] * LANES
        rq = Uq.shape[2] if Uq is not None else 0
        dv = out.shape[-1]
        lib = library(q.dtype)
        dout = dout.contiguous()
        z = torch.zeros_like
        dq, dKW, dVT, drates, dratesT = z(q), z(KW), z(VT), z(rates), z(ratesT)
        dUq = z(Uq) if Uq is not None else None
        dlam, dqq, dkk, dcK, deQ = z(lam), z(qq), z(kk), z(cK), z(eQ)
        mrows = mask.shape[1] if mask is not None else 0
        ptrs = (_p(q), _p(KW), _p(Uq), _p(VT), _p(rates), _p(ratesT), _p(pos), _p(lam), _p(qq), _p(kk), _p(cK),
                _p(eQ), _p(mask), _p(mask_id), mrows, scale, wk, wq, flags, _p(out), _p(seen), _p(dout),
                _p(dq), _p(dKW), _p(dUq), _p(dVT), _p(drates), _p(dratesT), _p(dlam), _p(dqq), _p(dkk), _p(dcK),
                _p(deQ))

        def bwd(b0, b1):
            return lib.rr_content_backward(b0, b1, n, np_, H, rk, rq, dv, *ptrs)

        _run(bwd, B, n * n * H)
        drates = drates + dratesT.permute(0, 1, 3, 2).reshape(B, np_, H)[:, :n]  # the key's rate, per token
        return (dq, dKW, dUq, dVT, drates, None, dlam, dqq, dkk, dcK, deQ, None, None, None, None, None, None)


def _blocks(x: Tensor) -> Tensor:
    """[B, C, np] -> [B, np/8, C, 8]: block-major, what one block of 8 keys needs is contiguous."""
    B, C, np_ = x.shape
    return x.view(B, C, np_ // LANES, LANES).permute(0, 2, 1, 3).contiguous()


def _pad(x: Tensor, np_: int) -> Tensor:
    """Zeros appended to the last (key) axis up to ``np_`` (a multiple of the kernel's 8 lanes)."""
    extra = np_ - x.shape[-1]
    return x if extra == 0 else torch.nn.functional.pad(x, (0, extra))


def flatten_batch(q: Tensor, k: Tensor, v: Tensor, rates: Tensor, p: Tensor, lam, factors):
    """The broadcast batch of a content-connection call, its size, a function that flattens a tensor to
    ``[B, *tail]`` (``flat(x, tail)``) and ``lam`` as a tensor; ``factors`` are ``(U, x)`` pairs (a factor
    and the queries or keys it goes with: per token when it has one more dimension)."""
    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2], rates.shape[:-2], p.shape[:-1]]
    for U, x in factors:
        if U is not None:
            shapes.append(U.shape[:-3] if U.dim() == x.dim() + 1 else U.shape[:-2])
    lam_t = lam if isinstance(lam, Tensor) else torch.tensor(float(lam), dtype=q.dtype, device=q.device)
    batch = torch.broadcast_shapes(*shapes, lam_t.shape)
    B = math.prod(batch)

    def flat(x: Tensor, tail: int) -> Tensor:
        t = x.shape[x.dim() - tail:]
        return x.expand(*batch, *t).reshape(B, *t)

    return batch, B, flat, lam_t


def content_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float,
                      U_q: Tensor | None, U_k: Tensor | None, lam: Tensor, metric_side: str, scores: str,
                      rates: Tensor, p: Tensor, transport_values: bool, rule: str) -> Tensor:
    """A validated content-connection call on the fused kernel (float32 or float64, CPU).

    ``U_q``, ``U_k`` per token [..., n, d, r] or shared [..., d, r] (expanded
    here, O(n d r)); ``mask`` None, boolean, or additive float without grad,
    broadcastable to [..., n, n]; ``p`` the positions [n] or [..., n].
    """
    n, d = q.shape[-2], q.shape[-1]
    H = d // 2
    per_q = U_q is not None and U_q.dim() == q.dim() + 1
    per_k = U_k is not None and U_k.dim() == k.dim() + 1
    batch, B, flat, lam_t = flatten_batch(q, k, v, rates, p, lam, ((U_q, q), (U_k, k)))

    def tokens(U: Tensor, per: bool) -> Tensor:  # [B, n, d, r]
        if not per:
            U = U.unsqueeze(-3).expand(*U.shape[:-2], n, *U.shape[-2:])
        return flat(U, 3)

    dot = scores == "dot"
    side = metric_side
    w = 0.5 if side == "mean" else 1.0
    qf, kf = flat(q, 2).contiguous(), flat(k, 2)
    Uk = tokens(U_k, per_k) if (U_k is not None and not dot and side in ("key", "mean")) else None
    Uq = tokens(U_q, per_q) if (U_q is not None and not dot and side in ("query", "mean")) else None
    rk = Uk.shape[-1] if Uk is not None else 0
    rq = Uq.shape[-1] if Uq is not None else 0
    np_ = -(-n // LANES) * LANES  # keys padded with zeros to the kernel's 8 lanes
    W = kf.unsqueeze(-1) if not rk else torch.cat((kf.unsqueeze(-1), Uk), -1)  # [B, n, d, 1+rk]
    KW = _blocks(_pad(W.permute(0, 3, 2, 1).reshape(B, (1 + rk) * d, n), np_))  # [B, np/8, (1+rk) d, 8]
    KW = KW.view(B, np_ // LANES, 1 + rk, H, 2, LANES)
    vf = flat(v, 2)
    VT = _blocks(_pad(vf.transpose(1, 2), np_))  # [B, np/8, d, 8] = [B, np/8, H, 2, 8], or [B, np/8, dv, 8]
    rf = flat(rates, 2).contiguous()
    pf = _pad(p.expand(*batch, n).reshape(B, n).to(q.dtype), np_).contiguous()
    lamf = lam_t.expand(batch).reshape(B).contiguous()
    qq = (qf * qf).sum(-1)
    kk = _pad((kf * kf).sum(-1), np_).contiguous()
    cK = _pad(torch.einsum("bjdt,bjd->btj", Uk, kf), np_).contiguous() if rk else q.new_zeros(B, 0, np_)
    eQ = torch.einsum("bidt,bid->bit", Uq, qf).contiguous() if rq else q.new_zeros(B, n, 0)
    UqT = Uq.transpose(-1, -2).contiguous() if rq else None  # [B, n, rq, d]
    mflat, mid = None, None
    if mask is not None:
        m = mask
        if m.dtype == torch.bool:
            m = torch.zeros((), dtype=q.dtype).masked_fill(~m, float("-inf")) if m.dim() == 0 else \
                torch.zeros(m.shape, dtype=q.dtype).masked_fill_(~m, float("-inf"))
        else:
            from .functional import _relative_mask
            m = _relative_mask(m.to(q.dtype), is_causal, n, n)
        while m.dim() < 2:
            m = m.unsqueeze(0)
        mb = m.shape[:-2]
        m = m.expand(*mb, m.shape[-2], n)
        mflat = m.reshape(-1, m.shape[-2], n).contiguous()
        ids = torch.arange(mflat.shape[0]).view(mb) if mb else torch.zeros((), dtype=torch.long)
        mid = ids.expand(batch).reshape(B).contiguous()
    flags = (CAUSAL if is_causal else 0) | (SOURCE if rule == "source" else 0) | (DOT if dot else 0) | \
        (TV if transport_values else 0)
    out = ContentAttentionFn.apply(qf, KW, UqT, VT, rf, pf, lamf, qq, kk, cK, eQ, mflat, mid, float(scale),
                                   w, w, flags)
    return out.view(*batch, n, out.shape[-1])
