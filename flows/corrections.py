"""Prefect flow `ggpo` (deployment `corrections`): the corrections table in one run (issue 35).

Both experiments of one preset, side by side in one flow run: the online cells of its
experiment (every method x the grid, the staleness ladder N in {1, 4, 16, 64}, x seeds:
flows/online.py's resident cells), and per seed every method trained on that seed's one
fixed pool at the preset's own N (flows/offline.py's cells of `corrections.offline_config`:
the experiment without its grid). The base model and each seed's base evaluation are one
stage key for both parts (the runner submits each key once), and every stage is the key
the two flows build on their own, so `ggpo run online` / `ggpo run offline` with the same
config reuse it and the other way round. The report is pipeline/reports/corrections.py's
(report/corrections.md, .csv, .png; the online and offline parts' own reports beside it).

Checked as an online run (preflight's online geometry for every cell; the offline cells are
the same configs at the preset's N). Thin on purpose: setup and ending are
flows/common.run_flow's, the submissions the two flows' own functions.
"""
from __future__ import annotations

from typing import Any

import polars as pl
from prefect import flow

from flows import offline as offline_flow, online as online_flow
from flows.common import FlowRun, Report, run_flow
from pipeline.core import grid
from pipeline.dag import placement
from pipeline.reports import corrections
from pipeline.services import tracking


@flow(name="ggpo", log_prints=True, task_runner=placement.ConfiguredTaskRunner())   # placement.use picks
def ggpo_corrections(preset: str = "corrections", overrides: dict[str, Any] | None = None,
                     force: list[str] | None = None) -> dict[str, Any]:
    """Every method on the staleness ladder and on the fixed offline pool, then the
    corrections table.

    preset: a file in pipeline/presets; overrides: {"experiment.seeds": [42], ...};
    force: stage names to recompute even when cached."""
    # a returned State ends the run Cancelled (a stop request); callers get no State
    return run_flow("online", preset, overrides, force, corrections_table)  # type: ignore[return-value]


def corrections_table(run: FlowRun) -> Report:
    """Submit every online cell and every offline training (the base shared), wait for
    both parts, then the report."""
    off_cfg = corrections.offline_config(run.cfg)
    off_cells = grid.cells(off_cfg)
    run.step("base", run.cfg, {}, "base")
    # offline first: its pools and short trainings fill the build slots while the long
    # online cells queue behind them
    pending = [p for seed in off_cfg.experiment.seeds
               for p in offline_flow.submit_seed(run.step, [c for c in off_cells if c.seed == seed])]
    runs = online_flow.cell_runs(run.client, run.parent, run.cells)
    futures, evals = online_flow.submit_cells(run.step, run.cells, runs)
    on_evals, on_curves = online_flow.collect(run.cells, futures, evals, run.step, run.cfg, run.client, runs)
    records, curves, _ = offline_flow.collect(pending, off_cfg)
    folder = tracking.report_folder("corrections", run.preset)
    off_evals = pl.DataFrame(records)
    result = corrections.log(run.client, run.parent, on_evals, on_curves, off_evals,
                             pl.concat(curves) if curves else pl.DataFrame(), run.cfg, folder)
    rows = [r | {"part": "online"} for r in on_evals.to_dicts()] + [r | {"part": "offline"} for r in records]
    return Report(result, rows, folder)
