"""Teacher-forced token log-probs and entropy of sampled responses under a causal LM.

A batch holds B rows `prompt + response` in one of two layouts (`make_batch`):
- padded: [B, L] right-padded with an attention mask, positions 0..L-1 (a right pad never
  influences earlier tokens under causal attention);
- packed: all rows concatenated into one sequence [1, sum of lengths], no padding at all,
  `position_ids` restarting at 0 for every row and no attention mask, so the attention
  kernel isolates rows (transformers builds a block-diagonal causal mask for sdpa / eager /
  flex attention once per forward; `use_cache=False` is essential: with a cache the rows
  would silently attend to each other). Flash attention's varlen kernels get the rows'
  boundaries as `cu_seq_lens` and their longest length, built here on the host with the
  batch: without them transformers derives both from `position_ids` in every layer, a
  device-to-host read each. A micro-batch then costs its real tokens, not rows x its
  longest row.
- bucketed (`Buckets`, where packing's attention is unavailable: the CPU): the rows sorted by
  length and split into a few padded batches, each as wide as its own longest row
  (packing.bucket_rows chooses the split), one forward each; their [b, T_b] log-probs are
  put back into the rows' original order, so the result (and its gradient) is the padded
  layout's up to rounding: every row's values depend on that row alone.
Either way response token t of row b is predicted at one position of the model's output:
`sel_rows[k], sel_cols[k]` for the k-th response token in row-major (b, t) order, and
`flat_index[k] = b * T + t` puts its log-prob back into the [B, T] result. These index
tensors are built on the host with the batch: nothing reads the mask back from the device.
Log-probs use softmax(logits / tau), the rollout engine's convention (spec section 1).

Two implementations with one result (parity tests hold them to rounding):
- `chunked` (default): the model body gives hidden states; only the positions that predict
  response tokens go through the LM head, a chunk of tokens at a time, in fp32
  (`lm_head.py`). Peak memory is one [chunk, V] block instead of [B, T, V] copies, which at
  Qwen3's V = 151,936 is what lets a GPU hold an update at all.
- `full`: the plain logits path, [B, L, V]; the reference implementation.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from pipeline.models import runtime
from pipeline.training import shared_prompt
from pipeline.training.lm_head import chunked_logprobs, hidden_for_targets, lm_head_weight
from pipeline.training.packing import bucket_rows


@dataclass
class Batch:
    input_ids: torch.Tensor              # [B, L] padded | [1, sum of lengths] packed
    attention_mask: torch.Tensor | None  # [B, L] long (padded) | None (packed)
    position_ids: torch.Tensor | None    # None (padded: 0..L-1) | [1, sum] restarting per row
    sel_rows: torch.Tensor               # [N] long: output row predicting response token k
    sel_cols: torch.Tensor               # [N] long: its column
    targets_flat: torch.Tensor           # [N] long: response token ids
    flat_index: torch.Tensor             # [N] long: b * T + t
    mask: torch.Tensor                   # [B, T] float: 1 on response tokens (incl. EOS)
    cu_seq_lens: torch.Tensor | None = None   # packed: [B + 1] int32 row starts, then the total
    max_length: int | None = None             # packed: the longest row (a host int)
    share: shared_prompt.Share | None = None  # padded rows repeating prompts: their distinct tokens

    @property
    def packed(self) -> bool:
        return self.position_ids is not None

    def attention_kwargs(self) -> dict:
        """What the model's forward gets besides ids, mask and positions: for packed rows the
        varlen boundaries flash attention reads (transformers' FlashAttentionKwargs), which
        every other attention implementation ignores."""
        if not self.packed or self.cu_seq_lens is None:
            return {}
        return {"cu_seq_lens_q": self.cu_seq_lens, "cu_seq_lens_k": self.cu_seq_lens,
                "max_length_q": self.max_length, "max_length_k": self.max_length}

    def to(self, device: torch.device) -> "Batch":
        """On `device`; from pinned host memory without waiting for the GPU when on CUDA."""
        def move(t):
            if not isinstance(t, torch.Tensor) or t.device == device:
                return t
            if device.type == "cuda":
                return t.pin_memory().to(device, non_blocking=True)
            return t.to(device)
        return Batch(**{f.name: move(getattr(self, f.name)) for f in fields(self)})


@dataclass
class Buckets:
    """A padded micro-batch run as several padded batches of similar-length rows: parts[k]
    holds rows rows[k] (original indices); `inverse` puts the parts' concatenated rows back
    in the original order; `mask` is the whole micro-batch's [B, T]."""
    parts: list[Batch]
    inverse: torch.Tensor                # [B] long
    mask: torch.Tensor                   # [B, T] float
    packed = False

    def to(self, device: torch.device) -> "Buckets":
        return Buckets([p.to(device) for p in self.parts], self.inverse.to(device), self.mask.to(device))


def make_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int,
               packed: bool = False, bucket_overhead: float | None = None) -> Batch | Buckets:
    """Rows prompt + response, padded [B, L] or packed [1, sum]; padded rows in buckets of
    similar length when `bucket_overhead` (a forward's fixed cost in padded tokens,
    packing.bucket_rows) is given and splitting pays; see the module docstring."""
    if bucket_overhead is not None and not packed and len(response_ids) > 1:
        rows = bucket_rows([len(p) + len(r) for p, r in zip(prompt_ids, response_ids)], bucket_overhead)
        if len(rows) > 1:
            return _buckets(prompt_ids, response_ids, pad_id, rows)
    return _one_batch(prompt_ids, response_ids, pad_id, packed)


def _buckets(prompt_ids, response_ids, pad_id: int, rows: list[list[int]]) -> Buckets:
    parts = [_one_batch([prompt_ids[i] for i in r], [response_ids[i] for i in r], pad_id, False) for r in rows]
    order = torch.tensor([i for r in rows for i in r], dtype=torch.long)
    mask = torch.zeros((len(response_ids), max(max(map(len, response_ids)), 1)))
    for b, r in enumerate(response_ids):
        mask[b, :len(r)] = 1.0
    return Buckets(parts, torch.argsort(order), mask)


def _one_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int, packed: bool) -> Batch:
    rows = [p + r for p, r in zip(prompt_ids, response_ids)]
    t_max = max(max(map(len, response_ids)), 1)
    mask = torch.zeros((len(rows), t_max))
    sel_rows, targets = [], []
    sel_cols: list[int] = []
    flat: list[int] = []
    offset = 0
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        start = offset if packed else 0
        sel_rows += [0 if packed else b] * len(r)
        sel_cols += range(start + len(p) - 1, start + len(p) - 1 + len(r))
        targets += r
        flat += range(b * t_max, b * t_max + len(r))
        mask[b, :len(r)] = 1.0
        offset += len(p) + len(r)
    long = lambda xs: torch.tensor(xs, dtype=torch.long)   # noqa: E731
    cu_seq_lens = max_length = None
    if packed:
        ids = long([x for row in rows for x in row])[None]
        positions = long([i for row in rows for i in range(len(row))])[None]
        attn = None
        starts = [0]
        for row in rows:
            starts.append(starts[-1] + len(row))
        cu_seq_lens, max_length = torch.tensor(starts, dtype=torch.int32), max(map(len, rows))
    else:
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, :len(row)] = long(row)
            attn[b, :len(row)] = 1
        positions = None
    share = None
    if not packed and shared_prompt.may_serve():
        share = shared_prompt.prompt_share(prompt_ids, response_ids, ids.shape[1])
    return Batch(ids, attn, positions, long(sel_rows), long(sel_cols), long(targets), long(flat), mask,
                 cu_seq_lens, max_length, share)


def scatter_rows(flat: torch.Tensor, batch: Batch) -> torch.Tensor:
    """[N] values of the response tokens -> [B, T] (0 on padding); differentiable."""
    out = torch.zeros(batch.mask.numel(), dtype=flat.dtype, device=flat.device)
    return out.scatter(0, batch.flat_index, flat).view(batch.mask.shape)


def token_logprobs(model, batch: Batch | Buckets, temperature: float = 1.0, with_entropy: bool = False,
                   impl: str = "chunked", chunk_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(lp [B, T] fp32, entropy [B, T] fp32 or None); lp carries gradient if grad is
    enabled, entropy never does (a diagnostic). Padding positions hold 0. The forward runs
    under the attention kernels chosen for the batch's device (runtime.attention_backends:
    the policy's, the reference's and the base model's forwards all come through here)."""
    ids = batch.parts[0].input_ids if isinstance(batch, Buckets) else batch.input_ids
    with runtime.attention_backends(ids.device):
        return _token_logprobs(model, batch, temperature, with_entropy, impl, chunk_tokens)


def _token_logprobs(model, batch: Batch | Buckets, temperature: float, with_entropy: bool, impl: str,
                    chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, Buckets):
        return _bucketed_logprobs(model, batch, temperature, with_entropy, impl, chunk_tokens)
    if impl == "full":
        return _full_logprobs(model, batch, temperature, with_entropy)
    if shared_prompt.serves(model, batch):   # each repeated prompt once through the token-wise layers
        assert batch.share is not None and batch.attention_mask is not None
        hidden = shared_prompt.shared_hidden(model, batch.input_ids, batch.attention_mask, batch.share)
    else:
        hidden = hidden_for_targets(model, batch.input_ids, batch.attention_mask, batch.sel_rows, batch.sel_cols,
                                    batch.position_ids, **batch.attention_kwargs())
    weight, bias = lm_head_weight(model)
    lp_flat, ent_flat = chunked_logprobs(hidden, weight, batch.targets_flat, temperature, chunk_tokens,
                                         with_entropy, bias, check_ids=False)
    lp = scatter_rows(lp_flat, batch)
    entropy = scatter_rows(ent_flat.detach(), batch) if ent_flat is not None else None     # with_entropy
    return lp, entropy


def _full_logprobs(model, batch: Batch, temperature: float, with_entropy: bool):
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids, use_cache=False, **batch.attention_kwargs()).logits
    picked = logits[batch.sel_rows, batch.sel_cols]                                   # [N, V]
    logp = torch.log_softmax(picked.to(torch.promote_types(picked.dtype, torch.float32)) / temperature, dim=-1)
    lp = scatter_rows(logp.gather(1, batch.targets_flat[:, None]).squeeze(1), batch)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = scatter_rows(-(logp.exp() * logp).sum(-1), batch)
    return lp, entropy


def _bucketed_logprobs(model, buckets: Buckets, temperature: float, with_entropy: bool, impl: str,
                       chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward per bucket; each [b, T_b] result is zero-padded to T, the parts stacked
    and their rows put back in the original order (index_select: differentiable)."""
    width = buckets.mask.shape[1]
    lps, ents = [], []
    for part in buckets.parts:
        lp, ent = _token_logprobs(model, part, temperature, with_entropy, impl, chunk_tokens)
        lps.append(F.pad(lp, (0, width - lp.shape[1])))
        if ent is not None:
            ents.append(F.pad(ent, (0, width - ent.shape[1])))
    lp = torch.cat(lps).index_select(0, buckets.inverse)
    return lp, (torch.cat(ents).index_select(0, buckets.inverse) if ents else None)
