"""Teacher-forced token log-probs and entropy of sampled responses under a causal LM.

Rows are `prompt + response`, right-padded, positions 0..L-1 (a right pad never
influences earlier tokens under causal attention). For response token t of row b the
predicting logit sits at column len(prompt_b) - 1 + t. Log-probs use softmax(logits / tau),
the rollout engine's convention (spec section 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    input_ids: torch.Tensor       # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    gather_cols: torch.Tensor     # [B, T] long: logit column predicting response token t
    targets: torch.Tensor         # [B, T] long: response token ids (pad where mask 0)
    mask: torch.Tensor            # [B, T] float: 1 on response tokens (incl. EOS)


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


def token_logprobs(model, batch: Batch, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(lp [B, T], entropy [B, T] or None); lp carries gradient if grad is enabled.
    Padding positions hold 0 (multiply by batch.mask before summing anyway)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    cols = batch.gather_cols[:, :, None].expand(-1, -1, logits.shape[-1])
    logp = torch.log_softmax(logits.gather(1, cols).float() / temperature, dim=-1)  # [B, T, V]
    lp = logp.gather(2, batch.targets[:, :, None]).squeeze(2) * batch.mask
    entropy = None
    if with_entropy:
        entropy = -(logp.exp() * logp).sum(-1) * batch.mask
    return lp, entropy
