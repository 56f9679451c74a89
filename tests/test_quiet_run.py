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


@pytest.mark.servers
def test_a_temporary_server_that_cannot_bind_is_one_error_naming_its_port(tmp_path, monkeypatch):
    """The CLI starts the temporary server and goes on with its own set-up (`launch`), then
    waits for it (`ready`): a server whose port is taken meanwhile exits, and the wait ends
    with one ServiceError naming the port ("did not start": the exit, not the start-up
    timeout, whose error says "did not answer")."""
    import socket

    from pipeline import cli
    from pipeline.services import servers
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "300")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = cli.detached_server(port)
        server.launch()
        try:
            with pytest.raises(servers.ServiceError, match=f"temporary server on port {port} did not start"):
                server.ready()
        finally:
            server.stop()


def test_prepare_makes_the_tracking_store_and_experiment(tmp_path, monkeypatch):
    """What the CLI does while the temporary server starts: MLflow's SQLite file with its
    tables and the flow's experiment, so the flow finds both."""
    from mlflow import MlflowClient

    from pipeline.services import tracking
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracking.prepare(tracking.EXPERIMENTS["online"])
    exp = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").get_experiment_by_name(
        tracking.EXPERIMENTS["online"])
    assert exp is not None and exp.tags[tracking.KIND_TAG] == "custom_model_development"
