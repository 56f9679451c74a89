"""Prefect flow `ggpo` (deployment `online`): the paper's Algorithm 1, every cell of the grid.

A cell (seed x method or variant x grid point, pipeline/core/grid.py) is one long-lived task that
keeps its learner and its sampler in memory for all its rounds (stages/online_cell.py):
round r syncs the sampler to the learner, draws seeded prompt batches until N * G_mb mixed
groups exist (`online_pool`), and takes N updates (`online_train`). Every round is still a
content-addressed artifact keyed by the chain, so a rerun replays cached rounds, a killed
cell resumes from its rolling checkpoint, and a longer run continues the chain. Each round
shows in the Prefect UI (the cell's `<cell>-rounds` table artifact) and in the cell's MLflow
run (curves per update, counts per round), published in batches of rounds (RoundLog). The policy at
`train.eval_every` and at the end is evaluated (base = update 0) once its cell is done; the
report (Table 1 / 2 / 4 / 7 and Figure 1 / 2 / 3 / 7 forms, pipeline/reports/online.py)
lands in the MLflow parent run. At most experiment.parallel cells build at once.
"""
from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any

import polars as pl
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from flows.common import FlowRun, Report, Runner, run_flow
from pipeline.core.config import PipelineConfig
from pipeline.core.grid import GridCell
from pipeline.core.store import Manifest, Store, write_text_atomic
from pipeline.dag import placement
from pipeline.dag.spec import build_slot
from pipeline.reports import online
from pipeline.services import prefect_client, progress, tracking
from stages.online_cell import CellResult, run_cell


@task(task_run_name="{run_name}", cache_policy=NO_CACHE, retries=0)
def cell_task(cfg: PipelineConfig, base: Manifest, run_name: str, cell_run_id: str | None = None) -> CellResult:
    """One resident cell, all its rounds; its counts (engine starts, rounds sampled, ...)
    and the manifests it wrote (small: keys, paths, hashes)."""
    store = Store()
    base = store.resolve(base)
    log = RoundLog(cell_run_id, run_name)
    with build_slot():
        try:
            result = run_cell(cfg, store, base, on_round=log.add)
        except BaseException:
            with contextlib.suppress(Exception):     # the points so far; the cell's own error goes on
                log.publish()
            raise
    log.publish()       # the rounds since the last batch
    counts = result.counts
    get_run_logger().info("%s: %s", run_name, {k: v for k, v in counts.items() if k not in ("folder", "stalled")})
    if counts.get("stalled"):
        get_run_logger().warning("%s stopped after update %d: %s", run_name, counts["stalled"]["update"],
                                 counts["stalled"]["reason"])
    if cell_run_id:
        tracking.log_params_metrics(tracking.client(), cell_run_id, {}, tracking.summary_metrics(
            {f"cell/{k}": v for k, v in counts.items() if isinstance(v, int)}))
    return result


PUBLISH_EVERY = 8      # rounds per batch of MLflow points and Prefect table versions


class RoundLog:
    """A cell's finished rounds for MLflow (curves per update, counts per round) and the
    cell's Prefect table artifact, published every PUBLISH_EVERY rounds and at the cell's end:
    one request and one artifact version a batch, not a round (74 ms a round on the tiny
    testbed). Every point keeps its step, so MLflow ends with the same points; the store
    holds every round the moment it finishes."""

    def __init__(self, run_id: str | None, name: str):
        self.run_id, self.name = run_id, name
        self.rows: list[dict] = []                              # the table: every round so far
        self.unpublished: list[tuple[Manifest, Manifest]] = []  # (trained, pool) not yet in MLflow

    def add(self, r: int, pool: Manifest, trained: Manifest) -> None:
        s = pool.summary
        self.rows.append({"round": r, "updates": trained.summary["updates"], "prompts_drawn": s["prompts_drawn"],
                          "groups_kept": s["groups_kept"], "pool_mean_reward": round(s["pool_mean_reward"], 4),
                          "final_reward": round(trained.summary["final_reward"], 4), "pool": pool.key[:16],
                          "round_key": trained.key[:16]})
        self.unpublished.append((trained, pool))
        if len(self.unpublished) >= PUBLISH_EVERY:
            self.publish()

    def publish(self) -> None:
        if not self.unpublished:
            return
        if self.run_id:
            tracking.log_rounds(self.unpublished, self.run_id)
        self.unpublished = []
        try:
            create_table_artifact(table=self.rows, key=progress.artifact_key(f"{self.name} rounds"),
                                  description=f"online cell {self.name}: one row per finished round")
        except Exception as exc:     # noqa: BLE001 - the rounds are recorded in the store and MLflow already
            prefect_client.noticed(exc)      # its server gone: said once, and no more waiting on it
            get_run_logger().debug("round artifact not published: %s", exc)


def cell_name(cell: GridCell) -> str:
    """The cell's MLflow run name and task name: method, N, the other grid values and the
    seed ("ggpo N=4 t_ref=fixed seed=42")."""
    rest = [p for p in cell.label.split(" ")[1:] if not p.startswith(("updates_per_step=", "train.updates_per_step="))]
    return " ".join([cell.method, f"N={cell.config.train.updates_per_step}", *rest, f"seed={cell.seed}"])


def cell_runs(client, parent: str, cells: list[GridCell]) -> dict[str, str]:
    """One MLflow run per cell (nested under the flow's run): its rounds log into it."""
    out = {}
    exp = tracking.experiment_id(client, tracking.EXPERIMENTS["online"])
    for cell in cells:
        name = cell_name(cell)
        run = client.create_run(exp, run_name=name, tags={"mlflow.parentRunId": parent, "ggpo.stage": "online",
                                                           "ggpo.method": cell.method, "ggpo.seed": str(cell.seed)})
        tracking.log_params_metrics(client, run.info.run_id, tracking.flatten(cell.config.model_dump(mode="json")), [])
        out[name] = run.info.run_id
    return out


def submit_cells(step: Runner, cells: list[GridCell], runs: dict[str, str]) -> tuple[list, list]:
    """Every cell's task and every base evaluation: ([cell future], [(stub, eval future)])."""
    evals, futures = [], []
    for cell in cells:
        cb = cell.config.updated({"eval.target": "base"})
        base = step("base", cb, {}, "base")
        evals.append(({"cell": cell, "update": 0}, step("evaluate", cb, {"model": base}, f"evaluate-base-seed{cell.seed}")))
        name = cell_name(cell)
        futures.append(placement.submit(cell_task, "online", cell.config, cell.config, base, name, runs.get(name)))
        step.submitted[("online", name)] = futures[-1]       # a stop request waits for it too
    return futures, evals


def submit_evaluations(step: Runner, cell: GridCell, done: CellResult) -> list:
    """A finished cell's evaluation points: the policies it kept, each evaluated. A cell
    that stopped early (a stall, the drift guard) kept the points before its stop and its
    policy at the stop."""
    out = []
    for at, policy in sorted(done.policies.items()):
        ce = cell.config.updated({"eval.target": "online", "eval.update": at})
        out.append(({"cell": cell, "update": at}, step("evaluate", ce, {"model": policy}, f"evaluate-{cell_name(cell)}-u{at}")))
    return out


def collect(cells: list[GridCell], futures: list, evals: list, step: Runner, cfg: PipelineConfig, client,
            runs: dict[str, str]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Wait for the cells (submitting each one's evaluations as it finishes), then the
    evaluations; (evaluations, per-update curves) with each cell's columns. Each cell run
    gets its evaluations as metrics and its round records as one artifact."""
    store, key, records, curves = Store(), f"mean_at_{cfg.eval.n_samples}", [], []
    done: dict[str, CellResult] = {}
    for cell, future in zip(cells, futures):
        done[cell_name(cell)] = future.result()
        evals += submit_evaluations(step, cell, done[cell_name(cell)])
    for stub, future in evals:
        cell, m = stub["cell"], future.result()
        records.append(online.record(cell, cfg, stub["update"], m))
        tracking.log_params_metrics(client, runs[cell_name(cell)], {}, [(f"eval/{key}", m.summary[key], stub["update"])])
    for cell in cells:
        # the cell's own records (made on another machine under Ray: read where the store has them here)
        manifests = [store.resolve(r.trained) for r in done[cell_name(cell)].rounds]
        curves.append(online.cell_curves(cell, cfg, manifests))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "rounds.json"
            write_text_atomic(path, json.dumps([{"stage": m.stage, "key": m.key, "folder": m.folder,
                                                 "summary": m.summary} for m in manifests], indent=1))
            client.log_artifact(runs[cell_name(cell)], str(path))
    return pl.DataFrame(records), pl.concat(curves, how="diagonal_relaxed")


@flow(name="ggpo", log_prints=True, task_runner=placement.ConfiguredTaskRunner())   # placement.use picks
def ggpo_online(preset: str = "tiny-online", overrides: dict[str, Any] | None = None,
                force: list[str] | None = None) -> dict[str, Any]:
    """Algorithm 1 for every cell of the preset's experiment, then the report.

    preset: a file in pipeline/presets; overrides: {"train.updates_per_step": 4, ...};
    force: stage names to recompute even when cached."""
    # a returned State ends the run Cancelled (a stop request); callers get no State
    return run_flow("online", preset, overrides, force, algorithm_1)  # type: ignore[return-value]


def algorithm_1(run: FlowRun) -> Report:
    """Every cell's rounds (sync, sample with refill, N updates) in its resident task, the
    base model evaluated once per seed and each cell's kept policies as its cell finishes;
    then the report (pipeline/reports/online.py)."""
    runs = cell_runs(run.client, run.parent, run.cells)
    futures, evals = submit_cells(run.step, run.cells, runs)
    evaluations, curves = collect(run.cells, futures, evals, run.step, run.cfg, run.client, runs)
    folder = tracking.report_folder("online", run.preset)
    result = online.log(run.client, run.parent, evaluations, curves, run.cfg, folder)
    return Report(result, evaluations.to_dicts(), folder)
