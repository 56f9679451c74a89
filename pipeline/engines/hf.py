"""Transformers rollout engine: a plain sampling loop over a KV cache.

Our own loop rather than `generate()` so that the sampled token's log-prob is read from
the exact distribution it was drawn from, the random stream is an explicit seeded
`torch.Generator`, and left-padded prompts get explicit position ids (so the result equals
a right-padded teacher-forced recompute to ~1e-6, which a test checks).
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch

from pipeline import interrupt
from pipeline.engines.base import LOGPROBS_MODE, Completion, SamplingParams, check_weights, stop_token_ids
from pipeline.hf import load_model, load_tokenizer
from pipeline.runtime import resolve_device


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the smallest set with mass >= top_p. probs: [B, V]."""
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    outside = sorted_p.cumsum(-1) - sorted_p > top_p
    sorted_p = sorted_p.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter(-1, idx, sorted_p)


def _cache_kwarg(model) -> str:
    # transformers >= 5.2x renames past_key_values to cache; older releases only know the former
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _last_logits_kwargs(model) -> dict:
    """Only the last position's logits: sampling reads nothing else, and the prefill would
    otherwise build [B, L, V] logits for every prompt position (at Qwen3's V = 151,936 and
    64 prompts of 500 tokens, 19 GB in bf16). transformers' causal LMs take
    `logits_to_keep` (an int keeps that many last positions); a model without it gets none."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def weights_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """rollout.dtype -> the engine's weight dtype. "auto": bf16 on a GPU (as vLLM's default),
    fp32 on CPU (so the CPU pool matches the fp32 trainer exactly). Log-probs are computed
    in fp32 from the logits whatever this is."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    known = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in known:
        raise ValueError(f"rollout.dtype '{dtype}' is not one of auto, float32, bfloat16")
    return known[dtype]


class TransformersEngine:
    name = "transformers"
    logprobs_mode = LOGPROBS_MODE

    def __init__(self, model_path: str, batch_prompts: int = 64, threads: int = 1, model=None,
                 device: str = "auto", dtype: str = "auto"):
        torch.set_num_threads(threads)
        self.device = resolve_device(device)
        self.tokenizer = load_tokenizer(model_path)
        self.dtype = weights_dtype(dtype, self.device)
        self.model = model if model is not None else load_model(model_path, self.dtype).to(self.device)
        self.batch_prompts = batch_prompts
        self.stop_ids = stop_token_ids(model_path, self.tokenizer)     # the same ids vLLM stops on

    def generate(self, prompts: list[str], params: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[list[Completion]]:
        """progress, if given, is called after each internal batch with the number of prompts
        it finished; it only observes, so the batches and the random stream stay the same."""
        gen = torch.Generator(device=self.device).manual_seed(params.seed)
        out: list[list[Completion]] = []
        for start in range(0, len(prompts), self.batch_prompts):
            batch = prompts[start:start + self.batch_prompts]
            flat = self._sample([p for p in batch for _ in range(params.n)], params, gen)
            out.extend(flat[i * params.n:(i + 1) * params.n] for i in range(len(batch)))
            if progress is not None:
                progress(len(batch))
        return out

    @torch.no_grad()
    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """The learner's parameters copied into the engine's model in place, cast to the
        engine's dtype (buffers such as the rotary frequencies are the model's own)."""
        params = dict(self.model.named_parameters())
        check_weights([(n, tuple(t.shape)) for n, t in named], {n: tuple(p.shape) for n, p in params.items()},
                      "transformers")
        for name, tensor in named:
            params[name].data.copy_(tensor.detach())

    def sleep(self) -> None:
        """Nothing to hand back: the engine's copy of the weights is small next to the
        learner's and stays (torch.cuda.empty_cache by the caller frees the rest)."""

    def wake(self) -> None:
        pass

    @torch.no_grad()
    def _sample(self, prompts: list[str], params: SamplingParams, gen: torch.Generator) -> list[Completion]:
        tok, model = self.tokenizer, self.model
        model.eval()
        ids = [tok(p)["input_ids"] for p in prompts]
        width = max(map(len, ids))
        dev = self.device
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids], device=dev)
        attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        stops = torch.tensor(self.stop_ids, device=dev)
        done = torch.zeros(len(prompts), dtype=torch.bool, device=dev)
        tokens, logps = [], []
        past, step_ids, step_pos = None, input_ids, pos
        cache_kw, last_only = _cache_kwarg(model), _last_logits_kwargs(model)
        for _ in range(params.max_new_tokens):
            interrupt.check("generation")        # a safe point: nothing of this batch is kept
            res = model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos,
                        use_cache=True, **{cache_kw: past}, **last_only)
            logits = res.logits[:, -1, :].float()
            if params.temperature == 0:   # greedy; log-probs reported at temperature 1
                logp = torch.log_softmax(logits, dim=-1)
                nxt = logits.argmax(-1)
            else:
                logp = torch.log_softmax(logits / params.temperature, dim=-1)
                probs = top_p_filter(logp.exp(), params.top_p)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            nxt = torch.where(done, torch.full_like(nxt, tok.pad_token_id), nxt)
            tokens.append(nxt)
            logps.append(logp.gather(1, nxt[:, None]).squeeze(1))
            done = done | torch.isin(nxt, stops)
            if bool(done.all()):
                break
            past, step_ids = getattr(res, "cache", None) or res.past_key_values, nxt[:, None]
            step_pos = step_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        return self._completions(torch.stack(tokens, 1), torch.stack(logps, 1), set(stops.tolist()), params.logprobs)

    def _completions(self, tokens: torch.Tensor, logps: torch.Tensor, stops: set[int],
                     with_logprobs: bool = True) -> list[Completion]:
        """Each row cut after its first stop token (kept, finish "stop"), else "length"."""
        result = []
        for row_t, row_lp in zip(tokens.tolist(), logps.tolist()):
            end = next((i + 1 for i, t in enumerate(row_t) if t in stops), None)
            n = end or len(row_t)
            result.append(Completion(
                token_ids=row_t[:n], logprobs=row_lp[:n] if with_logprobs else [],
                finish_reason="stop" if end else "length",
                text=self.tokenizer.decode(row_t[:n], skip_special_tokens=True)))
        return result
