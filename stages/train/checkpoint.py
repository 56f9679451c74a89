"""Atomic training checkpoints: model, optimizer, reference, RNG states, update index,
metrics so far and the current step's anchor log-probs (lp_old).

One file, `checkpoints/latest.pt`, replaced atomically (write temp, fsync, rename), so a
crash at any moment leaves the previous complete checkpoint. The pool cursor is the update
index: the group order is a pure function of (seed, update), see `order.py`.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import torch

from pipeline.store import fsync_rename

NAME = "latest.pt"


def save(folder: Path, *, update: int, model, optimizer, reference, metrics: list[dict],
         lp_old: dict | None = None, block_s: list[float] | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        "update": update,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "reference": reference.state_dict() if reference is not None else None,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "metrics": metrics,
        "lp_old": lp_old,        # step anchor, needed to resume inside a step exactly
        "block_s": block_s or [],  # sequence log ratios of the unfinished ESS block
    }
    tmp = folder / f".{NAME}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    fsync_rename(tmp, folder / NAME)


def load(folder: Path) -> dict | None:
    path = folder / NAME
    if not path.exists():
        return None
    # on the CPU first: load_state_dict then copies to wherever the model and optimizer live
    return torch.load(path, weights_only=False, map_location="cpu")


def restore(state: dict, *, model, optimizer, reference) -> tuple[int, list[dict]]:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if reference is not None and state["reference"] is not None:
        reference.load_state_dict(state["reference"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return state["update"], state["metrics"]
