"""A cache built before a refactor is read after it: every key the shipped presets lead to
(offline and online, every method, tests/cache_keys.py) equals the one pinned in
tests/data/cache_keys.json, which was computed by the code before the house's second pass
(commit f1fbc09). A key that moves means every user's cache misses: it must be a decision
(a stage version bump), made by regenerating the pins in the same commit, never a side
effect. The pins are the reproducible kernel mode's (a CPU stage's key carries its numerics,
pipeline/core/kernels.py; regenerated when that mode landed): where the mode cannot hold, the
keys are another numerics' and the message says so."""
from __future__ import annotations

import json
from pathlib import Path

from cache_keys import all_keys

from pipeline.core import kernels

PINNED = Path(__file__).parent / "data" / "cache_keys.json"


def test_every_preset_keeps_its_cache_keys():
    pinned, now = json.loads(PINNED.read_text()), all_keys()
    assert sorted(now) == sorted(pinned), "presets added or removed: regenerate the pins (tests/cache_keys.py)"
    for preset in pinned:
        for flow in ("offline", "online"):
            moved = sorted(set(pinned[preset][flow]) ^ set(now[preset][flow]))
            assert not moved, (f"{preset} {flow}: {len(moved)} keys moved, e.g. {moved[:4]} "
                               f"({kernels.state().line()})")
