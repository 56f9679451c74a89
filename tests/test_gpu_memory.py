"""The sampler's share of a GPU beside an online cell's learner (pipeline/models/gpu_memory.py), at
the paper's scale: Qwen3-1.7B (28 layers, hidden 2,048, 16 / 8 heads of 128, MLP 6,144,
vocabulary 151,936, tied) trained at the qwen3-1.7b preset's geometry, on one H200 and on
8 (FSDP). Pure arithmetic on the meta device: nothing is allocated."""
from __future__ import annotations

import pytest
import torch

from pipeline.core.config import load_config
from pipeline.models.gpu_memory import (
    RESERVE_BYTES,
    RESERVE_SHARE,
    GiB,
    LearnerSetup,
    ModelShape,
    micro_batch_tokens,
    plan_sampler_memory,
)

H200 = 143_771 * 2 ** 20        # what an H200 reports (torch.cuda.mem_get_info), ~140.4 GiB


@pytest.fixture(scope="module")
def qwen3_1_7b() -> ModelShape:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=151_936, hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, intermediate_size=6144, tie_word_embeddings=True)
    with torch.device("meta"):
        return ModelShape.of(Qwen3ForCausalLM(cfg))


def paper_setup(world: int) -> LearnerSetup:
    cfg = load_config("qwen3-1.7b")
    return LearnerSetup(tokens=micro_batch_tokens(cfg.train, cfg.rollout), world=world,
                        gradient_checkpointing=cfg.train.gradient_checkpointing,
                        chunk_tokens=cfg.train.logprob_chunk_tokens)


def test_the_shape_of_qwen3_1_7b(qwen3_1_7b):
    s = qwen3_1_7b
    assert s.params == 1_720_574_976                  # tied: the embedding once (2.03e9 counted twice)
    assert s.embedding_params == 151_936 * 2048
    assert s.autocast_params == 28 * (2048 * (2048 + 2 * 1024) + 2048 * 2048 + 3 * 2048 * 6144)
    assert s.activation_bytes_per_token() == 4 * (8 * 2048 + 2 * 3072) + 2 * (3 * 2048 + 3 * 4096 + 2048 + 4 * 6144)
    assert micro_batch_tokens(load_config("qwen3-1.7b").train, load_config("qwen3-1.7b").rollout) == 32_768


def test_one_h200_leaves_the_sampler_what_the_trained_learner_does_not_use(qwen3_1_7b):
    """One process: weights, gradients (4 B), AdamW moments (8 B) in fp32, the reference (bf16
    linear weights, fp32 embeddings and norms), activations at 32,768 tokens under gradient
    checkpointing, the chunked head. The old share (0.85, measured before AdamW's first step)
    plus that learner does not fit; the planned one does, with the reserve."""
    s, plan = qwen3_1_7b, plan_sampler_memory(qwen3_1_7b, paper_setup(1), H200)
    p = plan.parts
    assert (p["weights"], p["gradients"], p["adamw"]) == (4 * s.params, 4 * s.params, 8 * s.params)
    assert p["reference"] == 2 * s.autocast_params + 4 * (s.params - s.autocast_params)
    assert p["activations"] == 28 * 4 * 2048 * 32_768 + 2 * s.activation_bytes_per_token() * 32_768
    assert "sync_gather" not in p and "fsdp_buffers" not in p
    assert plan.learner_bytes == sum(p.values())                      # training is the largest phase here
    assert plan.reserve_bytes == RESERVE_BYTES + int(RESERVE_SHARE * plan.learner_bytes)
    assert plan.sampler_bytes + plan.learner_bytes + plan.reserve_bytes == H200
    print("\n1 x H200:", plan.describe())
    assert 45 * GiB < plan.learner_bytes < 55 * GiB
    assert 0.55 < plan.gpu_memory_utilization < 0.65            # ~83 GiB: weights 3.4 GB, the rest KV cache
    assert 0.85 * H200 + plan.learner_bytes > H200                # the old share: out of memory after round 0


def test_eight_gpus_shard_the_learner_and_rank_0_holds_the_gathered_weights(qwen3_1_7b):
    """FSDP over 8: weights, gradients and moments / 8; the reference whole on every rank;
    the root's embedding and two layers unsharded while computing; the same activations per
    rank; rank 0 (the sampler's GPU) also holds the gathered fp32 weights during a sync."""
    s = qwen3_1_7b
    one, eight = plan_sampler_memory(s, paper_setup(1), H200), plan_sampler_memory(s, paper_setup(8), H200)
    p = eight.parts
    assert (p["weights"], p["adamw"]) == (4 * s.params // 8, 8 * s.params // 8)
    assert p["reference"] == one.parts["reference"] and p["activations"] == one.parts["activations"]
    assert p["sync_gather"] == 4 * s.params and p["fsdp_buffers"] > 0
    assert eight.sampler_bytes + eight.learner_bytes + eight.reserve_bytes == H200
    print("\n8 x H200 (rank 0):", eight.describe())
    assert one.gpu_memory_utilization < eight.gpu_memory_utilization < 0.85
    assert 0.85 * H200 + eight.learner_bytes > H200


def test_without_checkpointing_the_paper_budget_leaves_no_room_and_says_why(qwen3_1_7b):
    setup = LearnerSetup(tokens=32_768, gradient_checkpointing=False)
    with pytest.raises(ValueError, match=r"the learner leaves the sampler .* activations "):
        plan_sampler_memory(qwen3_1_7b, setup, H200)


def test_an_online_cells_vllm_sampler_starts_with_the_planned_share(monkeypatch):
    """Where the share is chosen: the cell plans it at its start from the learner it holds
    (here Qwen3-1.7B on the meta device, the preset's training on a GPU), and builds its
    vLLM engine with it, not with rollout.gpu_memory_utilization (0.85) of what is free."""
    import types

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipeline.models import runtime
    from stages import online_cell

    class Built(Exception):
        pass

    def make_engine(kind, path, *a, rollout_cfg=None, resident=False, **kw):
        made.append((kind, rollout_cfg.gpu_memory_utilization, resident))
        raise Built
    made = []
    cfg = load_config("qwen3-1.7b")
    rt = runtime.Runtime(device=torch.device("cuda"), autocast_dtype=torch.bfloat16,
                         reference_device=torch.device("cuda"), gradient_checkpointing=True, chunk_tokens=1024,
                         logprob_impl="chunked")
    qwen = Qwen3Config(vocab_size=151_936, hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=6144, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(qwen)
    monkeypatch.setattr(online_cell, "device_total_bytes", lambda: H200)
    share = online_cell.sampler_share(cfg, model, rt)
    assert share == plan_sampler_memory(ModelShape.of(model), paper_setup(1), H200).gpu_memory_utilization < 0.85
    assert online_cell.sampler_share(cfg.updated({"rollout.engine": "transformers"}), model, rt) is None
    monkeypatch.setattr(online_cell, "make_engine", make_engine)
    monkeypatch.setattr(online_cell, "model_path", lambda base: "/the/base/model")
    cell = types.SimpleNamespace(engine=None, sampler_share=share, base=None, counts={})
    with pytest.raises(Built):
        online_cell.sync_and_sample(cell, [], cfg, None)
    assert made == [("vllm", share, True)]
