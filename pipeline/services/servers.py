"""`ggpo up / down / status`: a Prefect server, an MLflow tracking server and the process
that serves the `ggpo/offline` deployment, in the background, bound to 127.0.0.1.

Each service runs in its own process group (stopped with SIGTERM to the group, then
SIGKILL: MLflow's workers would otherwise be orphaned, and SIGINT is ignored by jobs
started from scripts). State, logs, the MLflow database and artifacts live in the state
folder ($GGPO_HOME, default ./.ggpo). `up` is idempotent, refuses a port that another
program holds, and on any failure stops whatever it started.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pipeline.core import paths
from pipeline.core.errors import ServiceError
from pipeline.core.store import default_root, write_text_atomic

STATE_FILE = paths.STATE_FILE


@dataclass
class Service:
    name: str
    argv: list[str]
    health_url: str
    env: dict[str, str]


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port() -> int:
    """A port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def urls(prefect_port: int, mlflow_port: int) -> dict[str, str]:
    return {"prefect_ui": f"http://127.0.0.1:{prefect_port}", "prefect_api": f"http://127.0.0.1:{prefect_port}/api",
            "mlflow": f"http://127.0.0.1:{mlflow_port}"}


def services(prefect_port: int, mlflow_port: int) -> list[Service]:
    state, u = paths.state_dir(), urls(prefect_port, mlflow_port)
    bindir = Path(sys.executable).parent
    prefect_env = {"PREFECT_HOME": str(state / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                   "PREFECT_LOCAL_STORAGE_PATH": str(state / "prefect" / "storage"),
                   "PREFECT_API_URL": u["prefect_api"], "PREFECT_UI_API_URL": u["prefect_api"],
                   "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}
    return [
        Service("prefect", [str(bindir / "prefect"), "server", "start", "--host", "127.0.0.1",
                            "--port", str(prefect_port)], f"{u['prefect_api']}/health", prefect_env),
        Service("mlflow", [str(bindir / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{paths.mlflow_db()}",
                           "--default-artifact-root", paths.mlflow_artifacts().as_uri(), "--no-serve-artifacts",
                           "--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1"],
                f"{u['mlflow']}/health", {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}),
        Service("serve", [sys.executable, "-m", "flows.serve"],
                f"{u['prefect_api']}/deployments/name/ggpo/offline",
                prefect_env | {"MLFLOW_TRACKING_URI": u["mlflow"], "PREFECT_RUNNER_POLL_FREQUENCY": "1",
                               "GGPO_CACHE": str(default_root()), "GGPO_HOME": str(state),
                               # the stages' progress lines (logger "ggpo") in the Prefect UI's run logs
                               "PREFECT_LOGGING_EXTRA_LOGGERS": "ggpo"}),
    ]


def read_state() -> dict:
    path = paths.state_dir() / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def start(svc: Service, timeout: float) -> int:
    logs = paths.state_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{svc.name}.log", "ab") as log:
        proc = subprocess.Popen(svc.argv, env=os.environ | svc.env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=os.getcwd())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError(f"{svc.name} exited with code {proc.returncode}; see {logs / (svc.name + '.log')}")
        if healthy(svc.health_url):
            return proc.pid
        time.sleep(0.5)
    stop_group(proc.pid)
    raise ServiceError(f"{svc.name} not healthy after {timeout:.0f}s at {svc.health_url}; see {logs / (svc.name + '.log')}")


def stop_group(pid: int, grace: float = 15.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def up(prefect_port: int | None = None, mlflow_port: int | None = None, timeout: float = 180.0) -> dict:
    current = status()
    if current and all(s["healthy"] for s in current["services"].values()):
        return current | {"already_up": True}
    # the ports asked for, else $GGPO_*_PORT, else those of the last `ggpo up` here, else the defaults
    prefect_port, mlflow_port = prefect_port or paths.prefect_port(), mlflow_port or paths.mlflow_port()
    if current:
        down()
    for name, port in (("prefect", prefect_port), ("mlflow", mlflow_port)):
        if not port_free(port):
            raise ServiceError(f"port {port} on 127.0.0.1 (for {name}) is taken by another program; free it "
                               f"or choose another with --{name}-port (or $GGPO_{name.upper()}_PORT). Nothing was started.")
    paths.state_dir().mkdir(parents=True, exist_ok=True)
    started: dict[str, int] = {}
    try:
        for svc in services(prefect_port, mlflow_port):
            started[svc.name] = start(svc, timeout)
    except BaseException:
        for pid in reversed(list(started.values())):
            stop_group(pid)
        raise
    state = {"pids": started, "ports": {"prefect": prefect_port, "mlflow": mlflow_port},
             "urls": urls(prefect_port, mlflow_port), "cache": str(default_root())}
    write_text_atomic(paths.state_dir() / STATE_FILE, json.dumps(state, indent=2))
    return status()


def ours(name: str) -> str | None:
    """The URL of ggpo's own `name` server ("prefect": its API, "mlflow") when `ggpo up`
    started it for this state folder and it answers; else None."""
    state = read_state()
    pid = state.get("pids", {}).get(name)
    url = state.get("urls", {}).get("prefect_api" if name == "prefect" else "mlflow")
    if not (pid and url and alive(pid) and healthy(f"{url}/health")):
        return None
    return url


def foreign(url: str, name: str) -> str:
    """The message for a server at `url` that `ggpo up` did not start."""
    return (f"something answers at {url}, but it is not the {name} server `ggpo up` started (state in "
            f"{paths.state_dir() / STATE_FILE}), so this project's runs do not go there")


def exports() -> list[str]:
    """Shell lines that point the Prefect CLI and MLflow clients at ggpo's servers."""
    state = read_state()
    if not state:
        return []
    return [f"export PREFECT_API_URL={state['urls']['prefect_api']}", f"export MLFLOW_TRACKING_URI={state['urls']['mlflow']}",
            f"export GGPO_PREFECT_PORT={state['ports']['prefect']} GGPO_MLFLOW_PORT={state['ports']['mlflow']}"]


def status() -> dict:
    state = read_state()
    if not state:
        return {}
    svcs = {s.name: s for s in services(state["ports"]["prefect"], state["ports"]["mlflow"])}
    report = {name: {"pid": pid, "alive": alive(pid), "healthy": alive(pid) and healthy(svcs[name].health_url)}
              for name, pid in state["pids"].items()}
    return state | {"services": report}


WHAT = {"prefect": "the Prefect server", "mlflow": "the MLflow server",
        "serve": "the process that serves the deployments ggpo/offline and ggpo/online"}


def not_healthy(state: dict) -> str:
    """One line on what of `ggpo up`'s services is gone or not answering (`status()`'s
    report) and how to bring it back; "" when all are healthy."""
    sick = [(name, s) for name, s in state["services"].items() if not s["healthy"]]
    if not sick:
        return ""
    logs = paths.state_dir() / "logs"
    parts = [f"{WHAT.get(name, name)} (pid {s['pid']}) {'is not answering' if s['alive'] else 'is gone'}"
             + (", so no deployment run would start" if name == "serve" else "") for name, s in sick]
    names = " ".join(f"{logs / name}.log" for name, _ in sick)
    return f"{'; '.join(parts)}; `ggpo up` restarts {'it' if len(sick) == 1 else 'them'} (see {names})"


def down() -> bool:
    state = read_state()
    for pid in reversed(list(state.get("pids", {}).values())):
        stop_group(pid)
    (paths.state_dir() / STATE_FILE).unlink(missing_ok=True)
    return bool(state)
