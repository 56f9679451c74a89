"""Stage `online_policy`: an online cell's policy at an evaluation point, as an HF folder.

Written only by an online cell (stages/online_cell.py) after the update `eval.update` of
its chain: every `train.eval_every` updates and at the end. These are the only policy
folders an online run keeps (the learner lives in memory, its heavy state in the cell's
rolling checkpoints), so a run's disk does not grow with its rounds. Input `round`: the
`online_train` artifact of the round that contains the update (it names the chain); reads
`eval.update`. The evaluate stage reads it (eval.target=online).
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.config import PipelineConfig
from pipeline.core.store import Manifest
from pipeline.dag.spec import Built, StageSpec

FILES = {"weights": ("model/model.safetensors", None), "model_config": ("model/config.json", None)}


@dataclass(frozen=True)
class Saved:
    """What an online cell hands this build: the folder where it saved its learner right
    after update eval.update (before its round's record existed: the record is this
    artifact's input)."""
    path: Path


def build(cfg: PipelineConfig, inputs: dict[str, Manifest], folder: Path, ctx: Saved) -> Built:
    """The policy the cell saved, moved in."""
    shutil.rmtree(folder / "model", ignore_errors=True)
    shutil.move(str(ctx.path), folder / "model")
    return Built(files=dict(FILES), summary={"updates": cfg.eval.update, "method": cfg.train.method, "seed": cfg.seed})


SPEC = StageSpec(name="online_policy", version=1, reads=("eval.update",), build=build, context=Saved,
                 without_context="an online policy is written by its cell: run the cell (`ggpo stage online` or "
                 "`ggpo run online`) with train.eval_every covering that update")
