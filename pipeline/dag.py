"""The DAG: which stage feeds which, and how to find a stage's cached inputs.

Keys chain, so the key of any stage follows from the config alone; that is what lets
`ggpo stage NAME` rerun one stage from the cached artifacts of its inputs.
"""
from __future__ import annotations

import importlib

from pipeline.config import PipelineConfig
from pipeline.stage import StageSpec, key_for
from pipeline.store import Manifest, Store

STAGE_NAMES = ("base", "rollout", "verify", "filter", "train", "evaluate")


class MissingInput(RuntimeError):
    pass


def spec(stage: str) -> StageSpec:
    if stage not in STAGE_NAMES:
        raise ValueError(f"unknown stage '{stage}'; known: {', '.join(STAGE_NAMES)}")
    return importlib.import_module(f"stages.{stage}").SPEC


def run(stage: str, config: PipelineConfig, inputs: dict[str, Manifest], store: Store,
        force: bool = False) -> Manifest:
    from pipeline.stage import run_stage
    return run_stage(spec(stage), config, inputs, store, force)


def upstream(stage: str, config: PipelineConfig) -> dict[str, str]:
    """Input name -> producing stage."""
    return {
        "base": {},
        "rollout": {"base": "base"},
        "verify": {"rollout": "rollout"},
        "filter": {"rollout": "rollout", "verify": "verify"},
        "train": {"base": "base", "pool": "filter"},
        "evaluate": {"model": config.eval.target},
    }[stage]


def expected_key(stage: str, config: PipelineConfig) -> str:
    inputs = {name: expected_key(src, config) for name, src in upstream(stage, config).items()}
    return key_for(spec(stage), config, dict(sorted(inputs.items())))


def cached_inputs(stage: str, config: PipelineConfig, store: Store,
                  preset: str = "tiny") -> dict[str, Manifest]:
    """The cached manifests of a stage's inputs; MissingInput names every missing one and
    the command that builds it."""
    found, missing = {}, []
    for name, src in upstream(stage, config).items():
        manifest = store.load(src, expected_key(src, config))
        if manifest is None:
            missing.append(f"  input '{name}' from stage '{src}': build it with "
                           f"`ggpo stage {src} --preset {preset}` (and the same --set options)")
        else:
            found[name] = manifest
    if missing:
        raise MissingInput(
            f"stage '{stage}' needs inputs that are not in the cache ({store.root}) for this config:\n"
            + "\n".join(missing) + f"\nor build everything with `ggpo run offline --preset {preset}`")
    return found
