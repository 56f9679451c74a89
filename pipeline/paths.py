"""Where the project keeps its state: services, logs, the MLflow database and artifacts."""
from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "GGPO_HOME"
PROJECT_ROOT = Path(__file__).resolve().parents[1]     # where data/ ships
PREFECT_PORT_ENV = "GGPO_PREFECT_PORT"
MLFLOW_PORT_ENV = "GGPO_MLFLOW_PORT"


def state_dir() -> Path:
    return Path(os.environ.get(HOME_ENV, ".ggpo")).resolve()


def prefect_port() -> int:
    return int(os.environ.get(PREFECT_PORT_ENV, "4200"))


def mlflow_port() -> int:
    return int(os.environ.get(MLFLOW_PORT_ENV, "5000"))


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
