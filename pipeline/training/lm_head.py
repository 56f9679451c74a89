"""Memory-bounded token log-probs and entropy: a chunked, fused LM head with its own backward.

Contract. For hidden states h [N, H] (one row per response token, the LM head's input),
head weight W [V, H] (optional bias b [V]), target ids y [N] and temperature tau:

    z_i   = (h_i @ W.T + b).float() / tau                  fp32 logits of row i, [V] (fp64 for fp64 inputs)
    lse_i = logsumexp_j z_ij
    lp_i  = z_{i, y_i} - lse_i                              log softmax(z_i)[y_i]
    H_i   = lse_i - sum_j p_ij z_ij = -sum_j p_ij log p_ij  entropy, p_i = softmax(z_i)

The logits never exist for all N rows at once: the forward walks row chunks of
`chunk_tokens`, keeps lse_i (and H_i), and the backward recomputes each chunk's logits
from the saved (h, W, y, lse). With upstream gradient g_i = dL/dlp_i:

    dL/dz_ij = g_i * (1[j = y_i] - p_ij),  p_ij = exp(z_ij - lse_i)
    dL/dh_i  = (1/tau) sum_j dL/dz_ij W_j          dL/dW_j = (1/tau) sum_i dL/dz_ij h_i
    dL/db_j  = (1/tau) sum_i dL/dz_ij

Peak extra memory is one chunk's [chunk_tokens, V] fp32 logits plus their softmax
(1024 x 151,936 x 4 B = 0.62 GB each), instead of N x V, plus: a compute-dtype copy of W when
its dtype differs (bf16 under autocast: 2 B x V x H, the copy autocast would make too), and in
backward an fp32 [V, H] grad-W accumulator (no extra copy when W is fp32). This is the pure-PyTorch form of
prime-rl's `_SequenceChunkedLogProbEntropyFn` and verl's `FusedLinearForPPOFunction`.

Entropy is a diagnostic: it is computed under no_grad and returned detached (marked
non-differentiable), so an entropy bonus cannot be trained through this function.

Precision. The matmul runs in the autocast dtype when autocast is on for hidden's device
(bf16 on CUDA), else in hidden's dtype (W is cast to it); the product is upcast to fp32
before the division by tau and the logsumexp. Gradients come back in the input dtypes;
grad W is accumulated over chunks in at least fp32.

Usage (what `policy.token_logprobs` does with it):

    h = hidden_for_targets(model, batch.input_ids, batch.attention_mask, batch.sel_rows, batch.sel_cols,
                           batch.position_ids)
    w, b = lm_head_weight(model)
    lp_flat, ent_flat = chunked_logprobs(h, w, batch.targets_flat, tau, with_entropy=True, bias=b)
    lp = scatter_rows(lp_flat, batch)      # [B, T]

Tied embeddings need nothing special: W is the shared Parameter itself, so its gradient
from the head and from the embedding lookup add up in the autograd graph.
"""
from __future__ import annotations

import torch
from torch import Tensor

from pipeline.core import gemm, kernels

VOCAB_BLOCK = 16384   # backward reduces over the vocabulary in blocks of this many ids


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    """The dtype autocast would run `hidden @ weight.T` in (hidden's dtype without autocast)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def _chunk_logits(h_c: Tensor, w: Tensor, b: Tensor | None, temperature: float) -> Tensor:
    """fp32 logits [c, V] of one row chunk; h_c, w, b already in the compute dtype."""
    if kernels.applies(h_c, w):      # the reproducible product (pipeline/core/gemm.py): same bits on any x86
        z = gemm.mm(h_c, w.T)
        if b is not None:
            z.add_(b)
    else:
        z = h_c @ w.T if b is None else torch.addmm(b, h_c, w.T)
    z = z.to(torch.promote_types(z.dtype, torch.float32))   # fp64 stays fp64
    return z.div_(temperature)                               # in place: one fp32 [c, V] buffer


class _ChunkedLogProbFn(torch.autograd.Function):
    """(hidden, weight, bias, targets) -> (lp [N] fp32, entropy [N] fp32 or empty); see module doc."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_tokens, with_entropy):
        cdt = _compute_dtype(hidden)
        n = hidden.shape[0]
        out_dtype = torch.promote_types(cdt, torch.float32)   # fp32 (fp64 only for fp64 inputs)
        lp = torch.empty(n, dtype=out_dtype, device=hidden.device)
        lse = torch.empty_like(lp)
        ent = torch.empty(n if with_entropy else 0, dtype=out_dtype, device=hidden.device)
        # Cast W once (not per chunk); autocast off so the matmul dtype is exactly cdt.
        with torch.autocast(hidden.device.type, enabled=False), torch.no_grad():
            w = weight.to(cdt)
            b = None if bias is None else bias.to(cdt)
            for s in range(0, n, chunk_tokens):
                e = min(s + chunk_tokens, n)
                z = _chunk_logits(hidden[s:e].to(cdt), w, b, temperature)
                lse[s:e] = torch.logsumexp(z, dim=-1)
                lp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
                if with_entropy:
                    # -sum p log p, in place (two [c, V] buffers): no cancellation between lse
                    # and sum p z, and no einsum/bmm row dot (those lose ~3e-4 relative over
                    # 151,936 terms on CPU).
                    logp = z.sub_(lse[s:e, None])
                    ent[s:e] = -(torch.exp(logp).mul_(logp)).sum(-1)
                del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk_tokens, ctx.cdt = temperature, chunk_tokens, cdt
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):
        # _grad_ent is ignored: entropy is marked non-differentiable (a diagnostic).
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        tau, cdt = ctx.temperature, ctx.cdt
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = torch.promote_types(cdt, torch.float32)   # accumulators: fp32 (fp64 for fp64)
        g_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        g_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        g_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(cdt)
            b = None if bias is None else bias.to(cdt)
            for s in range(0, hidden.shape[0], ctx.chunk_tokens):
                e = min(s + ctx.chunk_tokens, hidden.shape[0])
                h_c = hidden[s:e].to(cdt)
                gz = _chunk_grad_logits(_chunk_logits(h_c, w, b, tau), lse[s:e], targets[s:e],
                                        grad_lp[s:e].to(lse.dtype), tau)
                _accumulate_vocab_blocks(gz, w, h_c, g_h[s:e] if g_h is not None else None, g_w)
                if g_b is not None:     # need_b
                    g_b += gz.sum(0)
                del gz
        g_h = None if g_h is None else g_h.to(hidden.dtype)
        g_w = None if g_w is None else g_w.to(weight.dtype)
        g_b = None if g_b is None else g_b.to(bias.dtype)
        return g_h, g_w, g_b, None, None, None, None


def _accumulate_vocab_blocks(gz: Tensor, w: Tensor, h_c: Tensor, g_h_c: Tensor | None,
                             g_w: Tensor | None) -> None:
    """g_h_c += gz @ w and g_w += gz.T @ h_c, one vocab block at a time. Blocking the reduction
    over V (151,936 terms) into fp32 partial sums keeps small chunks (a 1-row matmul is a
    sequential dot product) as accurate as big ones, and never copies all of gz to bf16."""
    for s in range(0, w.shape[0], VOCAB_BLOCK):
        e = min(s + VOCAB_BLOCK, w.shape[0])
        gz_b = gz[:, s:e].to(w.dtype)
        if g_h_c is not None:
            g_h_c += kernels.matmul(gz_b, w[s:e])
        if g_w is not None:
            g_w[s:e] += kernels.matmul(gz_b.T, h_c)


def _chunk_grad_logits(z: Tensor, lse_c: Tensor, y_c: Tensor, g_c: Tensor, tau: float) -> Tensor:
    """dL/d(h W^T + b) for one chunk, fp32 [c, V]: g_i (1[j = y_i] - p_ij) / tau, in place on z."""
    p = z.sub_(lse_c[:, None]).exp_()            # softmax, reusing z's memory
    gz = p.mul_(-(g_c / tau)[:, None])
    gz.scatter_add_(1, y_c[:, None], (g_c / tau)[:, None])
    return gz


def _validate(hidden, weight, targets, temperature, chunk_tokens, bias, check_ids: bool) -> None:
    where = "pipeline/training/lm_head.py chunked_logprobs"
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(f"{where}: expected hidden [N, H], weight [V, H], targets [N]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{where}: hidden size {hidden.shape[1]} != weight's {weight.shape[1]} "
                         f"(pass the LM head weight [V, H], not its transpose)")
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"{where}: {hidden.shape[0]} hidden rows but {targets.shape[0]} targets "
                         f"(select both with the same response mask)")
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"{where}: hidden/weight must be floating point, got {hidden.dtype}/{weight.dtype}")
    if targets.dtype != torch.long:
        raise ValueError(f"{where}: targets must be torch.long token ids, got {targets.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{where}: bias shape {tuple(bias.shape)} != ({weight.shape[0]},)")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"{where}: chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if not temperature > 0:
        raise ValueError(f"{where}: temperature must be > 0, got {temperature!r}")
    if len({hidden.device, weight.device, targets.device}) != 1:
        raise ValueError(f"{where}: hidden, weight, targets on different devices "
                         f"({hidden.device}, {weight.device}, {targets.device})")
    # One host sync, so optional: an out-of-range id would otherwise be a CUDA device-side
    # assert. The trainer checks its pool's ids once instead (loop.check_token_ids).
    if check_ids and targets.numel() and not bool(((targets >= 0) & (targets < weight.shape[0])).all()):
        raise ValueError(f"{where}: target ids must lie in [0, {weight.shape[0]}), got "
                         f"min {int(targets.min())}, max {int(targets.max())}")


def chunked_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                     chunk_tokens: int = 1024, with_entropy: bool = False, bias: Tensor | None = None,
                     check_ids: bool = True) -> tuple[Tensor, Tensor | None]:
    """hidden [N, H] (any float dtype, may require grad), weight [V, H] (the LM head / tied embedding
    weight, may require grad), targets [N] long -> (lp [N] float32 with grad, entropy [N] float32 detached or None).
    lp_i = log softmax(hidden_i @ weight.T / temperature)[targets_i], computed per chunk of `chunk_tokens`
    rows in float32 (logits upcast to fp32 before /temperature and logsumexp). Entropy carries no
    gradient. fp64 inputs (tests) give fp64 outputs. Raises ValueError on bad shapes, dtypes, devices,
    ids (check_ids: one host sync), chunk_tokens < 1 or temperature <= 0."""
    _validate(hidden, weight, targets, temperature, chunk_tokens, bias, check_ids)
    lp, ent = _ChunkedLogProbFn.apply(hidden, weight, bias, targets, float(temperature),
                                      chunk_tokens, with_entropy)
    return lp, (ent if with_entropy else None)


def lm_head_weight(model) -> tuple[Tensor, Tensor | None]:
    """(weight [V, H], bias [V] or None) of an HF causal LM's output layer. With tied embeddings
    this is the embedding Parameter itself, so gradients reach it through both uses."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"pipeline/training/lm_head.py: {type(model).__name__} has no output embedding "
                         f"layer with a weight (get_output_embeddings() gave {head!r})")
    return head.weight, getattr(head, "bias", None)


def _decoder(model):
    """The transformer body (embeddings, blocks, final norm) of an HF causal LM."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    body = body if body is not None else getattr(model, "model", None)
    if body is None:
        raise ValueError(f"pipeline/training/lm_head.py: cannot find the decoder body of {type(model).__name__} "
                         f"(neither get_decoder() nor .model)")
    return body


def hidden_for_targets(model, input_ids: Tensor, attention_mask: Tensor | None, rows: Tensor, cols: Tensor,
                       position_ids: Tensor | None = None, **attention_kwargs) -> Tensor:
    """hidden [N, H]: the final-norm hidden state at (rows[k], cols[k]) for every response
    token k, in the order of `rows` / `cols` (policy.make_batch builds them on the host, so
    selecting costs no device-to-host read). Padded rows pass `attention_mask`; packed rows
    pass `position_ids` restarting per row and no mask, and `attention_kwargs` (flash
    attention's cu_seq_lens, Batch.attention_kwargs). No cache: with one, transformers
    would not isolate packed rows."""
    if rows.shape != cols.shape or rows.dim() != 1:
        raise ValueError(f"pipeline/training/lm_head.py hidden_for_targets: rows {tuple(rows.shape)} and cols "
                         f"{tuple(cols.shape)} must be the same [N]")
    out = _decoder(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False, **attention_kwargs)
    states = out.last_hidden_state                                     # [B, L, H]
    return states[rows.to(states.device), cols.to(states.device)]
