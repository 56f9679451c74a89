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
"""
from __future__ import annotations

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


def install() -> None:
    """After `import prefect`, before the flow runs: see the module docstring."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    import prefect.flow_engine as engine
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    propose = engine.propose_state_sync

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
    engine.propose_state_sync = propose_state_sync

    handle_batch = APILogWorker._handle_batch

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
    APILogWorker._handle_batch = _handle_batch  # type: ignore[method-assign]

    handle = EventsWorker._handle

    async def _handle_event(self, event):
        if _DOWN.is_set():
            self._context_cache.pop(event.id, None)
            return
        try:
            await handle(self, event)
        except Exception as exc:
            if connection_error(exc) and gone():
                mark_down(exc)
                return
            raise
    EventsWorker._handle = _handle_event  # type: ignore[method-assign]

    from prefect.events.clients import PrefectEventsClient
    reconnect = PrefectEventsClient._reconnect

    async def _reconnect(self):     # an event being sent when the server went: no more attempts
        if _DOWN.is_set():
            raise ServerGone(f"the Prefect server at {api_url()} is down")     # not an OSError: no retry
        await reconnect(self)
    PrefectEventsClient._reconnect = _reconnect  # type: ignore[method-assign]

    from prefect.client.base import PrefectHttpxAsyncClient, PrefectHttpxSyncClient
    for cls in (PrefectHttpxAsyncClient, PrefectHttpxSyncClient):
        _fail_fast(cls)

    quiet = _Quiet()
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
                                       if name.startswith("prefect")]
    for handler in {h for lg in loggers for h in lg.handlers}:     # prefect._internal does not propagate
        handler.addFilter(quiet)


def _fail_fast(cls) -> None:
    """Once the server is gone, a call to it fails at once (no retries, no timeout): the
    callers that can do without it (artifacts, progress) carry on."""
    import inspect

    import httpx
    send = cls.send
    if inspect.iscoroutinefunction(send):
        async def async_send(self, request, *args, **kwargs):
            if _DOWN.is_set() and _ours(request):
                raise httpx.ConnectError(f"the Prefect server at {api_url()} is down", request=request)
            return await send(self, request, *args, **kwargs)
        cls.send = async_send
    else:
        def sync_send(self, request, *args, **kwargs):
            if _DOWN.is_set() and _ours(request):
                raise httpx.ConnectError(f"the Prefect server at {api_url()} is down", request=request)
            return send(self, request, *args, **kwargs)
        cls.send = sync_send


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
