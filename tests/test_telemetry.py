"""MLflow's telemetry thread is off in every ggpo process, outside pytest and CI too.

Offline, its config fetch fails and its thread unsets an environment variable while the run's
threads read os.environ: a user's `ggpo run` with tracking on failed with
KeyError('_MLFLOW_TELEMETRY_SESSION_ID'). MLflow turns telemetry off by itself under pytest
and CI (PYTEST_CURRENT_TEST, CI, ...), so the child here runs without those variables, as a
user's shell does."""
import os
import subprocess
import sys

from conftest import REPO

# is_telemetry_disabled(): MLflow's own verdict from the environment (not a race with its thread)
PROBE = ("import pipeline, mlflow\n"
         "from mlflow.telemetry.utils import is_telemetry_disabled\n"
         "print(is_telemetry_disabled())\n")


def _user_env(**extra: str) -> dict[str, str]:
    """This environment without what makes MLflow turn telemetry off by itself: the CI and
    pytest markers its _is_ci_env_or_testing reads (taken from its source, so a CI that sets
    another one is covered) and the two switches."""
    import inspect
    import re

    from mlflow.telemetry import utils
    markers = set(re.findall(r'"([A-Z][A-Z0-9_]+)"', inspect.getsource(utils._is_ci_env_or_testing)))
    assert {"CI", "PYTEST_CURRENT_TEST"} <= markers
    markers |= {"MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK"}
    return {k: v for k, v in os.environ.items() if k not in markers} | extra


def test_importing_pipeline_turns_mlflow_telemetry_off():
    res = subprocess.run([sys.executable, "-c", PROBE], env=_user_env(), cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "True"


def test_without_the_setting_mlflow_would_start_it():
    """The probe can fail: importing mlflow alone, outside pytest and CI, starts telemetry."""
    probe = PROBE.replace("import pipeline, mlflow", "import mlflow")
    res = subprocess.run([sys.executable, "-c", probe], env=_user_env(), cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "False"
