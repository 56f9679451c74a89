"""Training losses: pure functions `fn(inputs, cfg) -> (loss, metrics)` and a registry.

Math: ../shared/spec/algorithms.md. Tensors are [G, m, T]: G groups of m responses to one
prompt, T padded response tokens. Aggregation is token-mean over the whole optimizer
update (spec section 1): `sum(mask * loss_tok) / T_tot`, with T_tot the update's global
token count, so micro-batches sum to the update's loss exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pipeline.config import TrainConfig

Tensor = torch.Tensor


@dataclass
class LossInputs:
    lp: Tensor                 # [G, m, T] learner log-probs of sampled tokens (with grad)
    lp_beh: Tensor             # [G, m, T] behavior log-probs recorded by the engine
    lp_ref: Tensor             # [G, m, T] reference policy log-probs
    mask: Tensor               # [G, m, T] 1 on response tokens (incl. EOS), 0 on padding
    rewards: Tensor            # [G, m] verifiable rewards
    t_tot: float               # tokens in the whole optimizer update (>= mask.sum())
    n_seq_tot: int             # responses in the whole update (seq-mean aggregation only)
    lp_old: Tensor | None = None   # [G, m, T] trainer log-probs at step start


def group_advantages(rewards: Tensor, eps_adv: float) -> Tensor:
    """[G, m] -> [G, m]: (r - mean_g) / (std_g (ddof 1) + eps_adv) (spec section 2)."""
    mu = rewards.mean(dim=1, keepdim=True)
    sd = rewards.std(dim=1, keepdim=True, unbiased=True)
    return (rewards - mu) / (sd + eps_adv)


def k3_to_reference(lp: Tensor, lp_ref: Tensor) -> Tensor:
    """Per-token K3 estimate of KL(pi_theta || pi_ref), clamped as verl's low_var_kl."""
    d = torch.clamp(lp_ref - lp, -20.0, 20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)


def aggregate(loss_tok: Tensor, inp: LossInputs, how: str) -> Tensor:
    """Token-mean over the update, or GRPO's original seq-mean-token-mean."""
    if how == "token-mean":
        return (loss_tok * inp.mask).sum() / inp.t_tot
    per_seq = (loss_tok * inp.mask).sum(-1) / inp.mask.sum(-1).clamp(min=1.0)  # [G, m]
    return per_seq.sum() / inp.n_seq_tot


def ppo_clipped_pg(adv: Tensor, log_ratio: Tensor, cfg: TrainConfig) -> tuple[Tensor, Tensor]:
    """PPO surrogate with dual clip. adv [G, m, 1], log_ratio [G, m, T] -> (pg, clipped)."""
    rho = torch.exp(log_ratio)
    pg1 = -adv * rho
    pg2 = -adv * torch.clamp(rho, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg = torch.maximum(pg1, pg2)
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.dual_clip), pg)
    return pg, (pg2 > pg1)


def grpo_loss(inp: LossInputs, cfg: TrainConfig) -> tuple[Tensor, dict[str, float]]:
    """GRPO (spec section 2): PPO-clipped surrogate on group-standardized advantages,
    ratio against the anchor (behavior log-probs by default, spec 13 item 4), plus
    beta * K3 to the reference, differentiated pathwise."""
    anchor = inp.lp_beh if cfg.anchor == "behavior" else inp.lp_old
    if anchor is None:
        raise ValueError("grpo with train.anchor='old' needs lp_old")
    adv = group_advantages(inp.rewards, cfg.eps_adv)[..., None]           # [G, m, 1]
    pg, clipped = ppo_clipped_pg(adv, inp.lp - anchor, cfg)
    k3 = k3_to_reference(inp.lp, inp.lp_ref)
    loss = aggregate(pg + cfg.beta * k3, inp, cfg.aggregation)
    with torch.no_grad():
        metrics = {
            "pg_loss": float(aggregate(pg, inp, cfg.aggregation)),
            "kl_ref_k3": float((k3 * inp.mask).sum() / inp.t_tot),
            "clip_frac": float((clipped.float() * inp.mask).sum() / inp.t_tot),
        }
    return loss, metrics


LossFn = Callable[[LossInputs, TrainConfig], tuple[Tensor, dict[str, float]]]
LOSSES: dict[str, LossFn] = {"grpo": grpo_loss}


def get_loss(method: str) -> LossFn:
    if method not in LOSSES:
        raise ValueError(f"unknown train.method '{method}'; known: {', '.join(sorted(LOSSES))}")
    return LOSSES[method]
