"""Learner-to-behavior drift at the end of an online round (issue #26, item 6).

A round samples its pool with the behavior policy pi_beh (the sampler synced to the learner
at the round's start), then takes N updates on it. Its drift is how far the learner after
those N updates, pi_theta, has moved from pi_beh on the round's own responses. Over S, a
seeded sample of the round's groups (all m responses y_i of each), with the token log ratios

    d_{i,t} = clamp(log pi_theta(y_{i,t} | x, y_{i,<t}) - log pi_beh(y_{i,t} | x, y_{i,<t}), +-20)

(the losses' guard, LOG_RATIO_BOUND; the same quantity as the per-update `abs_log_ratio`),
T_i the response's length and n = |S| * m responses:

    round_drift     = sum_i sum_t |d_{i,t}| / sum_i T_i     token mean |log ratio|
    round_drift_seq = (1 / n) sum_i |sum_t d_{i,t}|          response mean |log w_i|

where log w_i = sum_t d_{i,t} is the log sequence importance weight of y_i (what a
sequence-level ratio, or the sequence ESS, sees). Both are 0 for a learner that has not
moved. Neither depends on the reference, so unlike `mean_ell` and `success_ess` they see
drift that a refreshed reference hides.

Cost: S is one update's worth of groups (train.groups_per_update, fewer when the pool has
fewer), drawn from the stream (seed, "round_drift/round r"): one no-grad forward of one
update's geometry per round, without backward or reference, so at most ~1/N of the
round's forwards, and the same sample on every rerun (deterministic on the CPU). The
per-update `abs_log_ratio` cannot stand in for it: it is taken before each update's step,
so the last one sees N - 1 updates of drift (none at N = 1), on that update's groups only.

Measured rounds (`due`): online.drift_every = k measures round r (0-based) when r is a
multiple of k (round 0 always: the report's first-round column) and the run's last round
(train.updates / N rounds); the others skip the forward and their columns are None
(missing, never 0), which online.max_round_drift skips too. Skipping changes nothing else: the forward draws no random numbers and takes no step.
"""
from __future__ import annotations

import torch

from pipeline.core import seeding
from pipeline.core.config import PipelineConfig
from pipeline.core.schemas import DRIFT_COLUMNS
from pipeline.training import distributed
from pipeline.training.loop import my_micro_batches, policy_logprobs
from pipeline.training.losses import LOG_RATIO_BOUND
from pipeline.training.pool import batch, stack_groups


def due(cfg: PipelineConfig) -> bool:
    """Whether round cfg.online.round is measured: rounds 0, k, 2k, ... (k =
    online.drift_every) and the run's last (train.updates // train.updates_per_step rounds)."""
    r, rounds = cfg.online.round, cfg.train.updates // cfg.train.updates_per_step
    return r % cfg.online.drift_every == 0 or r + 1 >= rounds


def drift_sample(n_groups: int, size: int, seed: int, round_: int) -> list[int]:
    """`size` pool positions (all when the pool has no more), sorted, from the stream
    (seed, "round_drift/round r"): the same groups for every method of a seed and round."""
    if n_groups <= size:
        return list(range(n_groups))
    g = seeding.generator(seed, f"round_drift/round {round_}")
    return sorted(torch.randperm(n_groups, generator=g)[:size].tolist())


def drift_sums(lp: torch.Tensor, lp_beh: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum |d|, tokens, sum_i |sum_t d_i|, responses] in float64 for responses as rows:
    lp, lp_beh, mask [n, T] (mask 1 on response tokens). Sums, so micro-batches and ranks add."""
    mask = mask.double()
    d = torch.clamp(lp.double() - lp_beh.double(), -LOG_RATIO_BOUND, LOG_RATIO_BOUND) * mask
    return torch.stack([d.abs().sum(), mask.sum(), d.sum(-1).abs().sum(),
                        torch.tensor(float(d.shape[0]), dtype=torch.float64, device=d.device)])


def from_sums(sums: torch.Tensor) -> dict[str, float | None]:
    """DRIFT_COLUMNS from drift_sums totals (None where nothing was measured)."""
    abs_tok, tokens, abs_seq, n = sums.tolist()
    return dict(zip(DRIFT_COLUMNS, (abs_tok / tokens if tokens else None, abs_seq / n if n else None)))


@torch.no_grad()
def round_drift(model, pool, groups: list[int], cfg, pad_id: int, rt) -> dict[str, float | None]:
    """DRIFT_COLUMNS of `model` against the pool's behavior log-probs on `groups` (pool
    positions), in micro-batches of the training geometry; None each for a round that is
    not `due` (no forward). Under torchrun a collective: each rank its shard, the sums added
    over ranks (every rank has the same config, so all skip the same rounds)."""
    if not due(cfg):
        return dict.fromkeys(DRIFT_COLUMNS)
    m, total = pool.group_size, torch.zeros(4, dtype=torch.float64)
    for chunk, real in my_micro_batches(pool, groups, cfg.train, rt.packed):
        b = batch(pool, chunk, pad_id, rt.packed, rt.bucket_overhead)
        lp, _ = policy_logprobs(model, b, rt, cfg.rollout.temperature)
        if not real:             # a rank's padding pass: the collective only
            continue
        width = b.mask.shape[1]
        lp_beh = stack_groups([pool.behavior(g) for g in chunk], width, rt.device, torch.float64)
        total += drift_sums(lp.view(len(chunk) * m, width), lp_beh.view(len(chunk) * m, width),
                            b.mask.view(len(chunk) * m, width).to(rt.device)).cpu()
    d = distributed.current()
    if d is not None:
        total = torch.stack(d.gather(total)).sum(0)
    return from_sums(total)
