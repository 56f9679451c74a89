"""Loading HF models and tokenizers: local folders, or hub ids for users with internet."""
from __future__ import annotations

import threading

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from pipeline.models import numerics
from pipeline.models.runtime import cast_parameters

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()


# from_pretrained patches process-global torch state while it builds a model (weight
# init, default device); two loads in two threads corrupt each other's models (measured:
# 12 of 12 generations differed). Flows run stages in threads, so loads are serialized.
_LOAD_LOCK = threading.Lock()

# Hub kernels off: transformers >= 5.25 swaps layers for kernels fetched from the hub by default
# whenever the `kernels` package is installed (it is one of its dependencies). They are not
# the arithmetic ggpo pins (numerics.py), they need the hub at load time, and a swapped model
# is not the one `LeanQwen3` copies. Read from the installed release, as the other API checks
# are: the releases with a `use_kernels` property (4.57 on) take the argument; older ones
# kernelize nothing unless asked.
_NO_HUB_KERNELS = {"use_kernels": False} if hasattr(PreTrainedModel, "use_kernels") else {}


def load_tokenizer(path: str):
    with _LOAD_LOCK:
        tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, dtype=torch.float32):
    """The model's weights in `dtype` (buffers such as RoPE frequencies stay fp32).

    Always loaded in fp32, then cast: from_pretrained(dtype=bf16) switches torch's
    process-global default dtype while it builds, and a training step running in another
    thread then creates bf16 tensors (measured: the online flow's bf16 sampler made a
    concurrent cell's weights differ from a sequential run's). The lock cannot cover that:
    training never takes it. The cast gives the same weights and logits as loading in bf16."""
    with _LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **_NO_HUB_KERNELS)
    return numerics.prepare(cast_parameters(model, dtype))      # reproducible fp32 Linear layers on the CPU

