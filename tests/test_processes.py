"""Stage tasks in worker processes (`experiment.task_runner = "processes"`,
pipeline/dag/placement.py): a stage's error raised in a worker is the CLI's one line.
Elsewhere: the online flow under processes, SIGKILLed and rerun, every artifact equal to the
threads runner's undisturbed run and no worker left (a cell of tests/test_fault_matrix.py);
a stop request reaching the workers, which checkpoint, and the rerun resuming
(tests/test_interrupt.py).

Marked `servers`: a Prefect server of its own."""
from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from ray_overhead import prefect_server, run_flow  # noqa: E402


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with prefect_server(tmp_path_factory.mktemp("prefect")) as url:
        yield url


@pytest.mark.servers
def test_stage_failure_in_a_worker_process_is_one_line(tmp_path, api):
    bad = tmp_path / "noanswer.jsonl"
    bad.write_text('{"problem": "1+1"}\n')
    with pytest.raises(RuntimeError) as failed:
        run_flow("processes", tmp_path / "cache", tmp_path / "home", api, overrides=[f"task.name={bad}"])
    lines = [line for line in str(failed.value).splitlines() if line.startswith("ggpo:")]
    assert len(lines) == 1 and lines[0].startswith(f"ggpo: {bad}: missing required column 'answer'"), lines
    assert "exit 2" in str(failed.value) and "Traceback" not in str(failed.value)


def test_the_runners_workers_start_before_any_task():
    """`use` spawns every worker of the process runner at the flow's start (`spawn_workers`):
    the pool by itself spawns one when a task reaches it, and the flow's first task (the
    base model) left the second to start only after it."""
    from pipeline.dag import placement
    runner = placement.process_runner(2)
    with runner:
        executor = runner._executor
        assert executor is not None and len(executor._processes) == 0
        placement.spawn_workers(runner, 2)
        assert len(executor._processes) == 2
        assert all(p.is_alive() for p in executor._processes.values())


def test_a_stop_request_after_the_runners_workers_are_gone_returns(monkeypatch):
    """The runner's workers poll a shared flag, so a stop request of the flow process never
    waits on them: with a multiprocessing Event, set() waited for every worker that had been
    inside Event.wait when its pool shut down, and hung (a served process's Ctrl-C after a
    flow ended; the full suite, in tests/test_store.py)."""
    import threading

    from pipeline.core import interrupt
    from pipeline.dag import placement
    monkeypatch.setattr(interrupt, "_listeners", [])
    runner = placement.process_runner(2)
    with runner:
        placement.spawn_workers(runner, 2)
        workers = list(runner._executor._processes.values())
        assert len(workers) == 2
    for p in workers:
        p.join(60)
    assert not any(p.is_alive() for p in workers)
    returned: list[bool] = []
    caller = threading.Thread(target=lambda: (interrupt.request(), returned.append(True)), daemon=True)
    try:
        caller.start()
        caller.join(120)        # a safety net: the verdict is whether it returns at all
        assert returned == [True], "interrupt.request() hung on the finished runner's workers"
    finally:
        interrupt.reset()
