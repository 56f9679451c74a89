"""Micro-batches of whole groups under a token budget (a pure function, tested alone).

A micro-batch holds whole groups (a group's m responses share one advantage baseline and
must stay together). Its rows are right-padded to its longest row, so its cost is
rows x longest row (prompt + response tokens). Groups are taken longest first and a
micro-batch is closed when the next group would push rows x width over the budget, so
little padding is spent and peak memory follows the budget, not the longest responses.
A group that alone exceeds the budget gets a micro-batch of its own (it cannot be split).

Packed micro-batches (train.packing, policy.make_batch) hold no padding: their cost is
their tokens, so `pack_tokens` closes a micro-batch when the next group's tokens would pass
the budget.

Bucketed rows (`bucket_rows`, where packing's attention is not available: the CPU): a padded
micro-batch's rows, sorted by length, run as a few padded forwards instead of one, each padded
to its own longest row; the cost model is rows x width per forward plus a fixed cost per
forward in token-equivalents, and the split minimizing it is found exactly (policy.Buckets).

The loss is token-mean over the whole update with the global T_tot (losses.py), so how
an update is split never changes its value, only the floating-point summation order.
"""
from __future__ import annotations


def group_width(prompt_len: int, response_lens: list[int]) -> int:
    """Padded row length of a group: prompt + its longest response."""
    return prompt_len + max(response_lens, default=0)


def pack_groups(groups: list[int], widths: dict[int, int], rows_per_group: int,
                budget: int) -> list[list[int]]:
    """groups (update order) -> micro-batches of groups, longest first, each with
    rows x max width <= budget unless a single group already exceeds it."""
    if budget < 1:
        raise ValueError(f"train.micro_batch_tokens must be >= 1, got {budget}")
    order = sorted(range(len(groups)), key=lambda i: (-widths[groups[i]], i))
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        g = groups[i]
        new_width = max(width, widths[g])
        if current and (len(current) + 1) * rows_per_group * new_width > budget:
            batches.append(current)
            current, new_width = [], widths[g]
        current.append(g)
        width = new_width
    if current:
        batches.append(current)
    return batches


def pack_tokens(groups: list[int], tokens: dict[int, int], budget: int) -> list[list[int]]:
    """groups (update order) -> micro-batches of whole groups, longest first, each with at
    most `budget` tokens (prompt + response, no padding) unless one group alone has more."""
    if budget < 1:
        raise ValueError(f"train.micro_batch_tokens must be >= 1, got {budget}")
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for g in sorted(groups, key=lambda g: (-tokens[g], groups.index(g))):
        if current and used + tokens[g] > budget:
            batches.append(current)
            current, used = [], 0
        current.append(g)
        used += tokens[g]
    if current:
        batches.append(current)
    return batches


def split_by_count(groups: list[int], per_batch: int) -> list[list[int]]:
    """The older split: `per_batch` groups per micro-batch, in update order."""
    return [groups[i:i + per_batch] for i in range(0, len(groups), per_batch)]


def bucket_rows(lengths: list[int], overhead: float) -> list[list[int]]:
    """Rows (their padded lengths) -> buckets of row indices, shortest first, minimizing
    sum over buckets of (rows x longest row + overhead): the padded tokens a forward of each
    bucket computes plus a fixed cost per forward in token-equivalents (python, kernel
    launches, the mask). Rows are sorted by length (ties in index order), so an optimal
    split is contiguous in that order and cuts only where the length changes; a dynamic
    program over those cut points finds it exactly. overhead = inf: one bucket."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    sl = [lengths[i] for i in order]
    n = len(sl)
    # bucket ends: after the last row of each distinct length (and the end)
    ends = [j for j in range(1, n + 1) if j == n or sl[j] != sl[j - 1]]
    best: dict[int, tuple[float, int]] = {0: (0.0, 0)}     # end -> (cost, start of its last bucket)
    for j in ends:
        best[j] = min((best[i][0] + (j - i) * sl[j - 1] + overhead, i) for i in best if i < j)
    cuts, j = [], n
    while j > 0:
        i = best[j][1]
        cuts.append(order[i:j])
        j = i
    return cuts[::-1]
