"""The chunked fused LM head (pipeline/training/lm_head.py) against exact arithmetic.

A randomly initialised Qwen3ForCausalLM with the real vocabulary (151,936) and a tiny body:
log-probs, entropy and the gradient of every parameter, from the chunked path and from the
plain full-logits path, each compared with the same computation in float64 (the exact
reference), within the rounding tolerance of fp32 for quantities of that size
(tests/tolerance.py), tied and untied, for several chunk sizes and temperatures; in fp64
chunked and full agree to 1e-10. Plus the bf16/autocast path, a frozen head, input
validation, and (gpu marker) CUDA memory.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from pipeline.training.lm_head import chunked_logprobs, hidden_for_targets, lm_head_weight
from pipeline.training.policy import make_batch

from tolerance import assert_close, rounding_tol

VOCAB = 151_936
HIDDEN = 32
ATOL = 1e-5                    # small hand-made cases below (|values| ~ 1, a few terms)
CHUNKS = (1, 7, 4096)          # N = 11: 11 x 1, 7 + 4 (ragged), one chunk


def _model(tied: bool, std: float, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64,
                      tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(cfg)
    # Wider weights than the 0.02-std init, so the softmax is far from uniform and errors show.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model.to(dtype)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()
    # Ragged prompts and responses: 6 + 5 response tokens, padded columns in row 1.
    return make_batch([ids(4), ids(6)], [ids(6), ids(5)], pad_id=0)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _reference(model, batch, coef, tau):
    """Full [B, L, V] logits, log_softmax in (at least) fp32, gather: (lp [N], entropy [N], grads)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    picked = logits[batch.sel_rows, batch.sel_cols]
    logp = torch.log_softmax(picked.to(torch.promote_types(picked.dtype, torch.float32)) / tau, -1)  # [N, V]
    lp = logp.gather(1, batch.targets_flat[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp * coef).sum().backward()
    return lp.detach(), ent.detach(), _grads(model)


def _chunked(model, batch, coef, tau, chunk):
    h = hidden_for_targets(model, batch.input_ids, batch.attention_mask, batch.sel_rows, batch.sel_cols)
    w, b = lm_head_weight(model)
    lp, ent = chunked_logprobs(h, w, batch.targets_flat, tau, chunk, with_entropy=True, bias=b)
    assert lp.dtype == ent.dtype == h.dtype and lp.requires_grad and not ent.requires_grad
    (lp * coef).sum().backward()
    return lp.detach(), ent, _grads(model)


def _compare(tied, tau, std, dtype, chunks=CHUNKS):
    """Chunked (every chunk size) and full logits in `dtype` against float64 on the same
    weights: lp, entropy and every gradient within the dtype's rounding tolerance."""
    model, batch = _model(tied, std, dtype), _batch()
    exact = copy.deepcopy(model).double()          # the same weights, exact arithmetic
    n = int(batch.mask.sum())
    assert n == 11
    # Token-mean weighting with random signs, as the losses weight lp.
    coef = torch.randn(n, generator=torch.Generator().manual_seed(2), dtype=torch.float64) / n
    lp64, ent64, g64 = _reference(exact, batch, coef, tau)
    assert lp64.min() < -15 and ent64.std() > 0.1                       # not a near-uniform softmax
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert "lm_head.weight" not in g64                              # one shared Parameter
    else:
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        z = exact(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.abs().max().item() / tau
    # lp = z_y - lse(z): logits are H-term dot products of size |z|; entropy moves by
    # |dz| (1 + H) at most; a gradient entry sums over the vocabulary (tolerance.py)
    scales = {"lp": (z, HIDDEN), "entropy": (z * (1 + ent64.max().item()), HIDDEN),
              "grad": (max(g.abs().max().item() for g in g64.values()), VOCAB)}
    runs = [("full", _reference(model, batch, coef.to(dtype), tau))]
    runs += [(f"chunk {c}", _chunked(model, batch, coef.to(dtype), tau, c)) for c in chunks]
    for name, (lp, ent, g) in runs:
        assert set(g) == set(g64)
        errs = {"lp": assert_close(lp, lp64, dtype, *scales["lp"], what=f"{name} lp"),
                "entropy": assert_close(ent, ent64, dtype, *scales["entropy"], what=f"{name} entropy")}
        for p in g64:
            errs[p] = assert_close(g[p], g64[p], dtype, *scales["grad"], what=f"{name} grad {p}")
        worst = max(errs, key=errs.get)
        print(f"{dtype} tied={tied} tau={tau} {name}: max abs err {errs[worst]:.2e} ({worst}); lp {errs['lp']:.2e} "
              f"(tol {rounding_tol(dtype, *scales['lp']):.1e}), entropy {errs['entropy']:.2e} "
              f"(tol {rounding_tol(dtype, *scales['entropy']):.1e})")
        assert g["model.embed_tokens.weight"].abs().max() > 1e-2           # not trivially 0


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_matches_exact_logits_fp32(tied, tau):
    """fp32 chunked and full log-probs, entropy and gradients within fp32 rounding of the
    exact (fp64) values: the chunked path is as accurate as the plain one, on any processor."""
    _compare(tied, tau, std=0.3, dtype=torch.float32)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_matches_full_logits_fp64_exactly(tied):
    """In fp64, with a sharp softmax, chunked and full agree to rounding: the math is exact,
    so the fp32 differences above are summation order only."""
    _compare(tied, 0.7, std=0.5, dtype=torch.float64, chunks=(4, 4096))  # 4, 4, 3 rows


def test_bf16_hidden_fp32_weight_and_cpu_autocast():
    torch.manual_seed(3)
    h32 = torch.randn(9, 32)
    w = (torch.randn(VOCAB, 32) * 0.3).requires_grad_()
    y = torch.randint(0, VOCAB, (9,))
    lp32, ent32 = chunked_logprobs(h32, w.detach(), y, 0.7, 4, with_entropy=True)
    # Mixed dtypes: the matmul runs in bf16, outputs and grad W keep fp32.
    h16 = h32.to(torch.bfloat16).requires_grad_()
    lp16, ent16 = chunked_logprobs(h16, w, y, 0.7, 4, with_entropy=True)
    lp16.sum().backward()
    assert lp16.dtype == ent16.dtype == torch.float32
    assert h16.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert (lp16 - lp32).abs().max() < 0.1 and (ent16 - ent32).abs().max() < 0.1
    assert (lp16 - lp32).abs().max() > 0                    # really ran in bf16
    # fp32 inputs under CPU autocast: the matmul runs in bf16 as autocast would.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp_ac, _ = chunked_logprobs(h32, w.detach(), y, 0.7, 4)
    assert lp_ac.dtype == torch.float32 and torch.allclose(lp_ac, lp16.detach())


def test_empty_input_and_no_entropy():
    w = torch.randn(50, 8, requires_grad=True)
    lp, ent = chunked_logprobs(torch.zeros(0, 8), w, torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and ent is None
    lp.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_frozen_head_and_no_grad():
    """Reference-model use: a frozen W gets no gradient; under no_grad nothing is recorded."""
    torch.manual_seed(6)
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(50, 8)
    y = torch.randint(0, 50, (4,))
    lp, _ = chunked_logprobs(h, w, y, 1.0, 3)
    ref = torch.log_softmax(h @ w.T, -1).gather(1, y[:, None]).squeeze(1)
    (g,) = torch.autograd.grad(lp.sum(), (h,))
    assert torch.allclose(g, torch.autograd.grad(ref.sum(), (h,))[0], atol=ATOL)
    with torch.no_grad():
        lp0, ent0 = chunked_logprobs(h, w, y, 1.0, 3, with_entropy=True)
    assert not lp0.requires_grad and torch.allclose(lp0, ref.detach(), atol=ATOL)


@pytest.mark.parametrize("args, match", [
    ((torch.zeros(3, 8), torch.zeros(50, 4), torch.zeros(3, dtype=torch.long)), "hidden size 8 != weight's 4"),
    ((torch.zeros(3, 8), torch.zeros(50, 8), torch.zeros(2, dtype=torch.long)), "3 hidden rows but 2 targets"),
    ((torch.zeros(2, 3, 8), torch.zeros(50, 8), torch.zeros(2, dtype=torch.long)), r"expected hidden \[N, H\]"),
    ((torch.zeros(3, 8), torch.zeros(50, 8), torch.zeros(3)), "targets must be torch.long"),
    ((torch.zeros(3, 8), torch.zeros(50, 8), torch.tensor([0, 50, 1])), r"in \[0, 50\)"),
])
def test_bad_input_raises(args, match):
    with pytest.raises(ValueError, match=match):
        chunked_logprobs(*args)


def test_bad_chunk_temperature_bias_raise():
    h, w, y = torch.zeros(3, 8), torch.zeros(50, 8), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_tokens must be an int >= 1, got 0"):
        chunked_logprobs(h, w, y, chunk_tokens=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        chunked_logprobs(h, w, y, temperature=0.0)
    with pytest.raises(ValueError, match=r"bias shape \(49,\)"):
        chunked_logprobs(h, w, y, bias=torch.zeros(49))


def test_bias_gradient_matches_full_logits():
    torch.manual_seed(4)
    h = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(50, 8, requires_grad=True)
    b = torch.randn(50, requires_grad=True)
    y = torch.randint(0, 50, (5,))
    lp, _ = chunked_logprobs(h, w, y, 0.7, 2, bias=b)
    ref = torch.log_softmax((h @ w.T + b) / 0.7, -1).gather(1, y[:, None]).squeeze(1)
    grads = torch.autograd.grad(lp.sum(), (h, w, b))
    ref_grads = torch.autograd.grad(ref.sum(), (h, w, b))
    assert torch.allclose(lp, ref, atol=ATOL)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, atol=ATOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_autocast_parity_and_bounded_memory():
    """Qwen3-1.7B-sized head (V 151,936, H 2,048) under bf16 autocast on CUDA: parity with the
    full-logits path at N = 2,048, and at N = 16,384 a peak far below one fp32 [N, V] copy."""
    dev, V, H, tau = torch.device("cuda"), VOCAB, 2048, 0.7
    torch.manual_seed(5)
    w = torch.nn.Parameter(torch.randn(V, H, device=dev) * 0.02)
    h = (torch.randn(2048, H, device=dev)).requires_grad_()
    y = torch.randint(0, V, (2048,), device=dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp, ent = chunked_logprobs(h, w, y, tau, 512, with_entropy=True)
        logp = torch.log_softmax((h @ w.T).float() / tau, -1)
    ref = logp.gather(1, y[:, None]).squeeze(1)
    assert lp.dtype == torch.float32 and lp.device.type == "cuda"
    # Both sides round the same bf16 matmul; allow a bf16 ulp of |z| ~ 4 on the target logit.
    assert (lp - ref).abs().max() < 5e-2 and (ent + (logp.exp() * logp).sum(-1)).abs().max() < 5e-2
    g = torch.autograd.grad(lp.sum(), (h, w))
    g_ref = torch.autograd.grad(ref.sum(), (h, w))
    for a, b in zip(g, g_ref):
        assert a.dtype == torch.float32 and (a - b).norm() / b.norm() < 2e-2
    del logp, ref, g, g_ref, lp, ent
    n = 16384                                       # one fp32 [N, V] copy would be 10 GB
    h = torch.randn(n, H, device=dev, requires_grad=True)
    y = torch.randint(0, V, (n,), device=dev)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp, _ = chunked_logprobs(h, w, y, tau, 1024, with_entropy=True)
    lp.sum().backward()
    extra = torch.cuda.max_memory_allocated() - base
    # grad W fp32 + bf16 W copy + ~4 chunk-sized fp32 buffers + slack, all far below N x V x 4.
    bound = V * H * (4 + 2) + 4 * 1024 * V * 4 + (256 << 20)
    assert extra < bound < n * V * 4, (extra / 2**30, bound / 2**30)
