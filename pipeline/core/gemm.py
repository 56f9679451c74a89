"""ggpo's reproducible fp32 matrix product on the CPU: gemm.c, built once per machine, called
through ctypes.

Contract (gemm.c's first comment): `mm(a, b)` for a [M, K], b [K, N] float32 CPU tensors
(any strides) returns c [M, N] with

    c[i, j] = fma(a[i, K-1], b[K-1, j], ... fma(a[i, 1], b[1, j], fma(a[i, 0], b[0, j], +0)))

one fused multiply-add after another, each rounded once: the same bits on every x86
processor with AVX2 and FMA, at any vector width (`GGPO_GEMM_WIDTH=256` holds it to AVX2's;
by default AVX-512 where the processor has it) and for any blocking. torch's own fp32 matmul
(MKL) gives such bits only on its slow SSE2 branch (pipeline/core/kernels.py).

`LinearFn` is F.linear with that product in forward and backward (dx = g W, dW = g^T x,
db = g summed over rows), `MatmulFn` a @ b; `mm_weight_t` is x W^T outside autograd, where a
weight is packed once per version of its values (the sampler's forwards multiply by it at every
step). Which products take this path is pipeline/core/kernels.py's decision (`kernels.linear`,
`kernels.matmul`); this module is the arithmetic alone.

The library: compiled by the C compiler ($CC, else cc) from gemm.c with -O2 -mavx2 -mfma
-ffp-contract=off into $GGPO_KERNEL_CACHE (default ~/.cache/ggpo/kernels), named by the
sha256 of the source and flags, written to a temporary name and renamed, so processes that
build at once never load half a file. Without a compiler or AVX2/FMA it is unavailable, and
the reproducible mode says so (kernels.state()).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("gemm.c")
FLAGS = ("-O2", "-mavx2", "-mfma", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")
WIDTH_ENV = "GGPO_GEMM_WIDTH"
CACHE_ENV = "GGPO_KERNEL_CACHE"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None
_tried = False
# id(weight) -> (a weak reference to it, (its version, its storage address), vector width,
# packed values); an entry goes when its weight does (weakref.finalize). Not a
# WeakKeyDictionary: that compares keys by ==, which a tensor answers elementwise. The version
# counter moves with every in-place write through the tensor itself, not with one through
# `weight.data` (a separate counter): writers of weights in place write through the parameter
# (engines/hf.py load_weights); `param.data = other` changes the address, which is checked too.
_packed: dict[int, tuple[weakref.ref, tuple[int, int], int, torch.Tensor]] = {}


def _cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ggpo" / "kernels"


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    return {"avx2", "fma"} <= set(flags.split(":", 1)[-1].split())


def _build(target: Path, compiler: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed on {SOURCE.name}: {done.stderr.strip().splitlines()[-1:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL:
    compiler = os.environ.get("CC", "cc")
    tag = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"libggpo_gemm-{tag}.so"
    if not target.exists():
        _build(target, compiler)
    lib = ctypes.CDLL(str(target))
    i, n, p = ctypes.c_int, ctypes.c_long, ctypes.c_void_p
    lib.ggpo_sgemm.argtypes = (i, i, i, p, n, n, p, n, n, p, n, i)
    lib.ggpo_sgemm_packed.argtypes = (i, i, i, p, n, n, p, p, n, i)
    lib.ggpo_pack.argtypes = (i, i, p, n, n, p, i)
    lib.ggpo_packed_size.argtypes = [ctypes.c_int] * 3
    lib.ggpo_packed_size.restype = ctypes.c_long
    lib.ggpo_sgemm_width.argtypes = [ctypes.c_int]
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded library, built on first use; None when it cannot be (see `unavailable`)."""
    global _lib, _error, _tried
    with _lock:
        if not _tried:
            _tried = True
            if not _cpu_has_avx2_fma():
                _error = "the processor has no AVX2 and FMA"
            else:
                try:
                    _lib = _load()
                except (OSError, subprocess.SubprocessError) as exc:
                    _error = (f"ggpo's matrix product could not be built ({exc}); install a C compiler "
                              f"(gcc), or set $CC")
    return _lib


def unavailable() -> str | None:
    """Why the product cannot run here, or None when it can."""
    library()
    return _error


def width() -> int:
    """The vector width the product runs at here (256 or 512 bits; the bits are the same)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"pipeline/core/gemm.py: {_error}")
    return int(lib.ggpo_sgemm_width(int(os.environ.get(WIDTH_ENV, "512"))))


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"pipeline/core/gemm.py mm: expected a [M, K] and b [K, N], got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.dtype != torch.float32 or b.dtype != torch.float32 or a.device.type != "cpu" or b.device.type != "cpu":
        raise ValueError(f"pipeline/core/gemm.py mm: float32 CPU tensors only, got {a.dtype} on {a.device} and "
                         f"{b.dtype} on {b.device}")


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N] float32, by the module docstring's contract."""
    _check(a, b)
    lib = library()
    if lib is None:
        raise RuntimeError(f"pipeline/core/gemm.py: {_error}")
    (m, k), n = a.shape, b.shape[1]
    out = torch.empty((m, n), dtype=torch.float32)
    if m and n and lib.ggpo_sgemm(m, n, k, a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(), b.stride(0),
                                  b.stride(1), out.data_ptr(), n, width()) != 0:
        raise MemoryError(f"pipeline/core/gemm.py: no memory to pack a {k} x {n} operand")
    return out


def _packed_t(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """weight [N, K] as the packed B = weight^T (ggpo_pack), kept while its values stay (the
    tensor's version counter) and while it lives."""
    lib = library()
    assert lib is not None
    version = (weight._version, weight.data_ptr())
    hit = _packed.get(id(weight))
    if hit is not None and hit[0]() is weight and hit[1] == version and hit[2] == bits:
        return hit[3]
    n, k = weight.shape
    wt = weight.detach().t()
    buf = torch.empty(int(lib.ggpo_packed_size(n, k, bits)), dtype=torch.float32)
    lib.ggpo_pack(n, k, wt.data_ptr(), wt.stride(0), wt.stride(1), buf.data_ptr(), bits)
    if hit is None or hit[0]() is not weight:
        weakref.finalize(weight, _packed.pop, id(weight), None)
    _packed[id(weight)] = (weakref.ref(weight), version, bits, buf)
    return buf


def mm_weight_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T. Under inference mode (the samplers' forwards) the weight is
    packed once per version of its values and kept: the same bits as mm(x, weight.t()), since
    packing moves values and computes nothing."""
    if not torch.is_inference_mode_enabled():
        return mm(x, weight.t())
    _check(x, weight.t())
    lib = library()
    assert lib is not None
    (m, k), n = x.shape, weight.shape[0]
    bits = width()
    packed = _packed_t(weight, bits)
    out = torch.empty((m, n), dtype=torch.float32)
    if m and n and lib.ggpo_sgemm_packed(m, n, k, x.data_ptr(), x.stride(0), x.stride(1), packed.data_ptr(),
                                         out.data_ptr(), n, bits) != 0:
        raise MemoryError("pipeline/core/gemm.py: no memory for a packing buffer")
    return out


class LinearFn(torch.autograd.Function):
    """x [M, K], weight [N, K], bias [N] or None -> x weight^T + bias [M, N], by `mm` (forward
    and backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        y = mm(x, weight.t())
        if bias is not None:
            y.add_(bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        gx = mm(g, weight) if need_x else None
        gw = mm(g.t(), x) if need_w else None
        gb = g.sum(0) if need_b and ctx.has_bias else None
        return gx, gw, gb


class MatmulFn(torch.autograd.Function):
    """a [M, K], b [K, N] -> a b [M, N], by `mm` (forward and backward)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return mm(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad
        return (mm(g, b.t()) if need_a else None), (mm(a.t(), g) if need_b else None)
