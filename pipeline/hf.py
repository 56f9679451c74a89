"""Loading HF models and tokenizers: local folders, or hub ids for users with internet."""
from __future__ import annotations

import threading

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()


# from_pretrained patches process-global torch state while it builds a model (weight
# init, default device); two loads in two threads corrupt each other's models (measured:
# 12 of 12 generations differed). Flows run stages in threads, so loads are serialized.
_LOAD_LOCK = threading.Lock()


def load_tokenizer(path: str):
    with _LOAD_LOCK:
        tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, dtype=torch.float32):
    with _LOAD_LOCK:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
