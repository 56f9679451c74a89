"""The `ggpo` command line.

  ggpo up | down | status                 background Prefect + MLflow servers and the deployment
  ggpo run offline [--preset P] [--set k=v ...] [--force STAGE ...]   the flow, in-process
  ggpo stage NAME [--preset P] [--set k=v ...] [--force]  one stage from cached inputs
  ggpo cache ls                           artifacts: stage, key, rows, size, created
  ggpo report [--preset P] [--set k=v ...]  stage timings and the comparison table, from the cache
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import urllib.request

from pipeline import dag, paths, services
from pipeline.config import ConfigError, load_config, parse_overrides, preset_names
from pipeline.store import Store


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help=f"one of: {', '.join(preset_names())}")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.lr=1e-5 (repeatable)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ggpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start Prefect, MLflow and the deployment server")
    up.add_argument("--prefect-port", type=int, default=None)
    up.add_argument("--mlflow-port", type=int, default=None)
    sub.add_parser("down", help="stop them")
    sub.add_parser("status", help="are they up and healthy")
    run = sub.add_parser("run", help="run a flow in this process")
    run.add_argument("flow", choices=["offline"])
    _config_args(run)
    run.add_argument("--force", nargs="*", default=[], metavar="STAGE", help="stages to recompute")
    st = sub.add_parser("stage", help="run one stage from the cached artifacts of its inputs")
    st.add_argument("name", choices=dag.STAGE_NAMES)
    _config_args(st)
    st.add_argument("--force", action="store_true", help="recompute even if cached")
    st.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    cache = sub.add_parser("cache", help="inspect the artifact store")
    cache.add_argument("action", choices=["ls"])
    rep = sub.add_parser("report", help="stage timings and the comparison table of the cached experiment")
    _config_args(rep)
    return ap


def cmd_up(args) -> int:
    state = services.up(args.prefect_port, args.mlflow_port)
    word = "already up" if state.get("already_up") else "up"
    print(f"ggpo services {word} (state: {paths.state_dir()})")
    print(f"  Prefect UI: {state['urls']['prefect_ui']}\n  MLflow UI:  {state['urls']['mlflow']}")
    print("  deployment: ggpo/offline  (prefect deployment run ggpo/offline --watch)")
    return 0


def cmd_status(args) -> int:
    state = services.status()
    if not state:
        print("ggpo services are down (ggpo up starts them)")
        return 1
    for name, s in state["services"].items():
        print(f"  {name:8s} pid {s['pid']:>7}  {'healthy' if s['healthy'] else 'NOT healthy'}")
    print(f"  Prefect UI: {state['urls']['prefect_ui']}\n  MLflow UI:  {state['urls']['mlflow']}")
    return 0 if all(s["healthy"] for s in state["services"].values()) else 1


def cmd_run(args) -> int:
    ensure_prefect_api()
    from flows.offline import ggpo
    result = ggpo(preset=args.preset, overrides=_overrides(args), force=args.force)
    print(result["table"])
    print(json.dumps(result["summary"], indent=2))
    print(f"MLflow parent run {result['mlflow_parent_run_id']}")
    return 0


def _overrides(args) -> dict:
    return parse_overrides(args.overrides)


def ensure_prefect_api() -> None:
    """Use the local server when it answers; else Prefect's in-process ephemeral API, not a
    dead URL from prefect.toml."""
    url = os.environ.get("PREFECT_API_URL") or f"http://127.0.0.1:{paths.prefect_port()}/api"
    if services.healthy(f"{url}/health"):
        os.environ["PREFECT_API_URL"] = url
        return
    os.environ["PREFECT_API_URL"] = ""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_HOME", str(paths.state_dir() / "prefect"))
    # Prefect creates its home without parents and then fails to open its database
    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)


def cmd_stage(args) -> int:
    cfg = load_config(args.preset, _overrides(args))
    store = Store()
    inputs = dag.cached_inputs(args.name, cfg, store, args.preset)
    manifest = dag.run(args.name, cfg, inputs, store, args.force)
    word = "cache hit" if manifest.cache_hit else f"built in {manifest.seconds:.1f}s"
    print(f"{args.name}: {word}\n  key    {manifest.key}\n  folder {manifest.folder}")
    for name, entry in manifest.files.items():
        print(f"  {name:12s} {entry.path} rows={entry.rows} sha256={entry.sha256[:16]}")
    print("  summary " + json.dumps(manifest.summary))
    if not args.no_track:
        from pipeline import tracking
        run_id = tracking.log_stage(manifest, f"stage-{args.name}")
        print(f"  mlflow run {run_id} at {tracking.tracking_uri()}")
    return 0


def cmd_cache(args) -> int:
    store = Store()
    print(f"{'stage':9s} {'key':16s} {'rows':>8s} {'size':>10s}  created")
    for m in store.entries():
        rows = sum(e.rows or 0 for e in m.files.values())
        size = sum(e.bytes for e in m.files.values())
        print(f"{m.stage:9s} {m.key[:16]} {rows:8d} {size / 1024:9.1f}K  {m.created_at}")
    print(f"root: {store.root}")
    return 0


def cmd_report(args) -> int:
    from pipeline import report, tracking
    cfg = load_config(args.preset, _overrides(args))
    evals, _, timings = report.from_cache(cfg, Store())
    print(f"stage timings (preset {args.preset}; seconds each took when it was built):")
    groups: dict[str, list[float]] = {}
    for label, seconds in timings:
        groups.setdefault(label.split(" seed ")[0], []).append(seconds)
    for label, values in groups.items():
        built = [v for v in values if v is not None]
        missing = f"  ({len(values) - len(built)} not built)" if len(built) < len(values) else ""
        print(f"  {label:22s} {sum(built):8.1f}s  over {len(built)} run(s){missing}")
    print(f"  {'total':22s} {sum(v for _, v in timings if v is not None):8.1f}s\n")
    if evals.height:
        print(report.markdown(report.summarize(evals), f"mean@{cfg.eval.n_samples}"))
    print(f"MLflow: {tracking.tracking_uri()} (experiment {tracking.EXPERIMENT})")
    return 0


def cmd_down(args) -> int:
    print("ggpo services stopped" if services.down() else "ggpo services were not running")
    return 0


COMMANDS = {"up": cmd_up, "down": cmd_down,
            "status": cmd_status, "run": cmd_run, "stage": cmd_stage, "cache": cmd_cache, "report": cmd_report}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one line per Prefect API call otherwise
    try:
        return COMMANDS[args.cmd](args)
    except (ConfigError, dag.MissingInput, services.ServiceError) as exc:
        print(f"ggpo: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
