"""Where the project keeps its state: services, logs, the MLflow database and artifacts."""
from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "GGPO_HOME"
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
