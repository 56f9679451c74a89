"""Training losses: pure functions `fn(inputs, cfg) -> (loss, metrics)` and a registry.

Math: docs/math.md ("spec N" below is its section N). Tensors are [G, m, T]: G groups of m
responses to one prompt, T padded response tokens. Aggregation is token-mean over the whole optimizer
update (spec section 1): `sum(mask * loss_tok) / T_tot`, with T_tot the update's global
token count, so micro-batches sum to the update's loss exactly. Every metric a loss
returns is a detached 0-dim tensor on the loss's device, additive over micro-batches for
the same reason (diagnostics.py has the rest): the trainer reads them once per update.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Callable, cast

import torch

from pipeline.core import methods
from pipeline.core.config import TrainConfig

Tensor = torch.Tensor


@dataclass
class LossInputs:
    lp: Tensor                 # [G, m, T] learner log-probs of sampled tokens (with grad)
    lp_beh: Tensor | None      # [G, m, T] behavior log-probs recorded by the engine; None: the pool has none
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


# Guard on every ratio exponent (verl's core_algos clamps the same way). Deviation from the
# spec's formulas, which exponentiate directly: in fp32 exp overflows past 88.7, and one
# token with lp - lp_beh > 88.7 (or lp_beh = -inf from an engine) made the whole update
# non-finite. Inside +-20 the clamp is the identity, so the spec's oracles are unchanged;
# outside it the ratio is held at e^+-20 with zero gradient (the PPO clip bounds those
# tokens' contribution anyway).
LOG_RATIO_BOUND = 20.0


def safe_exp_ratio(log_ratio: Tensor) -> Tensor:
    """exp(clamp(log_ratio, -20, 20)): a finite ratio for any finite or infinite input."""
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def ppo_clipped_pg(adv: Tensor, log_ratio: Tensor, cfg: TrainConfig) -> tuple[Tensor, Tensor]:
    """PPO surrogate with dual clip. adv [G, m, 1], log_ratio [G, m, T] -> (pg, clipped)."""
    rho = safe_exp_ratio(log_ratio)
    pg1 = -adv * rho
    pg2 = -adv * torch.clamp(rho, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg = torch.maximum(pg1, pg2)
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.dual_clip), pg)
    return pg, (pg2 > pg1)


def grpo_loss(inp: LossInputs, cfg: TrainConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO (spec section 2): PPO-clipped surrogate on group-standardized advantages,
    ratio against the anchor (behavior log-probs by default, spec 13 item 4), plus
    beta * K3 to the reference, differentiated pathwise."""
    anchor = inp.lp_beh if cfg.anchor == "behavior" else inp.lp_old
    if anchor is None:
        raise ValueError(f"grpo with train.anchor='{cfg.anchor}' needs {'lp_beh' if cfg.anchor == 'behavior' else 'lp_old'}")
    adv = group_advantages(inp.rewards, cfg.eps_adv)[..., None]           # [G, m, 1]
    pg, clipped = ppo_clipped_pg(adv, inp.lp - anchor, cfg)
    k3 = k3_to_reference(inp.lp, inp.lp_ref)
    loss = aggregate(pg + cfg.beta * k3, inp, cfg.aggregation)
    with torch.no_grad():
        metrics = {
            "pg_loss": aggregate(pg, inp, cfg.aggregation),
            "kl_ref_k3": (k3 * inp.mask).sum() / inp.t_tot,
            "clip_frac": (clipped.to(inp.mask.dtype) * inp.mask).sum() / inp.t_tot,
        }
    return loss, metrics


def grpo_tis_loss(inp: LossInputs, cfg: TrainConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO + truncated importance sampling (spec section 3): PPO ratio against lp_old,
    each token's PG term times w = min(exp(lp_old - lp_beh), C), detached and one-sided;
    the K3 term is not reweighted."""
    if inp.lp_old is None or inp.lp_beh is None:
        raise ValueError("grpo_tis needs lp_old (the step-start recompute) and lp_beh")
    adv = group_advantages(inp.rewards, cfg.eps_adv)[..., None]
    pg, clipped = ppo_clipped_pg(adv, inp.lp - inp.lp_old, cfg)
    log_w = (inp.lp_old - inp.lp_beh).detach()
    w = torch.clamp(safe_exp_ratio(log_w), max=cfg.tis_cap)
    k3 = k3_to_reference(inp.lp, inp.lp_ref)
    loss = aggregate(w * pg + cfg.beta * k3, inp, cfg.aggregation)
    with torch.no_grad():
        metrics = {
            "pg_loss": aggregate(w * pg, inp, cfg.aggregation),
            "kl_ref_k3": (k3 * inp.mask).sum() / inp.t_tot,
            "clip_frac": (clipped.to(inp.mask.dtype) * inp.mask).sum() / inp.t_tot,
            "trunc_frac": ((log_w > math.log(cfg.tis_cap)).to(inp.mask.dtype) * inp.mask).sum() / inp.t_tot,
        }
    return loss, metrics


def kl_adjusted_rewards(inp: LossInputs, beta: float) -> tuple[Tensor, Tensor]:
    """(ell [G, m], rt [G, m]): ell = sum_t mask (lp - lp_ref), rt = r - beta ell (spec 1).
    ell keeps its graph (GGPO differentiates through it)."""
    ell = ((inp.lp - inp.lp_ref) * inp.mask).sum(-1)
    return ell, inp.rewards.to(ell.dtype) - beta * ell


def agro_coefficients(rt: Tensor) -> Tensor:
    """Leave-one-out advantages a = (m/(m-1)) (rt - mean rt), [G, m] (spec section 4)."""
    m = rt.shape[1]
    return (m / (m - 1)) * (rt - rt.mean(dim=1, keepdim=True))


def agro_loss(inp: LossInputs, cfg: TrainConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """AGRO (spec section 4): loss_tok = -sg(a) lp, a the LOO advantage of the KL-adjusted
    reward computed with the current learner; token-mean. No importance weights."""
    ell, rt = kl_adjusted_rewards(inp, cfg.beta)
    a = agro_coefficients(rt.detach())
    loss = ((-a[..., None] * inp.lp) * inp.mask).sum() / inp.t_tot
    return loss, {"pg_loss": loss.detach()}


def log_mean_exp(x: Tensor, tau: float, keepdim: bool = False) -> Tensor:
    """tau (LSE_j(x_j / tau) - log m) over a group's m values, [G, m] -> [G] ([G, 1] with
    `keepdim`): GGPO's soft maximum, and OPMD's log-avg-exp baseline (corrections.py)."""
    return tau * (torch.logsumexp(x / tau, dim=1, keepdim=keepdim) - math.log(x.shape[1]))


def ggpo_group_loss(rt: Tensor, beta: float) -> Tensor:
    """Raw GGPO loss per group, [G, m] -> [G] (spec 5.1): beta (LSE(rt/beta) - log m) - mean rt."""
    return log_mean_exp(rt, beta) - rt.mean(dim=1)


def ggpo_coefficients(rt: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """(w, c_hat), [G, m] each: w = softmax(rt/beta), c_hat = (m w - 1)/sqrt(m-1) (spec 5.2-5.3)."""
    m = rt.shape[1]
    w = torch.softmax(rt / beta, dim=1)
    return w, (m * w - 1.0) / math.sqrt(m - 1)


def ggpo_loss(inp: LossInputs, cfg: TrainConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GGPO (spec 5.4): L = (s / T_tot) sum_g L_g with s = m / (beta sqrt(m-1)), by
    autograd through ell (lp_ref detached). With `ggpo_clip_delta` set, the detached-
    coefficient variant of spec 5.5 against the step anchor lp_old instead. No lp_beh."""
    if cfg.ggpo_clip_delta is not None:
        return ggpo_clipped_loss(inp, cfg)
    m = inp.rewards.shape[1]
    ell, rt = kl_adjusted_rewards(inp, cfg.beta)
    raw = ggpo_group_loss(rt, cfg.beta)
    scale = m / (cfg.beta * math.sqrt(m - 1))
    loss = scale * raw.sum() / inp.t_tot
    return loss, {"pg_loss": loss.detach()}


def ggpo_clipped_loss(inp: LossInputs, cfg: TrainConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Spec 5.5: o = min(c_hat D, c_hat clamp(D, -delta, delta)), D = lp - lp_old, c_hat
    detached; loss_tok = -o; token-mean. Equals the original update's gradient at D = 0."""
    if inp.lp_old is None:
        raise ValueError("ggpo with train.ggpo_clip_delta needs lp_old (the step-start recompute)")
    delta = cfg.ggpo_clip_delta
    assert delta is not None    # ggpo_loss calls this only with the delta set
    ell, rt = kl_adjusted_rewards(inp, cfg.beta)
    _, c_hat = ggpo_coefficients(rt.detach(), cfg.beta)
    c = c_hat[..., None]
    d = inp.lp - inp.lp_old
    o = torch.minimum(c * d, c * torch.clamp(d, -delta, delta))
    loss = ((-o) * inp.mask).sum() / inp.t_tot
    with torch.no_grad():
        clipped = ((c > 0) & (d > delta)) | ((c < 0) & (d < -delta))
        metrics = {"pg_loss": loss.detach(), "clip_frac": (clipped.to(inp.mask.dtype) * inp.mask).sum() / inp.t_tot}
    return loss, metrics


LossFn = Callable[[LossInputs, TrainConfig], tuple[Tensor, dict[str, Tensor]]]
# the built-in methods' losses, keyed as pipeline/core/methods.py's METHODS (tests/test_methods.py
# checks that each entry's `loss` names the function here)
LOSSES: dict[str, LossFn] = {"grpo": grpo_loss, "grpo_tis": grpo_tis_loss, "agro": agro_loss, "ggpo": ggpo_loss}


def get_loss(method: str) -> LossFn:
    """The loss of train.method `method`: its METHODS entry's "module:function"."""
    if method in LOSSES:
        return LOSSES[method]
    module, _, name = methods.get(method).loss.partition(":")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"train.method '{method}': loss '{module}:{name}' is not a function")
    return cast(LossFn, fn)
