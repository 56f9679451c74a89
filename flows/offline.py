"""Prefect flow `ggpo` (deployment `offline`): the offline comparison, stage by stage.

Per seed one pool (rollout -> verify -> filter; with `pool.source` the imported pool,
pool_import [-> score]: graph.pool_stages); every method of `methods` trains on that pool
with the same seeded group order and geometry, at every point of `experiment.grid`
(pipeline/core/grid.py: the cells; a grid over a field the pool reads gives one pool per value,
and named `experiment.variants` join `methods`); each policy is evaluated every
`train.eval_every` updates and at the end; the base model is update 0. The flow ends with
the report (seed Table 5 / Figure 4 forms) as MLflow artifacts of the parent run.

Thin on purpose: the run's setup and ending are flows/common.run_flow's, the report is
pipeline/reports/offline.py's; each task runs one cached stage and logs it to MLflow, and tasks pass
manifests (paths, keys, hashes), never tensors.
"""
from __future__ import annotations

from typing import Any

import polars as pl
from prefect import flow
from prefect.futures import PrefectFuture

from flows.common import FlowRun, Report, Runner, run_flow
from pipeline.core import grid
from pipeline.core.config import PipelineConfig
from pipeline.core.grid import GridCell
from pipeline.core.store import Manifest
from pipeline.dag import graph, placement
from pipeline.reports import offline
from pipeline.services import tracking


def stage_reads(stage: str, cfg: PipelineConfig) -> set[str]:
    """The config fields that enter `stage`'s key, itself or through its inputs."""
    reads = set(graph.spec(stage).reads)
    for src in graph.upstream(stage, cfg).values():
        reads |= stage_reads(src, cfg)
    return reads


def keyed_fields(stage: str, cfg: PipelineConfig, fields: set[str]) -> set[str]:
    """The grid fields among `fields` that enter `stage`'s key: run names carry only those
    (a pool is named by its rollout fields, never by train.lr)."""
    reads = stage_reads(stage, cfg)
    return {f for f in fields if any(f == r or f.startswith(r + ".") or r.startswith(f + ".") for r in reads)}


def submit_seed(step: Runner, cells: list[GridCell]) -> list[tuple[dict, PrefectFuture]]:
    """One seed's cells, each on the pool its config builds: one pool per seed unless the
    grid sweeps a field the pool reads (the runner submits each stage key once). Returns
    (record stub, evaluation future)s and, per cell, the training future (kind "train")."""
    pending = []
    for cell in cells:
        c, s = cell.config, cell.seed

        def name(stage: str, head: str, sc: PipelineConfig = c) -> str:
            return head + cell.tag(keyed_fields(stage, sc, set(cell.values)))
        base = step("base", c, {}, name("base", "base"))
        pool = submit_pool(step, c, base, lambda stage: name(stage, f"{stage}-seed{s}"))
        cb = c.updated({"eval.target": "base"})
        base_eval = step("evaluate", cb, {"model": base}, name("evaluate", f"evaluate-base-seed{s}", cb))
        trained = step("train", c, {"base": base, "pool": pool}, f"train-{cell.slug}-seed{s}")
        stub = {"method": cell.method, "seed": s, "cell": cell}
        pending.append((stub | {"kind": "train"}, trained))
        pending.append((stub | {"kind": "eval"}, base_eval))
        for update in c.train.snapshot_updates() + [None]:      # None: the final policy
            pending.append((stub | {"kind": "eval"},
                            step("evaluate", c.updated({"eval.update": update}), {"model": trained},
                                 f"evaluate-{cell.slug}-seed{s}-u{update or c.train.updates}")))
    return pending


def submit_pool(step: Runner, c: PipelineConfig, base: PrefectFuture, name) -> PrefectFuture:
    """The pool's stages (graph.pool_stages): rollout, verify, filter; or for an imported pool
    (pool.source) pool_import and, with pool.score_model, score. Returns the last one."""
    done = {"base": base}
    for stage in graph.pool_stages(c):
        done[stage] = step(stage, c, {n: done[src] for n, src in graph.upstream(stage, c).items()}, name(stage))
    return done[stage]


def collect(pending: list[tuple[dict, PrefectFuture]], cfg: PipelineConfig) -> tuple[list[dict], list, list]:
    """Wait for every submitted stage (in submission order): eval records, training
    curves and the final evaluations' per-benchmark tables."""
    key = f"mean_at_{cfg.eval.n_samples}"
    records, curves, finals = [], [], []
    for stub, future in pending:
        manifest: Manifest = future.result()
        cell, columns = stub["cell"], grid.columns(stub["cell"], cfg)     # columns: {} without a grid
        if stub["kind"] == "eval":
            records.append({"method": stub["method"], "seed": stub["seed"], "update": manifest.summary["update"],
                            "accuracy": manifest.summary[key]} | columns)
            if manifest.summary["update"] == cell.config.train.updates:      # the final policy: Table 1 / 3
                finals.append(pl.read_csv(manifest.path("report_csv"))
                              .with_columns(pl.lit(cell.label).alias("method"), pl.lit(stub["seed"]).alias("seed")))
        else:
            curves.append(offline.training_curves(manifest, stub["method"], stub["seed"], columns.get("cell")))
    return records, curves, finals


@flow(name="ggpo", log_prints=True, task_runner=placement.ConfiguredTaskRunner())   # placement.use picks
def ggpo(preset: str = "tiny", overrides: dict[str, Any] | None = None, force: list[str] | None = None,
         methods: list[str] | None = None, seeds: list[int] | None = None) -> dict[str, Any]:
    """Base model, then per seed: pool, every method, evaluations; then the report.

    preset: a file in pipeline/presets; overrides: {"train.lr": 1e-5, ...}; force: stage
    names to recompute even when cached; methods / seeds: default to the preset's
    `experiment.methods` / `experiment.seeds`."""
    # a returned State ends the run Cancelled (a stop request); callers get no State
    return run_flow("offline", preset, overrides, force, comparison, methods, seeds)  # type: ignore[return-value]


def comparison(run: FlowRun) -> Report:
    """The offline comparison: the base model; per seed its pool, every cell trained on it
    and evaluated (base = update 0); the report from every evaluation and training curve."""
    cfg, step = run.cfg, run.step
    if cfg.pool.source:      # the imported pool's source, as the parent run's dataset input
        tracking.log_source_dataset(run.client, run.parent, cfg.pool)
    step("base", cfg, {}, "base")
    pending = [p for seed in cfg.experiment.seeds for p in submit_seed(step, [c for c in run.cells if c.seed == seed])]
    records, curves, finals = collect(pending, cfg)
    folder = tracking.report_folder("offline", run.preset)
    return Report(offline.log(run.client, run.parent, records, curves, finals, cfg, folder), records, folder)
