"""Rollout engines: one protocol, a transformers engine (CPU) and a vLLM engine (GPU).

Log-prob convention (recorded in every pool as `logprobs_mode`): the sampled token's
log-prob under softmax(logits / temperature), before top-p renormalization. The trainer
computes log-probs the same way (spec section 1), so with top_p = 1 importance ratios at
step 0 are exactly 1; with top_p < 1 they carry the nucleus renormalization, as vLLM's
`processed_logprobs` do not: keep top_p = 1 for off-policy corrections to be exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

LOGPROBS_MODE = "temperature_scaled_before_top_p"


@dataclass(frozen=True)
class SamplingParams:
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str       # "stop" (EOS sampled, included in token_ids) | "length"
    text: str


class Engine(Protocol):
    name: str
    logprobs_mode: str

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        """params.n completions for each prompt, in prompt order."""
        ...


def make_engine(kind: str, model_path: str, batch_prompts: int = 64, threads: int = 1) -> Engine:
    if kind == "transformers":
        from pipeline.engines.hf import TransformersEngine
        return TransformersEngine(model_path, batch_prompts=batch_prompts, threads=threads)
    if kind == "vllm":
        from pipeline.engines.vllm_engine import VLLMEngine  # GPU only, imported lazily
        return VLLMEngine(model_path)
    raise ValueError(f"unknown engine '{kind}'; known: transformers, vllm")
