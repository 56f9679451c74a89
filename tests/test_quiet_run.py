"""What a new user sees without `ggpo up`: `ggpo run offline --preset smoke` uses Prefect's
temporary server and prints no error lines; the MLflow experiment is a model-training one.

The flow test is slow (1-3 min: the temporary server starts in 15-25 s, then the smoke
flow runs; the base model comes from the session cache when another test built it).
It is marked `servers` because it starts Prefect's temporary server.
"""
from __future__ import annotations

import os
import re
import subprocess

import pytest

from conftest import BIN, REPO

# Words that mean something went wrong. Whole words only: a clean run prints summaries
# such as "status_parse_error" (a grading outcome), which is not an error of the run.
TROUBLE = re.compile(r"\b(error|errors|traceback|failed|exception)\b", re.IGNORECASE)


@pytest.mark.servers
def test_run_without_servers_prints_no_error_lines(base_manifest, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")          # a fresh temporary-server database
    env["GGPO_HOME"] = str(tmp_path / "home")   # its own MLflow database: other tests count the session's runs
    # cwd = the repository: its prefect.toml points at the (absent) server of `ggpo up`
    res = subprocess.run([str(BIN / "ggpo"), "run", "offline", "--preset", "smoke"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "Starting temporary server" in out          # really ran without a server
    assert "MLflow parent run" in res.stdout
    trouble = [line for line in out.splitlines() if TROUBLE.search(line)]
    assert not trouble, "\n".join(trouble[:20])


def test_experiment_is_a_model_training_experiment(tmp_path):
    """Created with the kind tag, and an existing experiment of another kind is re-tagged
    (MLflow's UI otherwise opens it in the GenAI view)."""
    from mlflow import MlflowClient

    from pipeline.services import tracking
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp_id = tracking.experiment_id(c)
    assert c.get_experiment(exp_id).tags[tracking.KIND_TAG] == "custom_model_development"
    c.set_experiment_tag(exp_id, tracking.KIND_TAG, "genai_development")
    assert tracking.experiment_id(c) == exp_id
    assert c.get_experiment(exp_id).tags[tracking.KIND_TAG] == "custom_model_development"
    assert tracking.runs_url("http://127.0.0.1:5000/", exp_id) == (
        f"http://127.0.0.1:5000/#/experiments/{exp_id}/runs?workflowType=machine_learning&compareRunsMode=CHART")
