"""Stage tasks in worker processes (`experiment.task_runner = "processes"`,
pipeline/dag/placement.py): the offline flow builds the same keys, byte-identical pools and
weights and the same MLflow runs as the threads runner; a stage's error raised in a worker
is the CLI's one line. Elsewhere: a stop request reaching the workers (tests/test_interrupt.py)
and the online flow SIGKILLed under processes, rerun, its artifacts equal to the threads
runner's undisturbed run (a cell of tests/test_fault_matrix.py).

Marked `servers`: one Prefect server for the module (1-2 min on 2 cores)."""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from ray_overhead import digests, prefect_server, run_flow, seed_store  # noqa: E402
from test_ray import FAST, mlflow_runs  # noqa: E402

from pipeline.core.store import Store  # noqa: E402


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with prefect_server(tmp_path_factory.mktemp("prefect")) as url:
        yield url


@pytest.mark.servers
def test_processes_flow_matches_threads(base_manifest, tmp_path, api):
    def run(runner: str) -> str:
        seed_store(tmp_path / runner / "cache", Store().folder("base", base_manifest.key))
        return run_flow(runner, tmp_path / runner / "cache", tmp_path / runner / "home", api, overrides=FAST)[1]
    with ThreadPoolExecutor(2) as pool:
        out = dict(zip(("threads", "processes"), pool.map(run, ("threads", "processes"))))
    assert "ggpo rollout: building" in out["processes"]       # a worker's stage log reached the terminal
    threads, processes = tmp_path / "threads" / "cache", tmp_path / "processes" / "cache"
    assert sorted(p.name for p in processes.iterdir()) == sorted(p.name for p in threads.iterdir())    # same keys
    d = digests(processes)
    assert len(d) == 3 and sum(k.startswith("train-") for k in d) == 1, d
    assert d == digests(threads)
    assert mlflow_runs(tmp_path / "processes" / "home") == mlflow_runs(tmp_path / "threads" / "home")


@pytest.mark.servers
def test_stage_failure_in_a_worker_process_is_one_line(tmp_path, api):
    bad = tmp_path / "noanswer.jsonl"
    bad.write_text('{"problem": "1+1"}\n')
    with pytest.raises(RuntimeError) as failed:
        run_flow("processes", tmp_path / "cache", tmp_path / "home", api, overrides=[f"task.name={bad}"])
    lines = [line for line in str(failed.value).splitlines() if line.startswith("ggpo:")]
    assert len(lines) == 1 and lines[0].startswith(f"ggpo: {bad}: missing required column 'answer'"), lines
    assert "exit 2" in str(failed.value) and "Traceback" not in str(failed.value)
