"""The off-policy corrections of the field as training losses: `fn(inputs, cfg) -> (loss, metrics)`.

Math and sources: docs/math.md, section "Off-policy corrections" (each formula in its notation,
the framework and file it was read from, and where two frameworks disagree, which one these
follow). Tensors are [G, m, T] as in losses.py: lp (learner, with grad), lp_beh (the engine's
behavior log-probs mu), lp_old (the trainer's step-start recompute pi_old), mask, rewards [G, m].
A = group_advantages(rewards) as GRPO's (OPMD: rewards minus its own baseline). Every loss adds
beta * K3(lp, lp_ref) per token as GRPO does (pathwise, never reweighted or masked), so the
methods differ only in their correction; train.beta = 0 removes it. Aggregation: `aggregate` with train.aggregation
(token-mean over the whole update by default); a rule's masked tokens stay in T_tot.

Metrics, each a detached 0-dim tensor additive over micro-batches: pg_loss, kl_ref_k3 and, per
rule, the fraction of the update's tokens it clipped (`clip_frac`: a PPO-style clip or a clamped
weight), truncated (`trunc_frac`: a capped importance weight) or masked (`mask_frac`); rules that
act on whole responses also give the fraction of the update's responses (`seq_trunc_frac`,
`seq_mask_frac`). Ratios are exponentiated through losses.safe_exp_ratio (the +-20 guard).
"""
from __future__ import annotations

import math

import torch

from pipeline.core.config import TrainConfig
from pipeline.training.losses import (
    LossInputs,
    aggregate,
    group_advantages,
    k3_to_reference,
    log_mean_exp,
    ppo_clipped_pg,
    safe_exp_ratio,
)

Tensor = torch.Tensor
Out = tuple[Tensor, dict[str, Tensor]]


def _need(inp: LossInputs, method: str, old: bool = False, beh: bool = False) -> None:
    """ValueError when the inputs lack the log-probs `method` reads (the trainer supplies them
    from its Method entry; a direct caller may not)."""
    missing = [n for n, want, got in (("lp_old", old, inp.lp_old), ("lp_beh", beh, inp.lp_beh)) if want and got is None]
    if missing:
        raise ValueError(f"{method} needs {' and '.join(missing)}")


def token_frac(flags: Tensor, inp: LossInputs) -> Tensor:
    """Fraction of the update's T_tot tokens where `flags` ([G, m, T] or [G, m, 1]) holds."""
    with torch.no_grad():
        return (flags.to(inp.mask.dtype) * inp.mask).sum() / inp.t_tot


def seq_frac(flags: Tensor, inp: LossInputs) -> Tensor:
    """Fraction of the update's responses (n_seq_tot) where `flags` [G, m] holds."""
    with torch.no_grad():
        return flags.to(inp.mask.dtype).sum() / inp.n_seq_tot


def seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Masked mean over each response's tokens: [G, m, T] -> [G, m, 1]."""
    return (x * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)


def _finish(pg: Tensor, inp: LossInputs, cfg: TrainConfig, metrics: dict[str, Tensor]) -> Out:
    """loss = aggregate(pg + beta K3); metrics plus pg_loss and kl_ref_k3, all detached."""
    k3 = k3_to_reference(inp.lp, inp.lp_ref)
    loss = aggregate(pg + cfg.beta * k3, inp, cfg.aggregation)
    with torch.no_grad():
        metrics = {"pg_loss": aggregate(pg, inp, cfg.aggregation), "kl_ref_k3": (k3 * inp.mask).sum() / inp.t_tot,
                   **{k: v.detach() for k, v in metrics.items()}}
    return loss, metrics


def _advantages(inp: LossInputs, cfg: TrainConfig) -> Tensor:
    return group_advantages(inp.rewards, cfg.eps_adv)[..., None]          # [G, m, 1]


def _ppo_old(inp: LossInputs, cfg: TrainConfig) -> tuple[Tensor, Tensor, Tensor]:
    """(A [G, m, 1], PPO-clipped pg against lp_old, its clip flags): the decoupled methods' base."""
    assert inp.lp_old is not None
    adv = _advantages(inp, cfg)
    pg, clipped = ppo_clipped_pg(adv, inp.lp - inp.lp_old, cfg)
    return adv, pg, clipped


def tis_seq_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """Sequence-level TIS: PPO-clip against lp_old times w_i = min(prod_t pi_old/mu, C), one
    detached weight per response, C = train.tis_cap. lp, lp_old, lp_beh [G, m, T] -> 0-dim."""
    _need(inp, "tis_seq", old=True, beh=True)
    assert inp.lp_old is not None and inp.lp_beh is not None
    _, pg, clipped = _ppo_old(inp, cfg)
    log_w = ((inp.lp_old - inp.lp_beh) * inp.mask).sum(-1, keepdim=True).detach()      # [G, m, 1]
    ratio = safe_exp_ratio(log_w)
    w, over = torch.clamp(ratio, max=cfg.tis_cap), ratio > cfg.tis_cap
    return _finish(w * pg, inp, cfg, {"clip_frac": token_frac(clipped, inp), "trunc_frac": token_frac(over, inp),
                                      "seq_trunc_frac": seq_frac(over[..., 0], inp)})


def icepop_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """Masked IS (IcePop): PPO-clip against lp_old times w = pi_old/mu where a <= w <= b, 0
    outside (a, b = train.is_threshold_low/high), detached. lp, lp_old, lp_beh [G, m, T] -> 0-dim."""
    _need(inp, "icepop", old=True, beh=True)
    assert inp.lp_old is not None and inp.lp_beh is not None
    _, pg, clipped = _ppo_old(inp, cfg)
    w = safe_exp_ratio(inp.lp_old - inp.lp_beh).detach()
    keep = (w >= cfg.is_threshold_low) & (w <= cfg.is_threshold_high)
    return _finish(w * keep * pg, inp, cfg, {"clip_frac": token_frac(clipped, inp), "mask_frac": token_frac(~keep, inp)})


def geo_mask_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """Geometric sequence masking: PPO-clip against lp_old on the responses whose geometric-mean
    ratio exp(mean_t log pi_old/mu) lies in [geo_mask_low, geo_mask_high]; others dropped.
    lp, lp_old, lp_beh [G, m, T] -> 0-dim."""
    _need(inp, "geo_mask", old=True, beh=True)
    assert inp.lp_old is not None and inp.lp_beh is not None
    _, pg, clipped = _ppo_old(inp, cfg)
    geo = safe_exp_ratio(seq_mean(inp.lp_old - inp.lp_beh, inp.mask)).detach()       # [G, m, 1]
    keep = (geo >= cfg.geo_mask_low) & (geo <= cfg.geo_mask_high)
    return _finish(keep * pg, inp, cfg, {"clip_frac": token_frac(clipped, inp), "mask_frac": token_frac(~keep, inp),
                                         "seq_mask_frac": seq_frac(~keep[..., 0], inp)})


def opsm_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """OPSM (DeepSeek-V3.2): PPO-clip against lp_old, dropping a response with A < 0 whose
    mean_t (lp_beh - lp) exceeds delta = train.opsm_delta (lp detached in the rule).
    lp, lp_old, lp_beh [G, m, T], A [G, m] -> 0-dim."""
    _need(inp, "opsm", old=True, beh=True)
    assert inp.lp_old is not None and inp.lp_beh is not None
    adv, pg, clipped = _ppo_old(inp, cfg)
    kl = seq_mean(inp.lp_beh - inp.lp.detach(), inp.mask)                            # [G, m, 1]
    drop = (adv < 0) & (kl > cfg.opsm_delta)
    return _finish(~drop * pg, inp, cfg, {"clip_frac": token_frac(clipped, inp), "mask_frac": token_frac(drop, inp),
                                          "seq_mask_frac": seq_frac(drop[..., 0], inp)})


def cispo_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """CISPO: loss_tok = -sg(clip(r, 1 - eps_l, 1 + eps_h)) A lp, r = pi/pi_old (eps =
    train.cispo_eps_clip_low/high): REINFORCE with a clipped, detached weight; every token keeps
    a gradient. lp, lp_old [G, m, T] -> 0-dim."""
    _need(inp, "cispo", old=True)
    assert inp.lp_old is not None
    adv = _advantages(inp, cfg)
    r = safe_exp_ratio(inp.lp - inp.lp_old).detach()
    rc = torch.clamp(r, 1.0 - cfg.cispo_eps_clip_low, 1.0 + cfg.cispo_eps_clip_high)
    return _finish(-rc * adv * inp.lp, inp, cfg, {"clip_frac": token_frac(rc != r, inp)})


# verl's GSPO bounds the token's log sequence ratio above by 10 (its own guard; no lower bound)
GSPO_LOG_RATIO_MAX = 10.0


def gspo_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """GSPO: one ratio per response s_i = exp(mean_t log pi/pi_old), carried per token as
    sg(s_i) pi_t / sg(pi_t) (verl), PPO-clipped to [1 - eps_l, 1 + eps_h] (train.gspo_eps_*),
    no dual clip. Each token's gradient is -A s_i d lp_t inside the clip. lp, lp_old [G, m, T]
    -> 0-dim."""
    _need(inp, "gspo", old=True)
    assert inp.lp_old is not None
    adv = _advantages(inp, cfg)
    log_s = seq_mean(inp.lp - inp.lp_old, inp.mask).detach()                        # [G, m, 1]
    s = torch.exp(torch.clamp(inp.lp - inp.lp.detach() + log_s, max=GSPO_LOG_RATIO_MAX))
    pg1 = -adv * s
    pg2 = -adv * torch.clamp(s, 1.0 - cfg.gspo_eps_low, 1.0 + cfg.gspo_eps_high)
    clipped = pg2 > pg1
    return _finish(torch.maximum(pg1, pg2), inp, cfg, {"clip_frac": token_frac(clipped, inp),
                                                      "seq_clip_frac": seq_frac(clipped[..., 0], inp)})


def m2po_keep(m2: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """M2PO's mask (AReaL `_apply_m2po_masking`): drop the fewest tokens of largest m2 such
    that the mean m2 of the kept ones is below `threshold` (all but one when none is). m2,
    mask [G, m, T] -> keep [G, m, T] bool; padding is never kept."""
    valid = mask > 0
    values = m2[valid].double()     # suffix means over thousands of tokens: fp32 sums would drift
    keep = torch.zeros_like(valid)
    if values.numel() == 0:
        return keep
    ordered, order = torch.sort(values, descending=True, stable=True)
    n = ordered.numel()
    suffix_mean = ordered.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, device=m2.device, dtype=torch.float64)
    below = torch.nonzero(suffix_mean < threshold)
    n_drop = int(below[0, 0]) if below.numel() else n - 1
    kept = torch.ones(n, dtype=torch.bool, device=m2.device)
    kept[order[:n_drop]] = False
    keep[valid] = kept
    return keep


def _decoupled(inp: LossInputs, cfg: TrainConfig, method: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(pg, PPO clip flags, behavior weight w = pi_old/mu zeroed above the cap, the cap's drops),
    each [G, m, T]."""
    _need(inp, method, old=True, beh=True)
    assert inp.lp_old is not None and inp.lp_beh is not None
    _, pg, clipped = _ppo_old(inp, cfg)
    w = safe_exp_ratio(inp.lp_old - inp.lp_beh).detach()
    over = w > cfg.behave_imp_weight_cap
    return pg, clipped, w * ~over, over


def decoupled_ppo_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """Decoupled PPO (AReaL): PPO-clip against the proximal policy lp_old times the detached
    behavior weight pi_old/mu, tokens whose weight exceeds train.behave_imp_weight_cap masked.
    lp, lp_old, lp_beh [G, m, T] -> 0-dim."""
    pg, clipped, w, over = _decoupled(inp, cfg, "decoupled_ppo")
    return _finish(w * pg, inp, cfg, {"clip_frac": token_frac(clipped, inp), "mask_frac": token_frac(over, inp)})


def m2po_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """M2PO (AReaL): decoupled PPO on the tokens left after M2PO's mask of m2 = (lp_beh -
    lp_old)^2 at train.m2_threshold, taken over this micro-batch's tokens as AReaL does.
    lp, lp_old, lp_beh [G, m, T] -> 0-dim."""
    pg, clipped, w, over = _decoupled(inp, cfg, "m2po")
    assert inp.lp_old is not None and inp.lp_beh is not None
    keep = m2po_keep(((inp.lp_beh - inp.lp_old) ** 2).detach(), inp.mask, cfg.m2_threshold)
    return _finish(keep * w * pg, inp, cfg, {"clip_frac": token_frac(clipped, inp),
                                             "mask_frac": token_frac(over | ~keep, inp),
                                             "m2_mask_frac": token_frac(~keep, inp)})


def dppo_tv_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """DPPO-TV (prime-rl's default loss): loss_tok = -keep A rho + kl_tau (log rho)^2, rho =
    pi/mu with its gradient; a token is dropped when A > 0 and p - p_beh > delta_h, or A <= 0
    and p - p_beh < -delta_l (p = exp lp). lp, lp_beh [G, m, T] -> 0-dim."""
    _need(inp, "dppo_tv", beh=True)
    assert inp.lp_beh is not None
    adv = _advantages(inp, cfg)
    log_rho = torch.clamp(inp.lp - inp.lp_beh, -20.0, 20.0)          # losses.safe_exp_ratio's guard
    diff = (torch.exp(inp.lp) - torch.exp(inp.lp_beh)).detach()
    drop = torch.where(adv > 0, diff > cfg.dppo_mask_high, diff < -cfg.dppo_mask_low)
    pg = -adv * torch.exp(log_rho) * ~drop
    loss_tok = pg + cfg.dppo_kl_tau * log_rho ** 2
    return _finish(loss_tok, inp, cfg, {"mask_frac": token_frac(drop, inp)})


def topr_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """TOPR (ROLL): loss_tok = -c A lp with c = 1 on responses of reward > 0 (no IS) and
    c = sg(clip(pi/pi_old, 0, 1)) on the others. lp, lp_old [G, m, T], rewards [G, m] -> 0-dim."""
    _need(inp, "topr", old=True)
    assert inp.lp_old is not None
    adv = _advantages(inp, cfg)
    r = safe_exp_ratio(inp.lp - inp.lp_old).detach()
    positive = (inp.rewards > 0)[..., None]
    c = torch.where(positive, torch.ones_like(r), torch.clamp(r, 0.0, 1.0))
    return _finish(-c * adv * inp.lp, inp, cfg, {"trunc_frac": token_frac(~positive & (r > 1.0), inp)})


def plain_is_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """Plain IS: loss_tok = -(pi/mu) A, the ratio unclipped and differentiated (no rule).
    lp, lp_beh [G, m, T] -> 0-dim."""
    _need(inp, "plain_is", beh=True)
    assert inp.lp_beh is not None
    adv = _advantages(inp, cfg)
    return _finish(-adv * safe_exp_ratio(inp.lp - inp.lp_beh), inp, cfg, {})


def _by_sign(adv: Tensor, pos: float, neg: float, strict: bool = True) -> Tensor:
    """[G, m, 1]: `pos` where A > 0 (A >= 0 when not `strict`), else `neg`, in A's dtype."""
    return torch.where(adv > 0 if strict else adv >= 0, adv.new_tensor(pos), adv.new_tensor(neg))


def sapo_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """SAPO (verl, TRL): loss_tok = -f(r) A with the soft gate f(r) = (4 / tau) sigmoid(tau (r - 1)),
    r = pi/pi_old differentiated through the gate (d f / d r = 1 at r = 1), tau =
    train.sapo_tau_pos where A > 0, else train.sapo_tau_neg. lp, lp_old [G, m, T] -> 0-dim."""
    _need(inp, "sapo", old=True)
    assert inp.lp_old is not None
    adv = _advantages(inp, cfg)
    tau = _by_sign(adv, cfg.sapo_tau_pos, cfg.sapo_tau_neg)                          # [G, m, 1]
    gate = torch.sigmoid(tau * (safe_exp_ratio(inp.lp - inp.lp_old) - 1.0)) * (4.0 / tau)
    return _finish(-gate * adv, inp, cfg, {})


# TRL's lower bound on VESPO's log weights (log 1e-8, its "matching the original implementation")
VESPO_LOG_W_MIN = math.log(1e-8)


def vespo_weights(log_w: Tensor, adv: Tensor, cfg: TrainConfig) -> Tensor:
    """VESPO's phi(W) = W^k exp(lambda (1 - W)) (phi(1) = 1, its peak at W = k / lambda), in log
    space as TRL; (k, lambda) = train.vespo_*_pos where A >= 0, else *_neg. [G, m, 1] -> [G, m, 1]."""
    k = _by_sign(adv, cfg.vespo_k_pos, cfg.vespo_k_neg, strict=False)
    lam = _by_sign(adv, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg, strict=False)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w))


def vespo_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """VESPO (TRL `get_gamma_weights`): loss_tok = -sg(phi(W_i)) A lp, one weight per response,
    log W_i = clip(sum_t clip(log pi/pi_old, +-20) + sum_t clip(log pi_old/mu, log 1e-8, 20),
    log 1e-8, 20), phi of vespo_weights. lp, lp_old, lp_beh [G, m, T] -> 0-dim."""
    _need(inp, "vespo", old=True, beh=True)
    assert inp.lp_old is not None and inp.lp_beh is not None
    adv = _advantages(inp, cfg)
    log_r = torch.clamp(inp.lp.detach() - inp.lp_old, -20.0, 20.0)
    log_is = torch.clamp(inp.lp_old - inp.lp_beh, VESPO_LOG_W_MIN, 20.0)
    log_w = torch.clamp(((log_r + log_is) * inp.mask).sum(-1, keepdim=True), VESPO_LOG_W_MIN, 20.0)   # [G, m, 1]
    return _finish(-vespo_weights(log_w, adv, cfg) * adv * inp.lp, inp, cfg, {})


def binary_kl(lp: Tensor, lp_old: Tensor) -> Tensor:
    """DPPO's binary KL of the sampled token, KL(Bern(q) || Bern(p)) with p = exp lp, q = exp
    lp_old and verl's 1e-8 in the complement: [G, m, T] -> [G, m, T]."""
    p, q = torch.exp(lp), torch.exp(lp_old)
    return q * (lp_old - lp) + (1.0 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))


def dppo_kl_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """DPPO-Binary-KL (verl `compute_policy_loss_dppo_kl`): loss_tok = -keep A sg(min(r, C)) lp,
    r = pi/pi_old, C = train.dppo_kl_clip_c; keep where A > 0: D <= delta_h or p <= q, else
    D <= delta_l or p >= q (D = binary_kl, p = exp lp, q = exp lp_old, all detached; delta =
    train.dppo_kl_delta_low/high). lp, lp_old [G, m, T] -> 0-dim."""
    _need(inp, "dppo_kl", old=True)
    assert inp.lp_old is not None
    adv = _advantages(inp, cfg)
    lp = inp.lp.detach()
    r, d = safe_exp_ratio(lp - inp.lp_old), binary_kl(lp, inp.lp_old)
    # p <= q as lp <= lp_old (exp is increasing; where exp rounds two log-probs to one value,
    # D is ~0, within any delta > 0, and the token is kept either way)
    keep = torch.where(adv > 0, (d <= cfg.dppo_kl_delta_high) | (lp <= inp.lp_old),
                       (d <= cfg.dppo_kl_delta_low) | (lp >= inp.lp_old))
    over = r > cfg.dppo_kl_clip_c
    pg = -adv * torch.clamp(r, max=cfg.dppo_kl_clip_c) * inp.lp * keep
    return _finish(pg, inp, cfg, {"mask_frac": token_frac(~keep, inp), "trunc_frac": token_frac(over & keep, inp)})


def gmpo_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """GMPO (verl `geo_mean`, TRL experimental gmpo): per response -A R_i, R_i = exp(mean_t l_t)
    with its gradient, l_t = min(log r, eps_h) where A > 0, max(log r, -eps_l) otherwise
    (r = pi/pi_old, eps = train.gmpo_eps_low/high); carried on each of its tokens, so
    train.aggregation=seq-mean-token-mean is verl's mean over responses. lp, lp_old [G, m, T]
    -> 0-dim."""
    _need(inp, "gmpo", old=True)
    assert inp.lp_old is not None
    adv = _advantages(inp, cfg)
    x = inp.lp - inp.lp_old
    clipped = torch.where(adv > 0, x > cfg.gmpo_eps_high, x < -cfg.gmpo_eps_low) & (adv != 0)
    lt = torch.where(adv > 0, torch.clamp(x, max=cfg.gmpo_eps_high), torch.clamp(x, min=-cfg.gmpo_eps_low))
    ratio = safe_exp_ratio(seq_mean(lt, inp.mask))                                    # [G, m, 1]
    return _finish((-adv * ratio).expand_as(inp.lp), inp, cfg, {"clip_frac": token_frac(clipped, inp)})


def opmd_advantages(rewards: Tensor, tau: float, baseline: str) -> Tensor:
    """OPMD's advantage r_i - b per group (Trinity-RFT `OPMDGroupAdvantage`), no std: b =
    tau (logsumexp_j(r_j / tau) - log m) ("logavgexp", >= the mean, -> it as tau -> inf) or
    mean_j r_j ("mean"). rewards [G, m] -> [G, m]."""
    if baseline == "mean":
        return rewards - rewards.mean(dim=1, keepdim=True)
    return rewards - log_mean_exp(rewards, tau, keepdim=True)


def opmd_loss(inp: LossInputs, cfg: TrainConfig) -> Out:
    """OPMD (Trinity-RFT): loss_tok = -A lp / (1 + tau), A = opmd_advantages(rewards,
    train.opmd_tau, train.opmd_baseline); no ratio, no anchor. lp [G, m, T] -> 0-dim."""
    adv = opmd_advantages(inp.rewards, cfg.opmd_tau, cfg.opmd_baseline)[..., None]           # [G, m, 1]
    return _finish(-adv * inp.lp / (1.0 + cfg.opmd_tau), inp, cfg, {})
