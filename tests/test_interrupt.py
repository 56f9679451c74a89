"""Ctrl-C (SIGINT) and SIGTERM stop a run at a safe point: exit 130, one line, the training
checkpoint written, and the same command resumes. Servers down here (Prefect's temporary
server, which must outlive the run's own shutdown); servers up in test_services.py."""
import os
import signal
import sys
import time

import pytest

from pipeline.core import interrupt

from conftest import REPO, assert_interrupted_cleanly, interrupt_offline_run

sys.path.insert(0, str(REPO / "benchmarks"))
from fault_matrix import FAULT_MARKER, marked  # noqa: E402


def test_sigint_with_servers_down_stops_checkpoints_and_resumes(base_manifest, tmp_path):
    # nothing listens on GGPO_PREFECT_PORT; a state folder (MLflow database) of its own
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"GGPO_HOME": str(tmp_path / "home")}
    assert_interrupted_cleanly(*interrupt_offline_run(env, seed=1, extra=["train.lr=2e-5"]))


def test_sigint_reaches_worker_processes(base_manifest, tmp_path):
    """experiment.task_runner = processes: the training runs in a worker process of its own
    process group (a terminal's Ctrl-C does not reach it); the flow process passes the request
    on, the worker checkpoints at its safe point, the CLI names where it stopped, and no
    worker is left once the run has exited."""
    marker = f"interrupt-processes-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {
        "GGPO_HOME": str(tmp_path / "home"), FAULT_MARKER: marker}
    # its own training run: lr 6e-5 (the runner is not in a key, so another lr than the other
    # interrupt tests, whose runs share the session cache)
    assert_interrupted_cleanly(*interrupt_offline_run(env, seed=2, extra=["train.lr=6e-5",
                                                                          "experiment.task_runner=processes"]))
    deadline = time.monotonic() + 30       # the workers' watch polls every 0.5 s: a safety net
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not marked(marker)


def test_signals_request_a_stop_and_a_third_restores_the_default():
    # what the process started with: Python's handler, or SIG_IGN under `nohup ... &` (a
    # shell without job control ignores SIGINT in background jobs)
    before = signal.getsignal(signal.SIGINT)
    interrupt.reset()
    with interrupt.handlers():
        os.kill(os.getpid(), signal.SIGTERM)
        assert interrupt.requested()
        with pytest.raises(interrupt.Interrupted, match="interrupted: train x at update 3"):
            interrupt.check("train x at update 3")
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) == before     # restored on exit
    assert interrupt.summary() == "interrupted (train x at update 3); rerun resumes"
    interrupt.reset()
    assert not interrupt.requested()
