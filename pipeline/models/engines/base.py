"""The engine protocol and its data: sampling parameters in, completions out.

Log-prob convention (recorded in every pool as `logprobs_mode`): the sampled token's
log-prob under softmax(logits / temperature), the distribution the trainer recomputes
(spec section 1). The transformers engine records it before top-p filtering
(`temperature_scaled_before_top_p`); vLLM's `processed_logprobs` are taken after
temperature AND top-k/top-p, renormalized over the kept tokens (vllm/config/model.py). With
top_p = 1 (and no top-k) the two are the same distribution; with top_p < 1 vLLM's value
gains log(1 / kept mass), which biases every importance ratio, so preflight refuses
top_p < 1 for the methods that read behavior log-probs (pipeline/dag/preflight.py).

Stop tokens: both engines stop on the same explicit ids, `stop_token_ids(model_path,
tokenizer)`: the tokenizer's EOS and every `eos_token_id` of the model's
generation_config.json (vLLM adds the latter on its own; the transformers engine would not).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.core.errors import NonFiniteLogits as NonFiniteLogits  # re-exported: the engines raise it

if TYPE_CHECKING:       # annotations only: this module stays importable without torch
    import torch

LOGPROBS_MODE = "temperature_scaled_before_top_p"


@dataclass(frozen=True)
class SamplingParams:
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    logprobs: bool = True     # record the sampled tokens' log-probs (evaluation does not need them)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str       # "stop" (EOS sampled, included in token_ids) | "length"
    text: str


class Engine(Protocol):
    name: str
    logprobs_mode: str
    tokenizer: Any      # the HF tokenizer of the model folder (the stages build prompts with it)

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        """params.n completions for each prompt, in prompt order."""
        ...

    def load_weights(self, named: list[tuple[str, "torch.Tensor"]]) -> None:
        """Replace the sampler's weights in place with the learner's (HF parameter names;
        the sync of Algorithm 1 line 3); WeightSyncError on names or shapes it does not have."""
        ...

    def sleep(self) -> None:
        """Hand the device memory the sampler holds back to the learner (no-op where none)."""
        ...

    def wake(self) -> None:
        """Take it again before the next load_weights / generate."""
        ...


def check_weights(named: list[tuple[str, tuple[int, ...]]], expected: dict[str, tuple[int, ...]], who: str) -> None:
    """The learner's (name, shape) pairs must be exactly the sampler's parameters: a
    WeightSyncError (one line) names what is missing, unexpected or of another shape."""
    from pipeline.core.errors import WeightSyncError
    got = dict(named)
    missing, unexpected = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    wrong = sorted(n for n in set(got) & set(expected) if tuple(got[n]) != tuple(expected[n]))
    if missing or unexpected or wrong:
        parts = [f"{len(missing)} missing (e.g. {missing[0]})" if missing else "",
                 f"{len(unexpected)} it does not have (e.g. {unexpected[0]})" if unexpected else "",
                 f"{len(wrong)} of another shape (e.g. {wrong[0]}: {tuple(got[wrong[0]])} for "
                 f"{tuple(expected[wrong[0]])})" if wrong else ""]
        raise WeightSyncError(f"the {who} sampler refused the learner's weights: "
                              + "; ".join(p for p in parts if p) + " (is the policy the sampler's model?)")


def stop_token_ids(model_path: str, tokenizer) -> list[int]:
    """The ids that end a response: the tokenizer's EOS and the generation config's
    eos_token_id (an int or a list), sorted."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = Path(model_path) / "generation_config.json"
    if config.exists():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return sorted(int(i) for i in ids)
