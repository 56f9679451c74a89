"""Transformers rollout engine: a plain sampling loop over a KV cache.

Our own loop rather than `generate()` so that the sampled token's log-prob is read from
the exact distribution it was drawn from, the random stream is an explicit seeded
`torch.Generator`, and left-padded prompts get explicit position ids (so the result equals
a right-padded teacher-forced recompute to ~1e-6, which a test checks). Decode steps run on
transformers' forward or, for Qwen3, on a lean copy of it with the same logits (`decode.py`).
Rows that have stopped leave the batch (`_worth_shrinking`), and the draw does not depend on when they do
(`_draw`), so a batch costs the tokens its rows produce. On CUDA every forward runs under the
project's attention kernels (runtime.attention_backends); a NaN or infinite logit stops the draw in
one line (NonFiniteLogits), never sampled from or scored.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from pipeline.core import interrupt
from pipeline.models import numerics
from pipeline.models.engines.base import LOGPROBS_MODE, Completion, NonFiniteLogits, SamplingParams, check_weights, stop_token_ids
from pipeline.models.engines.decode import LeanQwen3, sampler_forward
from pipeline.models.hf import load_model, load_tokenizer
from pipeline.models.runtime import attention_backends, resolve_device

log = logging.getLogger("ggpo")


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the smallest set with mass >= top_p. probs: [B, V]."""
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    outside = sorted_p.cumsum(-1) - sorted_p > top_p
    sorted_p = sorted_p.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter(-1, idx, sorted_p)


def weights_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """rollout.dtype -> the engine's weight dtype. "auto": bf16 on a GPU (as vLLM's default),
    fp32 on CPU (so the CPU pool matches the fp32 trainer exactly). Log-probs are computed
    in fp32 from the logits whatever this is. bf16 on the CPU is emulated in fp32
    (pipeline/models/numerics.py: emulate_bf16): the model's tensors stay fp32."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    known = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in known:
        raise ValueError(f"rollout.dtype '{dtype}' is not one of auto, float32, bfloat16")
    return known[dtype]


def _draw(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator, live: torch.Tensor,
          rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(next token [b], log-probs [b, V]) for the b rows still in a batch of `rows`; `live` [b]:
    their original rows. Greedy at temperature 0 (log-probs then at temperature 1).

    The draw is torch.multinomial's own (its one-sample path takes argmax(p / q), q ~ Exp(1)
    drawn over the whole [rows, V] tensor), with the noise drawn for every original row, so
    each row's token is the one it got when finished rows stayed in the batch: the random
    stream, and so the pool, does not depend on when rows leave."""
    if params.temperature == 0:
        return logits.argmax(-1), torch.log_softmax(logits, dim=-1)
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = top_p_filter(logp.exp(), params.top_p)
    noise = torch.empty((rows, probs.shape[1]), dtype=probs.dtype, device=probs.device).exponential_(generator=gen)
    return (probs / noise[live]).argmax(-1), logp


def left_padded(ids: list[list[int]], pad_id: int, steps: int,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids [B, W], attention mask [B, W + steps], position ids [B, W]) of prompts `ids`
    left-padded to the longest, W. The mask of every step is allocated once (the prompt part,
    then ones for the new tokens) and read through a growing slice: no torch.cat per step.
    Positions count real tokens only, so a padded row's positions equal an unpadded one's."""
    width = max(map(len, ids))
    input_ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in ids], device=device)
    attn = torch.ones((len(ids), width + steps), dtype=torch.long, device=device)
    attn[:, :width] = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
    return input_ids, attn, (attn[:, :width].cumsum(-1) - 1).clamp(min=0)


def shared_prefill(forward, n: int, input_ids: torch.Tensor, attn: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """The prefill's logits [B, V] of rows that come in runs of n copies of one prompt (as
    `_sample` lays out a prompt's n samples), each prompt computed once: the prefill runs on
    one row per prompt and its key/value cache and logits are repeated n times
    (`forward.select` with repeated rows). The same bits as the prefill of every row: each
    row's forward is a function of that row alone (the padded width, set by the same prompts,
    is the same; tests/test_engine.py compares draws with and without it), at 1/n of the
    FLOPs (at group size 8, ~12 % of an online cell). n = 1: the plain prefill."""
    if n == 1:
        return forward(input_ids, attn, positions)
    logits = forward(input_ids[::n], attn[::n], positions[::n])
    repeat = torch.arange(input_ids.shape[0] // n, device=input_ids.device).repeat_interleave(n)
    forward.select(repeat)
    return logits[repeat]


def _non_finite(logits: torch.Tensor, step: int, live: torch.Tensor) -> NonFiniteLogits:
    """The one-line error for a step whose logits hold a NaN or an infinity: where (the
    batch row, the new token's index, the first token id) and what, so nothing of the draw
    is returned, scored or kept."""
    bad = ~torch.isfinite(logits)
    row, token = (int(x) for x in bad.nonzero()[0])
    return NonFiniteLogits(
        f"the transformers sampler's logits are not finite at new token {step}: {int(bad.sum())} entries, "
        f"the first at batch row {int(live[row])}, token id {token}: {float(logits[row, token])} "
        f"(the draw is refused: nothing of it is scored or kept)")


def _worth_shrinking(done: torch.Tensor) -> bool:
    """Drop the finished rows once they are a quarter of the batch: each drop copies the KV
    cache, so dropping at every finished row costs much of what it saves; at a quarter the
    batch shrinks geometrically and at most a quarter of a step's rows are wasted. Measured on
    the tiny model (512 rows, 24 new tokens, bf16): a draw costs 0.74x keeping every row to the
    end, 0.80x at a tenth, 0.88x at every finished row."""
    return 4 * int(done.sum()) >= done.numel()


class TransformersEngine:
    name = "transformers"
    logprobs_mode = LOGPROBS_MODE

    def __init__(self, model_path: str, batch_prompts: int = 64, threads: int = 1, model=None,
                 device: str = "auto", dtype: str = "auto", lean: bool = True):
        torch.set_num_threads(threads)
        self.lean = lean      # the lean decode step where it copies the model's forward (engines/decode.py)
        self.lean_checked = False   # set once a draw's first decode step found both forwards equal
        self.lean_layouts: set = set()      # the attention layouts the lean step has proven (decode.LeanQwen3)
        self.lean_checks: list[dict] = []   # every check the lean step ran, in order (what each covered)
        self.share_prefill = True   # a prompt's prefill once for its n samples (shared_prefill; off: every row)
        self.device = resolve_device(device)
        self.tokenizer = load_tokenizer(model_path)
        self.dtype = weights_dtype(dtype, self.device)
        if model is None:
            emulated = self.dtype == torch.bfloat16 and self.device.type == "cpu"
            model = load_model(model_path, torch.float32 if emulated else self.dtype).to(self.device)
            if emulated:
                numerics.emulate_bf16(model)
        self.model = model
        self.batch_prompts = batch_prompts
        self.stop_ids = stop_token_ids(model_path, self.tokenizer)     # the same ids vLLM stops on

    @classmethod
    def from_model(cls, model, tokenizer, stop_ids: list[int], batch_prompts: int = 64,
                   lean: bool = True) -> "TransformersEngine":
        """An engine over a model in memory (the base model's warm-up samples the model it is
        training), on the model's device, in the model's dtype."""
        engine = cls.__new__(cls)
        engine.model, engine.tokenizer, engine.stop_ids = model, tokenizer, list(stop_ids)
        engine.batch_prompts, engine.lean, engine.lean_checked = batch_prompts, lean, False
        engine.lean_layouts, engine.lean_checks, engine.share_prefill = set(), [], True
        engine.device, engine.dtype = next(model.parameters()).device, next(model.parameters()).dtype
        return engine

    def generate(self, prompts: list[str], params: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[list[Completion]]:
        """progress, if given, is called after each internal batch with the number of prompts
        it finished; it only observes, so the batches and the random stream stay the same."""
        gen = torch.Generator(device=self.device).manual_seed(params.seed)
        out: list[list[Completion]] = []
        for start in range(0, len(prompts), self.batch_prompts):
            batch = prompts[start:start + self.batch_prompts]
            flat = self._sample(batch, params, gen)
            out.extend(flat[i * params.n:(i + 1) * params.n] for i in range(len(batch)))
            if progress is not None:
                progress(len(batch))
        return out

    @torch.no_grad()
    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """The learner's parameters copied into the engine's model in place, cast to the
        engine's dtype (buffers such as the rotary frequencies are the model's own); an
        emulated bf16 model's rounded to bf16 values again."""
        params = dict(self.model.named_parameters())
        check_weights([(n, tuple(t.shape)) for n, t in named], {n: tuple(p.shape) for n, p in params.items()},
                      "transformers")
        emulated = getattr(self.model, "ggpo_bf16_emulated", False)
        for name, tensor in named:
            # through the parameter, not .data: .data has its own version counter, and the
            # reproducible product keeps a weight's packed copy while the parameter's version
            # stays (pipeline/core/gemm.py), so a write through .data would leave it stale
            params[name].copy_(tensor.detach())
            if emulated:
                numerics.round_bf16_(params[name])

    def sleep(self) -> None:
        """Nothing to hand back: the engine's copy of the weights is small next to the
        learner's and stays (torch.cuda.empty_cache by the caller frees the rest)."""

    def wake(self) -> None:
        pass

    @torch.inference_mode()     # no_grad's tokens, less bookkeeping per op (~5 % of a small draw)
    def _sample(self, prompts: list[str], params: SamplingParams, gen: torch.Generator) -> list[Completion]:
        """params.n rows per prompt, a prompt's rows one after the other (each prompt tokenized
        once), decoded together, every forward under the device's attention kernels
        (runtime.attention_backends)."""
        self.model.eval()
        ids = [x for x in (self.tokenizer(p)["input_ids"] for p in prompts) for _ in range(params.n)]
        with attention_backends(self.device):
            return self._decode(ids, params, gen)

    def _decode(self, ids: list[list[int]], params: SamplingParams, gen: torch.Generator) -> list[Completion]:
        """A row leaves the batch once it has sampled a stop token (`_shrink`), so a batch costs
        the tokens its rows produce, not rows x the longest row. The draws do not depend on which
        rows are still in the batch (`_draw`). A logit that is not finite stops the draw at once
        (`_non_finite`): nothing drawn from it is returned, scored or kept."""
        tok, dev = self.tokenizer, self.device
        rows, steps = len(ids), params.max_new_tokens
        input_ids, attn, step_pos = left_padded(ids, tok.pad_token_id, steps, dev)
        width = input_ids.shape[1]
        stops = torch.tensor(self.stop_ids, device=dev)
        tokens = torch.full((rows, steps), tok.pad_token_id, dtype=torch.long, device=dev)
        logps = torch.zeros((rows, steps), device=dev)
        live = torch.arange(rows, device=dev)       # the original row of each row still in the batch
        step_ids, done = input_ids, torch.zeros(rows, dtype=torch.bool, device=dev)
        forward = sampler_forward(self.model, width + steps, self.lean, check=not self.lean_checked,
                                  verified=self.lean_layouts)
        t = 0
        for t in range(steps):
            interrupt.check("generation")        # a safe point: nothing of this batch is kept
            logits = (shared_prefill(forward, params.n if self.share_prefill else 1, input_ids, attn[:, :width],
                                     step_pos) if t == 0
                      else forward(step_ids, attn[:, :width + t], step_pos))
            nxt, logp = _draw(logits.float(), params, gen, live, rows)
            nxt = torch.where(done, torch.full_like(nxt, tok.pad_token_id), nxt)
            tokens[live, t], logps[live, t] = nxt, logp.gather(1, nxt[:, None]).squeeze(1)
            done = done | torch.isin(nxt, stops)
            finite, finished = torch.stack((torch.isfinite(logits).all(), done.all())).tolist()   # one device read
            if not finite:
                raise _non_finite(logits, t, live)
            if finished:
                break
            step_ids, step_pos = nxt[:, None], step_pos[:, -1:] + 1
            if _worth_shrinking(done):
                keep = (~done).nonzero().squeeze(1)
                forward.select(keep)
                live, attn, step_ids, step_pos, done = live[keep], attn[keep], step_ids[keep], step_pos[keep], done[keep]
        self._note_check(forward)
        return self._completions(tokens[:, :t + 1], logps[:, :t + 1], set(stops.tolist()), params.logprobs)

    def _note_check(self, forward) -> None:
        """The lean step's checks (decode.LeanQwen3): kept on equal logits, else dropped for this
        engine with one warning (the draw already used transformers' logits)."""
        if not isinstance(forward, LeanQwen3):
            return          # transformers' forward: nothing to check
        self.lean_checks.extend(forward.checks)
        if forward.equal is None:
            return          # no forward check ran (checked before, or no decode step)
        self.lean_checked = forward.equal
        if not forward.equal:
            self.lean = False
            log.warning("the lean decode step's logits differ from transformers' forward for %s (transformers %s); "
                        "the sampler uses transformers' forward", type(self.model).__name__, _transformers_version())

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


def _transformers_version() -> str:
    import transformers
    return transformers.__version__
