"""What both flows (flows/offline.py, flows/online.py) share: the run's setup and ending, and
the task that runs one cached stage.

`run_flow` is the frame of a flow run: every prerequisite checked before any work
(preflight), the task runner placed (threads or Ray), one grading pool warm for every
verify and evaluate, the MLflow parent run, Ctrl-C / a cancelled deployment run stopping
at safe points, and at the end the report published to the Prefect UI and printed. A flow
hands it its procedure (the paper's, in a screen), which submits stages through a `Runner`
and returns its `Report`.

Tasks pass manifests (paths, keys, hashes), never tensors. Prefect's own task cache stays
off: the store's content keys decide what is recomputed, the same with or without a server.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run
from prefect.states import Cancelled, State

from pipeline.core import interrupt
from pipeline.core.config import PipelineConfig
from pipeline.core.errors import Interrupted
from pipeline.core.grid import GridCell
from pipeline.core.store import Manifest, Store
from pipeline.dag import graph, placement
from pipeline.dag.preflight import check_run
from pipeline.dag.spec import build_slot, outcome, set_parallel_builds
from pipeline.services import prefect_client, progress, tracking
from pipeline.tasks import grading

# the stages' progress and resume lines (logger "ggpo"; forwarded to the Prefect API where
# PREFECT_LOGGING_EXTRA_LOGGERS names it, as `ggpo up`'s serve process does): INFO unless set
if logging.getLogger("ggpo").level == logging.NOTSET:
    logging.getLogger("ggpo").setLevel(logging.INFO)

DESCRIPTIONS = {"offline": "ggpo offline comparison", "online": "ggpo online loop (Algorithm 1)"}


@task(task_run_name="{run_name}", cache_policy=NO_CACHE, retries=0)
def run_stage_task(stage: str, cfg: PipelineConfig, inputs: dict[str, Manifest], run_name: str,
                   force: bool = False, parent_run_id: str | None = None) -> Manifest:
    store = Store()
    inputs = {n: store.resolve(m) for n, m in inputs.items()}     # made on another machine (Ray)?
    with build_slot():      # at most experiment.parallel builds at once
        result = graph.run(stage, cfg, inputs, store, force)
    get_run_logger().info("%s %s: %s", run_name, outcome(result),
                          {k: v for k, v in result.summary.items() if not isinstance(v, str)})
    tracking.log_stage(result, run_name, parent_run_id)
    return result


class Runner:
    """Submits stage tasks with the flow's force set and MLflow parent run, each stage key
    once: grid cells that share a pool (or a base model, a base evaluation) get the same
    future. Inputs may be futures: Prefect resolves them, so independent stages (the
    cells of a seed, the seeds) run concurrently while dependent ones wait."""

    def __init__(self, force: set[str], parent: str):
        self.force, self.parent = force, parent
        self.submitted: dict[tuple[str, str], PrefectFuture] = {}

    def __call__(self, stage: str, cfg: PipelineConfig, inputs: dict, name: str) -> PrefectFuture:
        key = (stage, graph.expected_key(stage, cfg))
        if key not in self.submitted:
            self.submitted[key] = self.submit(stage, cfg, inputs, name)
        return self.submitted[key]

    def submit(self, stage: str, cfg: PipelineConfig, inputs: dict, name: str) -> PrefectFuture:
        # threads, or a Ray worker with the stage's GPUs/CPUs (experiment.task_runner)
        return placement.submit(run_stage_task, stage, cfg, stage, cfg, inputs, name, stage in self.force, self.parent)


@dataclass(frozen=True)
class FlowRun:
    """What a flow's procedure works with: the checked config and its cells, the MLflow
    client and parent run, and the stage runner."""
    flow: str               # "offline" | "online"
    preset: str
    cfg: PipelineConfig
    cells: list[GridCell]
    client: Any
    parent: str
    step: Runner


@dataclass(frozen=True)
class Report:
    """What a procedure ends with: the report (its markdown `table` and `summary` metrics,
    already in the parent run), every evaluation record, and the report's folder."""
    result: dict[str, Any]
    records: list[dict]
    folder: Path


def run_flow(flow: str, preset: str, overrides: dict[str, Any] | None, force: list[str] | None,
             procedure: Callable[[FlowRun], Report], methods: list[str] | None = None,
             seeds: list[int] | None = None) -> dict[str, Any] | State:
    """One flow run around `procedure`: checks, placement, grading pool, MLflow parent run,
    interrupts; then the report published and printed. A stop request ends it Cancelled."""
    # config, cells, device, engine, model, data, disk: every prerequisite before any work
    cfg, cells = check_run(flow, preset, overrides, force, methods, seeds)
    placement.use(cfg, preload=(procedure.__module__,))   # the runner (experiment.task_runner), before any work
    if cfg.experiment.task_runner == "threads":    # worker processes start their own, lazily
        grading.start_pool(cfg.verify.workers)   # one grading pool for every verify and evaluate, warm by then
    tags = tracking.run_tags(flow, preset, cfg, str(flow_run.get_id() or ""))
    title = tracking.run_title(flow, preset, overrides or {}, cfg)
    step = None
    with interrupt.handlers():      # Ctrl-C / a cancelled deployment run: stop at safe points
        try:
            with tracking.parent_run(title, cfg.model_dump(mode="json"), tags, tracking.EXPERIMENTS[flow]) \
                    as (client, parent):
                set_parallel_builds(cfg.experiment.parallel)
                step = Runner(set(force or []), parent)
                done = procedure(FlowRun(flow, preset, cfg, cells, client, parent, step))
        except Exception:
            if not interrupt.requested():
                raise
            return cancelled(step)
    publish_report(done.result, done.records, preset, flow)
    link = tracking.run_link(parent, client.get_run(parent).info.experiment_id)
    print(f"{done.result['table']}\nreport files: {done.folder}\nMLflow parent run: {link or parent}")
    return done.result | {"mlflow_parent_run_id": parent, "records": done.records, "report_folder": str(done.folder),
                          "mlflow_link": link}


def cancelled(step: Runner | None) -> State:
    """After a stop request: wait until every submitted stage has reached its safe point
    (checkpoints written), stop the graders, and end the flow run Cancelled."""
    if step is not None:
        # each one to its end (a stage at its safe point), and where it stopped: a worker
        # process's too. Not prefect's wait(): with worker processes it raises for a stage
        # whose inputs failed (UpstreamTaskError) before the others are done
        for future in step.submitted.values():
            try:
                future.result()
            except Interrupted as exc:
                interrupt.stopped(exc.where)
            except Exception:       # noqa: BLE001 - failures after a stop request are the stop's
                pass
    grading.close_pool()
    return Cancelled(message=f"ggpo: {interrupt.summary()}")


def publish_report(result: dict, records: list[dict], preset: str, flow: str = "offline") -> None:
    """The report in the Prefect UI (the flow run's Artifacts tab): the tables as markdown,
    the summary metrics and every evaluation as tables. A report the UI cannot take is a
    warning, never a failed run: the same report is in MLflow already."""
    if prefect_client.down():     # the server stopped answering mid-run (said once already)
        return
    key = progress.artifact_key(f"ggpo {preset}")
    try:
        create_markdown_artifact(markdown=result["table"], key=f"{key}-report",
                                 description=f"{DESCRIPTIONS[flow]}, preset {preset}")
        create_table_artifact(table=[{"metric": k, "value": v} for k, v in result["summary"].items()],
                              key=f"{key}-summary", description="final and base accuracy")
        create_table_artifact(table=records, key=f"{key}-evaluations",
                              description="every evaluation: method, seed, update, accuracy")
    except Exception as e:       # noqa: BLE001 - the run itself succeeded
        if prefect_client.noticed(e):     # its server went away meanwhile (said once)
            return
        get_run_logger().warning("report not published as Prefect artifacts: %s: %s", type(e).__name__, e)
