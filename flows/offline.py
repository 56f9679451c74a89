"""Prefect flow `ggpo` (deployment `offline`): the offline experiment, stage by stage.

Thin on purpose: each task runs one cached stage and logs it to MLflow; tasks pass
manifests (paths, keys, hashes), never tensors. Prefect's own task cache stays off: the
store's content keys decide what is recomputed, the same with or without a server.
"""
from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from pipeline import dag, tracking
from pipeline.config import PipelineConfig, load_config
from pipeline.store import Manifest, Store


def run_name(stage: str, cfg: PipelineConfig, inputs: dict[str, Manifest]) -> str:
    if stage == "train":
        return f"train-{cfg.train.method}-seed{cfg.seed}"
    if stage == "evaluate":
        return f"evaluate-{inputs['model'].stage}"
    return stage


@task(task_run_name="{stage}", cache_policy=NO_CACHE, retries=0)
def run_stage_task(stage: str, cfg: PipelineConfig, inputs: dict[str, Manifest],
                   force: bool = False, parent_run_id: str | None = None) -> Manifest:
    logger = get_run_logger()
    result = dag.run(stage, cfg, inputs, Store(), force)
    logger.info("%s %s in %.1fs: %s", stage, "cache hit" if result.cache_hit else "built",
                result.seconds, {k: v for k, v in result.summary.items() if not isinstance(v, str)})
    tracking.log_stage(result, run_name(stage, cfg, inputs), parent_run_id)
    return result


def evaluation_summary(base_eval: Manifest, train_eval: Manifest, cfg: PipelineConfig) -> dict[str, float]:
    key = f"mean_at_{cfg.eval.n_samples}"
    return {f"base_{key}": base_eval.summary[key], f"trained_{key}": train_eval.summary[key],
            f"base_pass_at_{cfg.eval.n_samples}": base_eval.summary[f"pass_at_{cfg.eval.n_samples}"],
            f"trained_pass_at_{cfg.eval.n_samples}": train_eval.summary[f"pass_at_{cfg.eval.n_samples}"]}


@flow(name="ggpo", log_prints=True)
def ggpo(preset: str = "tiny", overrides: dict[str, Any] | None = None, force: list[str] | None = None) -> dict[str, Any]:
    """Base model -> rollout pool -> verify -> filter -> train -> evaluate (base and trained).

    preset: a file in pipeline/presets; overrides: {"train.lr": 1e-5, ...};
    force: stage names to recompute even when cached."""
    cfg = load_config(preset, overrides or {})
    force = set(force or [])
    unknown = force - set(dag.STAGE_NAMES)
    if unknown:
        raise ValueError(f"force: unknown stages {sorted(unknown)}; known: {', '.join(dag.STAGE_NAMES)}")
    tags = {"ggpo.preset": preset, "prefect.flow_run_id": str(flow_run.get_id() or "")}
    with tracking.parent_run(f"offline-{preset}-{cfg.train.method}-seed{cfg.seed}",
                             cfg.model_dump(mode="json"), tags) as (client, parent):
        def step(stage: str, inputs: dict[str, Manifest], c: PipelineConfig = cfg) -> Manifest:
            return run_stage_task(stage, c, inputs, stage in force, parent)
        base = step("base", {})
        roll = step("rollout", {"base": base})
        ver = step("verify", {"rollout": roll})
        pool = step("filter", {"rollout": roll, "verify": ver})
        trained = step("train", {"base": base, "pool": pool})
        base_cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"target": "base"})})
        base_eval = step("evaluate", {"model": base}, base_cfg)
        train_eval = step("evaluate", {"model": trained})
        summary = evaluation_summary(base_eval, train_eval, cfg)
        tracking.log_params_metrics(client, parent, {}, tracking.summary_metrics(summary))
    stages = {m.stage if m is not base_eval else "evaluate_base": m for m in
              (base, roll, ver, pool, trained, base_eval, train_eval)}
    print(f"evaluation: {summary}")
    return {"summary": summary, "stages": {k: {"key": m.key, "folder": m.folder, "seconds": m.seconds,
                                              "cache_hit": m.cache_hit} for k, m in stages.items()},
            "mlflow_parent_run_id": parent}
