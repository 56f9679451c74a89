"""The `ggpo` command line.

  ggpo up | down | status                 background Prefect + MLflow servers and the deployment
  ggpo env                                export lines pointing the prefect CLI and MLflow clients at them
  ggpo run offline [--preset P] [--set k=v ...] [--force STAGE ...]   the flow, in-process
  ggpo run online [--preset P] ...        the online loop (Algorithm 1; default preset tiny-online)
  ggpo run corrections [--preset P] ...   every method on the staleness ladder and the fixed pool
                                          (default preset corrections): report/corrections.md/.csv/.png
  ggpo run offline --deployment           the same, as a run of the served deployment ggpo/offline
  ggpo stage NAME [--preset P] [--set k=v ...] [--force]  one stage from cached inputs
  ggpo pool import SOURCE [--split S] [--map FIELD=COLUMN ...] [--trust-rewards]  a pool you already have
  ggpo stage score --model PATH ...       behavior log-probs for an imported pool, from a named model
  ggpo cache ls                           artifacts: stage, key, rows, size, created
  ggpo cache verify                       re-hash every artifact against its manifest
  ggpo cache gc [--yes] [--all] [--unreferenced]  remove interrupted builds and unreachable artifacts
  ggpo --debug ...                        show the traceback of an expected error too
  ggpo report [--preset P] [--set k=v ...]  stage timings and the comparison table, from the cache
  ggpo report --preset corrections [--save DIR] [--merge DIR ...]  the table into a results folder;
                                          the table of results folders of distinct seeds
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable, cast

from pydantic import ValidationError

from pipeline.core import interrupt, kernels, paths
from pipeline.core.config import PRESET_DIR, load_config, parse_overrides, preset_names
from pipeline.core.errors import (
    BenchmarkError,
    ConfigError,
    DatasetError,
    DiskFull,
    ExpectedError,
    NonFiniteUpdate,
    PoolError,
    drop_expected_traceback,
)
from pipeline.core.methods import METHODS
from pipeline.core.store import Store, gc_plan, verify_all
from pipeline.dag import graph, spec
from pipeline.reports import offline, online
from pipeline.services import prefect_client, servers, tracking
from pipeline.tasks import grading, pool_source


def _config_args(p: argparse.ArgumentParser, default: str | None = "tiny") -> None:
    p.add_argument("--preset", default=default, help=f"one of: {', '.join(preset_names())}"
                   + ("" if default else " (default: tiny for offline, tiny-online for online)"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.lr=1e-5 (repeatable)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ggpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debug", action="store_true", help="show tracebacks of expected errors too")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start Prefect, MLflow and the deployment server")
    up.add_argument("--prefect-port", type=int, default=None)
    up.add_argument("--mlflow-port", type=int, default=None)
    sub.add_parser("down", help="stop them")
    sub.add_parser("env", help="print the export lines that point the prefect CLI and MLflow clients at ggpo's "
                               "servers: eval \"$(ggpo env)\"")
    sub.add_parser("status", help="are they up and healthy")
    run = sub.add_parser("run", help="run a flow in this process")
    run.add_argument("flow", choices=["offline", "online", "corrections"])
    _config_args(run, default=None)
    run.add_argument("--force", nargs="*", default=[], metavar="STAGE", help="stages to recompute")
    run.add_argument("--deployment", action="store_true",
                     help="run it as the served deployment ggpo/<flow> (after ggpo up), with its logs here; "
                          "Ctrl-C cancels the Prefect run, which stops at safe points")
    st = sub.add_parser("stage", help="run one stage from the cached artifacts of its inputs")
    st.add_argument("name", choices=graph.STAGE_NAMES + ("online",),
                    help="a stage, or `online`: one online cell, every round (the cell of --preset/--set)")
    _config_args(st)
    st.add_argument("--force", action="store_true", help="recompute even if cached")
    st.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    st.add_argument("--model", metavar="PATH", help="stage score: the model folder whose teacher-forced log-probs "
                    "become an imported pool's behavior log-probs (= --set pool.score_model=PATH)")
    pool = sub.add_parser("pool", help="bring your own pool: completions you already have")
    pool_sub = pool.add_subparsers(dest="action", required=True)
    imp = pool_sub.add_parser("import", help="build a training pool from a Parquet/JSONL file or a dataset id")
    imp.add_argument("source", help="a .parquet or .jsonl file, a folder saved by datasets, or a dataset id")
    imp.add_argument("--split", help="the dataset's split (dataset ids and saved folders; default train)")
    imp.add_argument("--map", dest="mapping", action="append", default=[], metavar="FIELD=COLUMN",
                     help="read our FIELD from your COLUMN, e.g. --map problem=question --map responses=generations "
                          "--map rewards=correctness (repeatable; = pool.map)")
    imp.add_argument("--trust-rewards", action="store_true",
                     help="keep the given rewards instead of grading every response with math-verify")
    _config_args(imp)
    imp.add_argument("--force", action="store_true", help="rebuild even if cached")
    imp.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    cache = sub.add_parser("cache", help="inspect the artifact store")
    cache.add_argument("action", choices=["ls", "verify", "gc"],
                       help="ls: list; verify: re-hash all files (exit 2 if any is damaged); "
                            "gc: what to remove (dry run unless --yes)")
    cache.add_argument("--yes", action="store_true", help="gc: really delete")
    cache.add_argument("--all", action="store_true", help="gc: also interrupted training runs that could resume")
    cache.add_argument("--unreferenced", action="store_true",
                       help="gc: also artifacts that lead to no result (trained policy or evaluation) and that "
                            "no preset's experiment expects: pools nobody trained on, rounds that led to no policy")
    rep = sub.add_parser("report", help="stage timings and the comparison table of the cached experiment")
    _config_args(rep)
    rep.add_argument("--save", type=Path, metavar="DIR",
                     help="corrections flow: write the table (corrections.md/.csv/.png) and its results folder "
                          "(the four frames it is computed from, Parquet) to DIR")
    rep.add_argument("--merge", type=Path, nargs="+", metavar="DIR",
                     help="corrections flow: the table of these results folders (distinct seeds of one "
                          "experiment: other runs' report folders or --save folders) instead of the cache")
    for command in sub.choices.values():     # `ggpo stage X --debug` works as well as `ggpo --debug stage X`
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return ap


def cmd_up(args) -> int:
    state = servers.up(args.prefect_port, args.mlflow_port)
    word = "already up" if state.get("already_up") else "up"
    print(f"ggpo services {word} (state: {paths.state_dir()})")
    print(f"  Prefect UI: {state['urls']['prefect_ui']}\n  MLflow UI:  {state['urls']['mlflow']}")
    print(f"  MLflow runs and charts: {tracking.experiment_link(state['urls']['mlflow'])} (offline)\n"
          f"                          {tracking.experiment_link(state['urls']['mlflow'], 'online')} (online)")
    print("  deployments: ggpo/offline, ggpo/online, ggpo/corrections  (prefect deployment run ggpo/offline --watch)")
    print_exports(state)
    print_unreported()
    return 0


def print_unreported() -> None:
    """Flow runs that ended while the Prefect server was down: their end, told to it now."""
    for line in prefect_client.report_unreported():
        print(f"  {line}")


def print_exports(state: dict) -> None:
    """The prefect CLI reads prefect.toml (port 4200) and knows nothing of other ports."""
    if state["ports"]["prefect"] != paths.DEFAULT_PORTS["prefect"] or state["ports"]["mlflow"] != paths.DEFAULT_PORTS["mlflow"]:
        print("  other ports than 4200/5000: in another shell, before `prefect deployment run ...`:\n    "
              + "\n    ".join(servers.exports()) + "\n  (or: eval \"$(ggpo env)\")")


def cmd_env(args) -> int:
    lines = servers.exports()
    if not lines:
        print("ggpo: no servers recorded here (ggpo up starts them)", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


def cmd_status(args) -> int:
    state = servers.status()
    if not state:
        print("ggpo services are down (ggpo up starts them)")
        return 1
    for name, s in state["services"].items():
        print(f"  {name:8s} pid {s['pid']:>7}  {'healthy' if s['healthy'] else 'NOT healthy'}")
    print(f"  Prefect UI: {state['urls']['prefect_ui']}\n  MLflow UI:  {state['urls']['mlflow']}")
    print_exports(state)
    if state["services"].get("prefect", {}).get("healthy"):
        print_unreported()
    return 0 if all(s["healthy"] for s in state["services"].values()) else 1


DEFAULT_PRESET = {"offline": "tiny", "online": "tiny-online", "corrections": "corrections"}
# what a flow is checked as (preflight): the corrections flow's cells are online cells
CHECKED_AS = {"corrections": "online"}


def cmd_run(args) -> int:
    args.preset = args.preset or DEFAULT_PRESET[args.flow]
    from pipeline.dag.preflight import check_run
    # config, data and every prerequisite before any server, worker or model starts: a bad
    # --set or task file answers in seconds, with nothing of Prefect's after it
    check_run(CHECKED_AS.get(args.flow, args.flow), args.preset, _overrides(args), args.force)
    if args.deployment:
        return run_deployment(args)
    # Prefect's state and result pickles under $GGPO_HOME, not ~/.prefect
    os.environ.setdefault("PREFECT_HOME", str(paths.state_dir() / "prefect"))
    os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(paths.state_dir() / "prefect" / "storage"))
    prefect_client.settings()    # bounded client retries: read once, at `import prefect`
    prefect_ready = ensure_prefect_api()
    # while a temporary Prefect server starts (~20 s here, its own process): the flow's imports
    # and MLflow's first use of a new SQLite file (its tables, ~10 s), which the flow would
    # otherwise do after the server answers
    if args.flow == "online":
        from flows.online import ggpo_online as ggpo
    elif args.flow == "corrections":
        from flows.corrections import ggpo_corrections as ggpo
    else:
        from flows.offline import ggpo
    tracking.prepare(tracking.EXPERIMENTS[args.flow])
    prefect_ready()
    prefect_client.install()     # a server that goes away mid-run: one line, the run goes on
    if not args.debug:
        for name in ("prefect.task_runs", "prefect.flow_runs"):
            logging.getLogger(name).addFilter(drop_expected_traceback)
    spec.clear_failures()
    interrupt.reset()
    try:
        result = ggpo(preset=args.preset, overrides=_overrides(args), force=args.force)
    except Exception as exc:
        if interrupt.requested():       # the flow ended Cancelled: its stages stopped at safe points
            return interrupted()
        # the flow fails on "upstream task did not complete": name the stage failure behind it
        from pipeline.dag import placement  # stage failures on Ray workers (experiment.task_runner=ray)
        cause = next((e for _, e in spec.failures() + placement.failures() if expected_error(e) is not None), None)
        if cause is None or expected_error(exc) is not None:
            raise
        raise cause from exc
    print(result["table"])
    print(json.dumps(result["summary"], indent=2))
    print(f"report files: {result['report_folder']}")
    print(f"MLflow parent run: {result['mlflow_link'] or result['mlflow_parent_run_id']}")
    return 0


def run_deployment(args) -> int:
    """The served deployment ggpo/<flow>, watched from here: its logs (the stages' progress)
    as they come, and on Ctrl-C the Prefect run is cancelled; the serve process then stops
    it at its safe points (SIGTERM: pipeline/core/interrupt.py) and it ends Cancelled."""
    state = servers.status()
    if not state:
        raise servers.ServiceError("ggpo run --deployment needs the servers and the deployment: run `ggpo up` first")
    sick = servers.not_healthy(state)
    if sick:
        raise servers.ServiceError(f"ggpo run --deployment: {sick}")
    os.environ["PREFECT_API_URL"] = state["urls"]["prefect_api"]
    prefect_client.settings()
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import FlowRun
    from prefect.deployments import run_deployment as start
    params = {"preset": args.preset, "overrides": _overrides(args), "force": args.force}
    # called from sync code it returns the FlowRun (prefect's async_dispatch types the coroutine too)
    run = cast(FlowRun, start(f"ggpo/{args.flow}", parameters=params, timeout=0))
    print(f"flow run {run.name}: {state['urls']['prefect_ui']}/runs/flow-run/{run.id}", flush=True)
    with get_client(sync_client=True) as client, interrupt.handlers():
        final = watch_flow_run(client, run.id, state["pids"].get("serve"))
    if final.is_cancelled():
        print(f"ggpo: {(final.message or '').removeprefix('ggpo: ') or 'cancelled'}", file=sys.stderr)
        return interrupt.EXIT_CODE
    if not final.is_completed():
        print(f"ggpo: flow run {run.name} ended {final.name}: {final.message}", file=sys.stderr)
        return 1
    return 0


def watch_flow_run(client, run_id, serve_pid: int | None = None):
    """Print the run's logs until it ends (cancelling it once a stop is requested here).
    A serve process (`serve_pid`) or Prefect server that goes away meanwhile ends the watch
    with one line that says so."""
    try:
        return _watch_flow_run(client, run_id, serve_pid)
    except Exception as exc:
        if not prefect_client.connection_error(exc):
            raise
        raise servers.ServiceError(f"the Prefect server at {os.environ.get('PREFECT_API_URL')} stopped answering "
                                    f"while this command watched flow run {run_id}; `ggpo up` restarts it "
                                    f"(see {paths.state_dir() / 'logs' / 'prefect.log'})") from None


def _watch_flow_run(client, run_id, serve_pid: int | None):
    import time

    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.states import Cancelling
    seen, cancelling = 0, False
    while True:
        if interrupt.requested() and not cancelling:
            client.set_flow_run_state(run_id, Cancelling(message="Ctrl-C in ggpo run --deployment"), force=True)
            cancelling = True
        flow_run = client.read_flow_run(run_id)
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), offset=seen,
                                sort=LogSort.TIMESTAMP_ASC)
        for entry in logs:
            print(f"{entry.timestamp:%H:%M:%S} {entry.message}", flush=True)
        seen += len(logs)
        if flow_run.state is not None and flow_run.state.is_final():
            return flow_run.state
        if serve_pid and not servers.alive(serve_pid):
            raise servers.ServiceError(f"{servers.WHAT['serve']} (pid {serve_pid}) is gone, so flow run "
                                        f"{flow_run.name} stays {flow_run.state_name}; `ggpo up` restarts it "
                                        f"(see {paths.state_dir() / 'logs' / 'serve.log'})")
        time.sleep(1.0)


def interrupted() -> int:
    """One line for an interrupted command, last; the graders and a temporary Prefect server
    (which outlived the run's own shutdown to record it Cancelled) stop first."""
    grading.close_pool()
    if _TEMPORARY_SERVER:      # what Prefect still has to send goes out before its server stops
        drain_prefect()
    for server in _TEMPORARY_SERVER:
        server.stop()
    print(f"ggpo: {interrupt.summary()}", file=sys.stderr)
    return interrupt.EXIT_CODE


def _overrides(args) -> dict:
    return parse_overrides(args.overrides)


def ensure_prefect_api() -> Callable[[], None]:
    """Use $PREFECT_API_URL when it answers, else the server `ggpo up` started (its port is
    recorded, so a new shell finds it), else start Prefect's temporary server and point
    PREFECT_API_URL at it, never at the dead URL of prefect.toml. A server on ggpo's port
    that `ggpo up` did not start is named and left alone. Returns what waits until the API
    answers: a temporary server is started, not waited for, so the caller's own set-up runs
    meanwhile.

    Must run before `import prefect`: Prefect reads its settings once, at import.
    Why not leave the URL empty: Prefect 3.9 treats PREFECT_API_URL="" as "no server" for
    flow runs (it starts its temporary server) but as "a running server" for events, so
    every event went to a websocket at "" and failed ("Error emitting event", "Service
    'EventsWorker' failed"). With one explicit URL both go to the same temporary server."""
    explicit = os.environ.get("PREFECT_API_URL")
    url = explicit if explicit and servers.healthy(f"{explicit}/health") else servers.ours("prefect")
    if url:
        os.environ["PREFECT_API_URL"] = url
        return lambda: None
    probe = f"http://127.0.0.1:{paths.prefect_port()}/api"
    if servers.healthy(f"{probe}/health"):
        print(f"ggpo: note: {servers.foreign(probe, 'Prefect')}; using a temporary one "
              f"(PREFECT_API_URL={probe} would use it)", file=sys.stderr)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_HOME", str(paths.state_dir() / "prefect"))
    # Prefect creates its home without parents and then fails to open its database
    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)
    port = servers.free_port()
    os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    server = detached_server(port)
    server.launch()          # stopped by Prefect's own atexit hook, after this process's own shutdown
    _TEMPORARY_SERVER.append(server)
    return server.ready


_TEMPORARY_SERVER: list = []


def drain_prefect() -> None:
    """Send Prefect's queued logs and events now (each worker waits at most 5 s)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=5)
        except Exception:       # noqa: BLE001 - a worker that cannot drain must not hide the summary line
            pass


def detached_server(port: int):
    """Prefect's temporary server in a session of its own: Ctrl-C in the terminal reaches
    the run, which stops at safe points and reports Cancelled to this server, instead of
    killing the server first (the run then spent minutes retrying a dead API). It still
    ends with the run's process, however that ends (popen_dying_with_us)."""
    import atexit
    import functools
    import subprocess
    import time
    from unittest import mock

    from prefect.server.api import server as prefect_server

    class Detached(prefect_server.SubprocessASGIServer):
        def _run_uvicorn_command(self):
            popen = functools.partial(popen_dying_with_us, subprocess.Popen, start_new_session=True)
            with mock.patch.object(prefect_server.subprocess, "Popen", popen):
                return super()._run_uvicorn_command()

        def launch(self) -> None:
            """Its process started, from the main thread (the parent-death signal is the
            starting thread's), not waited for: `start` would wait for it to answer."""
            prefect_server.subprocess_server_logger.info("Starting temporary server on %s", self.address)
            self.running = True
            self.server_process = self._run_uvicorn_command()
            atexit.register(self.stop)

        def ready(self) -> None:
            """Wait until it answers; one ServiceError when it exits or stays silent."""
            timeout = float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"])
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                assert self.server_process is not None      # launch() started it
                code = self.server_process.poll()
                if code is not None:
                    why = "its port was taken" if code == 3 else f"it exited with code {code}"
                    raise servers.ServiceError(f"Prefect's temporary server on port {self.port} did not start "
                                               f"({why}); run again, or start the servers with `ggpo up`")
                if servers.healthy(f"{self.api_url}/health"):
                    return
                time.sleep(0.1)
            raise servers.ServiceError(f"Prefect's temporary server on port {self.port} did not answer in {timeout:g} s "
                                       f"(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS); start the servers with "
                                       f"`ggpo up`")
    return Detached(port)


# Run in the server's process before exec: SIGTERM once the process that started it is gone.
# Prefect's atexit hook stops the server when a run exits; a SIGKILLed run (the OOM killer)
# runs no hook, and its server (its own session: no signal from the terminal either) served
# nobody for ever after. Measured in tests/test_fault_matrix.py (a killed run, no servers).
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "
                    "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execv(sys.argv[2], sys.argv[2:])")


def popen_dying_with_us(popen, args, **kwargs):
    """popen(args, ...) (subprocess.Popen, passed in: the caller patches it) whose process
    gets SIGTERM when this one ends, even by SIGKILL (Linux's parent-death signal,
    PR_SET_PDEATHSIG = 1, set before exec; it is tied to the calling thread, here the main
    one). Elsewhere a plain popen."""
    if sys.platform.startswith("linux"):
        args = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *args]
    return popen(args, **kwargs)


def cmd_stage(args) -> int:
    overrides = _overrides(args) | ({"pool.score_model": args.model} if args.model else {})
    return run_one_stage(args.name, load_config(args.preset, overrides), args)


def run_one_stage(name: str, cfg, args, inputs_of=None) -> int:
    """Build (or find) one stage from its cached inputs and print its manifest; inputs_of:
    another way to get the inputs (default: the cache, graph.cached_inputs)."""
    from pipeline.dag.preflight import preflight
    preflight(cfg, name)      # device, engine, model, data, disk: every prerequisite before any work
    store = Store()
    interrupt.reset()
    with interrupt.handlers():       # Ctrl-C: stop at a safe point (training checkpoints), exit 130
        try:
            if name == "online":
                return stage_online(cfg, store, args)
            inputs = (inputs_of or graph.cached_inputs)(name, cfg, store, args.preset)
            manifest = graph.run(name, cfg, inputs, store, args.force)
        except interrupt.Interrupted:
            return interrupted()
    print_manifest(name, manifest, store)
    if not args.no_track:
        run_id = tracking.log_stage(manifest, f"stage-{name}")
        print(tracking.stage_run_line(run_id))
    return 0


def print_manifest(name: str, manifest, store: Store) -> None:
    print(f"{name}: {spec.outcome(manifest)}\n  key    {manifest.key}\n  folder {manifest.folder}")
    if store.url:
        print(f"  store  {store.address(manifest)}")
    for name, entry in manifest.files.items():
        print(f"  {name:12s} {entry.path} rows={entry.rows} sha256={entry.sha256[:16]}")
    print("  summary " + json.dumps(manifest.summary))


def cmd_pool(args) -> int:
    """`ggpo pool import SOURCE`: the pool_import stage with the source and its mapping as
    pool.* settings; the base model (its tokenizer) is built first when it is not cached.
    Ends with the --set options that make `ggpo stage train` and `ggpo run offline` use it."""
    mapping = {}
    for item in args.mapping:
        field, sep, column = item.partition("=")
        if not sep or not field.strip() or not column.strip():
            raise ConfigError(f"--map expects FIELD=COLUMN (e.g. --map problem=question), got '{item}'")
        mapping[field.strip()] = column.strip()
    pool = {"pool.source": args.source, "pool.map": mapping} | ({"pool.split": args.split} if args.split else {}) | (
        {"pool.trust_rewards": True} if args.trust_rewards else {})
    cfg = load_config(args.preset, _overrides(args) | pool)
    code = run_one_stage("pool_import", cfg, args, inputs_of=built_inputs)
    sets = " ".join(f"--set '{k}={v if isinstance(v, str) else json.dumps(v)}'" for k, v in pool.items() if v != {})
    if not pool_source.load(cfg.pool).has_behavior:     # what trains without behavior log-probs
        trainable = [m.name for m in METHODS.values() if not m.needs_behavior("old")]
        sets += f" --set 'experiment.methods={json.dumps(trainable, separators=(',', ':'))}' --set train.anchor=old"
    print(f"train on it: ggpo stage train --preset {args.preset} {sets} --set train.method=ggpo\n"
          f"         or: ggpo run offline --preset {args.preset} {sets}")
    return code


def built_inputs(name: str, cfg, store: Store, preset: str) -> dict:
    """The stage's inputs, each from the cache or built now from its own cached inputs."""
    return {n: graph.run(src, c, graph.cached_inputs(src, c, store, preset), store)
            for n, (src, c) in graph.sources(name, cfg).items()}


def stage_online(cfg, store: Store, args) -> int:
    """`ggpo stage online`: the cell of this config (one method, one seed), all its rounds,
    resumed from its checkpoint and cached rounds; prints its counts and last round."""
    from stages.online_cell import run_cell
    base = graph.run("base", cfg, {}, store)
    result = run_cell(cfg, store, base)
    counts, last = result.counts, result.last
    assert last is not None     # run_cell returns after recording its last round (there is at least one)
    print(f"online cell {cfg.train.method} seed {cfg.seed}: {counts['rounds']} rounds, {counts['update']} updates\n"
          f"  counts {json.dumps({k: v for k, v in counts.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})}\n"
          f"  state  {counts['folder']}\n  last round {last.key}  {last.folder}\n  summary {json.dumps(last.summary)}")
    if not args.no_track:
        run_id = tracking.log_stage(last, f"stage-online {cfg.train.method} seed {cfg.seed}")
        print(tracking.stage_run_line(run_id))
    return 0


def cmd_cache(args) -> int:
    store = Store()
    if args.action == "verify":
        return cache_verify(store)
    if args.action == "gc":
        return cache_gc(store, args)
    print(f"{'stage':9s} {'key':16s} {'rows':>8s} {'size':>10s}  created")
    for m in store.entries():
        rows = sum(e.rows or 0 for e in m.files.values())
        size = sum(e.bytes for e in m.files.values())
        print(f"{m.stage:9s} {m.key[:16]} {rows:8d} {size / 1024:9.1f}K  {m.created_at}")
    print(f"root: {store.location}")
    return 0


def cache_verify(store: Store) -> int:
    import time
    start = time.perf_counter()
    artifacts, files, size, problems = verify_all(store)
    for problem in problems:
        print(problem)
    how = "checked for presence and size (hashed when staged)" if store.url else "re-hashed"
    print(f"{artifacts} artifacts, {files} files, {size / 2**20:.1f} MiB {how} in "
          f"{time.perf_counter() - start:.2f}s under {store.location}: "
          + (f"{len(problems)} damaged (`ggpo stage NAME --force` or the flow rebuilds them)" if problems else "all intact"))
    return 2 if problems else 0


def cache_gc(store: Store, args) -> int:
    import shutil
    versions = {name: graph.spec(name).version for name in graph.STAGE_NAMES}
    protected = preset_experiment_keys() if args.unreferenced else None
    plan = gc_plan(store, versions, protected, args.all)
    for folder, why, size in plan:
        print(f"{'removing' if args.yes else 'would remove'} {folder.name:28s} {size / 1024:10.1f}K  {why}")
        if args.yes:
            shutil.rmtree(folder)
    total = sum(size for _, _, size in plan)
    verb = "removed" if args.yes else "would free (dry run; --yes deletes)"
    print(f"{len(plan)} folders, {total / 2**20:.1f} MiB {verb} under {store.root}")
    return 0


def preset_experiment_keys() -> set[tuple[str, str]]:
    """(stage, key) of everything the offline and online flows build for each preset as shipped."""
    keys = set()
    for name in preset_names():
        try:
            cfg = load_config(name)
            keys |= graph.experiment_keys(cfg) | graph.online_experiment_keys(cfg)
        except Exception as exc:    # e.g. a preset whose benchmark files are not here
            raise ConfigError(f"cache gc --unreferenced: the keys of preset '{name}' cannot be computed "
                              f"({str(exc).splitlines()[0]}), so it would not know what to keep; "
                              f"run `ggpo cache gc` without --unreferenced") from None
    return keys


def cmd_report(args) -> int:
    """The experiment's stage timings and tables, from the cache the flow wrote (the flow is
    the preset's experiment.flow; online: the flow's report tables, byte for byte)."""
    from pipeline.dag.preflight import flow_overrides
    cfg = load_config(args.preset, flow_overrides(args.overrides))
    flow = cfg.experiment.flow
    if flow == "corrections":
        return report_corrections(args.preset, cfg, args.save, args.merge)
    if args.save or args.merge:
        raise ConfigError(f"--save and --merge are for the corrections flow; preset {args.preset} runs the "
                          f"{flow} flow")
    if flow == "online":
        evals, curves, timings = online.from_cache(cfg, Store())
    else:
        evals, curves, timings = offline.from_cache(cfg, Store())
    print_timings(args.preset, timings)
    if not evals.height:
        print("nothing evaluated yet for this experiment: run it with "
              f"`ggpo run {flow} --preset {args.preset}` (and the same --set options)")
    elif flow == "online":
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            table, _ = online.write(evals, curves, Path(tmp), f"mean@{cfg.eval.n_samples}")
        print(table)
    else:
        print(offline.markdown(offline.summarize(evals), f"mean@{cfg.eval.n_samples}"))
        diag = offline.diagnostics(curves)
        if diag.height:
            print(offline.diagnostics_markdown(diag))
    print(f"MLflow: {tracking.tracking_uri()} (experiment {tracking.EXPERIMENTS[flow]})")
    return 0


def report_corrections(preset: str, cfg, save: Path | None = None, merge: list[Path] | None = None) -> int:
    """`ggpo report` of a corrections experiment: both parts' timings, then the corrections
    table (reports/corrections.py) as the flow writes it, from the cache; or, with `merge`,
    from results folders of distinct seeds (no timings). `save`: the table and its results
    folder into that folder as well."""
    import tempfile

    from pipeline.reports import corrections
    if merge:
        frames = corrections.load_results(merge)
        print(f"results folders {', '.join(str(m) for m in merge)}: seeds {corrections.seeds_of(frames)}\n")
    else:
        *cached, timings = corrections.from_cache(cfg, Store())
        frames = tuple(cached)  # type: ignore[assignment]
        print_timings(preset, timings)
    if not (frames[0].height or frames[2].height):
        print(f"nothing evaluated yet for this experiment: run it with `ggpo run corrections --preset {preset}` "
              "(and the same --set options)")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            folder = save or Path(tmp)
            table, paths, _ = corrections.write(*frames, folder, f"mean@{cfg.eval.n_samples}")
            if save:
                paths += corrections.save_results(frames, save)
        print(table)
        if save:
            print(f"report files: {save} ({', '.join(p.name for p in paths)})")
    print(f"MLflow: {tracking.tracking_uri()} (experiment {tracking.EXPERIMENTS['corrections']})")
    return 0


def print_timings(preset: str, timings: list[tuple[str, float | None]]) -> None:
    """Seconds each stage took when it was built, summed per kind of stage."""
    print(f"stage timings (preset {preset}; seconds each took when it was built):")
    groups: dict[str, list[float | None]] = {}
    for label, seconds in timings:
        groups.setdefault(label.split(" seed ")[0], []).append(seconds)
    for label, values in groups.items():
        built = [v for v in values if v is not None]
        missing = f"  ({len(values) - len(built)} not built)" if len(built) < len(values) else ""
        print(f"  {label:22s} {sum(built):8.1f}s  over {len(built)} run(s){missing}")
    print(f"  {'total':22s} {sum(v for _, v in timings if v is not None):8.1f}s\n")


def cmd_down(args) -> int:
    print("ggpo services stopped" if servers.down() else "ggpo services were not running")
    return 0


COMMANDS = {"up": cmd_up, "down": cmd_down, "env": cmd_env, "status": cmd_status, "run": cmd_run,
            "stage": cmd_stage, "pool": cmd_pool, "cache": cmd_cache, "report": cmd_report}


# what to do, per kind of expected error (the most specific class that has one wins)
HINTS: dict[type, str] = {
    PoolError: "fix the source, or map its columns: --map FIELD=COLUMN, pool.map",
    DatasetError: "fix the file, or pick a prompt set: --set task.name=digit_sort|arithmetic|PATH",
    BenchmarkError: "fix the file; eval.data_dir is a folder of <benchmark>.parquet/.jsonl files, or 'hub'",
    DiskFull: "free space on that disk (or point GGPO_CACHE at a larger one) and rerun the same command: it resumes "
              "from the last complete checkpoint and reuses every finished stage",
    NonFiniteUpdate: "try a smaller learning rate (--set train.lr=...) or a larger train.beta, which starts a "
                     "new run; the same command resumes from the checkpoint",
}


def expected_error(exc: BaseException) -> str | None:
    """The message of an expected failure (bad config or data, missing or damaged input,
    training stopped, server trouble) with what to do, chosen by the error's type; None for
    a bug, which keeps its traceback."""
    if isinstance(exc, ValidationError) or isinstance(exc.__context__, ValidationError) and isinstance(exc, ConfigError):
        invalid = exc if isinstance(exc, ValidationError) else exc.__context__
        assert isinstance(invalid, ValidationError)     # the condition above
        head = str(exc).splitlines()[0].rstrip(":") if isinstance(exc, ConfigError) else "invalid config"
        fields = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']} (got {e.get('input')!r})"
                           for e in invalid.errors())
        return f"{head}: {fields}; fix the --set option or the preset file in {PRESET_DIR}"
    if not isinstance(exc, ExpectedError):
        return None
    hint = next((HINTS[k] for k in type(exc).__mro__ if k in HINTS), None)
    return f"{exc} ({hint})" if hint else str(exc)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one line per Prefect API call otherwise
    # multiprocessing's resource tracker (a process of its own, started with this environment)
    # warns at exit about a named semaphore already unlinked by its pool: two lines of noise
    # after a finished run, nothing lost (seen when a run ends right after a server outage)
    os.environ.setdefault("PYTHONWARNINGS", "ignore:resource_tracker:UserWarning")
    try:
        kernels.mode()          # a mistyped GGPO_KERNELS fails here, before any work
    except ValueError as exc:
        print(f"ggpo: {exc}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[args.cmd](args)
    except Exception as exc:
        message = None if args.debug else expected_error(exc)
        if message is None:
            raise
        print(f"ggpo: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
