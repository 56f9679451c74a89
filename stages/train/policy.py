"""Teacher-forced token log-probs and entropy of sampled responses under a causal LM.

Rows are `prompt + response`, right-padded, positions 0..L-1 (a right pad never
influences earlier tokens under causal attention). For response token t of row b the
predicting logit sits at column len(prompt_b) - 1 + t. Log-probs use softmax(logits / tau),
the rollout engine's convention (spec section 1).

Two implementations with one result (a parity test holds them to 1e-5):
- `chunked` (default): the model body gives hidden states; only the positions that predict
  response tokens go through the LM head, a chunk of tokens at a time, in fp32
  (`lm_head.py`). Peak memory is one [chunk, V] block instead of [B, T, V] copies, which at
  Qwen3's V = 151,936 is what lets a GPU hold an update at all.
- `full`: the plain logits path, [B, T, V] in fp32; the reference implementation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.train.lm_head import chunked_logprobs, hidden_for_targets, lm_head_weight


@dataclass
class Batch:
    input_ids: torch.Tensor       # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    gather_cols: torch.Tensor     # [B, T] long: logit column predicting response token t
    targets: torch.Tensor         # [B, T] long: response token ids (pad where mask 0)
    mask: torch.Tensor            # [B, T] float: 1 on response tokens (incl. EOS)

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(t.to(device, non_blocking=True) for t in
                       (self.input_ids, self.attention_mask, self.gather_cols, self.targets, self.mask)))


def make_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> Batch:
    rows = [p + r for p, r in zip(prompt_ids, response_ids)]
    width = max(map(len, rows))
    t_max = max(max(map(len, response_ids)), 1)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    cols = torch.zeros((len(rows), t_max), dtype=torch.long)
    targets = torch.full((len(rows), t_max), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), t_max))
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        ids[b, :len(p) + len(r)] = torch.tensor(p + r)
        attn[b, :len(p) + len(r)] = 1
        cols[b, :len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        targets[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[b, :len(r)] = 1.0
    return Batch(ids, attn, cols, targets, mask)



def token_logprobs(model, batch: Batch, temperature: float = 1.0, with_entropy: bool = False,
                   impl: str = "chunked", chunk_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(lp [B, T] fp32, entropy [B, T] fp32 or None); lp carries gradient if grad is
    enabled, entropy never does (a diagnostic). Padding positions hold 0."""
    if impl == "full":
        return _full_logprobs(model, batch, temperature, with_entropy)
    keep = batch.mask > 0
    hidden = hidden_for_targets(model, batch.input_ids, batch.attention_mask, batch.gather_cols, batch.mask)
    weight, bias = lm_head_weight(model)
    lp_flat, ent_flat = chunked_logprobs(hidden, weight, batch.targets[keep], temperature,
                                         chunk_tokens, with_entropy, bias)
    lp = torch.zeros(batch.mask.shape, dtype=lp_flat.dtype, device=lp_flat.device)
    lp = lp.masked_scatter(keep, lp_flat)     # row-major (b, t), the order hidden_for_targets uses
    entropy = None
    if with_entropy:
        entropy = torch.zeros_like(lp, requires_grad=False).masked_scatter(keep, ent_flat.detach())
    return lp, entropy


def _full_logprobs(model, batch: Batch, temperature: float, with_entropy: bool):
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    cols = batch.gather_cols[:, :, None].expand(-1, -1, logits.shape[-1])
    picked = logits.gather(1, cols)
    logp = torch.log_softmax(picked.to(torch.promote_types(picked.dtype, torch.float32)) / temperature, dim=-1)  # [B, T, V]
    lp = logp.gather(2, batch.targets[:, :, None]).squeeze(2) * batch.mask
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1) * batch.mask
    return lp, entropy
