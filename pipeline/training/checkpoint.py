"""Atomic training checkpoints: model, optimizer, reference, RNG states, update index,
metrics so far and the current step's anchor log-probs (lp_old).

One process: one file, `checkpoints/latest.pt`, replaced atomically (write temp, fsync,
rename), so a crash at any moment leaves the previous complete checkpoint.

Under torchrun (an FSDP-sharded policy, distributed.py): torch.distributed.checkpoint (DCP).
Every rank writes its shards of the model and optimizer into `checkpoints/.dcp-NNNNNN.tmp/`;
rank 0 adds `meta.pt` (update, metrics, lp_old, ESS block, reference once refreshed, its
RNG), renames the folder to `dcp-NNNNNN/`, then replaces the pointer `latest-dcp.json`
atomically and removes older `dcp-*` folders. A rank dying at any moment leaves the pointer
on the previous complete folder. DCP reshards on load, so a run resumes under another
world size; `load` picks whichever of `latest.pt` and the DCP pointer is further on, and
`restore` applies either format to a plain or a sharded policy.

The pool cursor is the update index: the group order is a pure function of (seed, update),
see `order.py`.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from pipeline.core.errors import DiskFull
from pipeline.core.store import atomic_path, disk_full, is_disk_full, write_text_atomic
from pipeline.training.distributed import after_checkpoint, current, is_sharded

NAME = "latest.pt"
POINTER = "latest-dcp.json"
META = "meta.pt"


def save(folder: Path, *, update: int, model, optimizer, reference, metrics: list[dict],
         lp_old: dict | None = None, block_s: list[float] | None = None) -> None:
    meta = _meta(update, reference, metrics, lp_old, block_s)
    if is_sharded(model):
        _save_dcp(folder, update, model, optimizer, meta)
        after_checkpoint(update)
        return
    write_plain(folder, meta | {"model": model.state_dict(), "optimizer": optimizer.state_dict()})


def snapshot(*, update: int, model, optimizer, reference, block_s: list[float] | None = None) -> dict:
    """A one-process checkpoint's state with every tensor copied to the CPU now, so it can be
    written (write_plain) while training goes on: memory copies only, no disk."""
    def cpu(obj):
        if torch.is_tensor(obj):
            return obj.detach().to("cpu", copy=True)
        if isinstance(obj, dict):
            return {k: cpu(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(cpu(v) for v in obj)
        return obj
    return cpu(_meta(update, reference, [], None, block_s)
               | {"model": model.state_dict(), "optimizer": optimizer.state_dict()})


def write_plain(folder: Path, state: dict) -> None:
    """`folder/latest.pt` from a one-process state, atomically (temp file, fsync, rename)."""
    folder.mkdir(parents=True, exist_ok=True)
    # into an open file, not a path: torch's own file writer reports a full disk as an
    # opaque RuntimeError ("unexpected pos"), a Python file as OSError(ENOSPC)
    with atomic_path(folder / NAME, lambda: state_bytes(state)) as tmp, open(tmp, "wb") as f:
        torch.save(state, f)


def state_bytes(obj) -> int:
    """The bytes of the tensors in a checkpoint's state: about what its file needs."""
    if torch.is_tensor(obj):
        return obj.nelement() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def _meta(update: int, reference, metrics: list[dict], lp_old: dict | None, block_s: list[float] | None) -> dict:
    return {
        "update": update,
        "reference": reference.state_dict() if reference is not None else None,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "metrics": metrics,
        "lp_old": lp_old,        # step anchor, needed to resume inside a step exactly
        "block_s": block_s or [],  # sequence log ratios of the unfinished ESS block
    }


def _save_dcp(folder: Path, update: int, model, optimizer, meta: dict) -> None:
    """Collective: every rank calls it after the same update."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict
    d = current()
    assert d is not None    # a sharded model: this process is a rank
    name = f"dcp-{update:06d}"
    tmp, final = folder / f".{name}.tmp", folder / name
    if d.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)     # leftovers of a rank that died mid-save
    d.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    # the pointer stays on the previous folder; this one's shards go. DCP gathers the ranks'
    # failures into one CheckpointException, a BaseException: `except Exception` let it
    # through, leaving the half-written folder (a full disk's shards) and no DiskFull line
    except (Exception, CheckpointException) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc) and not isinstance(exc, DiskFull):
            raise disk_full(tmp, state_bytes({"model": model_sd, "optim": optim_sd}), "checkpointing into") from exc
        raise
    if d.is_main:
        with atomic_path(tmp / META, lambda: state_bytes(meta)) as part, open(part, "wb") as f:
            torch.save(meta, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_text_atomic(folder / POINTER, json.dumps({"dir": name, "update": update}))
        for old in folder.glob("dcp-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    d.barrier()


def _dcp_pointer(folder: Path) -> dict | None:
    path = folder / POINTER
    if not path.exists():
        return None
    pointer = json.loads(path.read_text())
    return pointer if (folder / pointer["dir"] / META).exists() else None


def load(folder: Path) -> dict | None:
    """The furthest complete checkpoint: latest.pt's state, or a DCP checkpoint's meta with
    `dcp` (its folder) in place of the model and optimizer; None when there is none."""
    path, pointer = folder / NAME, _dcp_pointer(folder)
    # on the CPU first: load_state_dict then copies to wherever the model and optimizer live
    plain = torch.load(path, weights_only=False, map_location="cpu") if path.exists() else None
    if pointer is None or (plain is not None and plain["update"] >= pointer["update"]):
        return plain
    where = folder / pointer["dir"]
    return torch.load(where / META, weights_only=False, map_location="cpu") | {"dcp": str(where)}


def restore(state: dict, *, model, optimizer, reference) -> tuple[int, list[dict]]:
    if "dcp" in state:
        _restore_dcp(Path(state["dcp"]), model, optimizer)
    elif is_sharded(model):
        _restore_full_into_sharded(state, model, optimizer)
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    if reference is not None and state["reference"] is not None:
        reference.load_state_dict(state["reference"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return state["update"], state["metrics"]


def _restore_dcp(where: Path, model, optimizer) -> None:
    """DCP -> model and optimizer, sharded (collective) or plain (one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(where))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _restore_full_into_sharded(state: dict, model, optimizer) -> None:
    """A one-process latest.pt into a sharded policy: the optimizer's parameter indices
    become names (the order of model.named_parameters(), which sharding keeps)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    names = [n for n, _ in model.named_parameters()]
    osd = state["optimizer"]
    named: dict[str, Any] = {"state": {names[i]: v for i, v in osd["state"].items()},
             "param_groups": [g | {"params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=named,
                   options=StateDictOptions(full_state_dict=True))
