"""Where a flow's stage tasks run: threads of the flow process, or Ray workers.

`experiment.task_runner`:
- `threads` (default): Prefect's ThreadPoolTaskRunner in the flow process;
  `experiment.parallel` bounds the builds that run at once.
- `ray`: prefect_ray's RayTaskRunner. Each stage task asks Ray for what it uses
  (`stage_resources`): one GPU for rollout, train, score and evaluate when they run on CUDA
  (vLLM: data_parallel x tensor_parallel_size GPUs), else CPUs (torch threads; verify and
  pool_import: their grading workers). Ray runs as many tasks at once as the cluster's resources hold;
  `experiment.parallel` does not apply. Address: `experiment.ray_address`, else
  $RAY_ADDRESS, else "local": a private Ray instance on this machine for the flow run.

Workers are other processes, maybe on other machines. They get the flow process's store
($GGPO_CACHE), state ($GGPO_HOME), MLflow tracking URI and Prefect API as absolute values
(`worker_env`, Ray's runtime_env) and its working directory when that folder exists there
(relative task and benchmark paths). Nothing else of the flow process's memory reaches
them: the grading pool starts lazily in the worker that grades, and build slots are per
process. A cluster needs the project installed on every node and a store and MLflow
server every node reaches. Results do not depend on the runner: the keys ignore
`experiment`, and every stage is deterministic given its config and inputs.

How a flow uses this module (flows/offline.py, flows/online.py):

    @flow(task_runner=placement.ConfiguredTaskRunner())
    def my_flow(preset, overrides):
        cfg = load_config(preset, overrides)
        preflight(cfg)            # calls placement.check(cfg): Ray installed, address answers
        placement.use(cfg)        # starts the configured runner (connects to Ray), before any work
        fut = placement.submit(run_stage_task, "train", cfg, <run_stage_task's arguments>)

Prefect enters a flow's task runner before the flow body runs, when the config is not
known yet (a deployment run gets preset and overrides as parameters), so the decorator's
runner is a shell that `use(cfg)` fills. `task_runner(cfg)` alone gives the concrete
runner, for `flow.with_options(task_runner=...)` where the config is known outside.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Any, Callable
from urllib.parse import urlsplit

from prefect.context import FlowRunContext
from prefect.futures import PrefectFuture
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from pipeline.core import interrupt, paths
from pipeline.core.config import ConfigError
from pipeline.core.errors import drop_expected_traceback
from pipeline.core.store import default_root
from pipeline.dag.graph import STAGE_NAMES
from pipeline.services import tracking

THREADS = 64                 # the thread runner's pool; experiment.parallel bounds the builds
LOCAL = "local"              # a private Ray instance for the flow run
PIP_EXTRA = "pip install -e '.[ray]'"
# what workers must see as the flow process sees it (prefixes); PREFECT__* are Prefect's
# per-run internals, never forwarded
# AWS_: an s3:// store's credentials and endpoint (pipeline/core/remote_store.py) reach the workers
FORWARD = ("GGPO_", "MLFLOW_", "PREFECT_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "AWS_")
WORKDIR_ENV = "GGPO_WORKDIR"     # the flow's working directory, for relative paths
MODEL_STAGES = {"rollout": "engine", "evaluate": "engine", "train": "trainer", "score": "scorer",
                "online": "trainer"}     # an online cell: its learner, and its sampler beside it


def ray_address(cfg) -> tuple[str, str]:
    """(address, where it came from): experiment.ray_address, $RAY_ADDRESS, or "local"."""
    if cfg.experiment.ray_address:
        return cfg.experiment.ray_address, "experiment.ray_address"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    return LOCAL, "experiment.ray_address (unset)"


def _require_ray() -> None:
    try:
        import prefect_ray  # noqa: F401
        import ray  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"experiment.task_runner=ray needs ray and prefect-ray, which are not "
                          f"installed ({exc.name} is missing): {PIP_EXTRA}") from None


def check(cfg) -> None:
    """Bad Ray settings as one ConfigError before any work (runtime.preflight calls it):
    ray not installed, or an address where nothing answers."""
    if cfg.experiment.task_runner != "ray":
        return
    _require_ray()
    address, source = ray_address(cfg)
    if address in (LOCAL, "auto"):
        return          # nothing to reach yet; "auto" without a cluster fails in use()
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        raise ConfigError(f"{source}={address}: not a Ray address; give host:port (the head's GCS "
                          f"port, 6379 by default), ray://host:10001, auto or local")
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as exc:
        raise ConfigError(f"{source}={address}: no Ray cluster answers at {host}:{port} "
                          f"({exc.strerror or type(exc).__name__}); start one (ray start --head "
                          f"--port={port}) or point {source} at a running head node") from None


def worker_env() -> dict[str, str]:
    """The environment a Ray worker needs to act as this process would: the store, the state
    folder, the MLflow URI and the Prefect API as absolute values, and the GGPO_/MLflow/
    Prefect/Hugging Face settings of this process."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARD) and not k.startswith("PREFECT__")}
    env.update({"GGPO_CACHE": str(default_root()), paths.HOME_ENV: str(paths.state_dir()),
                "MLFLOW_TRACKING_URI": tracking.tracking_uri(), WORKDIR_ENV: os.getcwd()})
    api = _prefect_api_url()
    if api:
        env["PREFECT_API_URL"] = api
    return env


def _prefect_api_url() -> str | None:
    """The API this flow run talks to: a server, or the temporary server Prefect started for it."""
    ctx = FlowRunContext.get()
    if ctx is not None and ctx.client is not None and str(ctx.client.api_url).startswith("http"):
        return str(ctx.client.api_url).rstrip("/")
    from prefect.settings import PREFECT_API_URL
    return PREFECT_API_URL.value() or None


def worker_setup() -> None:
    """Runs once in each Ray worker process (runtime_env worker_process_setup_hook): work in
    the flow's folder when this machine has it, so relative task and benchmark paths resolve."""
    folder = os.environ.get(WORKDIR_ENV)
    if folder and os.path.isdir(folder):
        os.chdir(folder)


def task_runner(cfg) -> TaskRunner:
    """The runner `experiment.task_runner` names, not started."""
    if cfg.experiment.task_runner == "threads":
        return ThreadPoolTaskRunner(max_workers=THREADS)
    if cfg.experiment.task_runner == "processes":
        return process_runner(cfg.experiment.parallel)
    _require_ray()
    from prefect_ray import RayTaskRunner
    address, _ = ray_address(cfg)
    runtime_env = {"env_vars": worker_env(), "worker_process_setup_hook": f"{__name__}.worker_setup"}
    init = {"runtime_env": runtime_env, "namespace": "ggpo"}
    if address in (LOCAL, "auto"):      # as ray.init reads them: a new instance; the running one or fail
        return RayTaskRunner(init_kwargs=init | {"address": address})
    return RayTaskRunner(address=address, init_kwargs=init)


_forget_previous_runner: list[Callable[[], None]] = [lambda: None]


def process_runner(workers: int) -> TaskRunner:
    """Prefect's ProcessPoolTaskRunner with `workers` spawned processes that act for this one:
    its folder, its logging, its stop requests (`interrupt.on_request` sets a shared flag each
    worker polls) and its life (a worker whose flow process is gone exits)."""
    import multiprocessing

    from prefect.task_runners import ProcessPoolTaskRunner
    # A lock-free byte, not a multiprocessing Event: Event.set() waits for every waiter to
    # wake, and a worker that exited inside Event.wait (every worker, when its pool shuts
    # down) never does, so a later stop request of this process hung in set().
    stop = multiprocessing.get_context("spawn").RawValue("b", 0)

    def request_stop() -> None:
        stop.value = 1
    _forget_previous_runner[0]()        # one listener: the newest runner's (a served process runs many flows)
    _forget_previous_runner[0] = interrupt.on_request(request_stop)
    # the CLI drops Prefect's tracebacks of expected errors unless --debug: the workers too
    quiet = drop_expected_traceback in logging.getLogger("prefect.task_runs").filters
    return ProcessPoolTaskRunner(max_workers=workers, initializer=process_worker_setup,
                                 initargs=(os.getpid(), os.getcwd(), stop, quiet))


def process_worker_setup(parent: int, workdir: str, stop, quiet: bool = True) -> None:
    """Runs once in each worker of the process runner. Its own process group, so a terminal's
    Ctrl-C reaches the flow process alone, which passes one request on through `stop`: the
    worker's stages stop at their safe points as the flow process's would. A watch thread
    ends the worker when its flow process is gone (killed: nothing else would)."""
    import signal
    import threading
    import time

    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # requests come through `stop`
    if os.path.isdir(workdir):
        os.chdir(workdir)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for name in ("prefect.task_runs", "prefect.flow_runs") if quiet else ():
        logging.getLogger(name).addFilter(drop_expected_traceback)

    def watch() -> None:
        while os.getppid() == parent:
            if stop.value and not interrupt.requested():
                interrupt.request()
            time.sleep(0.5)
        os._exit(1)         # the flow process is gone: so is every reason to go on

    threading.Thread(target=watch, name="ggpo-worker-watch", daemon=True).start()


def _gpus_for(stage: str, cfg) -> int:
    """GPUs `stage` uses under `cfg`: 0 for a stage that runs on the CPU."""
    role = MODEL_STAGES.get(stage)
    if role == "engine" and cfg.rollout.engine == "vllm":
        dp = cfg.rollout.data_parallel
        return (dp if isinstance(dp, int) else 1) * cfg.rollout.tensor_parallel_size
    if role is None or cfg.train.device == "cpu":
        return 0
    ranks = cfg.train.nproc if role == "trainer" else 1      # train.nproc: one GPU per torchrun rank
    if cfg.train.device == "cuda":       # the transformers engine follows train.device too
        return ranks
    return ranks if _cluster_has_gpus() else 0      # auto


def _cluster_has_gpus() -> bool:
    """train.device=auto: CUDA where the task runs. Under Ray, whether the cluster has a GPU."""
    import sys
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch
    return torch.cuda.is_available()


def stage_resources(stage: str, cfg) -> dict[str, Any]:
    """What a `stage` task asks Ray for: {"num_gpus": n, "num_cpus": 1} for a stage on CUDA,
    else {"num_cpus": n}: the torch threads of a model stage, verify's grading workers
    (verify.workers=0, one per core of the node: 1 is reserved), 1 for the rest."""
    gpus = _gpus_for(stage, cfg)
    if gpus:
        return {"num_gpus": gpus, "num_cpus": 1}
    if stage in ("verify", "pool_import"):      # the grading workers
        return {"num_cpus": cfg.verify.workers or 1}
    return {"num_cpus": cfg.model.threads if stage in MODEL_STAGES or stage == "base" else 1}


class ConfiguredTaskRunner(TaskRunner[PrefectFuture[Any]]):     # what @flow's task_runner takes
    """The flow decorator's task runner: a shell that Prefect enters before the flow body
    runs, and that `use(cfg)` fills with the runner the config names. A flow that never
    calls `use` runs its tasks in threads, as before."""

    def __init__(self):
        super().__init__()
        self.inner: TaskRunner | None = None

    def duplicate(self) -> "ConfiguredTaskRunner":
        return type(self)()

    def start(self, inner: TaskRunner) -> None:
        if self.inner is not None:
            raise RuntimeError("the flow's task runner is chosen already (placement.use runs once per flow run)")
        self.inner = inner.__enter__()

    def _runner(self) -> TaskRunner:
        if self.inner is None:
            self.start(ThreadPoolTaskRunner(max_workers=THREADS))
        assert self.inner is not None   # start set it
        return self.inner

    def submit(self, task, parameters, wait_for=None, dependencies=None):
        return self._runner().submit(task, parameters, wait_for, dependencies)

    def map(self, task, parameters, wait_for=None):
        return self._runner().map(task, parameters, wait_for)

    def cancel_all(self) -> None:
        if self.inner is not None and hasattr(self.inner, "cancel_all"):
            self.inner.cancel_all()

    def __exit__(self, *exc_info) -> None:
        inner, self.inner = self.inner, None
        try:
            if inner is not None:
                inner.__exit__(*exc_info)
        finally:
            super().__exit__(*exc_info)


def use(cfg, preload: tuple[str, ...] = ()) -> None:
    """Start the runner `cfg` names for the running flow, before any work. Under Ray: connect
    (one ConfigError when the cluster cannot be reached) and check that every stage's
    resources fit on some node (an infeasible task would wait forever). `preload`: the
    modules of the flow's tasks, which the process runner's workers import as they start."""
    ctx = FlowRunContext.get()
    shell = ctx.task_runner if ctx is not None else None
    if not isinstance(shell, ConfiguredTaskRunner):
        if cfg.experiment.task_runner == "threads" or _is_ray(shell):
            return      # a flow whose runner is fixed already (with_options) and agrees
        raise ConfigError(f"experiment.task_runner={cfg.experiment.task_runner}: this flow's task runner is fixed; "
                          f"declare it with task_runner=placement.ConfiguredTaskRunner()")
    runner = task_runner(cfg)
    _failures.clear()
    try:
        shell.start(runner)
    except ConnectionError as exc:      # ray.init: no cluster at the address, or "auto" finds none
        address, source = ray_address(cfg)
        raise ConfigError(f"{source}={address}: cannot connect to a Ray cluster: "
                          f"{str(exc).splitlines()[0]}") from None
    if _is_ray(runner):
        _check_fits(cfg, ray_address(cfg))
    if cfg.experiment.task_runner == "processes":
        spawn_workers(runner, cfg.experiment.parallel, preload)


def spawn_workers(runner: TaskRunner, workers: int, preload: tuple[str, ...] = ()) -> None:
    """Every worker of the process runner started now, each importing `preload` (a flow's
    module: torch, transformers, ~7 s here) while the flow process sets up. Left alone, the
    pool spawns a worker when a task reaches it: the first for the base model, the second
    only once that is built, when every cell waits for it."""
    executor = getattr(runner, "_executor", None)       # Prefect 3.9's ProcessPoolExecutor
    if executor is None:
        return
    for _ in range(workers):        # each submit finds no idle worker yet: one spawn each
        executor.submit(import_modules, preload)


def import_modules(names: tuple[str, ...]) -> None:
    """In a worker: the modules its tasks' pickles name, imported before the first task
    (by name: this layer does not import the flows)."""
    import importlib
    for name in names:
        importlib.import_module(name)


def _is_ray(runner) -> bool:
    return type(runner).__name__ == "RayTaskRunner"


def _check_fits(cfg, where: tuple[str, str]) -> None:
    import ray
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    for stage in STAGE_NAMES:
        asked = stage_resources(stage, cfg)
        need = {"CPU": asked.get("num_cpus", 0), "GPU": asked.get("num_gpus", 0)}
        if not any(all(node.get(k, 0) >= v for k, v in need.items()) for node in nodes):
            have = ", ".join(f"{n.get('CPU', 0):g} CPU/{n.get('GPU', 0):g} GPU" for n in nodes) or "none"
            fix = ("add GPU nodes, or run it on the CPU (train.device=cpu, rollout.engine=transformers)"
                   if need["GPU"] else f"lower {'verify.workers' if stage == 'verify' else 'model.threads'} or add nodes")
            raise ConfigError(f"{where[1]}={where[0]}: stage {stage} asks Ray for {need['GPU']:g} GPU and "
                              f"{need['CPU']:g} CPU, more than any node has (nodes: {have}); {fix}")


def submit(task, stage: str, cfg, *args, **kwargs) -> PrefectFuture:
    """`task.submit(*args, **kwargs)`, asking Ray for `stage`'s resources when the flow runs
    on Ray (prefect_ray's remote_options); a plain submit under threads."""
    ctx = FlowRunContext.get()
    runner = ctx.task_runner if ctx is not None else None
    runner = getattr(runner, "inner", runner)
    if type(runner).__name__ == "ProcessPoolTaskRunner":
        future = task.submit(*args, **kwargs)
        future.add_done_callback(_note_process_failure(stage))
        return future
    if not _is_ray(runner):
        return task.submit(*args, **kwargs)
    from prefect_ray.context import remote_options
    with remote_options(**stage_resources(stage, cfg)):
        future = task.submit(*args, **kwargs)
    future.wrapped_future._on_completed(_note_failure(stage))   # Ray passes the task's final State
    return future


# Stage failures on Ray workers or worker processes, oldest first (spec.failures() holds this process's own):
# the flow then fails on "upstream task not completed", and the CLI names the cause instead.
_failures: list[tuple[str, Exception]] = []


def failures() -> list[tuple[str, Exception]]:
    """(stage, exception) of every stage task that failed on a Ray worker in this flow run."""
    return list(_failures)


def _note_process_failure(stage: str):
    def note(future) -> None:       # done: its final state came back from the worker process
        try:
            future.result()
        except Exception as exc:    # noqa: BLE001 - recorded for the CLI's one line, raised to the flow anyway
            _failures.append((stage, exc))
    return note


def _note_failure(stage: str):
    def note(state) -> None:        # on a Ray thread: look, never block
        data = getattr(state, "data", None)
        exc = getattr(data, "result", data)         # a failed state holds its exception (in a record)
        if getattr(state, "is_failed", lambda: False)() and isinstance(exc, Exception):
            _failures.append((stage, exc))
    return note
