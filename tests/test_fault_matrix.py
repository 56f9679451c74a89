"""The fault matrix (#25, 5): each fault of a bad day injected into the smoke flows, offline and
online, against an undisturbed run of the same config (benchmarks/fault_matrix.py runs the
cells; docs/faults.md has the measured table).

Per cell: the exit code (0 for a server outage and a killed grading worker; a full disk is one
line and exit 2, then a rerun after space is freed exits 0 and resumes; a SIGKILLed run's rerun
exits 0 and resumes), the warning and error lines on stderr (at most two for an outage or a
killed worker; no traceback anywhere), the seconds from the fault to the exit (bounded
generously: a safety net, not a verdict), the final artifacts (every manifest's content
hashes, CPU timings aside) equal to the undisturbed run's, and none of the run's processes
left behind.

One shell with its own servers for the module; the two flows of a fault run at once, each on
a cache of its own. The cells run in FAULTS order: the MLflow server is stopped before the
Prefect one, so the `prefect` cells track to the SQLite file of an MLflow server already gone.
`GGPO_FAULT_MATRIX_OUT=path` writes the table there."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import fault_matrix as fm  # noqa: E402

EXIT_BOUND_S = 300.0      # from the fault to the exit: generous, this machine's speed must not matter


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, base_manifest):
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    work = tmp_path_factory.mktemp("fault-matrix")
    shell = fm.Shell(work / "home", Path(os.environ["GGPO_CACHE"]))
    shell.up()
    m = fm.Matrix(shell, Path(base_manifest.folder), work / "cells")
    try:
        yield m
    finally:
        shell.down()
        out = os.environ.get("GGPO_FAULT_MATRIX_OUT")
        if out:
            Path(out).write_text(f"{fm.table(collected(m))}\n\n{fm.measured_on(t0, load0)}\n")


def collected(m: fm.Matrix) -> list[fm.Outcome]:
    return list(m.baselines.values()) + [o for f in fm.FAULTS for o in m.results.get(f, {}).values()]


def explain(o: fm.Outcome) -> str:
    return (f"{o.fault}/{o.flow}: exit {o.exit}, rerun {o.rerun_exit}, notes {o.notes}, differences {o.differences}, "
            f"leftovers {o.leftovers}\nwarnings: {o.warnings}\nrerun warnings: {o.rerun_warnings}\n"
            f"stderr tail:\n{o.stderr[-3000:]}\nrerun stderr tail:\n{o.rerun_stderr[-2000:]}")


@pytest.mark.servers
def test_undisturbed_runs_are_quiet(matrix):
    """The reference: exit 0, not one warning or error line (so a cell's count is the fault's),
    artifacts hashed, no process left."""
    for o in matrix.baseline().values():
        assert o.exit == 0 and not o.warnings and not o.traceback, explain(o)
        assert not o.leftovers and any(k.startswith(("train-", "online_policy-")) for k in o.digests), explain(o)


def grader(o: fm.Outcome) -> None:
    assert o.exit == 0 and 1 <= len(o.warnings) <= 2, explain(o)
    assert any("grading:" in w and "died" in w for w in o.warnings), explain(o)


def sigkill(o: fm.Outcome) -> None:
    assert o.exit == -9 and o.rerun_exit == 0 and not o.rerun_warnings, explain(o)
    assert any(n.startswith("rerun resumed") for n in o.notes), explain(o)


def disk(o: fm.Outcome) -> None:
    said = [w for w in o.warnings if w.startswith("ggpo:")]
    assert o.exit == 2 and len(said) == 1 and said[0].startswith("ggpo: disk full"), explain(o)
    assert "needs about" in said[0] and said == [ln for ln in o.stderr.splitlines() if ln.strip()][-1:], explain(o)
    assert o.rerun_exit == 0 and not o.rerun_warnings, explain(o)
    assert any(n.startswith("rerun resumed") for n in o.notes), explain(o)


def outage(server: str):
    def check(o: fm.Outcome) -> None:
        assert o.exit == 0 and 1 <= len(o.warnings) <= 2, explain(o)
        assert f"the {server} server at" in o.warnings[0] and "stopped answering" in o.warnings[0], explain(o)
    return check


CHECKS = {"grader": grader, "sigkill": sigkill, "disk": disk, "mlflow": outage("MLflow"), "prefect": outage("Prefect")}


@pytest.mark.servers
@pytest.mark.parametrize("fault, flow", fm.CELLS)
def test_cell(matrix, fault, flow):
    o = matrix.run(fault)[flow]
    assert o.fault_to_exit_s is not None, explain(o)       # the fault was injected, mid-run
    assert o.fault_to_exit_s < EXIT_BOUND_S, explain(o)
    assert not o.traceback, explain(o)
    CHECKS[fault](o)
    assert o.differences == [], explain(o)
    assert not o.leftovers, explain(o)


@pytest.mark.servers
def test_table(matrix):
    """The table of what ran (shown with -rP or -s); every cell that ran is in it."""
    text = fm.table(collected(matrix))
    print(text)
    assert text.count("\n") == 1 + len(collected(matrix))


def test_a_grading_worker_killed_while_it_warms_up_is_replaced():
    """The cell the matrix leaves out: a grading worker SIGKILLed before it is ready (the OOM
    killer while math-verify imports). Like one killed while it grades, it is replaced and the
    batch graded; before the fix the call failed ("exited with code -9 before it was ready (its
    traceback is above ...)"), and with it the stage and the run (exit 1, a traceback)."""
    from pipeline.tasks import grading
    responses, answers = [rf"\boxed{{{i}}}" for i in range(20)], [(str(i),) for i in range(20)]
    grading.close_pool()
    grading.start_pool(2)
    info = grading.pool_info()
    if info["ready"]:
        pytest.skip("a worker was ready before it could be killed")
    os.kill(info["pids"][0], signal.SIGKILL)
    try:
        got = grading.grade_many(responses, answers, 5.0, workers=2)
    finally:
        grading.close_pool()
    assert [g[:2] for g in got] == [(1.0, "ok")] * 20
