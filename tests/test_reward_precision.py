"""A train.dtype=float64 run keeps the pool's float64 rewards: one GRPO micro-batch's gradient
(pipeline/training/loop.py micro_batch_loss) equals an independent float64 computation of the
same gradient to 1e-12. The rewards are continuous (0.3, 0.9, ...): cast to float32 as they
once were, the group advantages carry float32's rounding (~1e-8 relative) into every
gradient entry, which this test sees."""
from __future__ import annotations

import statistics

import torch

from pipeline.core.config import load_config
from pipeline.models import runtime
from pipeline.models.engines.hf import TransformersEngine
from pipeline.models.hf import load_model
from pipeline.training import loop
from pipeline.training.reference import ReferenceCache
from stages.base_model import model_path

REWARDS = [[0.3, 0.9, 0.1, 0.5], [0.7, 0.2, 0.2, 0.6]]
PROMPTS = ["Q:123\nA:", "Q:98765\nA:"]


def advantages(rewards: list[float], eps: float) -> list[float]:
    """Spec section 2, in Python floats (float64): (r - mean) / (sample std + eps)."""
    mu, sd = statistics.fmean(rewards), statistics.stdev(rewards)
    return [(r - mu) / (sd + eps) for r in rewards]


def test_a_float64_micro_batch_gradient_matches_float64_to_1e12(base_manifest):
    cfg = load_config("smoke", ["train.dtype=float64", "train.method=grpo", "train.beta=0", "train.packing=off"])
    path = model_path(base_manifest)
    rt = runtime.make_runtime(cfg.train)
    policy = rt.prepare(load_model(path))
    tok = TransformersEngine(path).tokenizer
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    responses = [[tok(" 1 + 2 = 3" * (1 + (i + j) % 3))["input_ids"] for i in range(4)] for j in range(2)]
    pool = loop.Pool(group_ids=[0, 1], prompt_ids=prompts, responses=responses,
                     lp_beh=[[[0.0] * len(r) for r in grp] for grp in responses],
                     rewards=torch.tensor(REWARDS, dtype=torch.float64), group_size=4)
    ctx = loop.TrainContext(cfg, pool, rt, tok.pad_token_id)
    batch = ctx.batch([0, 1])
    with torch.no_grad():       # behavior = the policy rounded to float32 (as pools hold it): ratios ~1, no clip acts
        lp0, _ = loop.policy_logprobs(policy, batch, rt, ctx.temperature)
    shape = (2, 4, batch.mask.shape[1])
    mask = batch.mask.view(shape)
    beh = lp0.view(shape).float().double() * mask
    pool.lp_beh = [[beh[g, i][mask[g, i].bool()].tolist() for i in range(4)] for g in range(2)]
    assert lp0.dtype == torch.float64
    t_tot = int(mask.sum())

    reference = rt.prepare_reference(load_model(path))
    st = loop.TrainState(policy, reference, torch.optim.SGD(policy.parameters(), lr=0.0),
                         ref_cache=ReferenceCache(enabled=False))
    loop.micro_batch_loss(st, ctx, [0, 1], t_tot, 8).loss.backward()
    ours = torch.cat([p.grad.flatten() for p in policy.parameters()])
    policy.zero_grad(set_to_none=True)

    # independent: GRPO's surrogate inside its clip range, -(1/T) sum_it A_i exp(lp_it - lp_beh_it)
    adv = torch.tensor([advantages(r, cfg.train.eps_adv) for r in REWARDS], dtype=torch.float64)
    lp, _ = loop.policy_logprobs(policy, batch, rt, ctx.temperature)
    ratio = torch.exp(lp.view(shape) - beh)
    assert ((ratio - 1).abs() * mask).max() < 0.1         # far inside the clip (0.2)
    (-(adv[..., None] * ratio * mask).sum() / t_tot).backward()
    ref = torch.cat([p.grad.flatten() for p in policy.parameters()])
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"\nfloat64 micro-batch gradient, max error relative to the largest entry: {err:.2e}")
    assert err <= 1e-12
