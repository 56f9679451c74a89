"""Where and in what precision the trainer runs: prepared once, handed to the loop.

`make_runtime(train_cfg)` resolves `train.device` (auto: CUDA when available, else CPU)
and `train.dtype` (auto: bf16 autocast over fp32 master weights on CUDA, fp32 on CPU;
float64: exact arithmetic, for checks that compare two training paths without rounding).
The policy keeps fp32 weights and optimizer state (AdamW in mixed precision); only its
forward runs under autocast. The reference is frozen and never trained, and must compute
exactly what the policy computes with the same weights (its log ratio is 0 at update 0 and
right after a refresh): under bf16 autocast it stores in bf16 only the parameters autocast
casts in every forward anyway (the nn.Linear weights and biases other than the LM head:
autocast's cast of an fp32 weight and the stored bf16 copy are the same rounding), and
keeps in fp32 the embeddings, the norms and the head, so its residual stream is fp32 like
the policy's (`Runtime.prepare_reference`; about 60 % of an fp32 copy at Qwen3-1.7B).
Buffers such as the rotary frequencies keep their dtype. It lives on the training device,
or on the CPU with `train.reference_device=cpu` (under the CPU's autocast there: close to
the policy's values, not bit-equal). Under FSDP with `train.fsdp_param_dtype=bfloat16` the
policy computes with every parameter in bf16, and so does its reference. Gradient
checkpointing is transformers' non-reentrant one.
Attention kernels: on CUDA every forward (the sampler's, the policy's, the reference's, and a
checkpointed layer's recompute in backward) runs under one explicit SDPA choice,
`attention_backends`: flash attention, then memory-efficient, then math, in that priority
and nothing else. Left to itself torch 2.14 puts cuDNN attention first on Hopper with CUDA
>= 13 and cuDNN > 9.15 (aten's check_prefer_cudnn_attention), whose compiled plans are keyed
on the KV length and the K/V strides (a new plan at every decode step and padded
micro-batch shape); with the choice made here cuDNN never decides a draw or a step. On
the CPU the choice is not made at all (a null context): CPU draws are torch's default ones.
The loop never asks `torch.cuda` itself: everything device-specific lives here. What a
run needs before it starts (device, engine, model, data, disk) is pipeline/dag/preflight.py.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
from dataclasses import dataclass

import torch

from pipeline.core.config import ConfigError, TrainConfig


def cast_parameters(model, dtype: torch.dtype, device: torch.device | None = None):
    """Parameters in `dtype` (and on `device`); buffers keep their dtype. `Module.to(dtype)`
    would also cast the rotary `inv_freq` buffer, and in bf16 the RoPE angles drift by
    radians past position ~1,000 (a bf16 reference's log-probs then differ from the
    policy's at long responses for no reason but the cast)."""
    if device is not None:
        model = model.to(device)
    for param in model.parameters():
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def autocast_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters bf16 autocast casts in every forward of `model` anyway: weights and
    biases of its nn.Linear layers, except the input and output embeddings (the lookup
    reads the embedding in full precision; a tied head is that same Parameter; the chunked
    LM head casts the head weight itself)."""
    embeddings = [getattr(model, name)() for name in ("get_input_embeddings", "get_output_embeddings")
                  if hasattr(model, name)]
    skip = {id(p) for e in embeddings if e is not None for p in e.parameters()}
    out: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            for p in module.parameters(recurse=False):
                if id(p) not in skip | seen:
                    seen.add(id(p))
                    out.append(p)
    return out


# The SDPA kernels a CUDA forward may use, in priority order (torch.nn.attention.sdpa_kernel's
# set_priority: the listed order first; cuDNN, not listed, is disabled). Flash needs no mask;
# memory-efficient takes the padded batches' boolean masks; math runs anything.
SDPA_BACKENDS: tuple[str, ...] = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
# the device types whose forwards run under that choice (a test adds "cpu" to put the CPU
# forwards through the same context and record it)
ATTENTION_DEVICES: tuple[str, ...] = ("cuda",)


def attention_backends(device: torch.device | str):
    """The context every forward on `device` runs under: on CUDA, SDPA restricted to
    SDPA_BACKENDS in that priority (module docstring); elsewhere a null context, so the
    CPU's kernels and draws are untouched. A new context each call (enter it once)."""
    if torch.device(device).type not in ATTENTION_DEVICES:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, name) for name in SDPA_BACKENDS], set_priority=True)


def _checkpoint_contexts(device: torch.device):
    """checkpoint's context_fn: the forward and its recompute in backward both under the
    same attention choice (the recompute runs outside the forward's `with`, and a kernel
    that differs there would save other tensors than the forward did)."""
    return attention_backends(device), attention_backends(device)


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    autocast_dtype: torch.dtype | None      # None: plain param_dtype
    reference_device: torch.device
    gradient_checkpointing: bool
    chunk_tokens: int                       # LM-head chunk for log-probs (tokens)
    logprob_impl: str                       # "chunked" | "full"
    param_dtype: torch.dtype = torch.float32  # master weights; float64 only for exact checks
    packed: bool = False                    # padding-free micro-batches (policy.make_batch)
    attn_implementation: str | None = None  # set on policy and reference when packed
    bf16_parameters: bool = False           # the policy computes with bf16 parameters (FSDP's param_dtype)
    # padded micro-batches as buckets of similar-length rows (policy.Buckets): a forward's
    # fixed cost in padded tokens (packing.bucket_rows); None: one padded batch
    bucket_overhead: float | None = None

    def autocast(self, device_type: str | None = None):
        """The forward's precision context (fp32 master weights stay fp32), for a model on
        `device_type` (default: the training device; a CPU reference gets the CPU's)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type or self.device.type, dtype=self.autocast_dtype)

    def attention(self, model):
        """The attention kernel packed rows need (None: the model's own)."""
        if self.attn_implementation:
            model.set_attn_implementation(self.attn_implementation)
        return model

    def prepare(self, model):
        """The trained policy: fp32 weights on the device, checkpointing as configured."""
        model = self.attention(model.to(device=self.device, dtype=self.param_dtype))
        if self.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
                "use_reentrant": False, "context_fn": functools.partial(_checkpoint_contexts, self.device)})
            model.config.use_cache = False
        return model

    def prepare_reference(self, model):
        """The frozen reference on `reference_device`, computing what the policy computes
        with the same weights (module docstring): the policy's parameter dtype, except the
        parameters autocast casts anyway, stored in the autocast dtype (half their memory,
        the same values in every matmul); all in bf16 only where the policy's are (FSDP's
        bf16 param_dtype). Buffers keep their dtype."""
        if self.param_dtype == torch.float64:
            model = model.to(device=self.reference_device, dtype=torch.float64)
        elif self.autocast_dtype is not None and self.bf16_parameters:
            model = cast_parameters(model, self.autocast_dtype, self.reference_device)
        else:
            model = cast_parameters(model, self.param_dtype, self.reference_device)
            if self.autocast_dtype is not None:
                for param in autocast_parameters(model):
                    param.data = param.data.to(self.autocast_dtype)
        model.requires_grad_(False)
        return self.attention(model).eval()


def release_device_memory() -> None:
    """Hand the trainer's cached but unused device blocks back (before a sampler starts or
    runs): what a finished stage or a resident learner's last update left in the allocator.
    Nothing to do without CUDA (a full gc.collect costs a CPU round tens of ms)."""
    if torch.cuda.is_available():
        import gc
        gc.collect()        # tensors only reference cycles still hold, before their blocks go back
        torch.cuda.empty_cache()


def free_device_fraction() -> float:
    """The share of the current GPU that is free, after release_device_memory (1.0 without CUDA)."""
    if not torch.cuda.is_available():
        return 1.0
    release_device_memory()
    free, total = torch.cuda.mem_get_info()
    return free / total


def device_total_bytes() -> int:
    """The current GPU's memory in bytes (0 without CUDA)."""
    return torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 0


def resolve_device(name: str, setting: str = "train.device") -> torch.device:
    """'auto' | 'cpu' | 'cuda' -> a device; 'cuda' without CUDA is a clear ConfigError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{setting}=cuda but this torch ({torch.__version__}) sees no CUDA device: "
            f"use {setting}=auto (or cpu) here, or install a CUDA build of torch on a GPU machine")
    return torch.device(name)


def packing_plan(setting: str, device: torch.device) -> tuple[bool, str | None]:
    """(packed, attention implementation) for train.packing on `device`. Packed rows need
    an attention that isolates them cheaply. On CUDA, `auto` and `on` pack: flash-attn's
    varlen kernels when flash-attn is installed (the rows' boundaries passed once per
    forward, policy.Batch.attention_kwargs), else torch's flex attention with a block-sparse
    mask (in torch since 2.5; the pinned GPU stack installs no flash-attn, so this is the
    GPU default). On the CPU only `on` packs, with sdpa and a dense block-diagonal mask
    (exact, but quadratic in the whole micro-batch: for checks); there `auto` runs padded rows
    in length buckets (make_runtime, policy.Buckets) and `off` one padded batch."""
    if setting == "off":
        return False, None
    if device.type == "cuda":
        if importlib.util.find_spec("flash_attn") is not None:
            return True, "flash_attention_2"
        if _flex_attention_available():
            return True, "flex_attention"
        if setting == "on":
            raise ConfigError(f"train.packing=on needs flash-attn or flex attention (torch >= 2.5); this torch "
                              f"{torch.__version__} has neither: use train.packing=auto or off")
        return False, None
    return (True, "sdpa") if setting == "on" else (False, None)


def _flex_attention_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


# A padded forward + backward's fixed cost in padded tokens, for bucketing a micro-batch's rows
# by length (packing.bucket_rows). Measured on the tiny model (hidden 128, 2 layers, 1 thread)
# as the update time against this setting, interleaved (benchmarks/bucket_padding.py; two
# runs on a loaded 2-core machine): 0 (a bucket per length) 1.7x the one padded batch,
# 30: 0.91-0.97x, 60-250: 0.82-0.91x, 500: 0.96-1.09x; the middle of the flat optimum.
# A larger model costs more per token, so its fixed cost is fewer tokens: this value then
# splits less than it could, never more.
BUCKET_OVERHEAD_TOKENS = 128.0


def make_runtime(tc: TrainConfig) -> Runtime:
    device = resolve_device(tc.device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else None,
             "float32": None, "float64": None, "bfloat16": torch.bfloat16}[tc.dtype]
    ref_device = torch.device("cpu") if tc.reference_device == "cpu" else device
    packed, attention = packing_plan(tc.packing, device)
    sharded = tc.nproc > 1 or tc.nnodes > 1        # FSDP's bf16 param_dtype applies only there
    # buckets where packing is off on the CPU under auto; never sharded (FSDP needs the same
    # number of forwards on every rank, and buckets vary per micro-batch)
    buckets = tc.packing == "auto" and not packed and device.type == "cpu" and not sharded
    return Runtime(device=device, autocast_dtype=dtype, reference_device=ref_device,
                   gradient_checkpointing=tc.gradient_checkpointing,
                   chunk_tokens=tc.logprob_chunk_tokens, logprob_impl=tc.logprob_impl,
                   param_dtype=torch.float64 if tc.dtype == "float64" else torch.float32,
                   packed=packed, attn_implementation=attention,
                   bf16_parameters=sharded and tc.fsdp_param_dtype == "bfloat16",
                   bucket_overhead=BUCKET_OVERHEAD_TOKENS if buckets else None)
