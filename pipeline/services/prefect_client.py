"""When the Prefect server goes away mid-run (a crash, a redeploy, a laptop asleep), the run
does not wait on it: its stages go on (their results are in the content-addressed store and
MLflow, never only in Prefect), ggpo says so in one line, and the flow run's own outcome is
the exit code. `ggpo up` / `ggpo status` later tell the restarted server how the run ended.

- `CLIENT_SETTINGS`: bounded retries for Prefect's HTTP client (2 quick ones, ~6 s a call,
  instead of 5 with exponential back-off: a minute a call); set before `import prefect`.
- `install()`: once the server does not answer (a call fails and its /health does not
  answer either), one warning line; from then on, for the rest of the process, the flow
  engine's state changes are kept locally instead of proposed (the run ends with its own
  state), logs and events for the API are dropped instead of retried one by one (Prefect's
  per-event "Unable to connect" / "EventsWorker failed" / "Error logging to API" noise, and
  minutes of draining at exit), and the flow run's last state is written to
  $GGPO_HOME/prefect/unreported/<flow run id>.json.
- `report_unreported()`: sends those states once the server answers again (`ggpo up`,
  `ggpo status`), so the UI shows the run Completed (or Failed), not stuck Running.

Prefect's internals. `install()` replaces six of Prefect's own functions (PATCHED), written
against Prefect 3.9.1; pyproject pins `prefect>=3.9,<3.10`. At start it checks each target:
one that is missing, or whose parameters (names, kinds, defaults, sync or async) differ
from the recorded ones, is left as Prefect has it (Prefect's own outage behavior: retries
and its own log lines) and named in one warning; the others are still replaced.
tests/test_private_api.py fails on any such difference, and on the other private APIs the
project replaces (cli.py's temporary server).
"""
from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from pipeline.core import paths
from pipeline.services import servers

# ~6 s a failing call (2 s, 4 s back-off, 20% jitter) instead of Prefect's 5 retries (~62 s)
CLIENT_SETTINGS = {"PREFECT_CLIENT_MAX_RETRIES": "2", "PREFECT_CLIENT_RETRY_JITTER_FACTOR": "0.2",
                   "PREFECT_API_REQUEST_TIMEOUT": "30"}

# "module:attribute.path" -> the shape (shape()) of what install() replaces there
PATCHED = {
    "prefect.flow_engine:propose_state_sync": "(client, state, flow_run_id, force=False)",
    "prefect.logging.handlers:APILogWorker._handle_batch": "async (self, items)",
    "prefect.events.worker:EventsWorker._handle": "async (self, event)",
    "prefect.events.clients:PrefectEventsClient._reconnect": "async (self)",
    "prefect.client.base:PrefectHttpxAsyncClient.send": "async (self, request, *args, **kwargs)",
    "prefect.client.base:PrefectHttpxSyncClient.send": "(self, request, *args, **kwargs)",
}
TESTED_ON = "3.9.1"
_REPLACED: dict[str, Any] = {}      # target -> Prefect's own function, once install() replaced it

_DOWN = threading.Event()
_LOCK = threading.Lock()
_INSTALLED: list[bool] = []


class ServerGone(Exception):
    """Raised in Prefect's events client once the server is known to be gone."""


def settings() -> None:
    """Bounded retries for Prefect's client (unless set): call before `import prefect`."""
    for k, v in CLIENT_SETTINGS.items():
        os.environ.setdefault(k, v)


def down() -> bool:
    """Whether this process has seen its Prefect server stop answering."""
    return _DOWN.is_set()


def api_url() -> str:
    return os.environ.get("PREFECT_API_URL", "")


def unreported_dir() -> Path:
    return paths.state_dir() / "prefect" / "unreported"


def connection_error(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) says the server did not answer."""
    import httpx
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (httpx.TransportError, ConnectionError, OSError, ServerGone)):
            return True
        if type(exc).__name__ in ("ConnectionClosed", "ConnectionClosedError", "InvalidStatus", "InvalidHandshake"):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def gone() -> bool:
    """Whether the server is down now: marked so, or its /health does not answer."""
    if _DOWN.is_set():
        return True
    url = api_url()
    return bool(url) and not servers.healthy(f"{url.rstrip('/')}/health")


def mark_down(why: BaseException | str | None = None) -> None:
    """Say it once, then stop talking to the server for the rest of the process."""
    with _LOCK:
        if _DOWN.is_set():
            return
        _DOWN.set()
    try:
        from prefect.events.clients import NullEventsClient
        from prefect.events.worker import EventsWorker
        EventsWorker.set_client_override(NullEventsClient)     # new emits go nowhere, at once
    except Exception:       # noqa: BLE001 - silencing must never fail the run
        pass
    # not print(): inside a flow (log_prints) that would become one of Prefect's log records
    then = "; `ggpo up` restarts it and records how this run ended" if own_server() else ""
    sys.stderr.write(f"ggpo: warning: the Prefect server at {api_url()} stopped answering; the run goes on without "
                     f"it (results are in the cache and MLflow{then})\n")
    sys.stderr.flush()


def noticed(exc: BaseException) -> bool:
    """For callers that do without the server (artifacts, progress): whether `exc` says it
    is gone; if so it is marked gone (said once), so the run stops waiting on it."""
    if _DOWN.is_set():
        return True
    if connection_error(exc) and gone():
        mark_down(exc)
        return True
    return False


def own_server() -> bool:
    """Whether the API in use is the Prefect server `ggpo up` started for this state folder."""
    ours = servers.read_state().get("urls", {}).get("prefect_api", "")
    return bool(ours) and ours.rstrip("/") == api_url().rstrip("/")


def record(flow_run_id: Any, state) -> None:
    """Keep the flow run's latest state for the server to learn later (last one wins);
    only for `ggpo up`'s server (a temporary one does not come back)."""
    if not own_server():
        return
    folder = unreported_dir()
    folder.mkdir(parents=True, exist_ok=True)
    entry = {"flow_run_id": str(flow_run_id), "api_url": api_url(), "type": state.type.value,
             "name": state.name, "message": state.message or ""}
    path = folder / f"{flow_run_id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entry, indent=2))
    tmp.replace(path)


class _Quiet(logging.Filter):
    """Drops Prefect's records about failing to reach its server once it is gone (the first
    one marks it gone: one line of ours instead)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("prefect"):
            return True
        if _DOWN.is_set() and record.levelno < logging.CRITICAL and _about_the_server(record):
            return False
        if record.levelno >= logging.WARNING and _about_the_server(record) and gone():
            mark_down()
            return False
        return True


_NOISE = ("Unable to connect", "EventsWorker", "APILogWorker", "Error logging to API", "Connect", "connection",
          "Still processing items", "failed to process", "ConnectError", "All connection attempts failed")


def _about_the_server(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    if exc is not None and connection_error(exc):
        return True
    try:
        text = record.getMessage()
    except Exception:       # noqa: BLE001
        text = str(record.msg)
    return any(n in text for n in _NOISE)


def shape(fn) -> str:
    """What the patches rely on of a callable: its parameters' names, kinds and defaults,
    and whether it is a coroutine function, e.g. "async (self, request, *args, **kwargs)"."""
    out, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind == p.KEYWORD_ONLY and not star:
            out.append("*")
        star = star or p.kind in (p.VAR_POSITIONAL, p.KEYWORD_ONLY)
        marks: dict[Any, str] = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}
        text = marks.get(p.kind, "") + p.name
        out.append(text if p.default is p.empty else f"{text}={p.default!r}")
    return ("async " if inspect.iscoroutinefunction(fn) else "") + f"({', '.join(out)})"


def resolve(target: str) -> Any:
    """The object at "module:attribute.path" (None when the module or an attribute is missing)."""
    module, _, path = target.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError:
        return None
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def target_problems(recorded: dict[str, str]) -> dict[str, str]:
    """{target: what is wrong} for each target of `recorded` that is missing or has another
    shape (Prefect's own function, also after install() replaced it)."""
    out = {}
    for target, expected in recorded.items():
        fn = _REPLACED.get(target) or resolve(target)
        if fn is None:
            out[target] = "is missing"
            continue
        try:
            got = shape(fn)
        except (TypeError, ValueError):
            got = "no signature"
        if got != expected:
            out[target] = f"is {got}, not {expected}"
    return out


def _replace(target: str, make) -> None:
    """Put `make(original)` at `target` (a module function or a class attribute)."""
    module, _, path = target.partition(":")
    owner_path, _, name = path.rpartition(".")
    owner = resolve(f"{module}:{owner_path}") if owner_path else importlib.import_module(module)
    original = getattr(owner, name)
    _REPLACED[target] = original
    setattr(owner, name, make(original))


def install() -> None:
    """After `import prefect`, before the flow runs: see the module docstring. Targets that
    changed shape (target_problems) keep Prefect's own behavior, said in one warning."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    problems = target_problems(PATCHED)
    if problems:
        import prefect
        said = "; ".join(f"{t} {why}" for t, why in problems.items())
        sys.stderr.write(f"ggpo: warning: Prefect {prefect.__version__} is not the version ggpo's handling of a "
                         f"Prefect outage was written for ({TESTED_ON}): {said}; Prefect's own behavior is kept "
                         f"there (pyproject pins prefect>=3.9,<3.10)\n")
    makers = {"prefect.flow_engine:propose_state_sync": _propose_state_sync,
              "prefect.logging.handlers:APILogWorker._handle_batch": _handle_batch,
              "prefect.events.worker:EventsWorker._handle": _handle_event,
              "prefect.events.clients:PrefectEventsClient._reconnect": _reconnect,
              "prefect.client.base:PrefectHttpxAsyncClient.send": _async_send,
              "prefect.client.base:PrefectHttpxSyncClient.send": _sync_send}
    for target, make in makers.items():
        if target not in problems:
            _replace(target, make)
    quiet = _Quiet()
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
                                       if name.startswith("prefect")]
    for handler in {h for lg in loggers for h in lg.handlers}:     # prefect._internal does not propagate
        handler.addFilter(quiet)


def _propose_state_sync(propose):
    def propose_state_sync(client, state, flow_run_id, force: bool = False):
        if not _DOWN.is_set():
            try:
                return propose(client, state, flow_run_id=flow_run_id, force=force)
            except Exception as exc:
                if not (connection_error(exc) and gone()):
                    raise
                mark_down(exc)
        record(flow_run_id, state)      # the run goes on with its own state, for `ggpo up` to report
        return state
    return propose_state_sync


def _handle_batch(handle_batch):
    async def _handle_batch(self, items):
        if _DOWN.is_set():
            return          # the server is gone: the logs are in the terminal (and MLflow)
        try:
            await self._client.request("POST", "/logs/", content=b"[" + b",".join(items) + b"]",
                                       headers={"Content-Type": "application/json"})
        except Exception as exc:
            if connection_error(exc) and gone():
                mark_down(exc)
                return
            await handle_batch(self, items)     # Prefect's own handling (and message) of other errors
    return _handle_batch


def _handle_event(handle):
    async def _handle_event(self, event):
        if _DOWN.is_set():
            getattr(self, "_context_cache", {}).pop(event.id, None)
            return
        try:
            await handle(self, event)
        except Exception as exc:
            if connection_error(exc) and gone():
                mark_down(exc)
                return
            raise
    return _handle_event


def _reconnect(reconnect):
    async def _reconnect(self):     # an event being sent when the server went: no more attempts
        if _DOWN.is_set():
            raise ServerGone(f"the Prefect server at {api_url()} is down")     # not an OSError: no retry
        await reconnect(self)
    return _reconnect


# Once the server is gone, a call to it fails at once (no retries, no timeout): the callers
# that can do without it (artifacts, progress) carry on.
def _async_send(send):
    import httpx

    async def async_send(self, request, *args, **kwargs):
        if _DOWN.is_set() and _ours(request):
            raise httpx.ConnectError(f"the Prefect server at {api_url()} is down", request=request)
        return await send(self, request, *args, **kwargs)
    return async_send


def _sync_send(send):
    import httpx

    def sync_send(self, request, *args, **kwargs):
        if _DOWN.is_set() and _ours(request):
            raise httpx.ConnectError(f"the Prefect server at {api_url()} is down", request=request)
        return send(self, request, *args, **kwargs)
    return sync_send


def _ours(request) -> bool:
    url = api_url()
    return bool(url) and str(request.url).startswith(url.rstrip("/"))


def report_unreported() -> list[str]:
    """Send the states kept while the server was gone to the server now up (this state
    folder's, `ggpo up`'s); returns one line per flow run reported. Records of another
    server, or that it refuses, are left for the next time."""
    folder = unreported_dir()
    entries = sorted(folder.glob("*.json")) if folder.exists() else []
    url = servers.ours("prefect")
    if not entries or not url:
        return []
    os.environ["PREFECT_API_URL"] = url
    settings()
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.objects import StateType
    from prefect.states import State
    lines = []
    with get_client(sync_client=True) as client:
        for path in entries:
            entry = json.loads(path.read_text())
            if entry.get("api_url", url).rstrip("/") != url.rstrip("/"):
                continue
            try:
                kind = StateType(entry["type"])
                run = client.read_flow_run(entry["flow_run_id"])
                if run.state is None or not run.state.is_final() or run.state.type != kind:
                    client.set_flow_run_state(entry["flow_run_id"], State(type=kind, name=entry["name"],
                                                                         message=entry["message"]), force=True)
                if kind == StateType.COMPLETED:     # its stages all finished (the flow waits on each)
                    flow_runs = FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))
                    for task_run in client.read_task_runs(flow_run_filter=flow_runs):
                        if task_run.state is None or not task_run.state.is_final():
                            client.set_task_run_state(task_run.id, State(type=kind, name=entry["name"]), force=True)
            except Exception as exc:    # noqa: BLE001 - left for the next `ggpo up` / `ggpo status`
                lines.append(f"flow run {entry['flow_run_id']}: not recorded yet ({type(exc).__name__}: {exc})")
                continue
            path.unlink(missing_ok=True)
            lines.append(f"flow run {run.name} ({entry['flow_run_id']}): recorded {entry['name']} "
                         f"(it ended while the server was down)")
    return lines
