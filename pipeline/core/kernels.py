"""CPU kernels: reproducible on every x86 processor (the default), or the processor's own.

Why: torch picks its CPU kernels per processor (ATen's vector width, MKL's code branch,
oneDNN's instruction set), and each choice sums in another order; so the same config and
seed trained other bits, and so printed other tables, on each processor (three processors,
three base accuracies: docs/testbed.md, "Replication on another processor"). Run to run on one
machine nothing moved; between machines everything did.

`GGPO_KERNELS=reproducible` (the default) pins every kernel whose choice moved a bit, before
torch runs anything (`pin_environment`, called when the `pipeline` package is imported, so
the CLI, every worker, torchrun rank and Ray worker it starts, and the tests get it):

    ATEN_CPU_CAPABILITY=avx2   ATen's own kernels (elementwise, reductions, softmax, AdamW's
                               foreach ops, SDPA's CPU kernel) at AVX2 width, whatever the
                               processor has beyond it
    MKL_CBWR=COMPATIBLE        MKL (what torch's fp32 matmuls call) on its SSE2 branch in its
                               conditional-reproducibility mode: the one branch MKL documents as
                               giving the same results on Intel and AMD processors (its AVX2
                               branch is Intel's only: on an AMD processor MKL takes its own
                               path and other bits, measured under qemu's EPYC-Rome model)
    ONEDNN_MAX_CPU_ISA=AVX2    oneDNN (bf16 matmuls, should one run) held to AVX2
    MKL_DYNAMIC=FALSE, OMP_DYNAMIC=FALSE   thread counts never adjusted at run time (MKL's
                               reproducibility needs a fixed count; ggpo sets it per process)

and routes every fp32 Linear layer and LM-head product on the CPU through ggpo's own matrix
product (pipeline/core/gemm.c: each output one fixed sequence of fused multiply-adds, the same
bits on any processor with AVX2 and FMA, at AVX2 or AVX-512 speed), since MKL's reproducible
branch is a third as fast as its native one. What is left to MKL (attention's small products,
RoPE's angles) runs on its SSE2 branch. A processor without AVX2 and FMA, a non-x86 one, a
missing C compiler, or torch having run a kernel before the pins were set gets one warning
line saying its results are not comparable to the published digits, and runs on its own
kernels (`state().comparable` is then False, and the artifacts' keys say so).

`GGPO_KERNELS=native` leaves every kernel to the processor: faster where it has AVX-512 and
bfloat16 instructions, reproducible run to run on that machine only. The mode is part of every
stage's key on the CPU (`fingerprint`), so a store never mixes the two. GPU runs are untouched:
the pins only steer CPU libraries and ggpo's product serves CPU tensors only.
"""
from __future__ import annotations

import logging
import os
import platform
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ENV = "GGPO_KERNELS"
MODES = ("reproducible", "native")
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2",
          "MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"}
VERSION = 3         # bump when the reproducible numerics change: it enters every CPU key
                    # (3: training's gradients through training/shared_prompt.py)
MKL_COMPATIBLE = 3  # MKL_CBWR_COMPATIBLE, what mkl_cbwr_get(MKL_CBWR_BRANCH) reports when pinned

log = logging.getLogger("ggpo")
_overridden: dict[str, str] = {}    # a pinned variable the user had set to something else
_state: "KernelState | None" = None


def mode() -> str:
    """GGPO_KERNELS, lower-cased ('reproducible' when unset); anything else is a ValueError
    naming the variable (the CLI reports it as one line)."""
    value = os.environ.get(ENV, "reproducible").strip().lower() or "reproducible"
    if value not in MODES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(MODES)}")
    return value


def pin_environment() -> None:
    """In the reproducible mode, set PINNED in os.environ (children inherit it). Torch reads
    these when it first needs them (ATen at its first kernel, MKL at its first call), so this
    must run before any tensor work; `state()` checks afterwards that it did. An invalid mode
    pins nothing here and fails at `state()`."""
    try:
        if mode() != "reproducible":
            return
    except ValueError:
        return
    for name, value in PINNED.items():
        if os.environ.get(name, value) != value:
            _overridden.setdefault(name, os.environ[name])
        os.environ[name] = value


@dataclass(frozen=True)
class KernelState:
    mode: str               # reproducible | native
    comparable: bool        # the published digits' numerics are in effect here
    capability: str         # ATen's CPU capability (AVX2, AVX512, DEFAULT, ...)
    gemm_width: int | None  # ggpo's product's vector width (None: not in use)
    why: str | None         # what keeps a reproducible run from being comparable

    def line(self) -> str:
        """One line for logs and reports: what runs here."""
        if self.mode == "native":
            return (f"CPU kernels: the processor's own ({self.capability}; {ENV}=native): reproducible on "
                    "this machine only, not comparable to the published digits")
        if not self.comparable:
            return f"CPU kernels: NOT reproducible here ({self.why}); results are not comparable to the published digits"
        return (f"CPU kernels: reproducible (ATen AVX2, MKL COMPATIBLE, ggpo's fp32 product at {self.gemm_width} bits): "
                "the published digits' numerics")


def _mkl_branch() -> int | None:
    """MKL's conditional-reproducibility branch as MKL reports it (None: MKL not found)."""
    import ctypes

    import torch
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        get = lib.mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    return int(get(1))      # 1: MKL_CBWR_BRANCH


def _why_not(capability: str) -> str | None:
    """Why the reproducible mode cannot hold in this process, or None."""
    from pipeline.core import gemm
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"a {platform.machine()} processor: the pinned kernels are x86's"
    if capability != "AVX2":
        return (f"ATen runs {capability} kernels, not AVX2 (a processor without AVX2, or torch ran a kernel "
                f"before the pipeline package set {', '.join(PINNED)})")
    branch = _mkl_branch()
    if branch not in (None, MKL_COMPATIBLE):
        return f"MKL's reproducibility branch is {branch}, not COMPATIBLE ({MKL_COMPATIBLE})"
    return gemm.unavailable()


def state() -> KernelState:
    """What this process runs (computed once; warns once when a reproducible run is not)."""
    global _state
    if _state is None:
        import torch

        from pipeline.core import gemm
        current, capability = mode(), torch.backends.cpu.get_cpu_capability()
        why = _why_not(capability) if current == "reproducible" else None
        comparable = current == "reproducible" and why is None
        _state = KernelState(current, comparable, capability, gemm.width() if comparable else None, why)
        if _overridden:
            log.warning("%s=reproducible set %s (yours: %s; %s=native keeps them)", ENV, ", ".join(
                f"{k}={PINNED[k]}" for k in _overridden), ", ".join(f"{k}={v}" for k, v in _overridden.items()), ENV)
        if current == "reproducible" and not comparable:
            log.warning(_state.line())
    return _state


def reproducible() -> bool:
    """ggpo's own product serves the CPU's fp32 Linear layers (the reproducible mode holds)."""
    return state().comparable


def fingerprint() -> str:
    """The numerics of this process's CPU computations, for stage keys: the same string on
    every processor where the reproducible mode holds, else the processor's capability."""
    s = state()
    if s.comparable:
        return f"reproducible-{VERSION}"
    return f"{s.mode}-{platform.machine().lower()}-{s.capability.lower()}"


def key_fingerprint() -> str | None:
    """What a stage computed by torch adds to its key: `fingerprint()` where it computes on
    the CPU, None on a machine with CUDA (GPU runs keep their keys: the pins steer only CPU
    libraries)."""
    import torch
    if torch.cuda.is_available():
        return None
    return fingerprint()


def applies(*tensors: "torch.Tensor") -> bool:
    """Does ggpo's reproducible product serve these operands: fp32 CPU tensors, no CPU
    autocast, and the reproducible mode holding in this process?"""
    import torch
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return False
    return not torch.is_autocast_enabled("cpu") and reproducible()


def linear(x: "torch.Tensor", weight: "torch.Tensor", bias: "torch.Tensor | None" = None) -> "torch.Tensor":
    """F.linear(x [..., K], weight [N, K], bias [N]) -> [..., N], by ggpo's product where it
    applies (differentiable), else torch's own."""
    import torch

    from pipeline.core import gemm
    if not applies(x, weight):
        return torch.nn.functional.linear(x, weight, bias)
    lead, flat = x.shape[:-1], x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        y = gemm.LinearFn.apply(flat, weight, bias)
    else:
        y = gemm.mm_weight_t(flat, weight)
        if bias is not None:
            y.add_(bias)
    return y.reshape(*lead, weight.shape[0])


def matmul(a: "torch.Tensor", b: "torch.Tensor") -> "torch.Tensor":
    """a [M, K] @ b [K, N] by ggpo's product where it applies (differentiable), else torch's."""
    from pipeline.core import gemm
    if a.dim() != 2 or b.dim() != 2 or not applies(a, b):
        return a @ b
    return gemm.MatmulFn.apply(a, b)
