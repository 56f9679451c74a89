"""The sampler's forward passes: transformers' own, or a lean decode step with the same arithmetic.

Contract: `forward(ids [b, s], attention_mask [b, L], position_ids [b, s]) -> logits [b, V]`
at the last position, over a key/value cache the forward keeps; `select(keep)` keeps the rows
`keep` [b'] of that cache. The first call is the prefill (s = prompt width), each later one a
decode step (s = 1) whose attention mask is the previous one with one more column.

Why a second forward: at the tiny model's sizes a decode step is mostly Python. transformers'
Qwen3 forward builds a causal mask, grows a DynamicCache by `torch.cat` and threads keyword
arguments through every layer at every step (measured on the tiny model, bf16, one thread:
1.3 / 2.3 / 11.2 ms a step at 8 / 64 / 512 rows against 0.8 / 1.8 / 9.9 for `LeanQwen3`).
`LeanQwen3` calls the model's own modules and transformers' own SDPA attention function, in
the order transformers' Qwen3 forward does, with the mask transformers would build (a boolean
[b, 1, 1, L] padding mask, or none when no row is padded), over a key/value cache written
in place (grown by doubling). Its logits equal transformers' bit for bit (tests/test_engine.py
checks it at every step, padded and unpadded, shrinking batches included), so a seeded draw,
and with it every pool and cache key, is what transformers' forward gives. It serves only the
models whose forward it copies (`lean_supported`); every other model keeps transformers'. As
that copy is of one transformers release's forward (and a GPU's kernels are not this CPU's),
each engine checks it once more where it runs: its first decode step runs both forwards and
compares the logits; on any difference the engine warns and keeps transformers' forward
(`TransformersEngine._sample`), so a draw is always transformers'.
"""
from __future__ import annotations

import inspect

import torch


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


class HFForward:
    """transformers' forward with its own cache: any causal LM."""

    def __init__(self, model):
        self.model, self.past = model, None
        self.cache_kw, self.last_only = _cache_kwarg(model), _last_logits_kwargs(model)

    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        res = self.model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                         **{self.cache_kw: self.past}, **self.last_only)
        self.past = getattr(res, "cache", None) or res.past_key_values
        return res.logits[:, -1, :]

    def select(self, keep: torch.Tensor) -> None:
        assert self.past is not None, "select before the prefill"
        self.past.batch_select_indices(keep)


def lean_supported(model) -> bool:
    """The models whose forward `LeanQwen3` copies: transformers' Qwen3 with SDPA attention,
    every layer full attention, no hub kernels swapped in."""
    cfg = getattr(model, "config", None)
    layer_types = getattr(cfg, "layer_types", None)
    return (type(model).__name__ == "Qwen3ForCausalLM" and cfg is not None and layer_types is not None
            and getattr(cfg, "_attn_implementation", None) == "sdpa"
            and all(t == "full_attention" for t in layer_types[:cfg.num_hidden_layers])
            and not getattr(model, "use_kernels", False))


def _widened(buf: torch.Tensor, columns: int) -> torch.Tensor:
    """buf [b, heads, L, d] copied into the first L of `columns` positions (the rest unset)."""
    out = buf.new_empty((buf.shape[0], buf.shape[1], columns, buf.shape[3]))
    out[:, :, :buf.shape[2]] = buf
    return out


class LeanQwen3:
    """Prefill by transformers' forward, then decode steps of the same arithmetic (see the
    module docstring) over preallocated keys and values [b, kv_heads, columns, head_dim],
    written in place; `room` columns past the prompt at first, doubled when full, never more
    than `capacity` (prompt width + the draw's max_new_tokens)."""

    def __init__(self, model, capacity: int, room: int = 64, check: bool = False):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
        self.model, self.capacity, self.room = model, capacity, room
        self.attention, self.rotary = sdpa_attention_forward, apply_rotary_pos_emb
        self.prefill: HFForward | None = HFForward(model)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        # check: the first decode step also runs transformers' forward and compares (`equal`);
        # on a difference transformers' forward serves the rest of the draw (`theirs`)
        self.check = check
        self.equal: bool | None = None
        self.theirs: HFForward | None = None

    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.prefill is not None:
            logits = self.prefill(ids, attention_mask, position_ids)
            self._take_cache(self.prefill.past, attention_mask.shape[1])
            self.theirs = self.prefill if self.check else None
            self.prefill = None
            return logits
        if self.theirs is None:
            return self._step(ids, attention_mask, position_ids)
        logits = self.theirs(ids, attention_mask, position_ids)
        if self.equal is None:
            self.equal = torch.equal(self._step(ids, attention_mask, position_ids), logits)
            if self.equal:
                self.theirs = None
        return logits

    def _take_cache(self, past, width: int) -> None:
        """The prefill's keys and values copied into buffers with `room` more columns."""
        columns = min(self.capacity, width + self.room)
        self.keys = [_widened(layer.keys, columns) for layer in past.layers]
        self.values = [_widened(layer.values, columns) for layer in past.layers]

    def _make_room(self, length: int) -> None:
        """Buffers that hold `length` columns: doubled (up to the capacity) when full. Not the
        whole capacity at once: a long budget (3,072 new tokens at Qwen3-1.7B: 28 layers x 8 heads
        x 128) would reserve for every row the memory of the longest possible response, where
        most rows stop early and leave the batch; doubling copies each column O(1) times."""
        have = self.keys[0].shape[2]
        if length > have:
            columns = min(self.capacity, max(length, 2 * have))
            self.keys = [_widened(k, columns) for k in self.keys]
            self.values = [_widened(v, columns) for v in self.values]

    def select(self, keep: torch.Tensor) -> None:
        self.keys = [k[keep] for k in self.keys]
        self.values = [v[keep] for v in self.values]
        if self.theirs is not None:
            self.theirs.select(keep)

    def _step(self, ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Qwen3Model.forward then Qwen3ForCausalLM's head, for one new token a row: the same
        modules and functions in the same order. The mask is what transformers' create_causal_mask
        gives SDPA for one query: none when no key is padding (the kernel then runs unmasked),
        else the padding mask as booleans [b, 1, 1, L]."""
        m, length = self.model.model, attention_mask.shape[1]
        self._make_room(length)
        mask = None if bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :]
        hidden = m.embed_tokens(ids)
        cos, sin = m.rotary_emb(hidden, position_ids)
        for i, layer in enumerate(m.layers[:m.config.num_hidden_layers]):
            residual = hidden
            hidden = residual + self._attend(layer.self_attn, layer.input_layernorm(hidden), cos, sin, mask, i, length)
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = m.norm(hidden)
        return self.model.lm_head(hidden[:, -1:, :])[:, -1, :]

    def _attend(self, attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                i: int, length: int) -> torch.Tensor:
        """Qwen3Attention.forward with the new key and value written into column length - 1."""
        shape = (*x.shape[:-1], -1, attn.head_dim)
        q = attn.q_norm(attn.q_proj(x).view(shape)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(shape)).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = self.rotary(q, k, cos, sin)
        self.keys[i][:, :, length - 1:length] = k
        self.values[i][:, :, length - 1:length] = v
        out, _ = self.attention(attn, q, self.keys[i][:, :, :length], self.values[i][:, :, :length], mask,
                                dropout=0.0, scaling=attn.scaling, sliding_window=attn.sliding_window)
        return attn.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())


def sampler_forward(model, capacity: int, lean: bool = True, check: bool = False) -> HFForward | LeanQwen3:
    """The forward a draw of at most `capacity` tokens a row (prompt + new) runs on; `check`:
    the lean step proves itself against transformers' forward on its first step (LeanQwen3)."""
    return LeanQwen3(model, capacity, check=check) if lean and lean_supported(model) else HFForward(model)
