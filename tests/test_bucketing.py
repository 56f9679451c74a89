"""Length buckets for padded micro-batches (#26 item 4): the split is optimal for its cost
model, the bucketed log-probs and gradients are the padded ones within rounding (float64),
and CPU training with buckets equals padded training, is deterministic run to run and
shares its cache key."""
import itertools

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from pipeline.core.config import load_config
from pipeline.core.store import Store
from pipeline.models.runtime import BUCKET_OVERHEAD_TOKENS, make_runtime
from pipeline.training.packing import bucket_rows
from pipeline.training.policy import Buckets, make_batch, token_logprobs
from stages import train

from tolerance import assert_close, assert_same_training


def _cost(lengths: list[int], buckets: list[list[int]], overhead: float) -> float:
    return sum(len(b) * max(lengths[i] for i in b) + overhead for b in buckets)


def _best_split_cost(lengths: list[int], overhead: float) -> float:
    """Brute force: every contiguous split of the rows sorted by length."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    best = float("inf")
    for k in range(len(order)):
        for cuts in itertools.combinations(range(1, len(order)), k):
            edges = [0, *cuts, len(order)]
            best = min(best, _cost(lengths, [order[a:b] for a, b in zip(edges, edges[1:])], overhead))
    return best


@pytest.mark.parametrize("overhead", [0.0, 7.0, 40.0])
def test_bucket_rows_is_the_cheapest_split(overhead):
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        lengths = torch.randint(3, 40, (7,), generator=g).tolist()
        buckets = bucket_rows(lengths, overhead)
        assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))     # every row once
        flat = [lengths[i] for b in buckets for i in b]
        assert flat == sorted(flat)                                                    # shortest first
        assert _cost(lengths, buckets, overhead) == _best_split_cost(lengths, overhead)


def test_bucket_rows_edges():
    assert bucket_rows([], 5.0) == []
    assert bucket_rows([5, 3, 9], float("inf")) == [[1, 0, 2]]          # never worth a second forward
    assert bucket_rows([4, 4, 4], 0.0) == [[0, 1, 2]]                   # equal lengths: nothing to save
    assert bucket_rows([10, 10, 50, 50], 0.0) == [[0, 1], [2, 3]]


def _lm(dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=16, intermediate_size=64))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.set_attn_implementation("sdpa")
    return model.to(dtype)


@pytest.mark.parametrize("impl", ["chunked", "full"])
def test_bucketed_rows_give_the_padded_logprobs_and_gradients(impl):
    """Rows of very different lengths, one padded batch and length buckets (float64): the
    same log-probs (in the original row order) and parameter gradients within float64's
    rounding (two computations; scale: the largest logit / gradient; terms: the longest
    sum, the vocabulary)."""
    dtype = torch.float64
    model = _lm(dtype)
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(3, 300, (n,), generator=g).tolist()    # noqa: E731
    prompts = [ids(5), ids(9), ids(2), ids(6), ids(4), ids(7)]
    responses = [ids(40), ids(3), ids(17), ids(38), ids(2), ids(16)]
    bucketed = make_batch(prompts, responses, 0, bucket_overhead=0.0)
    assert isinstance(bucketed, Buckets) and len(bucketed.parts) > 1
    coef = torch.randn((6, 40), generator=torch.Generator().manual_seed(4), dtype=dtype)
    out = []
    for b in (make_batch(prompts, responses, 0), bucketed):
        lp, ent = token_logprobs(model, b, 0.7, with_entropy=True, impl=impl, chunk_tokens=16)
        assert lp.shape == ent.shape == (6, 40) and torch.equal((lp != 0).to(lp.dtype), b.mask.to(lp.dtype))
        (lp * coef).sum().backward()
        out.append((lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    (lp_pad, ent_pad, g_pad), (lp_b, ent_b, g_b) = out
    with torch.no_grad():
        z = model(input_ids=make_batch(prompts, responses, 0).input_ids).logits.abs().max().item() / 0.7
    assert_close(lp_b, lp_pad, dtype, z, 300, "log-probs", computations=2)
    assert_close(ent_b, ent_pad, dtype, z, 300, "entropy", computations=2)
    scale = max(v.abs().max().item() for v in g_pad.values())
    for name in g_pad:
        assert_close(g_b[name], g_pad[name], dtype, scale, 300, f"grad {name}", computations=2)


def test_buckets_on_cpu_auto_only():
    """train.packing=auto buckets padded rows on the CPU; off keeps one padded batch, on
    packs, and torchrun (FSDP: the same forwards on every rank) never buckets."""
    cpu = ["train.device=cpu"]
    assert make_runtime(load_config("smoke", cpu).train).bucket_overhead == BUCKET_OVERHEAD_TOKENS
    assert make_runtime(load_config("smoke", cpu + ["train.packing=off"]).train).bucket_overhead is None
    assert make_runtime(load_config("smoke", cpu + ["train.packing=on"]).train).bucket_overhead is None
    assert make_runtime(load_config("smoke", cpu + ["train.nproc=2"]).train).bucket_overhead is None


def test_bucketed_training_equals_padded_training_and_repeats(tmp_path, base_manifest, pool, monkeypatch):
    """Two GGPO updates on the CPU (float64) with buckets (auto) and one padded batch per
    micro-batch (off): the same metrics and weights within rounding; buckets twice: the
    same bytes (float32 too); and one cache key (placement, not content)."""
    from pipeline.training import policy
    calls: list[int] = []
    real = policy._bucketed_logprobs
    monkeypatch.setattr(policy, "_bucketed_logprobs", lambda model, b, *a: (calls.append(len(b.parts)), real(model, b, *a))[1])
    runs, bucketed = {}, {}
    for name, sets in {"auto": ["train.packing=auto"], "off": ["train.packing=off"],
                       "auto32": ["train.packing=auto", "train.dtype=float32"],
                       "auto32b": ["train.packing=auto", "train.dtype=float32"]}.items():
        dtype = [] if "32" in name else ["train.dtype=float64"]
        cfg = load_config("smoke", ["train.method=ggpo", "train.updates=2", "train.device=cpu", *dtype, *sets])
        m = train.run(cfg, {"base": base_manifest, "pool": pool[2]}, store=Store(tmp_path / name))
        runs[name] = (pl.read_parquet(m.path("metrics")), load_file(m.path("weights")), m)
        bucketed[name], calls[:] = len(calls), []
    assert bucketed["off"] == 0 and bucketed["auto"] > 0       # the pool's micro-batches do split
    assert_same_training(*runs["off"][:2], *runs["auto"][:2], lr=cfg.train.lr)
    assert runs["auto32"][2].files["weights"].sha256 == runs["auto32b"][2].files["weights"].sha256
    assert runs["auto"][2].key == runs["off"][2].key
