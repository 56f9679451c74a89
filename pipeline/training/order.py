"""Seeded group order on a fixed pool (spec sections 8.3-8.4).

Update u consumes positions u*G_mb .. u*G_mb + G_mb - 1 of an endless stream made of one
seeded permutation of the pool's groups per pass (pass e uses the stream
(seed, "train/group-order", e)). The order depends only on (seed, pool size, G_mb): every
method of a seed sees the same groups in the same updates, and resuming needs no cursor
beyond the update index.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache

from pipeline.core.seeding import permutation


@lru_cache(maxsize=64)
def _pass(n_groups: int, seed: int, epoch: int) -> tuple[int, ...]:
    return tuple(permutation(n_groups, seed, "train/group-order", epoch))


def groups_for_update(update: int, groups_per_update: int, n_groups: int, seed: int) -> list[int]:
    """Pool group positions (0..n_groups-1) used by optimizer update `update` (0-based)."""
    out = []
    for pos in range(update * groups_per_update, (update + 1) * groups_per_update):
        out.append(_pass(n_groups, seed, pos // n_groups)[pos % n_groups])
    return out


def order_hash(updates: int, groups_per_update: int, group_ids: list[int], seed: int) -> str:
    """sha256 of the group-id sequence of a whole run: equal hashes = same data order."""
    h = hashlib.sha256()
    for u in range(updates):
        for g in groups_for_update(u, groups_per_update, len(group_ids), seed):
            h.update(f"{group_ids[g]},".encode())
    return h.hexdigest()
