"""vLLM rollout engine (GPU only; `pip install .[gpu]`). Imported lazily by make_engine.

Uses `logprobs_mode="processed_logprobs"` so the recorded log-prob is taken after
temperature scaling, matching the trainer's softmax(logits / temperature) when top_p = 1
(../shared/platform-notes.md: the default raw mode would bias every importance ratio).
"""
from __future__ import annotations

from pipeline.engines import Completion, SamplingParams


class VLLMEngine:
    name = "vllm"
    logprobs_mode = "processed_logprobs"

    def __init__(self, model_path: str):
        from vllm import LLM
        self.llm = LLM(model=model_path, logprobs_mode="processed_logprobs", seed=0)

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        from vllm import SamplingParams as VParams
        sp = VParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                     max_tokens=params.max_new_tokens, seed=params.seed, logprobs=0)
        outputs = self.llm.generate(prompts, sp, use_tqdm=False)
        return [[self._completion(o) for o in req.outputs] for req in outputs]

    @staticmethod
    def _completion(o) -> Completion:
        ids = list(o.token_ids)
        lps = [step[tid].logprob for step, tid in zip(o.logprobs, ids)]
        return Completion(token_ids=ids, logprobs=lps,
                          finish_reason="stop" if o.finish_reason == "stop" else "length",
                          text=o.text)
