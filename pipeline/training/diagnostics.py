"""Training diagnostics (spec section 9), from detached tensors of an update's micro-batches.

Per micro-batch we return sums (already divided by the update's T_tot where token-mean),
so an update's value is the sum over its micro-batches:
- K3 behavior-learner mismatch: sum mask (rho - 1 - log rho) / T_tot, rho = exp(lp - lp_beh)
- mean |lp - lp_beh| over tokens, and its max (the online loop's "ratios are 1 at a step start")
- chi-square of learner vs behavior: sum mask (rho - 1)^2 / T_tot per token, and
  sum_i (exp(s_i) - 1)^2 / n_seq per response (s_i below)
- mean learner-reference sequence log ratio ell (returned as a sum over responses)
- within-success ESS of GGPO weights (groups with >= 2 successes; a sum and a count)
Sequence log ratios s_i = sum_t mask (lp - lp_beh) are returned per response: the
normalized ESS of exp(s) is taken over a block of responses, in log space.
"""
from __future__ import annotations

import math

import torch

from pipeline.training.losses import LOG_RATIO_BOUND, LossInputs, ggpo_group_loss, kl_adjusted_rewards


def normalized_ess(log_w: torch.Tensor) -> float:
    """(sum w)^2 / (n sum w^2) = exp(2 LSE(log w) - LSE(2 log w) - log n), in (0, 1]."""
    log_w = log_w.double().flatten()
    n = log_w.numel()
    if n == 0:
        return float("nan")
    return math.exp(2 * torch.logsumexp(log_w, 0).item() - torch.logsumexp(2 * log_w, 0).item() - math.log(n))


def within_success_ess(rt: torch.Tensor, rewards: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) as tensors, over groups with >= 2 successes, of the normalized ESS of
    the GGPO log-weights rt/beta restricted to the successes (spec 9); rt, rewards [G, m].
    Vectorized over groups: no per-group host read."""
    success = rewards.to(rt.device) > 0.5
    log_w = torch.where(success, rt.double() / beta, torch.tensor(float("-inf"), dtype=torch.float64, device=rt.device))
    k = success.sum(1)
    counted = k >= 2
    ess = torch.exp(2 * torch.logsumexp(log_w, 1) - torch.logsumexp(2 * log_w, 1) - torch.log(k.clamp(min=1).double()))
    return torch.where(counted, ess, torch.zeros_like(ess)).sum(), counted.sum()


@torch.no_grad()
def micro_batch_stats(inp: LossInputs, beta: float) -> dict[str, torch.Tensor]:
    """The spec-9 diagnostics of one micro-batch as float64 tensors on its device: sums
    (token ones already / T_tot), the largest |log rho|, and the responses' sequence log
    ratios s_i (`seq_log_ratio`, [G * m]) for the block ESS."""
    # in float64: rho - 1 - log rho of a near-1 ratio cancels to fp32 noise (~1e-7 a token)
    # in fp32, which would hide a mismatch as small as an engine's KV-cache rounding
    lp, mask = inp.lp.detach().double(), inp.mask.double()
    lp_beh = None if inp.lp_beh is None else inp.lp_beh.double()
    if lp_beh is None:      # no behavior policy: placeholders, which the trainer reports as None
        log_rho = torch.zeros_like(lp)
    else:
        log_rho = torch.clamp(lp - lp_beh, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)   # the losses' guard
    k3 = torch.exp(log_rho) - 1.0 - log_rho
    detached = LossInputs(lp=lp, lp_beh=lp_beh, lp_ref=inp.lp_ref.double(), mask=mask, rewards=inp.rewards,
                          t_tot=inp.t_tot, n_seq_tot=inp.n_seq_tot)
    ell, rt = kl_adjusted_rewards(detached, beta)
    zero = torch.zeros((), dtype=torch.float64, device=lp.device)
    ess_sum, ess_count = within_success_ess(rt, inp.rewards, beta) if beta > 0 else (zero, zero)
    # chi-square divergence of the learner from the behavior policy, estimated on the behavior's
    # samples: E_beh[(rho - 1)^2] per token and E_beh[(w - 1)^2] per response, w = exp(s_i)
    # (verl's rollout_corr/chi2_token and chi2_seq). In float64 (w - 1)^2 overflows only past
    # s_i = 354 nats; an inf there is the honest size of such a sequence weight's second moment
    seq_log_ratio = (log_rho * mask).sum(-1).flatten()
    return {
        "chi2_token": ((torch.exp(log_rho) - 1.0) ** 2 * mask).sum() / inp.t_tot,
        "chi2_seq": ((torch.exp(seq_log_ratio) - 1.0) ** 2).sum() / inp.n_seq_tot,
        "k3_mismatch": (k3 * mask).sum() / inp.t_tot,
        "abs_log_ratio": (log_rho.abs() * mask).sum() / inp.t_tot,
        "max_abs_log_ratio": (log_rho.abs() * mask).max() if mask.numel() else zero,
        "ell_sum": ell.sum(),
        "ggpo_raw_sum": ggpo_group_loss(rt, beta).sum() if beta > 0 else zero + float("nan"),
        "success_ess_sum": ess_sum, "success_ess_count": ess_count.double(),
        "seq_log_ratio": seq_log_ratio,
    }
