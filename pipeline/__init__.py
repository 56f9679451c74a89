"""ggpo: offline and online RL with verifiable rewards as a DAG of cached stages.

`pipeline` is the library, in layers (each imports only its own level or below;
tests/test_imports.py checks it): core (0), tasks and models (1), services (2), training
and dag (3), then the stages/ modules (4), reports (5), flows/ (6) and the CLI (cli.py, 7).
"""
import os as _os

# MLflow's telemetry (mlflow >= 3.x) fetches its config in a thread at `import mlflow`; offline
# that fails and the thread unsets an environment variable while other threads read
# os.environ (requests does, for proxies, on every call): a run with `ggpo up`'s tracking
# server failed with KeyError('_MLFLOW_TELEMETRY_SESSION_ID') in its first MLflow call. Pytest
# and CI turn telemetry off by themselves, so only users met it. Every ggpo process imports this
# package before mlflow; a user's own MLFLOW_DISABLE_TELEMETRY wins.
_os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# CPU kernels: pinned before torch runs anything, so that the same config and seed give the same
# bits on every x86 processor (pipeline/core/kernels.py; GGPO_KERNELS=native turns it off).
# Every ggpo process (the CLI, workers, torchrun ranks, Ray workers, tests) imports this first.
from pipeline.core import kernels as _kernels  # noqa: E402

_kernels.pin_environment()
