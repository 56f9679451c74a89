"""The private APIs of our dependencies that the project replaces stay what the
replacements were written against (Prefect 3.9). pyproject keeps prefect>=3.4,<4, because
vLLM 0.33's GPU stack does not resolve with 3.9; so every patched target's signature is
checked here and by install() at every run's start, which keeps Prefect's own behavior, with
one warning, where one differs: a fresh install that resolves to another version fails here
instead of silently losing the outage handling.

Replaced, found by grepping pipeline/, stages/, flows/, benchmarks/, scripts/ for `_`-prefixed
attributes of prefect, mlflow, transformers, torch and vllm that are assigned, overridden or
patched:
- pipeline/services/prefect_client.py `install()`: six of Prefect's functions (PATCHED);
- pipeline/cli.py `detached_server`: a subclass overrides Prefect's
  `SubprocessASGIServer._run_uvicorn_command` and patches `subprocess.Popen` as the server
  module sees it.
Relied on, not replaced (covered too): `APILogWorker._client` and
`EventsWorker._context_cache` (the replacements use them) and MLflow's
`Dataset._to_mlflow_entity` (pipeline/services/tracking.py log_pool_dataset).
Cost: imports only (Prefect, MLflow's dataset module), ~1 s once they are loaded."""
from __future__ import annotations

import inspect
import re
import tomllib
from importlib.metadata import version

import pytest

from pipeline.services import prefect_client
from pipeline.services.prefect_client import PATCHED, resolve, shape, target_problems

from conftest import REPO

# what the project's other replacements and calls rely on, shaped as prefect_client.shape says
OTHERS = {
    "prefect.server.api.server:SubprocessASGIServer._run_uvicorn_command": "(self)",
    "prefect.server.api.server:SubprocessASGIServer.stop": "(self)",
    "mlflow.data.polars_dataset:PolarsDataset._to_mlflow_entity": "(self)",
}


@pytest.mark.parametrize("target", sorted(PATCHED))
def test_every_prefect_function_install_replaces_has_the_recorded_signature(target):
    fn = prefect_client._REPLACED.get(target) or resolve(target)       # Prefect's own, also once replaced
    assert fn is not None, f"{target} is missing in Prefect {version('prefect')}"
    assert shape(fn) == PATCHED[target], f"{target}: Prefect {version('prefect')} has {shape(fn)}"


@pytest.mark.parametrize("target", sorted(OTHERS))
def test_the_other_private_apis_the_project_replaces_have_the_recorded_signature(target):
    fn = resolve(target)
    assert fn is not None, f"{target} is missing"
    assert shape(fn) == OTHERS[target], f"{target} is {shape(fn)}"


def test_the_replaced_functions_are_still_where_prefect_calls_them():
    """A replacement nobody calls is a silent no-op: the flow engine calls propose_state_sync
    by its module-level name, the temporary server is started through the server module's
    `subprocess.Popen`, and the attributes the replacements use are set where they were."""
    import prefect.flow_engine as flow_engine
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api import server
    assert re.search(r"\bpropose_state_sync\(", inspect.getsource(flow_engine))
    assert "subprocess.Popen(" in inspect.getsource(server.SubprocessASGIServer._run_uvicorn_command)
    assert hasattr(server.subprocess, "Popen") and hasattr(server, "subprocess_server_logger")
    assert "self._context_cache" in inspect.getsource(EventsWorker.__init__)
    assert "self._client" in inspect.getsource(APILogWorker)


def test_the_installed_prefect_is_the_one_the_patches_were_written_for():
    """The range stays wide (vLLM 0.33's GPU stack does not resolve with prefect 3.9,
    tests/test_gpu_stack.py); what `make install` resolves to here is the version the patches
    were written and tested on, and any other meets install()'s signature check (below)."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "prefect>=3.4,<4" in deps
    assert version("prefect").startswith("3.9.") and prefect_client.TESTED_ON.startswith("3.9.")


def test_a_changed_or_missing_target_keeps_prefects_own_behavior_with_one_warning(monkeypatch, capsys):
    """install() with one target recorded differently (as if Prefect had changed it) and one
    that does not exist: those two are left alone, said in one warning line; the rest are
    replaced. Run on copies of the state install() keeps, so the process's Prefect is as it was."""
    import prefect.flow_engine as flow_engine
    from prefect.events.clients import PrefectEventsClient
    from prefect.events.worker import EventsWorker
    changed = "prefect.flow_engine:propose_state_sync"
    recorded = dict(PATCHED) | {changed: "(client, state)", "prefect.flow_engine:gone_in_4_0": "(self)"}
    assert set(target_problems(recorded)) == {changed, "prefect.flow_engine:gone_in_4_0"}
    monkeypatch.setattr(prefect_client, "PATCHED", recorded)
    monkeypatch.setattr(prefect_client, "_INSTALLED", [])
    monkeypatch.setattr(prefect_client, "_REPLACED", {})
    for owner, name in ((flow_engine, "propose_state_sync"), (EventsWorker, "_handle"),
                        (PrefectEventsClient, "_reconnect")):
        monkeypatch.setattr(owner, name, getattr(owner, name))      # restored after the test
    from prefect.client.base import PrefectHttpxAsyncClient, PrefectHttpxSyncClient
    from prefect.logging.handlers import APILogWorker
    for client in (PrefectHttpxAsyncClient, PrefectHttpxSyncClient):
        monkeypatch.setattr(client, "send", client.send)
    monkeypatch.setattr(APILogWorker, "_handle_batch", APILogWorker._handle_batch)
    before = flow_engine.propose_state_sync
    prefect_client.install()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ggpo: warning: Prefect "), lines
    assert f"{changed} is (client, state, flow_run_id, force=False), not (client, state)" in lines[0]
    assert "prefect.flow_engine:gone_in_4_0 is missing" in lines[0]
    assert flow_engine.propose_state_sync is before                      # Prefect's own, untouched
    assert EventsWorker._handle is not prefect_client._REPLACED["prefect.events.worker:EventsWorker._handle"]
    assert set(prefect_client._REPLACED) == set(PATCHED) - {changed}


def test_shape_tells_apart_what_the_patches_rely_on():
    """shape() sees a renamed parameter, a new default, sync versus async: the check can fail."""
    def a(client, state, flow_run_id, force=False): ...
    def b(client, state, run_id, force=False): ...
    def c(client, state, flow_run_id, force=True): ...
    async def d(client, state, flow_run_id, force=False): ...
    def e(client, state, flow_run_id, *, force=False): ...
    shapes = [shape(f) for f in (a, b, c, d, e)]
    assert shapes[0] == PATCHED["prefect.flow_engine:propose_state_sync"]
    assert len(set(shapes)) == 5 and shapes[4] == "(client, state, flow_run_id, *, force=False)"
