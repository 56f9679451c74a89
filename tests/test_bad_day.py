"""The bad day: a side service that dies mid-run costs a warning, not the run.

The MLflow server `ggpo up` started is stopped (SIGTERM to its process group, as a crash
or a redeploy would) while `ggpo run offline` trains: the run finishes its stages, says
so in one line, exits 0, and once `ggpo up` brings the server back the UI shows the run
complete: every training metric, its runs FINISHED."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from conftest import BIN, REPO, api, state

pytestmark = pytest.mark.servers

UPDATES = 48
SETS = ["experiment.seeds=[11]", "experiment.methods=[grpo]", f"train.updates={UPDATES}", "train.eval_every=null",
        "train.checkpoint_every=4"]


def test_mlflow_server_dying_mid_training_costs_one_warning(shell):
    from pipeline.core.config import load_config
    from pipeline.core.store import Store
    from pipeline.dag import graph
    cfg = load_config("smoke", SETS + ["train.method=grpo", "seed=11"])
    ckpt = Store().folder("train", graph.expected_key("train", cfg)) / "checkpoints"
    argv = [str(BIN / "ggpo"), "run", "offline", "--preset", "smoke"] + [a for s in SETS for a in ("--set", s)]
    proc = subprocess.Popen(argv, cwd=REPO, env=shell, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900           # a safety net for a hung run, not a verdict
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()
    mlflow_pid = state(shell)["pids"]["mlflow"]
    os.killpg(mlflow_pid, signal.SIGTERM)       # the server and its workers, mid-training
    out, err = proc.communicate(timeout=1800)
    assert proc.returncode == 0, err[-4000:]
    assert "Traceback" not in out + err, err[-4000:]
    warnings = [line for line in err.splitlines() if "warning" in line.lower() or "retrying" in line.lower()]
    assert 1 <= len(warnings) <= 2, warnings
    assert "stopped answering" in warnings[0]
    # back up: the run is there, complete
    up = subprocess.run([str(BIN / "ggpo"), "up"], cwd=REPO, env=shell, capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    mlflow = state(shell)["urls"]["mlflow"]
    exp = api(mlflow, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=ggpo-offline")["experiment"]
    runs = api(mlflow, "/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]],
                                                      "max_results": 100})["runs"]
    by_name = {r["info"]["run_name"]: r for r in runs}
    train = by_name["train-grpo-seed11"]
    history = api(mlflow, f"/api/2.0/mlflow/metrics/get-history?run_id={train['info']['run_id']}&metric_key=train/loss")
    assert sorted(m["step"] for m in history["metrics"]) == list(range(1, UPDATES + 1))
    assert {r["info"]["status"] for r in runs} == {"FINISHED"}, [(n, r["info"]["status"]) for n, r in by_name.items()]
    assert "evaluate-grpo-seed11-u48" in by_name
