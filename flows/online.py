"""Prefect flow `ggpo` (deployment `online`): the paper's Algorithm 1, every cell of the grid.

A cell (seed x method or variant x grid point, pipeline/grid.py) is a chain of rounds
(spec 8.1): round r = `online_pool` (sync the sampler to the policy after round r-1,
draw seeded prompt batches until N * G_mb mixed groups exist) then `online_train` (N
updates continuing round r-1's state). Both are cached stages: a rerun reuses finished
rounds, a killed round resumes from its checkpoint. Each cell's policy is evaluated at
`train.eval_every` and at the end (base = update 0); the report (Table 1 / 2 / 4 and
Figure 1 / 2 / 3 / 7 forms, pipeline/online_report.py) lands in the MLflow parent run.

Submission order is round-robin over cells (every cell's round 0, then every round 1,
...), each task taking its predecessor's future: Prefect runs a task once its inputs
resolve, so cells advance concurrently (at most experiment.parallel builds at once) and
no cell waits for another's rounds. MLflow: one run per cell, each round's metrics in one
`log_batch`, the cell's round manifests as one artifact at its end; evaluations as
nested runs like the offline flow's.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import polars as pl
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run

from flows.offline import Runner, cancelled, publish_report
from pipeline import dag, grading, grid, interrupt, online_report, placement, tracking
from pipeline.config import PipelineConfig
from pipeline.grid import Cell
from pipeline.preflight import check_run
from pipeline.stage import build_slot, outcome, set_parallel_builds
from pipeline.store import Manifest, Store


@task(task_run_name="{run_name}", cache_policy=NO_CACHE, retries=0)
def online_stage_task(stage: str, cfg: PipelineConfig, inputs: dict[str, Manifest], run_name: str,
                      force: bool = False, cell_run_id: str | None = None) -> Manifest:
    store = Store()
    inputs = {n: store.resolve(m) for n, m in inputs.items()}     # made on another machine (Ray)?
    with build_slot():
        result = dag.run(stage, cfg, inputs, store, force)
    get_run_logger().info("%s %s", run_name, outcome(result))
    if stage == "online_train" and cell_run_id:
        tracking.log_round(result, inputs["pool"], cell_run_id)
    return result


class OnlineRunner(Runner):
    """The offline flow's runner (each stage key submitted once) with round stages on the
    cheap task above: a round logs into its cell's run, not a run of its own."""

    def __init__(self, force: set[str], parent: str, cell_runs: dict[str, str]):
        super().__init__(force, parent)
        self.cell_runs = cell_runs

    def submit(self, stage: str, cfg: PipelineConfig, inputs: dict, name: str) -> PrefectFuture:
        if stage not in dag.ONLINE:
            return super().submit(stage, cfg, inputs, name)
        return placement.submit(online_stage_task, stage, cfg, stage, cfg, inputs, name, stage in self.force,
                                self.cell_runs.get(name.rsplit("/", 1)[0]))


def cell_name(cell: Cell) -> str:
    """The cell's MLflow run name, and the head of its round tasks' names ("<head>/pool-r3"):
    method, N, the other grid values and the seed ("ggpo N=4 t_ref=fixed seed=42")."""
    rest = [p for p in cell.label.split(" ")[1:] if not p.startswith(("updates_per_step=", "train.updates_per_step="))]
    return " ".join([cell.method, f"N={cell.config.train.updates_per_step}", *rest, f"seed={cell.seed}"])


def submit_cell(step: OnlineRunner, cell: Cell, round_: int, prev: PrefectFuture | None) -> PrefectFuture:
    """Round `round_` of a cell: its pool (sampled by `prev`, the previous round) and training."""
    c = cell.config.updated({"online.round": round_})
    head = cell_name(cell)
    policy = prev if prev is not None else step("base", c, {}, "base")
    pool = step("online_pool", c, {"policy": policy}, f"{head}/pool-r{round_}")
    inputs = {"base": step("base", c, {}, "base"), "pool": pool} | ({"state": prev} if prev is not None else {})
    return step("online_train", c, inputs, f"{head}/train-r{round_}")


def submit_all(step: OnlineRunner, cells: list[Cell]) -> tuple[dict, list]:
    """Every round of every cell, round-robin; evaluations as their rounds are submitted.
    Returns (cell index -> [train future per round], [(record stub, eval future)])."""
    rounds = {i: [] for i in range(len(cells))}
    evals = []
    for i, cell in enumerate(cells):
        cb = cell.config.updated({"eval.target": "base"})
        evals.append(({"cell": cell, "update": 0}, step("evaluate", cb, {"model": step("base", cb, {}, "base")},
                                                         f"evaluate-base-seed{cell.seed}")))
    n_rounds = [cell.config.train.updates // cell.config.train.updates_per_step for cell in cells]
    for r in range(max(n_rounds)):
        for i, cell in enumerate(cells):
            if r >= n_rounds[i]:
                continue
            fut = submit_cell(step, cell, r, rounds[i][-1] if rounds[i] else None)
            rounds[i].append(fut)
            for _, update, at in (p for p in cell.config.train.online_eval_points() if p[0] == r):
                ce = cell.config.updated({"eval.target": "online_train", "online.round": r, "eval.update": update})
                evals.append(({"cell": cell, "update": at},
                              step("evaluate", ce, {"model": fut}, f"evaluate-{cell_name(cell)}-u{at}")))
    return rounds, evals


def cell_runs(client, parent: str, cells: list[Cell]) -> dict[str, str]:
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


def collect(cells: list[Cell], rounds: dict, evals: list, cfg: PipelineConfig, client,
            runs: dict[str, str]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Wait for everything; (evaluations, per-update curves) with each cell's columns. Each
    cell run gets its evaluations as metrics and its round manifests as one artifact."""
    key, records, curves = f"mean_at_{cfg.eval.n_samples}", [], []
    for stub, future in evals:
        cell, m = stub["cell"], future.result()
        records.append(online_report.record(cell, cfg, stub["update"], m))
        run = runs[cell_name(cell)]
        tracking.log_params_metrics(client, run, {}, [(f"eval/{key}", m.summary[key], stub["update"])])
    for i, cell in enumerate(cells):
        manifests = [f.result() for f in rounds[i]]
        curves.append(online_report.cell_curves(cell, cfg, manifests))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "rounds.json"
            path.write_text(json.dumps([{"stage": m.stage, "key": m.key, "folder": m.folder, "summary": m.summary}
                                        for m in manifests], indent=1))
            client.log_artifact(runs[cell_name(cell)], str(path))
    return pl.DataFrame(records), pl.concat(curves, how="diagonal_relaxed")


@flow(name="ggpo", log_prints=True, task_runner=placement.ConfiguredTaskRunner())   # placement.use picks
def ggpo_online(preset: str = "tiny-online", overrides: dict[str, Any] | None = None,
                force: list[str] | None = None) -> dict[str, Any]:
    """Algorithm 1 for every cell of the preset's experiment, then the report.

    preset: a file in pipeline/presets; overrides: {"train.updates_per_step": 4, ...};
    force: stage names to recompute even when cached."""
    # config, cells, online geometry, device, engine, model, data, disk: before any work
    cfg, cells = check_run("online", preset, overrides, force)
    placement.use(cfg)      # threads or Ray (experiment.task_runner): connected before any work
    if cfg.experiment.task_runner == "threads":    # Ray workers start their own, lazily
        grading.start_pool(cfg.verify.workers)
    tags = tracking.run_tags("online", preset, cfg, str(flow_run.get_id() or ""))
    title = tracking.run_title("online", preset, overrides or {}, cfg)
    step = None
    with interrupt.handlers():      # Ctrl-C / a cancelled deployment run: stop at safe points
        try:
            with tracking.parent_run(title, cfg.model_dump(mode="json"), tags, tracking.EXPERIMENTS["online"]) \
                    as (client, parent):
                set_parallel_builds(cfg.experiment.parallel)
                runs = cell_runs(client, parent, cells)
                step = OnlineRunner(set(force or []), parent, runs)
                rounds, evals = submit_all(step, cells)
                evaluations, curves = collect(cells, rounds, evals, cfg, client, runs)
                folder = tracking.report_folder("online", preset)
                result = online_report.log(client, parent, evaluations, curves, cfg, folder)
        except Exception:
            if not interrupt.requested():
                raise
            return cancelled(step)
    publish_report(result, evaluations.to_dicts(), preset)
    link = tracking.run_link(parent, client.get_run(parent).info.experiment_id)
    print(f"{result['table']}\nreport files: {folder}\nMLflow parent run: {link or parent}")
    return result | {"mlflow_parent_run_id": parent, "records": evaluations.to_dicts(), "report_folder": str(folder),
                     "mlflow_link": link}
