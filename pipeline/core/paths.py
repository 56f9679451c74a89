"""Where the project keeps its state: services, logs, the MLflow database and artifacts."""
from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "GGPO_HOME"
PROJECT_ROOT = Path(__file__).resolve().parents[2]     # where data/ ships
PREFECT_PORT_ENV = "GGPO_PREFECT_PORT"
MLFLOW_PORT_ENV = "GGPO_MLFLOW_PORT"


def state_dir() -> Path:
    return Path(os.environ.get(HOME_ENV, ".ggpo")).resolve()


STATE_FILE = "services.json"     # what `ggpo up` started: pids, ports, urls
DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000}


def recorded_ports() -> dict[str, int]:
    """The ports of the servers `ggpo up` started for this state folder ({} if none)."""
    import json
    path = state_dir() / STATE_FILE
    try:
        return {k: int(v) for k, v in json.loads(path.read_text()).get("ports", {}).items()}
    except (OSError, ValueError):
        return {}


def _port(name: str, env: str) -> int:
    """$GGPO_<NAME>_PORT, else the port `ggpo up` chose (so a new shell reaches the same
    servers), else the default."""
    if os.environ.get(env):
        return int(os.environ[env])
    return recorded_ports().get(name, DEFAULT_PORTS[name])


def prefect_port() -> int:
    return _port("prefect", PREFECT_PORT_ENV)


def mlflow_port() -> int:
    return _port("mlflow", MLFLOW_PORT_ENV)


def mlflow_db() -> Path:
    return state_dir() / "mlflow.db"


def mlflow_artifacts() -> Path:
    return state_dir() / "mlartifacts"


def project_file(name: str | Path) -> Path:
    """A data path as the user wrote it: absolute, or relative to the working directory if
    it exists there, else relative to the project root (where data/ ships), so presets that
    name `data/benchmarks/...` work from any directory. Unchanged when found nowhere (the
    caller's error then names it as written)."""
    path = Path(name).expanduser()
    if path.is_absolute() or path.exists():
        return path
    shipped = PROJECT_ROOT / path
    return shipped if shipped.exists() else path
