"""Ctrl-C (SIGINT) and SIGTERM stop a run at a safe point: exit 130, one line, the training
checkpoint written, and the same command resumes. Servers down here (Prefect's temporary
server, which must outlive the run's own shutdown); servers up in test_services.py."""
import os
import signal

import pytest

from pipeline.core import interrupt

from conftest import assert_interrupted_cleanly, interrupt_offline_run


def test_sigint_with_servers_down_stops_checkpoints_and_resumes(base_manifest, tmp_path):
    # nothing listens on GGPO_PREFECT_PORT; a state folder (MLflow database) of its own
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"GGPO_HOME": str(tmp_path / "home")}
    assert_interrupted_cleanly(*interrupt_offline_run(env, seed=1, extra=["train.lr=2e-5"]))


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
