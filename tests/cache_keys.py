"""Every cache key the shipped presets lead to, offline and online, for every method: what
tests/test_cache_keys.py compares with the keys pinned in tests/data/cache_keys.json.

Run as a script to print them (JSON): `python tests/cache_keys.py > tests/data/cache_keys.json`
regenerates the pins, which is right only when a change means to move keys (a new stage
version, a new key field); a refactor never does."""
from __future__ import annotations

import json
import sys

METHODS = ("grpo", "grpo_tis", "agro", "ggpo")


def all_keys() -> dict[str, dict[str, list[str]]]:
    """{preset: {"offline" | "online": sorted "stage key" lines}} with every method in the
    experiment (the preset's grid and seeds kept)."""
    from pipeline.core.config import load_config, preset_names
    from pipeline.dag import graph

    out = {}
    for preset in preset_names():
        cfg = load_config(preset, {"experiment.methods": list(METHODS)})
        out[preset] = {
            "offline": sorted(f"{s} {k}" for s, k in graph.experiment_keys(cfg)),
            "online": sorted(f"{s} {k}" for s, k in graph.online_experiment_keys(cfg)),
        }
    return out


if __name__ == "__main__":
    json.dump(all_keys(), sys.stdout, indent=1)
    sys.stdout.write("\n")
