"""The bad day, orchestration side: a Prefect server that dies mid-run costs a warning, not
the run; a serve process that is gone is named in one line, with how to restart it.

The Prefect server `ggpo up` started is stopped (SIGTERM to its process group, as a crash
or a redeploy would) while `ggpo run offline` trains: the run finishes its stages, says so
in one line, exits 0 with its own outcome, and once `ggpo up` brings the server back the
UI shows the flow run Completed (not stuck Running), its stage tasks too.

Commands run as `python -m pipeline.cli` from the repository (this checkout's code)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, api, prefect_dies_mid_training, state

GGPO = [sys.executable, "-m", "pipeline.cli"]
UPDATES = 48
SETS = ["experiment.seeds=[12]", "experiment.methods=[grpo]", f"train.updates={UPDATES}", "train.eval_every=null",
        "train.checkpoint_every=4"]


def newest_file(*folders: Path) -> float:
    return max(p.stat().st_mtime for f in folders if f.exists() for p in f.rglob("*") if p.is_file())


@pytest.mark.servers
def test_prefect_server_dying_mid_training_costs_one_warning(shell):
    from pipeline.core.store import Store
    store = Store()
    proc = prefect_dies_mid_training(shell, SETS)
    out, err = proc.communicate(timeout=1800)   # a safety net, not a verdict
    exited = time.time()
    assert proc.returncode == 0, err[-4000:]
    assert "Traceback" not in out + err, err[-4000:]
    warnings = [line for line in err.splitlines() if "warning" in line.lower() or "retrying" in line.lower()]
    assert 1 <= len(warnings) <= 2, warnings
    assert "Prefect server" in warnings[0] and "stopped answering" in warnings[0], warnings
    for noise in ("Unable to connect", "EventsWorker", "Error logging to API", "APILogWorker"):
        assert noise not in err, err[-4000:]
    assert "report files:" in out and "MLflow parent run:" in out, out[-2000:]
    # measured, not asserted (a loaded machine is slow): from the work's end to the exit
    report = Path(out.split("report files: ")[-1].splitlines()[0])
    print(f"seconds from the work's last file to exit: {exited - newest_file(Path(store.root), report):.1f}")
    unreported = list((Path(shell["GGPO_HOME"]) / "prefect" / "unreported").glob("*.json"))
    assert len(unreported) == 1, unreported
    assert json.loads(unreported[0].read_text())["type"] == "COMPLETED"
    # back up: the flow run is recorded as it ended, its stage tasks with it
    up = subprocess.run(GGPO + ["up"], cwd=REPO, env=shell, capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "recorded Completed" in up.stdout, up.stdout
    assert not list(unreported[0].parent.glob("*.json"))
    prefect = state(shell)["urls"]["prefect_api"]
    run_id = unreported[0].stem
    assert api(prefect, f"/flow_runs/{run_id}")["state"]["type"] == "COMPLETED"
    tasks = api(prefect, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
    assert tasks and {t["state"]["type"] for t in tasks if t["state"]} == {"COMPLETED"}, \
        [(t["name"], t["state"]) for t in tasks]


@pytest.mark.servers
def test_a_gone_serve_process_is_named_with_the_way_back(shell):
    os.killpg(state(shell)["pids"]["serve"], signal.SIGKILL)
    time.sleep(1)
    argv = GGPO + ["run", "offline", "--preset", "smoke", "--deployment"] + [a for s in SETS for a in ("--set", s)]
    run = subprocess.run(argv, cwd=REPO, env=shell, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert run.returncode == 2, run.stderr[-3000:]
    assert len(lines) == 1, lines
    assert "serves the deployments" in lines[0] and "is gone" in lines[0] and "`ggpo up` restarts it" in lines[0], lines
    status = subprocess.run(GGPO + ["status"], cwd=REPO, env=shell, capture_output=True, text=True, timeout=120)
    assert status.returncode == 1 and "serve" in status.stdout and "NOT healthy" in status.stdout


def test_not_healthy_names_what_is_gone():
    from pipeline.services import servers
    report = {"services": {"prefect": {"pid": 1, "alive": True, "healthy": True},
                           "serve": {"pid": 4242, "alive": False, "healthy": False}}}
    line = servers.not_healthy(report)
    assert "\n" not in line and "pid 4242" in line and "is gone" in line and "`ggpo up` restarts it" in line
    assert servers.not_healthy({"services": {"prefect": {"pid": 1, "alive": True, "healthy": True}}}) == ""


def test_the_end_of_a_run_is_kept_for_ggpo_ups_server_only(tmp_path, monkeypatch):
    import httpx
    from prefect.states import Completed

    from pipeline.services import prefect_client
    monkeypatch.setenv("GGPO_HOME", str(tmp_path))
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")
    assert prefect_client.connection_error(httpx.ConnectError("refused"))
    assert not prefect_client.connection_error(RuntimeError("a refused call"))
    prefect_client.record("r1", Completed())     # a temporary server (no services.json): nothing to report later
    assert not prefect_client.unreported_dir().exists()
    (tmp_path / "services.json").write_text(json.dumps({"urls": {"prefect_api": "http://127.0.0.1:1/api"}}))
    prefect_client.record("r1", Completed(message="done"))
    entry = json.loads((prefect_client.unreported_dir() / "r1.json").read_text())
    assert (entry["type"], entry["name"], entry["message"]) == ("COMPLETED", "Completed", "done")
    assert prefect_client.report_unreported() == []      # its server is not up: kept for the next time
    assert (prefect_client.unreported_dir() / "r1.json").exists()


def test_watching_a_deployment_run_ends_in_one_line_when_its_server_or_serve_process_goes(monkeypatch):
    import httpx

    from pipeline import cli
    from pipeline.core.errors import ServiceError

    class Gone:
        def read_flow_run(self, run_id):
            raise httpx.ConnectError("All connection attempts failed")

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")
    with pytest.raises(ServiceError, match="stopped answering while this command watched flow run r1; `ggpo up`"):
        cli.watch_flow_run(Gone(), "r1")

    class Running:
        def read_flow_run(self, run_id):
            from types import SimpleNamespace
            return SimpleNamespace(state=SimpleNamespace(is_final=lambda: False), name="quiet-fox", state_name="Running")

        def read_logs(self, *args, **kwargs):
            return []

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with pytest.raises(ServiceError, match="serves the deployments .* is gone, so flow run quiet-fox stays Running"):
        cli.watch_flow_run(Running(), "6326a6a2-1e64-4128-8eb0-47ccc329c4b2", dead.pid)
