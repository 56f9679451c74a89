"""Where and in what precision the trainer runs: prepared once, handed to the loop.

`make_runtime(train_cfg)` resolves `train.device` (auto: CUDA when available, else CPU)
and `train.dtype` (auto: bf16 autocast over fp32 master weights on CUDA, fp32 on CPU;
float64: exact arithmetic, for checks that compare two training paths without rounding).
The policy keeps fp32 weights and optimizer state (AdamW in mixed precision); only its
forward runs under autocast. The reference is frozen and never trained, so under bf16 its
parameters are stored in bf16 (half the memory; buffers such as the rotary frequencies
stay fp32, hf.cast_parameters) on the training device, or on the CPU with
`train.reference_device=cpu`. Gradient checkpointing is transformers' non-reentrant one.
The loop never asks `torch.cuda` itself: everything device-specific lives here.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.config import ConfigError, TrainConfig


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


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    autocast_dtype: torch.dtype | None      # None: plain param_dtype
    reference_device: torch.device
    gradient_checkpointing: bool
    chunk_tokens: int                       # LM-head chunk for log-probs (tokens)
    logprob_impl: str                       # "chunked" | "full"
    param_dtype: torch.dtype = torch.float32  # master weights; float64 only for exact checks

    def autocast(self):
        """The forward's precision context (fp32 master weights stay fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def prepare(self, model):
        """The trained policy: fp32 weights on the device, checkpointing as configured."""
        model = model.to(device=self.device, dtype=self.param_dtype)
        if self.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        return model

    def prepare_reference(self, model):
        """The frozen reference: bf16 parameters when training runs in bf16 (buffers keep
        their dtype), on `reference_device`."""
        if self.param_dtype == torch.float64:
            model = model.to(device=self.reference_device, dtype=torch.float64)
        else:
            model = cast_parameters(model, self.autocast_dtype or torch.float32, self.reference_device)
        model.requires_grad_(False)
        return model.eval()


def resolve_device(name: str, setting: str = "train.device") -> torch.device:
    """'auto' | 'cpu' | 'cuda' -> a device; 'cuda' without CUDA is a clear ConfigError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{setting}=cuda but this torch ({torch.__version__}) sees no CUDA device: "
            f"use {setting}=auto (or cpu) here, or install a CUDA build of torch on a GPU machine")
    return torch.device(name)


def make_runtime(tc: TrainConfig) -> Runtime:
    device = resolve_device(tc.device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else None,
             "float32": None, "float64": None, "bfloat16": torch.bfloat16}[tc.dtype]
    ref_device = torch.device("cpu") if tc.reference_device == "cpu" else device
    return Runtime(device=device, autocast_dtype=dtype, reference_device=ref_device,
                   gradient_checkpointing=tc.gradient_checkpointing,
                   chunk_tokens=tc.logprob_chunk_tokens, logprob_impl=tc.logprob_impl,
                   param_dtype=torch.float64 if tc.dtype == "float64" else torch.float32)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def preflight(cfg) -> None:
    """Bad settings that would fail hours into a run, caught before any work, each as one
    ConfigError naming the setting and what to do. `cfg` is a PipelineConfig."""
    from pipeline.store import check_store
    check_store()       # the artifact store opens (URL, credentials, endpoint)
    device = resolve_device(cfg.train.device)
    _check_placement(cfg.train, device)
    if cfg.experiment.task_runner == "ray":     # (placement imports prefect: only when asked)
        from pipeline import placement
        placement.check(cfg)    # ray installed, the address answers
    if cfg.rollout.engine == "vllm":
        from pipeline.engines import check_vllm
        check_vllm()
    if cfg.model.name_or_path:
        _check_model_folder(cfg)


def _check_placement(tc: TrainConfig, device: torch.device) -> None:
    """train.nproc ranks fit this node (one GPU each on CUDA; gloo ranks are processes, up
    to 4 per core); several nodes need the rendezvous endpoint."""
    import os
    if device.type == "cuda" and tc.nproc > torch.cuda.device_count():
        raise ConfigError(f"train.nproc={tc.nproc} but {torch.cuda.device_count()} GPU(s) are visible "
                          "(one rank per GPU): lower train.nproc or check CUDA_VISIBLE_DEVICES")
    cap = 4 * (os.cpu_count() or 1)
    if device.type == "cpu" and tc.nproc > cap:
        raise ConfigError(f"train.nproc={tc.nproc} CPU ranks on {os.cpu_count()} cores (at most {cap}): "
                          "lower train.nproc")
    if tc.nnodes > 1 and not tc.rdzv_endpoint:
        raise ConfigError(f"train.nnodes={tc.nnodes} needs train.rdzv_endpoint=HOST:PORT (node 0's address, "
                          "the same on every node)")


def _check_model_folder(cfg) -> None:
    """A local HF folder has a tokenizer, and its context holds the response budgets."""
    folder = Path(cfg.model.name_or_path)
    if not folder.exists():
        if cfg.model.name_or_path.startswith((".", "/", "~")):
            raise ConfigError(f"model.name_or_path={cfg.model.name_or_path}: no such folder")
        return      # a hub id: transformers resolves it (needs internet)
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise ConfigError(f"model.name_or_path={folder}: the folder has no tokenizer (none of "
                          f"{', '.join(TOKENIZER_FILES)}); save the tokenizer next to the weights "
                          "(tokenizer.save_pretrained(folder))")
    config_file = folder / "config.json"
    if not config_file.exists():
        raise ConfigError(f"model.name_or_path={folder}: no config.json; is this a Hugging Face model folder?")
    context = json.loads(config_file.read_text()).get("max_position_embeddings")
    for setting, budget in (("rollout.max_new_tokens", cfg.rollout.max_new_tokens),
                            ("eval.max_new_tokens", cfg.eval.max_new_tokens)):
        if context is not None and budget >= context:
            raise ConfigError(f"{setting}={budget} does not fit the model's context of {context} tokens "
                              f"(max_position_embeddings in {config_file}) with any prompt: lower {setting}")
