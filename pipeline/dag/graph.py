"""The DAG: which stage feeds which, and how to find a stage's cached inputs.

Keys chain, so the key of any stage follows from the config alone; that is what lets
`ggpo stage NAME` rerun one stage from the cached artifacts of its inputs. A cached input
whose files no longer match its manifest is rebuilt from its own inputs (recursively, with
a warning) when those are intact and cached; otherwise the error names it and the command
that rebuilds it.
"""
from __future__ import annotations

import hashlib
import importlib

from pipeline.core.config import PipelineConfig
from pipeline.core.errors import DamagedArtifact, MissingInput
from pipeline.core.grid import cells
from pipeline.core.store import Manifest, Store, canonical_json as canonical
from pipeline.dag.spec import StageSpec, content_key, key_for, run_stage

STAGE_NAMES = ("base", "rollout", "verify", "filter", "train", "evaluate", "online_pool", "online_train",
               "online_policy", "pool_import", "score")
STAGE_MODULES = {"base": "base_model"}    # stage name -> module in stages/ where they differ
ONLINE = ("online_pool", "online_train")
EVAL_TARGETS = {"train": "train", "base": "base", "online": "online_policy"}   # eval.target -> stage


def pool_stages(config: PipelineConfig) -> tuple[str, ...]:
    """The stages that make the training pool, in order; the last one feeds `train`.
    Sampled: rollout, verify, filter. Imported (pool.source): pool_import, then score
    when pool.score_model asks for scored behavior log-probs."""
    if not config.pool.source:
        return ("rollout", "verify", "filter")
    return ("pool_import", "score") if config.pool.score_model else ("pool_import",)


def spec(stage: str) -> StageSpec:
    if stage not in STAGE_NAMES:
        raise ValueError(f"unknown stage '{stage}'; known: {', '.join(STAGE_NAMES)}")
    return importlib.import_module(f"stages.{STAGE_MODULES.get(stage, stage)}").SPEC


def run(stage: str, config: PipelineConfig, inputs: dict[str, Manifest], store: Store,
        force: bool = False) -> Manifest:
    return run_stage(spec(stage), config, inputs, store, force)


def upstream(stage: str, config: PipelineConfig) -> dict[str, str]:
    """Input name -> producing stage."""
    return {name: src for name, (src, _) in sources(stage, config).items()}


def sources(stage: str, config: PipelineConfig) -> dict[str, tuple[str, PipelineConfig]]:
    """Input name -> (producing stage, the config it was produced under). The online loop
    chains rounds: round r's pool samples with round r-1's policy (`policy`), and its
    training continues round r-1's state (`state`); round 0 starts from `base`. Offline
    training takes its pool from the last of `pool_stages`."""
    r = config.online.round
    prev = config.updated({"online.round": r - 1}) if stage in ONLINE and r > 0 else None
    if stage == "online_pool":
        return {"policy": ("online_train", prev) if prev else ("base", config)}
    if stage == "online_policy":
        update = config.eval.update or config.train.updates
        return {"round": ("online_train", config.updated({"online.round": round_of(update, config)}))}
    if stage == "online_train":
        return {"base": ("base", config), "pool": ("online_pool", config)} | (
            {"state": ("online_train", prev)} if prev else {})
    return {name: (src, config) for name, src in {
        "base": {},
        "rollout": {"base": "base"},
        "verify": {"rollout": "rollout"},
        "filter": {"rollout": "rollout", "verify": "verify"},
        "pool_import": {"base": "base"},
        "score": {"pool": "pool_import"},
        "train": {"base": "base", "pool": pool_stages(config)[-1]},
        "evaluate": {"model": EVAL_TARGETS[config.eval.target]},
    }[stage].items()}


# (config without online.round) -> [{stage: key} per round]: the chain is walked once
_chains: dict[str, list[dict[str, str]]] = {}


def online_keys(config: PipelineConfig, round_: int) -> dict[str, str]:
    """{online_pool: key, online_train: key} of round `round_`, walking the chain from round 0
    iteratively (a 1,000-round run must not recurse 2,000 deep). Keys do not depend on
    online.round itself, only on the inputs' keys."""
    pool_spec, train_spec = spec("online_pool"), spec("online_train")
    chain = _chains.setdefault(chain_identity(config), [])
    base = expected_key("base", config)
    while len(chain) <= round_:
        prev = chain[-1]["online_train"] if chain else None
        pool = key_for(pool_spec, config, {"policy": prev or base})
        train = key_for(train_spec, config, dict(sorted(({"base": base, "pool": pool} | (
            {"state": prev} if prev else {})).items())))
        chain.append({"online_pool": pool, "online_train": train})
    return chain[round_]


def chain_identity(config: PipelineConfig) -> str:
    """What an online cell's chain of rounds depends on, as canonical JSON: the fields its
    round keys read (not the run's length, evaluation or checkpoint schedule, nor
    online.round) and the task file's content. One walk of the chain per identity."""
    train_spec = spec("online_train")
    return canonical([config.slice(("seed", "model", "task", "rollout", "verify", "train", "online.draw_prompts"),
                                   train_spec.ignores), content_key(spec("online_pool"), config)])


def cell_key(config: PipelineConfig) -> str:
    """The key of an online cell's state folder (its rolling checkpoints): its chain's identity
    and its base model."""
    return hashlib.sha256((chain_identity(config) + expected_key("base", config)).encode()).hexdigest()


def round_of(update: int, config: PipelineConfig) -> int:
    """The online round whose updates include `update` (1-based update counts)."""
    return -(-update // config.train.updates_per_step) - 1


def expected_key(stage: str, config: PipelineConfig) -> str:
    if stage in ONLINE:
        return online_keys(config, config.online.round)[stage]
    if stage == "online_policy":
        update = config.eval.update or config.train.updates
        chain = online_keys(config, round_of(update, config))["online_train"]
        return key_for(spec(stage), config.updated({"eval.update": update}), {"round": chain})
    inputs = {name: expected_key(src, cfg) for name, (src, cfg) in sources(stage, config).items()}
    return key_for(spec(stage), config, dict(sorted(inputs.items())))


def cached_inputs(stage: str, config: PipelineConfig, store: Store,
                  preset: str = "tiny", rebuild_damaged: bool = True) -> dict[str, Manifest]:
    """The cached manifests of a stage's inputs; MissingInput names every missing one and
    the command that builds it. A damaged input is rebuilt (rebuild_damaged) or raises
    DamagedArtifact."""
    expected_key(stage, config)     # reads the stage's outside files: a missing benchmark is named first
    found, missing = {}, []
    for name, (src, cfg) in sources(stage, config).items():
        manifest, problems = store.inspect(src, expected_key(src, cfg))
        if problems:
            manifest = rebuild(name, src, problems, cfg, store, preset, rebuild_damaged)
        if manifest is None and src == "base" and cfg.model.name_or_path:
            manifest = run_stage(spec("base"), cfg, {}, store)    # records the external model's path: free
        if manifest is None:
            missing.append(missing_line(name, src, cfg, preset))
        else:
            found[name] = manifest
    if missing:
        raise MissingInput(
            f"stage '{stage}' needs inputs that are not in the cache ({store.location}) for this config:\n"
            + "\n".join(missing) + f"\nor build everything with `ggpo run {'online' if online_side(stage, config) else 'offline'} "
            f"--preset {preset}`")
    return found


def online_side(stage: str, config: PipelineConfig) -> bool:
    """Whether `stage` under `config` belongs to the online flow."""
    return stage in ONLINE + ("online_policy",) or (stage == "evaluate" and config.eval.target == "online")


def missing_line(name: str, src: str, cfg: PipelineConfig, preset: str) -> str:
    """How to build a missing input: its stage, or for an online round its cell (which
    builds every round of its chain in one process)."""
    if src in ONLINE or src == "online_policy":
        what = f"round {cfg.online.round}" if src in ONLINE else f"the policy after update {cfg.eval.update}"
        return (f"  input '{name}' from stage '{src}' ({what} of an online cell): build it with "
                f"`ggpo stage online --preset {preset}` (and the same --set options)")
    command = f"ggpo pool import {cfg.pool.source}" if src == "pool_import" else f"ggpo stage {src}"
    return f"  input '{name}' from stage '{src}': build it with `{command} --preset {preset}` (and the same --set options)"


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
    per cell (seed x method or variant x grid point, pipeline/core/grid.py) its pool, the base
    evaluation, the training run and its evaluations at each snapshot and at the end
    (flows/offline.py, the same expansion)."""
    keys = {("base", expected_key("base", config))}
    for cell in cells(config):
        c = cell.config
        keys |= {(stage, expected_key(stage, c)) for stage in pool_stages(c) + ("train",)}
        keys.add(("evaluate", expected_key("evaluate", c.updated({"eval.target": "base"}))))
        keys |= {("evaluate", expected_key("evaluate", c.updated({"eval.update": u})))
                 for u in c.train.snapshot_updates() + [None]}
    return keys


def online_experiment_keys(config: PipelineConfig) -> set[tuple[str, str]]:
    """(stage, key) of every artifact the online flow (flows/online.py) builds for `config`:
    the base model and its evaluation; per cell every round's pool and training, and the
    evaluations at train.online_eval_points()."""
    keys = {("base", expected_key("base", config))}
    for cell in cells(config):
        c, tc = cell.config, cell.config.train
        keys.add(("evaluate", expected_key("evaluate", c.updated({"eval.target": "base"}))))
        for r in range(tc.updates // tc.updates_per_step):
            keys |= set(online_keys(c, r).items())
        for _, _, at in tc.online_eval_points():
            ce = c.updated({"eval.target": "online", "eval.update": at})
            keys |= {("evaluate", expected_key("evaluate", ce)), ("online_policy", expected_key("online_policy", ce))}
    return keys
