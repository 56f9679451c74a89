"""Every CUDA forward runs under the project's SDPA choice (pipeline/models/runtime.py
attention_backends: flash > memory-efficient > math, cuDNN off): the sampler's (transformers'
forward and the lean decode step), the trainer's (forward, and the checkpointed layers'
recompute in backward) and the reference's.

There is no GPU here, so the CPU is put on the same code path: runtime.ATTENTION_DEVICES
gets "cpu" too, and a spy on torch's SDPA function records the backend flags in force at
every call (torch.backends.cuda's flags and priority are global, set by sdpa_kernel on any
build). A forward that skips the helper runs with torch's defaults (cuDNN enabled) and fails
the test; the last test shows the spy sees that state. Cost: the session's tiny model, then
~10 s (a few short draws, one update with checkpointing, one reference forward).
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from pipeline.core.config import load_config
from pipeline.models import runtime
from pipeline.models.engines import SamplingParams
from pipeline.models.engines.hf import TransformersEngine
from pipeline.models.hf import load_model
from pipeline.training import loop
from pipeline.training.reference import ReferenceCache
from stages.base_model import model_path

PROMPTS = ["Q:123\nA:", "Q:98765\nA:", "Q:4\nA:", "Q:3141592\nA:"]
# the state sdpa_kernel([FLASH, EFFICIENT, MATH], set_priority=True) leaves: cuDNN off, the
# others on, and that priority order
CHOSEN = {"cudnn": False, "flash": True, "efficient": True, "math": True,
          "priority": tuple(b.value for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                             SDPBackend.MATH))}


def sdpa_state() -> dict:
    b = torch.backends.cuda
    return {"cudnn": b.cudnn_sdp_enabled(), "flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
            "math": b.math_sdp_enabled(), "priority": tuple(torch._C._get_sdp_priority_order()[:3])}


@pytest.fixture
def calls(monkeypatch):
    """[(phase, in backward, SDPA state)] of every SDPA call; phase[0] names the work running."""
    seen: list = []
    phase = ["?"]
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((phase[0], torch._C._current_graph_task_id() != -1, sdpa_state()))
        return real(*args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen, phase


def tiny_pool(tok, groups: int = 2, m: int = 4) -> loop.Pool:
    """Responses of different lengths after prompts of different lengths: padded rows."""
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:groups]]
    responses = [[tok(" 1 + 2 = 3" * (1 + (i + j) % 3))["input_ids"] for i in range(m)] for j in range(groups)]
    rewards = torch.tensor([[float(i % 2) for i in range(m)] for _ in range(groups)], dtype=torch.float64)
    return loop.Pool(group_ids=list(range(groups)), prompt_ids=prompts, responses=responses,
                     lp_beh=[[[-1.0] * len(r) for r in grp] for grp in responses], rewards=rewards, group_size=m)


def test_every_cuda_forward_runs_under_the_chosen_kernels(base_manifest, calls, monkeypatch):
    seen, phase = calls
    monkeypatch.setattr(runtime, "ATTENTION_DEVICES", ("cuda", "cpu"))     # the CPU takes the CUDA path
    path = model_path(base_manifest)
    params = SamplingParams(2, 1.0, 1.0, 6, seed=1)
    phase[0] = "sampler, lean"
    TransformersEngine(path, batch_prompts=4).generate(PROMPTS, params)
    phase[0] = "sampler, transformers' forward"
    TransformersEngine(path, batch_prompts=4, lean=False).generate(PROMPTS, params)

    cfg = load_config("smoke", ["train.gradient_checkpointing=true", "train.packing=off"])
    rt = runtime.make_runtime(cfg.train)
    policy, reference = rt.prepare(load_model(path)), rt.prepare_reference(load_model(path))
    policy.train()
    tok = TransformersEngine(path).tokenizer
    pool = tiny_pool(tok)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    phase[0] = "trainer"        # the policy's forward and backward, and the reference inside the update
    loop.run_update(loop.TrainState(policy, reference, opt, ref_cache=ReferenceCache(enabled=False)),
                    loop.TrainContext(cfg, pool, rt, tok.pad_token_id), [0, 1])
    phase[0] = "reference"
    ReferenceCache().get(reference, pool, [0], tok.pad_token_id, rt, 1.0, loop.policy_logprobs)

    phases = {p for p, _, _ in seen}
    assert phases == {"sampler, lean", "sampler, transformers' forward", "trainer", "reference"}, phases
    assert any(backward for p, backward, _ in seen if p == "trainer")      # the checkpointed recompute ran
    outside = [(p, backward, s) for p, backward, s in seen if s != CHOSEN]
    assert not outside, f"{len(outside)} of {len(seen)} SDPA calls ran outside the choice, e.g. {outside[0]}"


def test_the_spy_sees_a_forward_outside_the_choice(base_manifest, calls):
    """The control: on the CPU (not in ATTENTION_DEVICES) the helper is a null context, torch's
    defaults hold (cuDNN enabled), and the spy records them; the CPU's draws are torch's own."""
    seen, phase = calls
    assert sdpa_state() != CHOSEN
    phase[0] = "cpu"
    TransformersEngine(model_path(base_manifest), batch_prompts=4).generate(PROMPTS, SamplingParams(1, 1.0, 1.0, 3, seed=1))
    assert seen and all(s == sdpa_state() != CHOSEN for _, _, s in seen)
    with runtime.attention_backends("cuda"):       # the choice itself, entered on any build
        assert sdpa_state() == CHOSEN
    assert sdpa_state() != CHOSEN                   # and left as it was
