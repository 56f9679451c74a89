"""Preflight: everything a run needs, checked before any server, worker or model starts.

`check_run(flow, preset, overrides, ...)` is what `ggpo run` (before it starts Prefect)
and both flows (before their first task) call: it builds the run's config (the seed rule
below), expands and validates its cells (pipeline/core/grid.py), and runs `problems` on the
base config and on every cell. `preflight(cfg)` does the same for one config (`ggpo
stage`). Every prerequisite is checked and all that are missing are reported in one
ConfigError, one line per problem, so a preset's missing pieces (CUDA, vLLM, the model,
the data, disk) come in one run, not one run each:

- the artifact store opens (URL, credentials, endpoint, permissions);
- `train.device` exists; `train.nproc` / `train.nnodes` fit; Ray answers when asked for;
- `rollout.engine=vllm`: vLLM importable and a GPU; temperatures inside vLLM's [0, 2];
- `rollout.top_p < 1` is refused for methods that use behavior log-probs (the engine's
  log-probs are renormalized over the nucleus, which biases every importance ratio);
- `model.name_or_path`: a local HF folder with a tokenizer and a context that holds the
  response budgets, or a hub id that resolves (its config and tokenizer are downloaded,
  then checked like a folder); anything else is refused;
- data: the task file parses (unusable rows within the limit, enough rows for n_eval),
  every benchmark file of `eval.benchmarks` parses, an imported pool's source
  (`pool.source`) reads and validates, and the methods that need behavior log-probs are
  refused on one that has none (unless `pool.score_model` scores them);
- `pool.score_model`: a local HF folder with a tokenizer;
- disk: the cache's file system has room for the checkpoints and policies the run plans.

The seed rule: a flow trains every seed of `experiment.seeds`. `--set seed=7` on a flow
means `experiment.seeds=[7]`; given together with a different `experiment.seeds` it is
refused. (A single stage, `ggpo stage`, uses `seed` itself.)

Nothing here imports Prefect, MLflow or a model: a bad `--set` or task file answers in
about two seconds.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from pipeline.core import grid
from pipeline.core.config import PipelineConfig, TrainConfig, load_config, parse_overrides
from pipeline.core.errors import BenchmarkError, ConfigError, DatasetError, StoreError
from pipeline.core.store import Store, check_store
from pipeline.dag import graph
from pipeline.models.engines import check_vllm
from pipeline.models.runtime import resolve_device
from pipeline.tasks import benchmarks, catalog, pool_source

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
FLOWS = ("offline", "online")


def flow_overrides(overrides: dict[str, Any] | list[str] | None) -> dict[str, Any]:
    """The seed rule (module doc): `seed` on a flow becomes `experiment.seeds`."""
    items = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides or {})
    if "seed" not in items:
        return items
    seed = items.pop("seed")
    seeds = items.get("experiment.seeds")
    if seeds is not None and list(seeds) != [seed]:
        raise ConfigError(f"--set seed={seed} and --set experiment.seeds={seeds} disagree: a flow trains every seed "
                          f"of experiment.seeds; give one of them")
    return items | {"experiment.seeds": [seed]}


def check_run(flow: str, preset: str, overrides: dict[str, Any] | list[str] | None = None,
              force: list[str] | None = None, methods: list[str] | None = None,
              seeds: list[int] | None = None) -> tuple[PipelineConfig, list]:
    """(config, cells) of a flow run, every prerequisite checked; ConfigError otherwise."""
    cfg = load_config(preset, flow_overrides(overrides))
    cfg = cfg.updated({"experiment.methods": methods or list(cfg.experiment.methods),
                       "experiment.seeds": seeds or list(cfg.experiment.seeds)})
    unknown = set(force or []) - set(graph.STAGE_NAMES)
    if unknown:
        raise ConfigError(f"force: unknown stages {sorted(unknown)}; known: {', '.join(graph.STAGE_NAMES)}")
    cells = grid.cells(cfg)          # every cell validated as the config it trains
    found = problems(cfg, runs=len(cells), flow=flow, per_cell=False)
    per_cell = {cell.label: problems(cell.config, flow=flow, shared=False) for cell in cells}
    texts = {label: [str(p) for p in ps] for label, ps in per_cell.items()}
    for problem in dict.fromkeys(p for ps in per_cell.values() for p in ps):
        where = [label for label, ps in texts.items() if str(problem) in ps]
        if str(problem) in map(str, found):
            continue
        found.append(problem if len(where) == len(cells) else ConfigError(
            f"experiment cell{'s' if len(where) > 1 else ''} {', '.join(repr(w) for w in where)}: {problem}"))
    raise_problems(found)
    return cfg, cells


def preflight(cfg: PipelineConfig, stage: str | None = None) -> None:
    """Every prerequisite of one config (ggpo stage NAME); one ConfigError listing what is
    missing. The method's needs are checked when `stage` trains (or is not named); `online`
    (one online cell) also checks the online geometry."""
    raise_problems(problems(cfg, runs=1, flow="online" if stage == "online" else None,
                            trains=stage in (None, "train", "online")))


def raise_problems(found: list) -> None:
    """Nothing (ready), the one problem as raised (its own kind: the CLI adds its advice), or
    one ConfigError listing them all."""
    if len(found) == 1:
        raise found[0] if isinstance(found[0], Exception) else ConfigError(found[0])
    if found:
        raise ConfigError(f"{len(found)} prerequisites are missing:\n" + "\n".join(f"  - {p}" for p in found))



def problems(cfg: PipelineConfig, runs: int = 1, flow: str | None = None, shared: bool = True,
             per_cell: bool = True, trains: bool = True) -> list[Exception]:
    """One (one-line) exception per missing prerequisite of `cfg` (empty: ready). shared: the checks that do
    not depend on a cell (store, device, model, data, disk for `runs` training runs);
    per_cell: those that do (sampling against the method, online geometry, and when the
    run `trains`, the method against an imported pool)."""
    checks: list[Callable[[], None]] = []
    if per_cell:
        checks.append(lambda: check_sampling(cfg))
    if per_cell and trains:
        checks.append(lambda: check_pool(cfg))
    if per_cell and flow == "online":
        checks.append(lambda: check_online(cfg))
    if shared:
        checks = [check_store_opens, lambda: check_device(cfg), lambda: check_engine(cfg),
                  lambda: check_model(cfg), lambda: check_data(cfg), lambda: check_disk(cfg, runs, flow)] + checks
    found: list[Exception] = []
    for check in checks:
        try:
            check()
        except Exception as exc:        # every expected failure is one line; collect them all
            if not isinstance(exc, (ConfigError, DatasetError, BenchmarkError, StoreError)):
                raise
            found.append(exc)
    return found


def check_store_opens() -> None:
    check_store()


def check_device(cfg: PipelineConfig) -> None:
    device = resolve_device(cfg.train.device)
    check_placement(cfg.train, device)
    if cfg.experiment.task_runner == "ray":     # (placement imports prefect: only when asked)
        from pipeline.dag import placement
        placement.check(cfg)


def check_engine(cfg: PipelineConfig) -> None:
    if cfg.rollout.engine == "vllm":
        check_vllm()


VLLM_TEMPERATURE = (0.0, 2.0)     # vllm/sampling_params.py _verify_args (0.33): outside, it raises


def check_sampling(cfg: PipelineConfig) -> None:
    """Sampling settings the engine or the losses cannot honour."""
    if cfg.rollout.engine == "vllm":
        lo, hi = VLLM_TEMPERATURE
        for name, value in (("rollout.temperature", cfg.rollout.temperature), ("eval.temperature", cfg.eval.temperature)):
            if not lo <= value <= hi:
                raise ConfigError(f"{name}={value}: vLLM accepts temperatures in [{lo:g}, {hi:g}]")
    if cfg.rollout.top_p < 1 and cfg.train.needs_behavior_logprobs():
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p} with train.method={cfg.train.method}: behavior "
                          f"log-probs under top_p < 1 are renormalized over the nucleus, which biases every "
                          f"importance ratio by the kept mass; sample with rollout.top_p=1 for this method")


def check_pool(cfg: PipelineConfig) -> None:
    """An imported pool without behavior log-probs (none in the source, none scored) refuses
    the methods that need them, before any work."""
    if not cfg.pool.source or cfg.pool.score_model or not cfg.train.needs_behavior_logprobs():
        return
    if not pool_source.load(cfg.pool).has_behavior:
        raise ConfigError(pool_source.behavior_refusal(cfg.train, cfg.pool.source))


def check_placement(tc: TrainConfig, device) -> None:
    """train.nproc ranks fit this node (one GPU each on CUDA; gloo ranks are processes, up
    to 4 per core); several nodes need the rendezvous endpoint."""
    import torch
    if device.type == "cuda" and tc.nproc > torch.cuda.device_count():
        raise ConfigError(f"train.nproc={tc.nproc} but {torch.cuda.device_count()} GPU(s) are visible "
                          "(one rank per GPU): lower train.nproc or check CUDA_VISIBLE_DEVICES")
    cap = 4 * (os.cpu_count() or 1)
    if device.type == "cpu" and tc.nproc > cap:
        raise ConfigError(f"train.nproc={tc.nproc} CPU ranks on {os.cpu_count()} cores (at most {cap}): "
                          "lower train.nproc")
    if tc.nnodes > 1 and not tc.rdzv_endpoint:
        raise ConfigError(f"train.nnodes={tc.nnodes} needs train.rdzv_endpoint=HOST:PORT (node 0's address, "
                          "the same on every node)")


def check_online(cfg: PipelineConfig) -> None:
    """Online geometry that can never run."""
    tc, n_prompts = cfg.train, cfg.task.n_train
    need = tc.updates_per_step * tc.groups_per_update
    if tc.updates % tc.updates_per_step:
        raise ConfigError(f"train.updates ({tc.updates}) must be a multiple of train.updates_per_step "
                          f"({tc.updates_per_step}): the online loop runs whole rounds of N updates")
    if need > n_prompts:
        raise ConfigError(f"a round needs train.updates_per_step x train.groups_per_update = {need} distinct "
                          f"mixed-reward groups but the task has {n_prompts} training prompts (task.n_train); "
                          f"lower train.updates_per_step or train.groups_per_update")
    if cfg.pool.source:
        raise ConfigError(f"pool.source={cfg.pool.source}: the online loop samples its own pools; an imported "
                          "pool trains in the offline flow (ggpo run offline)")
    if cfg.online.per_draw(tc) * cfg.online.max_draws < need:
        raise ConfigError(f"online.max_draws x draw size = {cfg.online.per_draw(tc) * cfg.online.max_draws} "
                          f"prompts can never fill a round of {need} groups")


# --------------------------------------------------------------------------- the model

def check_model(cfg: PipelineConfig) -> None:
    """model.name_or_path: a local HF folder, or a hub id that resolves; pool.score_model: a
    local HF folder."""
    if cfg.pool.score_model:
        folder = Path(cfg.pool.score_model).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"pool.score_model={cfg.pool.score_model}: no such folder; give a local model folder "
                              f"(huggingface-cli download ID --local-dir DIR)")
        check_model_folder(cfg, folder, "pool.score_model")
    name = cfg.model.name_or_path
    if not name:
        return
    folder = Path(name).expanduser()
    if not folder.exists():
        if name.startswith((".", "/", "~")) or name.count("/") != 1:
            raise ConfigError(f"model.name_or_path={name}: no such folder, and not a hub id (owner/name)")
        folder = resolve_hub_model(name)
    check_model_folder(cfg, folder)


def resolve_hub_model(repo_id: str) -> Path:
    """The hub model's config and tokenizer files, downloaded into the Hugging Face cache
    (the weights follow when a stage loads the model); a ConfigError when it cannot be had."""
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.model", "*.txt", "*.tiktoken"]))
    except Exception as exc:            # offline, unknown id, gated: say which, in one line
        why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model.name_or_path={repo_id}: not a local folder, and the hub id cannot be resolved "
                          f"here ({type(exc).__name__}: {why}); on a machine without internet give a model folder "
                          f"(huggingface-cli download {repo_id} --local-dir DIR)") from None


def check_model_folder(cfg: PipelineConfig, folder: Path, setting: str = "model.name_or_path") -> None:
    """A model folder has a tokenizer and config.json, and its context holds the response budgets."""
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise ConfigError(f"{setting}={folder}: the folder has no tokenizer (none of "
                          f"{', '.join(TOKENIZER_FILES)}); save the tokenizer next to the weights "
                          "(tokenizer.save_pretrained(folder))")
    config_file = folder / "config.json"
    if not config_file.exists():
        raise ConfigError(f"{setting}={folder}: no config.json; is this a Hugging Face model folder?")
    context = json.loads(config_file.read_text()).get("max_position_embeddings")
    for setting, budget in (("rollout.max_new_tokens", cfg.rollout.max_new_tokens),
                            ("eval.max_new_tokens", cfg.eval.max_new_tokens)):
        if context is not None and budget >= context:
            raise ConfigError(f"{setting}={budget} does not fit the model's context of {context} tokens "
                              f"(max_position_embeddings in {config_file}) with any prompt: lower {setting}")


# --------------------------------------------------------------------------- data and disk

def check_data(cfg: PipelineConfig) -> None:
    """The task file, an imported pool's source and the benchmark files parse (each read
    once per process)."""
    if cfg.task.name not in catalog.BUILTIN:
        catalog.splits(cfg.task)          # parses, skips unusable rows within the limit, n_eval fits
    if cfg.pool.source:
        pool_source.load(cfg.pool)      # every check that needs no tokenizer (pipeline/tasks/pool_source.py)
    for name in cfg.eval.benchmarks:
        benchmarks.load(name, cfg.eval.data_dir)


def model_parameters(cfg: PipelineConfig) -> int:
    """Parameters of the policy: from the folder's safetensors index or headers; the
    built-in tiny model's from its config. 0 when it cannot be told (a hub id's weights
    are not here yet)."""
    name = cfg.model.name_or_path
    if not name:
        m = cfg.model
        return 100 * m.hidden_size + m.num_layers * (4 * m.hidden_size ** 2 + 3 * m.hidden_size * m.intermediate_size)
    folder = Path(name).expanduser()
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return int(json.loads(index.read_text()).get("metadata", {}).get("total_size", 0)) // 4
    total = 0
    for path in folder.glob("*.safetensors") if folder.is_dir() else []:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(_numel(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# bytes per parameter of what a training run keeps: a checkpoint (fp32 weights 4, AdamW
# moments 8, a refreshed reference up to 4) and an fp32 policy folder (4) per snapshot
CHECKPOINT_BYTES_PER_PARAM = 16
POLICY_BYTES_PER_PARAM = 4


def planned_bytes(cfg: PipelineConfig, runs: int, flow: str | None) -> int:
    """Disk the run's training artifacts plan for: per training run one checkpoint (two
    rolling ones online), its final policy and its evaluation snapshots."""
    params = model_parameters(cfg)
    snapshots = len(cfg.train.snapshot_updates()) + 1
    checkpoints = 2 if flow == "online" else 1
    return runs * params * (checkpoints * CHECKPOINT_BYTES_PER_PARAM + snapshots * POLICY_BYTES_PER_PARAM)


def check_disk(cfg: PipelineConfig, runs: int, flow: str | None) -> None:
    store = Store()
    need = planned_bytes(cfg, runs, flow)
    root = store.root
    while not root.exists():
        root = root.parent
    free = shutil.disk_usage(root).free
    if need > free:
        raise ConfigError(f"the run plans about {need / 2**30:.1f} GiB of checkpoints and policies ({runs} training "
                          f"run(s)) but {root} has {free / 2**30:.1f} GiB free: free space or point GGPO_CACHE elsewhere")
