"""MLflow tracking: one experiment per flow (`ggpo-offline`, `ggpo-online`), one parent run
per flow run named so a person can scan the runs table (`offline tiny lr=1e-4 ·
2026-11-30 14:02`, tagged with preset, methods, seeds, grid and git commit), one nested run
per stage (training runs named by method and seed; online cells by method, N and seed).
A nested run lives in its parent's experiment; a stage run without a parent (`ggpo stage`)
in its flow's experiment.

Runs are addressed by id through `MlflowClient`, never through mlflow's thread-local
active-run stack, because Prefect may run tasks in worker threads. Per-update metrics
are sent with `log_batch` (<= 1,000 per call): one call at a time costs ~27 ms each on
SQLite (docs/measurements.md, Tracking).

Tracking URI: $MLFLOW_TRACKING_URI if set (a remote server works unchanged), else the
local server of `ggpo up` if it answers, else the SQLite file it uses. Artifacts of the
local setup live under a file:// root in the state folder, so direct SQLite clients
and the server read and write the same places.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from pipeline.core import interrupt, kernels, paths
from pipeline.core.errors import DiskFull
from pipeline.core.grid import fmt, short_names
from pipeline.core.store import Manifest, folder_bytes, is_disk_full, size_text
from pipeline.services import servers
from pipeline.tasks import pool_source

EXPERIMENT = "ggpo-offline"
# the corrections flow (flows/corrections.py) runs online cells and offline trainings under
# one parent run: in the online experiment, where its cells' nested runs are made
EXPERIMENTS = {"offline": EXPERIMENT, "online": "ggpo-online", "corrections": "ggpo-online"}
ONLINE_STAGES = ("online_pool", "online_train", "online_policy")
POOL_STAGES = ("filter", "pool_import", "score")     # their train_pool.parquet is logged as a dataset input
ARTIFACT_LIMIT = 64 * 1024 * 1024     # larger files are referenced by path and hash
# Without this tag MLflow 3's UI opens the experiment in its GenAI view (traces, sessions) and
# files training runs under "Evaluation runs"; this value selects the model-training view.
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"
# the runs table with its charts, in the model-training layout whatever the browser last used
RUNS_VIEW_QUERY = "workflowType=machine_learning&compareRunsMode=CHART"
HEADLINE_CURVES = ("train/reward", "train/loss")


_NOTED: set[str] = set()


def tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else the MLflow server `ggpo up` started (found through its
    recorded port from any shell), else the SQLite file it uses. A server on ggpo's port
    that `ggpo up` did not start gets nothing of ours (said once)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    url = servers.ours("mlflow")
    if url:
        return url
    probe = f"http://127.0.0.1:{paths.mlflow_port()}"
    if probe not in _NOTED and servers.healthy(f"{probe}/health"):
        _NOTED.add(probe)
        import sys
        print(f"ggpo: note: {servers.foreign(probe, 'MLflow')}; tracking to {paths.mlflow_db()} "
              f"(MLFLOW_TRACKING_URI={probe} would use it)", file=sys.stderr)
    paths.state_dir().mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{paths.mlflow_db()}"


# A tracking server that stops answering must cost a run seconds, not MLflow's default
# back-off (7 retries, factor 2: ~4 minutes a call, measured 9 minutes for one run): two
# quick retries (1 s, 2 s) ride out a blip, then the run carries on without the server.
HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
_FALLBACK: list[str] = []       # the SQLite URI this process tracks to since its server went away


def client():
    """An MLflow client for tracking_uri(), which survives ggpo's own server going away
    mid-run (Resilient); every caller in the project gets its client here."""
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    # MLflow's own "View run" lines open the GenAI layout; ggpo prints run_link's instead
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    for name, value in HTTP_SETTINGS.items():
        os.environ.setdefault(name, value)
    # one line says the server went away (Resilient), not one per retried request
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    return Resilient(_FALLBACK[0] if _FALLBACK else tracking_uri())


def unreachable(exc: BaseException) -> bool:
    """Whether `exc` says the tracking server did not answer (as opposed to refusing a call)."""
    import requests
    text = str(exc)
    return isinstance(exc, requests.exceptions.ConnectionError) or "Max retries exceeded" in text or (
        "Connection refused" in text)


class Resilient:
    """An MlflowClient whose calls, once ggpo's own server (`ggpo up`) stops answering, go
    to the SQLite file that server serves, for the rest of the process: the same runs, by
    id, so the UI shows them complete once the server is back. Said once, on one line.
    A server that is not ggpo's (a remote $MLFLOW_TRACKING_URI) has no file we know: its
    errors stand, after HTTP_SETTINGS' bounded retries."""

    def __init__(self, uri: str):
        from mlflow import MlflowClient
        self._client = MlflowClient(tracking_uri=uri)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except Exception as exc:
                if name.startswith("log_artifact") and is_disk_full(exc):
                    raise self._artifact_disk_full(args) from exc
                if not (unreachable(exc) and self._fall_back(exc)):
                    raise
                return getattr(self._client, name)(*args, **kwargs)
        return call

    def _artifact_disk_full(self, args: tuple) -> DiskFull:
        """The one line for an artifact the tracking store's disk could not hold (its own
        disk: a local store; the server's: ggpo's server or another). A rerun logs it again:
        the stages behind it are cached."""
        local = Path(args[1]) if len(args) > 1 else None
        size = local.stat().st_size if local is not None and local.is_file() else (
            folder_bytes(local) if local is not None and local.is_dir() else None)
        return DiskFull(f"disk full: MLflow could not store artifact {local} (needs about {size_text(size)}) for run "
                        f"{args[0] if args else '?'}: the artifact store of {self._client.tracking_uri} is out of "
                        f"space")

    def _fall_back(self, exc: BaseException) -> bool:
        from mlflow import MlflowClient
        uri = self._client.tracking_uri
        if not _FALLBACK:
            if not uri.startswith("http") or not own_server(uri):
                return False
            _FALLBACK.append(f"sqlite:///{paths.mlflow_db()}")
            import sys
            print(f"ggpo: warning: the MLflow server at {uri} stopped answering; tracking goes on in "
                  f"{paths.mlflow_db()}, which it serves (`ggpo up` brings it back with these runs)",
                  file=sys.stderr, flush=True)
        self._client = MlflowClient(tracking_uri=_FALLBACK[0])
        return True


def own_server(uri: str) -> bool:
    """Whether `uri` is the MLflow server `ggpo up` recorded (its SQLite file is ours)."""
    return servers.read_state().get("urls", {}).get("mlflow", "").rstrip("/") == uri.rstrip("/")


def prepare(experiment: str = EXPERIMENT) -> None:
    """The tracking store opened and `experiment` made, before a flow needs them: MLflow's
    first use of a new SQLite file creates its tables (~10 s on the 2-core machine), which
    the CLI does while the Prefect server starts."""
    experiment_id(client(), experiment)


def experiment_id(c, name: str = EXPERIMENT) -> str:
    """The experiment's id, created if missing, always tagged as a model-training experiment."""
    exp = c.get_experiment_by_name(name)
    if exp is None:
        location = None if c.tracking_uri.startswith("http") else paths.mlflow_artifacts().as_uri()
        try:
            return c.create_experiment(name, artifact_location=location, tags={KIND_TAG: KIND})
        except Exception:  # created concurrently by another process
            exp = c.get_experiment_by_name(name)
    if exp.tags.get(KIND_TAG) != KIND:     # experiments made before the tag, or re-kinded in the UI
        c.set_experiment_tag(exp.experiment_id, KIND_TAG, KIND)
    return exp.experiment_id


def runs_url(server: str, exp_id: str) -> str:
    """The MLflow UI page of the experiment's runs table with the chart view open."""
    return f"{server.rstrip('/')}/#/experiments/{exp_id}/runs?{RUNS_VIEW_QUERY}"


def experiment_link(server: str, flow: str = "offline") -> str:
    """Create (or re-tag) the flow's experiment on the MLflow server at `server` and return
    the link to its runs and charts, so the first page a user opens is the right one."""
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    from mlflow import MlflowClient
    return runs_url(server, experiment_id(MlflowClient(tracking_uri=server), EXPERIMENTS[flow]))


def run_link(run_id: str, exp_id: str, server: str | None = None) -> str | None:
    """A run's page in the model-training layout (None when tracking is not a server)."""
    server = server or tracking_uri()
    if not server.startswith("http"):
        return None
    return f"{server.rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}?workflowType=machine_learning"


def stage_run_line(run_id: str) -> str:
    """`  mlflow run <link>` for a run logged by `ggpo stage`: its page on the tracking server
    (the experiment read from the run), or its id and the SQLite file when tracking is local."""
    c = client()
    link = run_link(run_id, c.get_run(run_id).info.experiment_id, c.tracking_uri)
    return f"  mlflow run {link or run_id + ' in ' + c.tracking_uri}"


def report_folder(flow: str, preset: str) -> Path:
    """Where a flow run's report files stay on disk (also logged to MLflow under report/):
    $GGPO_HOME/reports/<flow>-<preset>-<UTC time>/."""
    folder = paths.state_dir() / "reports" / f"{flow}-{preset}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def git_commit() -> str:
    """The project's commit (+"-dirty" with uncommitted changes), or "unknown"."""
    import subprocess
    root = paths.PROJECT_ROOT
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def run_title(flow: str, preset: str, overrides: dict[str, Any], cfg) -> str:
    """`offline tiny lr=1e-4 N=[1,4] · 2026-11-30 14:02`: the flow, the preset, what --set
    changed (experiment fields aside) and the grid, and when."""
    changed = {k: v for k, v in (overrides or {}).items() if not k.startswith("experiment.") and k != "seed"}
    names = short_names({**changed, **cfg.experiment.grid})
    parts = [flow, preset] + [f"{names[k]}={fmt(v)}" for k, v in changed.items()]
    parts += [f"{names[k]}=[{','.join(fmt(x) for x in v)}]" for k, v in cfg.experiment.grid.items()]
    return " ".join(parts) + " · " + time.strftime("%Y-%m-%d %H:%M")


def run_tags(flow: str, preset: str, cfg, flow_run_id: str = "") -> dict[str, str]:
    exp = cfg.experiment
    return {"ggpo.flow": flow, "ggpo.preset": preset, "ggpo.methods": ",".join(exp.methods),
            "ggpo.seeds": ",".join(map(str, exp.seeds)), "ggpo.grid": json.dumps(exp.grid),
            "ggpo.git_commit": git_commit(), "prefect.flow_run_id": flow_run_id}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


# One MLflow write at a time per process: a flow's tasks finish together on a rerun (all
# cache hits), and 64 threads logging at once exhausted SQLAlchemy's connection pool on the
# SQLite store (QueuePool limit reached, 30 s timeout: measured on the online ladder).
_WRITE_LOCK = threading.RLock()


def log_params_metrics(c, run_id: str, params: dict[str, str], metrics: list[tuple[str, float, int]]) -> None:
    with _WRITE_LOCK:
        _log_params_metrics(c, run_id, params, metrics)


def _log_params_metrics(c, run_id: str, params: dict[str, str], metrics: list[tuple[str, float, int]]) -> None:
    from mlflow.entities import Metric, Param
    ts = int(time.time() * 1000)
    plist = [Param(k, v[:6000]) for k, v in params.items()]
    mlist = [Metric(k, float(v), ts, step) for k, v, step in metrics]
    for i in range(0, max(len(plist), 1), 100):        # MLflow caps params at 100 a call
        c.log_batch(run_id, params=plist[i:i + 100])
    for i in range(0, len(mlist), 1000):
        c.log_batch(run_id, metrics=mlist[i:i + 1000])


@contextmanager
def parent_run(run_name: str, params: dict[str, Any], tags: dict[str, str],
               experiment: str = EXPERIMENT) -> Iterator[tuple[Any, str]]:
    """A parent run for one flow run; FAILED if the body raises."""
    c = client()
    run = c.create_run(experiment_id(c, experiment), run_name=run_name, tags=tags)
    log_params_metrics(c, run.info.run_id, flatten(params), [])
    try:
        yield c, run.info.run_id
    except BaseException:
        c.set_terminated(run.info.run_id, "KILLED" if interrupt.requested() else "FAILED")
        raise
    c.set_terminated(run.info.run_id, "FINISHED")


def summary_metrics(summary: dict[str, Any]) -> list[tuple[str, float, int]]:
    return [(k, float(v), 0) for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)]


def log_stage(manifest: Manifest, run_name: str, parent_run_id: str | None = None) -> str:
    """A (nested) run for one stage result: config, summary, files, training curves."""
    with _WRITE_LOCK:
        return _log_stage(manifest, run_name, parent_run_id)


def _log_stage(manifest: Manifest, run_name: str, parent_run_id: str | None = None) -> str:
    c = client()
    tags = {"ggpo.stage": manifest.stage, "ggpo.key": manifest.key,
            "ggpo.cache_hit": str(manifest.cache_hit).lower(), "ggpo.folder": manifest.folder}
    if (numerics := kernels.key_fingerprint()) is not None:     # which CPU numerics (pipeline/core/kernels.py)
        tags["ggpo.kernels"] = numerics
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
        exp_id = c.get_run(parent_run_id).info.experiment_id
    else:
        exp_id = experiment_id(c, EXPERIMENTS["online" if manifest.stage in ONLINE_STAGES else "offline"])
    # string summaries (e.g. the group-order hash that shows two runs saw the same data)
    tags |= {f"ggpo.{k}": str(v) for k, v in manifest.summary.items() if isinstance(v, str)}
    run_id = c.create_run(exp_id, run_name=run_name, tags=tags).info.run_id
    try:
        metrics = summary_metrics(manifest.summary) + [("stage_seconds", manifest.seconds, 0)]
        if manifest.stage == "train":
            metrics += training_curves(manifest)
        log_params_metrics(c, run_id, flatten(manifest.config), metrics)
        if manifest.stage == "train" and parent_run_id:
            log_headline_curves(c, parent_run_id, run_name, metrics)
        log_files(c, run_id, manifest)
        if manifest.stage in POOL_STAGES:
            log_pool_dataset(c, run_id, manifest)
    except BaseException:
        c.set_terminated(run_id, "FAILED")
        raise
    c.set_terminated(run_id, "FINISHED")
    return run_id


def training_curves(manifest: Manifest) -> list[tuple[str, float, int]]:
    import polars as pl
    df = pl.read_parquet(manifest.path("metrics"))
    names = [n for n in df.columns if n not in ("update",)]
    return [(f"train/{n}", row[n], row["update"]) for row in df.iter_rows(named=True) for n in names
            if row[n] is not None]


def log_headline_curves(c, parent_run_id: str, run_name: str, metrics: list[tuple[str, float, int]]) -> None:
    """Copy reward and loss per update onto the flow's parent run as `<run name>/reward`.

    MLflow's runs page charts only the runs in view, and nested runs sit folded under
    their parent: without this copy the page a user lands on shows no training curve.
    Two curves per training run keep the copy small (400 updates: 800 points)."""
    head = [(f"{run_name}/{k.removeprefix('train/')}", v, step) for k, v, step in metrics
            if k in HEADLINE_CURVES]
    log_params_metrics(c, parent_run_id, {}, head)


def log_files(c, run_id: str, manifest: Manifest) -> None:
    folder = Path(manifest.folder)
    c.log_artifact(run_id, str(folder / "manifest.json"))
    for name, entry in manifest.files.items():
        path = folder / entry.path
        if path.suffix in (".parquet", ".json", ".md", ".csv") and entry.bytes <= ARTIFACT_LIMIT:
            c.log_artifact(run_id, str(path), artifact_path=Path(entry.path).parent.as_posix().strip(".") or None)
        else:
            c.set_tag(run_id, f"ggpo.file.{name}", f"{path} sha256={entry.sha256}")


def log_pool_dataset(c, run_id: str, manifest: Manifest) -> None:
    import polars as pl
    from mlflow.data.dataset_source_registry import get_dataset_source_from_json
    from mlflow.data.polars_dataset import from_polars  # what mlflow.data.from_polars is, set there at run time
    from mlflow.entities import DatasetInput, InputTag
    path = manifest.path("train_pool")
    df = pl.read_parquet(path, columns=["prompt_id", "group", "sample", "reward", "response_length"])
    # an explicit "local" source: a bare path matches two identical MLflow source classes
    # ("" and "file" schemes) and MLflow warned on every run
    source = get_dataset_source_from_json(json.dumps({"uri": str(path)}), "local")
    ds = from_polars(df, source=source, name=f"train_pool-{manifest.key[:16]}")
    c.log_inputs(run_id, datasets=[DatasetInput(ds._to_mlflow_entity(),
                                                tags=[InputTag("mlflow.data.context", "training")])])


def log_source_dataset(c, run_id: str, pool_cfg) -> None:
    """An imported pool's source (pool.source) as a dataset input of the flow's parent run:
    its name, the digest that keys the import (file sha256, or dataset id with its
    fingerprint; MLflow keeps 36 characters, the tag all 64) and its row count, from the
    validated source the preflight already read."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    src = pool_source.load(pool_cfg)
    if src.kind == "dataset":
        name, source_type, where = pool_cfg.source, "hugging_face", {"path": pool_cfg.source}
    else:
        name, source_type, where = src.name, "local", {"uri": str(Path(src.name).resolve())}
    entity = Dataset(name=f"pool source {name}", digest=src.digest[:36], source_type=source_type,
                     source=json.dumps(where), profile=json.dumps({"num_rows": src.rows}))
    c.log_inputs(run_id, datasets=[DatasetInput(entity, tags=[InputTag("mlflow.data.context", "training")])])
    c.set_tag(run_id, "ggpo.pool_source_digest", src.digest)


def round_metrics(trained: Manifest, pool: Manifest) -> list[tuple[str, float, int]]:
    """One online round's points: its per-update metrics (`train/...`, cumulative prompts
    drawn and responses generated included) and its pool's counts (`round/...`) at the
    round's first update, plus the two stages' seconds and cache hits."""
    metrics = training_curves(trained)
    first = trained.summary["first_update"] + 1
    metrics += [(f"round/{k}", v, first) for k, v, _ in summary_metrics(pool.summary)]
    metrics += [("round/stage_seconds_pool", pool.seconds, first), ("round/stage_seconds_train", trained.seconds, first),
                ("round/cache_hit_pool", float(pool.cache_hit), first), ("round/cache_hit_train", float(trained.cache_hit), first)]
    return metrics


def log_round(trained: Manifest, pool: Manifest, run_id: str) -> None:
    """One online round into its cell's run, in one call (round_metrics)."""
    log_rounds([(trained, pool)], run_id)


def log_rounds(rounds: list[tuple[Manifest, Manifest]], run_id: str) -> None:
    """Several online rounds (trained, pool) into their cell's run in one batch: every point
    keeps its own step, so batching changes when points arrive, not which."""
    log_params_metrics(client(), run_id, {}, [m for trained, pool in rounds for m in round_metrics(trained, pool)])
