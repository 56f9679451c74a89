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
(`TransformersEngine._sample`) and the lean buffers are freed, so a draw is always
transformers'. The one input that differs later is the keys' and values' layout (views of
wider buffers, where transformers passes contiguous tensors): each new layout (masked or
unmasked path, rows, buffer width: after every shrink and growth) is checked once against
contiguous copies, and the copies are passed from then on if any layer differs.

Padding: the prefill of left-padded rows runs under `prefill_mask`, in which a pad query
attends to itself instead of to nothing (a query without keys is NaN on some kernels, and a
NaN pad key reaches real rows); the real rows' logits are unchanged, bit for bit.
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


def _full_attention_sdpa(model) -> bool:
    """transformers' SDPA attention and every layer full attention (no sliding window): the
    models whose prefill mask `prefill_mask` builds."""
    cfg = getattr(model, "config", None)
    layer_types = getattr(cfg, "layer_types", None) or []
    return (cfg is not None and getattr(cfg, "_attn_implementation", None) == "sdpa"
            and all(t == "full_attention" for t in layer_types[:cfg.num_hidden_layers]))


def prefill_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The 4D boolean prefill mask [B, 1, W, W] of left-padded rows (attention_mask [B, W]):
    what transformers' create_causal_mask gives SDPA (key j <= query i and key j real), except
    that a pad query, whose keys are all padding, attends to itself. A query with no key at all
    comes out 0 or NaN depending on the kernel (CPU kernels give 0; GPU ones may give NaN), and
    a NaN pad key reaches real rows through the next layer's P @ V (0 * NaN). A pad query's
    output is never read and real queries never attend to pad keys, so the real rows compute
    exactly what they computed under transformers' own mask (a test checks it bit for bit)."""
    width = attention_mask.shape[1]
    real = attention_mask.bool()
    causal = torch.ones((width, width), dtype=torch.bool, device=real.device).tril()
    mask = causal[None, None] & real[:, None, None, :]
    return mask | torch.eye(width, dtype=torch.bool, device=real.device)[None, None]


class HFForward:
    """transformers' forward with its own cache: any causal LM. A padded prefill of a model
    with SDPA full attention gets `prefill_mask` (no query without a key)."""

    def __init__(self, model):
        self.model, self.past = model, None
        self.cache_kw, self.last_only = _cache_kwarg(model), _last_logits_kwargs(model)
        self.pad_safe = _full_attention_sdpa(model)

    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        mask = attention_mask
        if self.past is None and self.pad_safe and ids.shape[1] > 1 and not bool(attention_mask.all()):
            mask = prefill_mask(attention_mask)
        res = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                         **{self.cache_kw: self.past}, **self.last_only)
        self.past = getattr(res, "cache", None) or res.past_key_values
        return res.logits[:, -1, :]

    def select(self, keep: torch.Tensor) -> None:
        assert self.past is not None, "select before the prefill"
        self.past.batch_select_indices(keep)


def lean_supported(model) -> bool:
    """The models whose forward `LeanQwen3` copies: transformers' Qwen3 with SDPA attention,
    every layer full attention, no hub kernels swapped in."""
    return (type(model).__name__ == "Qwen3ForCausalLM" and getattr(model.config, "layer_types", None) is not None
            and _full_attention_sdpa(model) and not getattr(model, "use_kernels", False))


def _widened(buf: torch.Tensor, columns: int) -> torch.Tensor:
    """buf [b, heads, L, d] copied into the first L of `columns` positions (the rest unset)."""
    out = buf.new_empty((buf.shape[0], buf.shape[1], columns, buf.shape[3]))
    out[:, :, :buf.shape[2]] = buf
    return out


class LeanQwen3:
    """Prefill by transformers' forward, then decode steps of the same arithmetic (see the
    module docstring) over preallocated keys and values [b, kv_heads, columns, head_dim],
    written in place; `room` columns past the prompt at first, doubled when full, never more
    than `capacity` (prompt width + the draw's max_new_tokens).

    What it proves where it runs (each check appended to `checks`, one dict each):
    - `check`: the first decode step also runs transformers' forward and compares the logits
      (check "forward"); on a difference transformers' forward serves the rest of the draw
      (`theirs`) and the lean buffers are freed at once.
    - every attention layout: the only inputs that differ from transformers' are the keys and
      values, strided views of wider buffers where transformers holds contiguous tensors of
      the same values. At the first step of each layout not in `verified` (path masked or
      unmasked, rows, buffer columns: so the first step, and the first after each shrink and
      each growth) every layer's attention also runs on contiguous copies (check "attention");
      that step uses the copies' output, and on any difference every later step passes the
      copies too (`contiguous`), as transformers does. `verified` is the engine's, kept across
      draws."""

    def __init__(self, model, capacity: int, room: int = 64, check: bool = False,
                 verified: set | None = None):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
        self.model, self.capacity, self.room = model, capacity, room
        self.attention, self.rotary = sdpa_attention_forward, apply_rotary_pos_emb
        self.prefill: HFForward | None = HFForward(model)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.check = check
        self.equal: bool | None = None
        self.theirs: HFForward | None = None
        self.verified: set = verified if verified is not None else set()
        self.contiguous = False
        self.checks: list[dict] = []
        self.steps = 0          # decode steps so far

    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.prefill is not None:
            logits = self.prefill(ids, attention_mask, position_ids)
            self._take_cache(self.prefill.past, attention_mask.shape[1])
            self.theirs = self.prefill if self.check else None
            self.prefill = None
            return logits
        self.steps += 1
        if self.theirs is None:
            return self._step(ids, attention_mask, position_ids)
        logits = self.theirs(ids, attention_mask, position_ids)
        if self.equal is None:
            mine = self._step(ids, attention_mask, position_ids)
            self.equal = torch.equal(mine, logits)
            self.checks.append(self._record("forward", attention_mask, self.equal))
            if self.equal:
                self.theirs = None          # transformers' cache goes
            else:
                self.keys, self.values = [], []     # the lean buffers go: transformers' serves the draw
        return logits

    def _record(self, kind: str, attention_mask: torch.Tensor, equal: bool) -> dict:
        return {"check": kind, "step": self.steps, "path": "unmasked" if bool(attention_mask.all()) else "masked",
                "rows": attention_mask.shape[0], "columns": self.keys[0].shape[2] if self.keys else None,
                "equal": equal}

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

    def _layout(self, mask: torch.Tensor | None, rows: int, length: int) -> tuple | None:
        """The attention layout this step uses, if it still needs its check (None: views that
        are contiguous already, copies passed anyway, or a layout verified before)."""
        columns = self.keys[0].shape[2]
        if self.contiguous or columns == length:
            return None
        layout = ("unmasked" if mask is None else "masked", rows, columns)
        return None if layout in self.verified else layout

    def _step(self, ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Qwen3Model.forward then Qwen3ForCausalLM's head, for one new token a row: the same
        modules and functions in the same order. The mask is what transformers' create_causal_mask
        gives SDPA for one query: none when no key is padding (the kernel then runs unmasked),
        else the padding mask as booleans [b, 1, 1, L]."""
        m, length = self.model.model, attention_mask.shape[1]
        self._make_room(length)
        mask = None if bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :]
        layout = self._layout(mask, ids.shape[0], length)
        same: list[bool] = []
        hidden = m.embed_tokens(ids)
        cos, sin = m.rotary_emb(hidden, position_ids)
        for i, layer in enumerate(m.layers[:m.config.num_hidden_layers]):
            residual = hidden
            out = self._attend(layer.self_attn, layer.input_layernorm(hidden), cos, sin, mask, i, length,
                               same if layout is not None else None)
            hidden = residual + out
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        if layout is not None:
            self.checks.append(self._record("attention", attention_mask, all(same)))
            if all(same):
                self.verified.add(layout)
            else:
                self.contiguous = True
        hidden = m.norm(hidden)
        return self.model.lm_head(hidden[:, -1:, :])[:, -1, :]

    def _attend(self, attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                i: int, length: int, same: list | None) -> torch.Tensor:
        """Qwen3Attention.forward with the new key and value written into column length - 1.
        `same` (a check step): the attention also runs on contiguous copies of the keys and
        values, whose output this step uses; whether the two agree is appended to `same`."""
        shape = (*x.shape[:-1], -1, attn.head_dim)
        q = attn.q_norm(attn.q_proj(x).view(shape)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(shape)).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = self.rotary(q, k, cos, sin)
        self.keys[i][:, :, length - 1:length] = k
        self.values[i][:, :, length - 1:length] = v
        keys, values = self.keys[i][:, :, :length], self.values[i][:, :, :length]
        if self.contiguous or same is not None:
            copies = self._sdpa(attn, q, keys.contiguous(), values.contiguous(), mask)
            if same is None:
                return attn.o_proj(copies)
            same.append(torch.equal(self._sdpa(attn, q, keys, values, mask), copies))
            return attn.o_proj(copies)
        return attn.o_proj(self._sdpa(attn, q, keys, values, mask))

    def _sdpa(self, attn, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        """transformers' SDPA attention function, its output [b, 1, heads * head_dim]."""
        out, _ = self.attention(attn, q, keys, values, mask, dropout=0.0, scaling=attn.scaling,
                                sliding_window=attn.sliding_window)
        return out.reshape(*q.shape[:1], q.shape[2], -1).contiguous()


def sampler_forward(model, capacity: int, lean: bool = True, check: bool = False,
                    verified: set | None = None) -> HFForward | LeanQwen3:
    """The forward a draw of at most `capacity` tokens a row (prompt + new) runs on; `check`:
    the lean step proves itself against transformers' forward on its first step, `verified`:
    the attention layouts proven before (LeanQwen3)."""
    if lean and lean_supported(model):
        return LeanQwen3(model, capacity, check=check, verified=verified)
    return HFForward(model)
