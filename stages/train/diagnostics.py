"""Training diagnostics (spec section 9), from detached tensors of an update's micro-batches.

Per micro-batch we return sums (already divided by the update's T_tot where token-mean),
so an update's value is the sum over its micro-batches:
- K3 behavior-learner mismatch: sum mask (rho - 1 - log rho) / T_tot, rho = exp(lp - lp_beh)
- mean |lp - lp_beh| over tokens, and its max (the online loop's "ratios are 1 at a step start")
- mean learner-reference sequence log ratio ell (returned as a sum over responses)
- within-success ESS of GGPO weights (groups with >= 2 successes; a sum and a count)
Sequence log ratios s_i = sum_t mask (lp - lp_beh) are returned per response: the
normalized ESS of exp(s) is taken over a block of responses, in log space.
"""
from __future__ import annotations

import math

import torch

from stages.train.losses import LOG_RATIO_BOUND, LossInputs, ggpo_group_loss, kl_adjusted_rewards


def normalized_ess(log_w: torch.Tensor) -> float:
    """(sum w)^2 / (n sum w^2) = exp(2 LSE(log w) - LSE(2 log w) - log n), in (0, 1]."""
    log_w = log_w.double().flatten()
    n = log_w.numel()
    if n == 0:
        return float("nan")
    return math.exp(2 * torch.logsumexp(log_w, 0).item() - torch.logsumexp(2 * log_w, 0).item() - math.log(n))


def within_success_ess(rt: torch.Tensor, rewards: torch.Tensor, beta: float) -> tuple[float, int]:
    """(sum, count) over groups with >= 2 successes of the ESS of GGPO log-weights rt/beta
    restricted to the successes. rt, rewards: [G, m]."""
    total, count = 0.0, 0
    for g in range(rt.shape[0]):
        success = rewards[g] > 0.5
        if int(success.sum()) >= 2:
            total += normalized_ess(rt[g][success] / beta)
            count += 1
    return total, count


@torch.no_grad()
def micro_batch_stats(inp: LossInputs, beta: float) -> dict:
    # in float64: rho - 1 - log rho of a near-1 ratio cancels to fp32 noise (~1e-7 a token)
    # in fp32, which would hide a mismatch as small as an engine's KV-cache rounding
    lp, lp_beh, mask = inp.lp.detach().double(), inp.lp_beh.double(), inp.mask.double()
    log_rho = torch.clamp(lp - lp_beh, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)   # the losses' guard
    k3 = torch.exp(log_rho) - 1.0 - log_rho
    detached = LossInputs(lp=lp, lp_beh=lp_beh, lp_ref=inp.lp_ref, mask=mask, rewards=inp.rewards,
                          t_tot=inp.t_tot, n_seq_tot=inp.n_seq_tot)
    ell, rt = kl_adjusted_rewards(detached, beta)
    ess_sum, ess_count = within_success_ess(rt, inp.rewards, beta) if beta > 0 else (0.0, 0)
    return {
        "k3_mismatch": float((k3 * mask).sum() / inp.t_tot),
        "abs_log_ratio": float((log_rho.abs() * mask).sum() / inp.t_tot),
        "max_abs_log_ratio": float((log_rho.abs() * mask).max()) if mask.numel() else 0.0,
        "ell_sum": float(ell.sum()),
        "ggpo_raw_sum": float(ggpo_group_loss(rt, beta).sum()) if beta > 0 else float("nan"),
        "success_ess_sum": ess_sum, "success_ess_count": ess_count,
        "seq_log_ratio": (log_rho * mask).sum(-1).flatten().tolist(),
    }
