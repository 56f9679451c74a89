"""Reference log-probs, once per group per reference window.

The reference policy is frozen between refreshes (spec 7), and an offline pool's groups
come back in every pass over it, so lp_ref of a group is computed once and served from
memory until the next refresh, which clears the cache (a new reference, new values). A
group is always computed alone (a forward of its m rows), never as part of whichever
micro-batch it lands in: its lp_ref is then a function of the group and the reference
only, and a cached value is bit-for-bit what a fresh computation gives (a test trains with
and without the cache and compares the bytes). The cache lives on the training device
(one [m, T_g] fp32 tensor per group: 8 x 3,000 tokens is 96 KB) and is not checkpointed:
a resumed run recomputes what it needs, to the same values. `enabled=False` computes every
time (train.reference_cache=false), for that comparison.
"""
from __future__ import annotations

import torch

from pipeline.models.runtime import Runtime
from pipeline.training.pool import Pool, batch


class ReferenceCache:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.rows: dict[int, torch.Tensor] = {}
        self.computed = 0          # group forwards run
        self.served = 0            # group lookups answered from the cache

    def clear(self) -> None:
        """The reference changed (a refresh): every cached value is stale."""
        self.rows.clear()

    def get(self, reference, pool: Pool, groups: list[int], pad_id: int, rt: Runtime, temperature: float,
            logprobs) -> list[torch.Tensor]:
        """[m, T_g] lp_ref per group of `groups`, on rt.device. `logprobs(model, batch, rt,
        temperature, device=...)` is the trainer's log-prob function (loop.policy_logprobs)."""
        out = []
        for g in groups:
            rows = self.rows.get(g)
            if rows is None:
                with torch.no_grad():
                    lp, _ = logprobs(reference, batch(pool, [g], pad_id, rt.packed, rt.bucket_overhead), rt, temperature,
                                     device=rt.reference_device)
                rows = lp.detach()
                self.computed += 1
                if self.enabled:
                    self.rows[g] = rows
            else:
                self.served += 1
            out.append(rows)
        return out
