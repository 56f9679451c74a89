"""Named random streams: every stream is derived from (seed, purpose) by a stable digest.

Python's `hash()` is salted per process, so it is never used. Prompt order, sampling and
model init get different purposes, hence independent streams: changing how many samples
a stage draws can never shift the prompt order another stage sees.
"""
from __future__ import annotations

import hashlib
import random

import torch


def derive_seed(seed: int, purpose: str) -> int:
    """A 63-bit seed that depends only on (seed, purpose)."""
    digest = hashlib.sha256(f"{int(seed)}/{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def generator(seed: int, purpose: str) -> torch.Generator:
    """A CPU torch generator for the stream (seed, purpose)."""
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, purpose))
    return g


def py_random(seed: int, purpose: str) -> random.Random:
    return random.Random(derive_seed(seed, purpose))


def permutation(n: int, seed: int, purpose: str, epoch: int = 0) -> list[int]:
    """Seeded permutation of range(n); a new one per epoch (spec 8.3)."""
    g = generator(seed, f"{purpose}/epoch{epoch}")
    return torch.randperm(n, generator=g).tolist()
