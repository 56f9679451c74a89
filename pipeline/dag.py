"""The DAG: which stage feeds which, and how to find a stage's cached inputs.

Keys chain, so the key of any stage follows from the config alone; that is what lets
`ggpo stage NAME` rerun one stage from the cached artifacts of its inputs. A cached input
whose files no longer match its manifest is rebuilt from its own inputs (recursively, with
a warning) when those are intact and cached; otherwise the error names it and the command
that rebuilds it.
"""
from __future__ import annotations

import importlib

from pipeline.config import PipelineConfig
from pipeline.stage import StageSpec, key_for, run_stage
from pipeline.store import DamagedArtifact, Manifest, Store

STAGE_NAMES = ("base", "rollout", "verify", "filter", "train", "evaluate")


class MissingInput(RuntimeError):
    pass


def spec(stage: str) -> StageSpec:
    if stage not in STAGE_NAMES:
        raise ValueError(f"unknown stage '{stage}'; known: {', '.join(STAGE_NAMES)}")
    return importlib.import_module(f"stages.{stage}").SPEC


def run(stage: str, config: PipelineConfig, inputs: dict[str, Manifest], store: Store,
        force: bool = False) -> Manifest:
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
                  preset: str = "tiny", rebuild_damaged: bool = True) -> dict[str, Manifest]:
    """The cached manifests of a stage's inputs; MissingInput names every missing one and
    the command that builds it. A damaged input is rebuilt (rebuild_damaged) or raises
    DamagedArtifact."""
    expected_key(stage, config)     # reads the stage's outside files: a missing benchmark is named first
    found, missing = {}, []
    for name, src in upstream(stage, config).items():
        manifest, problems = store.inspect(src, expected_key(src, config))
        if problems:
            manifest = rebuild(name, src, problems, config, store, preset, rebuild_damaged)
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


def rebuild(name: str, stage: str, problems: list[str], config: PipelineConfig, store: Store,
            preset: str, allowed: bool) -> Manifest:
    """Rebuild a damaged cached artifact from its own (intact or rebuilt) inputs."""
    command = f"`ggpo stage {stage} --preset {preset} --force` (and the same --set options)"
    if not allowed:
        raise DamagedArtifact(f"input '{name}': {problems[0]}; rebuild it with {command}")
    try:    # run_stage logs each problem ("it will be rebuilt") when its cache lookup fails
        inputs = cached_inputs(stage, config, store, preset)
    except MissingInput as exc:
        raise MissingInput(f"input '{name}': {problems[0]}, and it cannot be rebuilt here:\n{exc}") from None
    return run_stage(spec(stage), config, inputs, store)


def experiment_keys(config: PipelineConfig) -> set[tuple[str, str]]:
    """(stage, key) of every artifact the offline flow builds for `config`: the base model;
    per cell (seed x method or variant x grid point, pipeline/grid.py) its pool, the base
    evaluation, the training run and its evaluations at each snapshot and at the end
    (flows/offline.py, the same expansion)."""
    from pipeline.grid import cells
    keys = {("base", expected_key("base", config))}
    for cell in cells(config):
        c = cell.config
        keys |= {(stage, expected_key(stage, c)) for stage in ("rollout", "verify", "filter", "train")}
        keys.add(("evaluate", expected_key("evaluate", c.updated({"eval.target": "base"}))))
        keys |= {("evaluate", expected_key("evaluate", c.updated({"eval.update": u})))
                 for u in c.train.snapshot_updates() + [None]}
    return keys
