"""The no-gradient forward with each repeated prompt once through the token-wise layers
(pipeline/training/shared_prompt.py): the plain forward's log-probs byte for byte, and it
serves only where that holds."""
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
    assert not shared_prompt.serves(net, batch)                  # gradient on: the plain forward
    lp, _ = token_logprobs(net, batch, 1.0)
    assert lp.requires_grad
    packed = make_batch(*rows(vocab, 2, 8, seed=3), 0, packed=True)
    assert packed.share is None
    with torch.no_grad():
        assert not shared_prompt.serves(net, packed)
        monkeypatch.setattr(kernels, "reproducible", lambda: False)   # the native mode, or a GPU
        assert not shared_prompt.serves(net, batch)
