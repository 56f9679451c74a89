"""Prefect flow `ggpo` (deployment `offline`): the offline comparison, stage by stage.

Per seed one pool (rollout -> verify -> filter; with `pool.source` the imported pool,
pool_import [-> score]: dag.pool_stages); every method of `methods` trains on that pool
with the same seeded group order and geometry, at every point of `experiment.grid`
(pipeline/grid.py: the cells; a grid over a field the pool reads gives one pool per value,
and named `experiment.variants` join `methods`); each policy is evaluated every
`train.eval_every` updates and at the end; the base model is update 0. The flow ends with
the report (seed Table 5 / Figure 4 forms) as MLflow artifacts of the parent run.

Thin on purpose: each task runs one cached stage and logs it to MLflow; tasks pass
manifests (paths, keys, hashes), never tensors. Prefect's own task cache stays off: the
store's content keys decide what is recomputed, the same with or without a server.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import polars as pl
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture, wait
from prefect.runtime import flow_run
from prefect.states import Cancelled, State

from pipeline import dag, grading, grid, interrupt, orchestration, placement, progress, report, tracking
from pipeline.config import PipelineConfig
from pipeline.grid import Cell
from pipeline.preflight import check_run
from pipeline.stage import build_slot, outcome, set_parallel_builds
from pipeline.store import Manifest, Store, write_file_atomic, write_text_atomic

# the stages' progress and resume lines (logger "ggpo"; forwarded to the Prefect API where
# PREFECT_LOGGING_EXTRA_LOGGERS names it, as `ggpo up`'s serve process does): INFO unless set
if logging.getLogger("ggpo").level == logging.NOTSET:
    logging.getLogger("ggpo").setLevel(logging.INFO)


@task(task_run_name="{run_name}", cache_policy=NO_CACHE, retries=0)
def run_stage_task(stage: str, cfg: PipelineConfig, inputs: dict[str, Manifest], run_name: str,
                   force: bool = False, parent_run_id: str | None = None) -> Manifest:
    store = Store()
    inputs = {n: store.resolve(m) for n, m in inputs.items()}     # made on another machine (Ray)?
    with build_slot():      # at most experiment.parallel builds at once
        result = dag.run(stage, cfg, inputs, store, force)
    get_run_logger().info("%s %s: %s", run_name, outcome(result),
                          {k: v for k, v in result.summary.items() if not isinstance(v, str)})
    tracking.log_stage(result, run_name, parent_run_id)
    return result


def cancelled(step: "Runner | None") -> State:
    """After a stop request: wait until every submitted stage has reached its safe point
    (checkpoints written), stop the graders, and end the flow run Cancelled."""
    if step is not None:
        wait(list(step.submitted.values()))
    grading.close_pool()
    return Cancelled(message=f"ggpo: {interrupt.summary()}")


class Runner:
    """Submits stage tasks with the flow's force set and MLflow parent run, each stage key
    once: grid cells that share a pool (or a base model, a base evaluation) get the same
    future. Inputs may be futures: Prefect resolves them, so independent stages (the
    cells of a seed, the seeds) run concurrently while dependent ones wait."""

    def __init__(self, force: set[str], parent: str):
        self.force, self.parent = force, parent
        self.submitted: dict[tuple[str, str], PrefectFuture] = {}

    def __call__(self, stage: str, cfg: PipelineConfig, inputs: dict, name: str) -> PrefectFuture:
        key = (stage, dag.expected_key(stage, cfg))
        if key not in self.submitted:
            self.submitted[key] = self.submit(stage, cfg, inputs, name)
        return self.submitted[key]

    def submit(self, stage: str, cfg: PipelineConfig, inputs: dict, name: str) -> PrefectFuture:
        # threads, or a Ray worker with the stage's GPUs/CPUs (experiment.task_runner)
        return placement.submit(run_stage_task, stage, cfg, stage, cfg, inputs, name, stage in self.force, self.parent)


def stage_reads(stage: str, cfg: PipelineConfig) -> set[str]:
    """The config fields that enter `stage`'s key, itself or through its inputs."""
    reads = set(dag.spec(stage).reads)
    for src in dag.upstream(stage, cfg).values():
        reads |= stage_reads(src, cfg)
    return reads


def keyed_fields(stage: str, cfg: PipelineConfig, fields: set[str]) -> set[str]:
    """The grid fields among `fields` that enter `stage`'s key: run names carry only those
    (a pool is named by its rollout fields, never by train.lr)."""
    reads = stage_reads(stage, cfg)
    return {f for f in fields if any(f == r or f.startswith(r + ".") or r.startswith(f + ".") for r in reads)}


def submit_seed(step: Runner, cells: list[Cell]) -> list[tuple[dict, PrefectFuture]]:
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
    """The pool's stages (dag.pool_stages): rollout, verify, filter; or for an imported pool
    (pool.source) pool_import and, with pool.score_model, score. Returns the last one."""
    done = {"base": base}
    for stage in dag.pool_stages(c):
        done[stage] = step(stage, c, {n: done[src] for n, src in dag.upstream(stage, c).items()}, name(stage))
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
            curves.append(report.training_curves(manifest, stub["method"], stub["seed"], columns.get("cell")))
    return records, curves, finals


def write_benchmark_report(finals: list[pl.DataFrame], cfg: PipelineConfig, folder: Path) -> list[Path]:
    """Table 1 / Table 3 forms and the pass@K figure from the final evaluations."""
    ks = [k for k in cfg.eval.pass_k if k <= cfg.eval.n_samples]
    t1_md, t3_md, t1, t3 = report.benchmark_tables(pl.concat(finals, how="diagonal_relaxed"), cfg.eval.n_samples, ks)
    paths = [folder / n for n in ("benchmarks.md", "benchmarks.csv", "pass_at_k.md", "pass_at_k.csv", "pass_at_k.png")]
    write_text_atomic(paths[0], t1_md)
    write_file_atomic(paths[1], t1.write_csv)
    write_text_atomic(paths[2], t3_md)
    write_file_atomic(paths[3], t3.write_csv)
    report.pass_at_k_figure(t3, ks, paths[4])
    return paths


def log_report(client, parent: str, records: list[dict], curves: list[pl.DataFrame], finals: list[pl.DataFrame],
               cfg: PipelineConfig, folder: Path) -> dict:
    """The report's files into `folder` and the parent run's report/; its metrics."""
    evals = pl.DataFrame(records)
    metric = f"mean@{cfg.eval.n_samples}"
    paths = report.write(evals, pl.concat(curves), folder, metric)
    extra = write_benchmark_report(finals, cfg, folder)
    for path in list(paths.values()) + extra:
        client.log_artifact(parent, str(path), artifact_path="report")
    table = paths["markdown"].read_text() + "\n" + extra[0].read_text() + "\n" + extra[2].read_text()
    by = report.label_column(evals)        # "cell" with a grid, else "method"
    final = evals.filter(pl.col("update") == pl.col("update").max().over(by))
    # polars types a mean as any scalar: of these non-empty float columns it is a float
    summary = {f"final_{metric.replace('@', '_at_')}/{grid.slug(m)}": cast(float, final.filter(pl.col(by) == m)["accuracy"].mean())
               for m in final[by].unique(maintain_order=True)}
    base = evals.filter(pl.col("update") == 0)["accuracy"].mean()
    summary[f"base_{metric.replace('@', '_at_')}"] = cast(float, base)
    tracking.log_params_metrics(client, parent, {}, tracking.summary_metrics(summary))
    return {"table": table, "summary": summary}


def publish_report(result: dict, records: list[dict], preset: str) -> None:
    """The report in the Prefect UI (the flow run's Artifacts tab): the tables as markdown,
    the summary metrics and every evaluation as tables. A report the UI cannot take is a
    warning, never a failed run: the same report is in MLflow already."""
    if orchestration.down():     # the server stopped answering mid-run (said once already)
        return
    key = progress.artifact_key(f"ggpo {preset}")
    try:
        create_markdown_artifact(markdown=result["table"], key=f"{key}-report",
                                 description=f"ggpo offline comparison, preset {preset}")
        create_table_artifact(table=[{"metric": k, "value": v} for k, v in result["summary"].items()],
                              key=f"{key}-summary", description="final and base accuracy")
        create_table_artifact(table=records, key=f"{key}-evaluations",
                              description="every evaluation: method, seed, update, accuracy")
    except Exception as e:       # noqa: BLE001 - the run itself succeeded
        if orchestration.noticed(e):     # its server went away meanwhile (said once)
            return
        get_run_logger().warning("report not published as Prefect artifacts: %s: %s", type(e).__name__, e)


@flow(name="ggpo", log_prints=True, task_runner=placement.ConfiguredTaskRunner())   # placement.use picks
def ggpo(preset: str = "tiny", overrides: dict[str, Any] | None = None, force: list[str] | None = None,
         methods: list[str] | None = None, seeds: list[int] | None = None) -> dict[str, Any]:
    """Base model, then per seed: pool, every method, evaluations; then the report.

    preset: a file in pipeline/presets; overrides: {"train.lr": 1e-5, ...}; force: stage
    names to recompute even when cached; methods / seeds: default to the preset's
    `experiment.methods` / `experiment.seeds`."""
    # config, cells, device, engine, model, data, disk: every prerequisite before any work
    cfg, cells = check_run("offline", preset, overrides, force, methods, seeds)
    seeds = list(cfg.experiment.seeds)
    placement.use(cfg)      # threads or Ray (experiment.task_runner): connected before any work
    if cfg.experiment.task_runner == "threads":    # Ray workers start their own, lazily
        grading.start_pool(cfg.verify.workers)   # one grading pool for every verify and evaluate, warm by then
    tags = tracking.run_tags("offline", preset, cfg, str(flow_run.get_id() or ""))
    title = tracking.run_title("offline", preset, overrides or {}, cfg)
    step = None
    with interrupt.handlers():      # Ctrl-C / a cancelled deployment run: stop at safe points
        try:
            with tracking.parent_run(title, cfg.model_dump(mode="json"), tags) as (client, parent):
                set_parallel_builds(cfg.experiment.parallel)
                if cfg.pool.source:      # the imported pool's source, as the parent run's dataset input
                    tracking.log_source_dataset(client, parent, cfg.pool)
                step = Runner(set(force or []), parent)
                step("base", cfg, {}, "base")
                pending = [p for seed in seeds for p in submit_seed(step, [c for c in cells if c.seed == seed])]
                records, curves, finals = collect(pending, cfg)
                folder = tracking.report_folder("offline", preset)
                result = log_report(client, parent, records, curves, finals, cfg, folder)
        except Exception:
            if not interrupt.requested():
                raise
            return cancelled(step)  # type: ignore[return-value]  # a returned State ends the run Cancelled; callers get no State
    publish_report(result, records, preset)
    link = tracking.run_link(parent, client.get_run(parent).info.experiment_id)
    print(f"{result['table']}\nreport files: {folder}\nMLflow parent run: {link or parent}")
    return result | {"mlflow_parent_run_id": parent, "records": records, "report_folder": str(folder),
                     "mlflow_link": link}
