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


def test_one_h200_plans_the_share_from_what_the_learner_holds_at_wake(qwen3_1_7b):
    """One process: weights, gradients (4 B), AdamW moments (8 B) in fp32, the reference (bf16
    linear weights, fp32 embeddings and norms), activations at 32,768 tokens under gradient
    checkpointing, the chunked head. When vLLM wakes the gradients, activations and head blocks
    are gone: it shares the GPU with weights + moments + reference only; the training peak runs
    while it sleeps, so it only has to fit beside the reserve. Worked numbers, in bytes:

        p = 1,720,574,976 parameters; autocast (bf16 in the reference) 1,409,286,144
        weights    4p                                     =  6,882,299,904
        adamw      8p                                     = 13,764,599,808
        reference  2 x 1,409,286,144 + 4 x 311,288,832    =  4,063,727,616
        wake       (the three above)                      = 24,710,627,328  (23.0 GiB)
        peak       wake + gradients 6,882,299,904 + activations 19,327,352,832
                   + lm_head 3,648,520,192                = 54,568,800,256  (50.8 GiB)
        reserve    4 GiB + int(0.05 x peak)               =  7,023,407,308  ( 6.5 GiB)
        sampler    H200 150,754,820,096 - wake - reserve  = 119,020,785,460 (110.8 GiB)
        share      sampler / H200                         = 0.7895
    Charging the training peak instead (the old rule): (H200 - peak - reserve) / H200 = 0.591."""
    s, plan = qwen3_1_7b, plan_sampler_memory(qwen3_1_7b, paper_setup(1), H200)
    p = plan.parts
    assert H200 == 150_754_820_096 and s.autocast_params == 1_409_286_144
    assert (p["weights"], p["gradients"], p["adamw"]) == (4 * s.params, 4 * s.params, 8 * s.params)
    assert (p["weights"], p["adamw"]) == (6_882_299_904, 13_764_599_808)
    assert p["reference"] == 2 * s.autocast_params + 4 * (s.params - s.autocast_params) == 4_063_727_616
    assert p["activations"] == 28 * 4 * 2048 * 32_768 + 2 * s.activation_bytes_per_token() * 32_768 == 19_327_352_832
    assert p["lm_head"] == 3_648_520_192
    assert "sync_gather" not in p and "fsdp_buffers" not in p
    assert plan.wake_bytes == p["weights"] + p["adamw"] + p["reference"] == 24_710_627_328
    assert plan.peak_bytes == sum(p.values()) == 54_568_800_256            # training is the largest phase
    assert plan.reserve_bytes == RESERVE_BYTES + int(RESERVE_SHARE * plan.peak_bytes) == 7_023_407_308
    assert plan.sampler_bytes == H200 - plan.wake_bytes - plan.reserve_bytes == 119_020_785_460
    assert plan.gpu_memory_utilization == pytest.approx(0.7895, abs=5e-5)
    assert plan.peak_bytes + plan.reserve_bytes <= H200            # training fits beside the sleeping sampler
    old = (H200 - plan.peak_bytes - plan.reserve_bytes) / H200     # the peak charged against the share
    assert old == pytest.approx(0.591, abs=5e-4)
    assert 0.85 * H200 + plan.wake_bytes > H200           # a share measured at round 0: no room at wake
    line = plan.describe()
    print("\n1 x H200:", line)
    assert "learner holds 23.0 GiB when the sampler wakes (weights 6.4, adamw 12.8, reference 3.8)" in line
    assert "50.8 GiB at its training peak while the sampler sleeps" in line
    assert "gpu_memory_utilization 0.789" in line


def test_eight_gpus_shard_the_learner_and_rank_0_holds_the_gathered_weights(qwen3_1_7b):
    """FSDP over 8: weights, gradients and moments / 8; the reference whole on every rank;
    the root's embedding and two layers unsharded while computing; the same activations per
    rank; rank 0 (the sampler's GPU) also holds the gathered fp32 weights while the sampler
    wakes and samples, so they count at wake; FSDP's buffers only at the training peak."""
    s = qwen3_1_7b
    one, eight = plan_sampler_memory(s, paper_setup(1), H200), plan_sampler_memory(s, paper_setup(8), H200)
    p = eight.parts
    assert (p["weights"], p["adamw"]) == (4 * s.params // 8, 8 * s.params // 8)
    assert p["reference"] == one.parts["reference"] and p["activations"] == one.parts["activations"]
    assert p["sync_gather"] == 4 * s.params and p["fsdp_buffers"] > 0
    assert eight.wake_bytes == p["weights"] + p["adamw"] + p["reference"] + p["sync_gather"]
    assert eight.peak_bytes == sum(v for k, v in p.items() if k != "sync_gather")
    assert eight.sampler_bytes + eight.wake_bytes + eight.reserve_bytes == H200
    print("\n8 x H200 (rank 0):", eight.describe())
    assert one.gpu_memory_utilization < eight.gpu_memory_utilization


def test_without_checkpointing_the_training_peak_does_not_fit_and_says_why(qwen3_1_7b):
    setup = LearnerSetup(tokens=32_768, gradient_checkpointing=False)
    with pytest.raises(ValueError, match=r"the learner's training peak .* do not fit the GPU's .* activations "):
        plan_sampler_memory(qwen3_1_7b, setup, H200)


def test_a_learner_that_leaves_the_sampler_too_little_at_wake_is_refused(qwen3_1_7b):
    """Rank 0 of 8 on a 19 GiB GPU: the training peak of a 1,024-token budget (13.5 GiB) and
    the reserve (4.7) fit, but what it holds at wake (12.6 GiB, the gathered weights among
    it) and the reserve leave the sampler 1.7 GiB, under MIN_SHARE (0.1)."""
    setup = LearnerSetup(tokens=1024, gradient_checkpointing=True, world=8)
    with pytest.raises(ValueError, match=r"the learner leaves the sampler 1.7 GiB .* 12.6 GiB when the sampler wakes"):
        plan_sampler_memory(qwen3_1_7b, setup, 19 * GiB)


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
