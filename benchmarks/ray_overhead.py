"""The offline flow on Ray against threads: wall time of the smoke preset, side by side
(run on demand, not a test; tests/test_ray.py reuses `local_cluster` and `run_flow`).

    .venv/bin/python benchmarks/ray_overhead.py [--preset smoke] [--cpus 2] [--set key=value ...]

Starts one Prefect server (so neither run pays for Prefect's temporary server) and a
local Ray cluster on free ports of 127.0.0.1, seeds two fresh stores with the base model
(built once; the flows then build pool, training and evaluations), runs `ggpo run
offline` with experiment.task_runner=threads and =ray, checks that pools and weights are
byte-identical, and prints both wall times and their ratio. Ratios are what to quote:
absolute times vary with machine load.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_ports_clear_of(taken: list[int], span: int = 200) -> int:
    """The first port of a free range for Ray's workers that holds none of `taken`: Ray
    refuses to start when a component's port falls inside the worker range (seen under load,
    where the ephemeral ports handed out lie close together)."""
    for _ in range(100):
        low = free_port()
        if low + span <= 65535 and not any(low <= p <= low + span for p in taken):
            return low
    raise RuntimeError(f"no range of {span + 1} ports clear of {taken} found")


def answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def _ours(marker: str) -> list[int]:
    """Pids of live processes whose command line names `marker` (our cluster's temp dir)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
    return pids


@contextlib.contextmanager
def local_cluster(num_cpus: int = 2, timeout_s: float = 90) -> Iterator[str]:
    """A Ray head on 127.0.0.1 with every port free and its own temp dir, no dashboard;
    yields its address ("127.0.0.1:PORT"). Stopped by signalling the `ray start --block`
    process this started, then killing what is left of its process group and of the
    processes that name its temp dir: never another cluster's processes (`ray stop` would)."""
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")     # short: Ray's socket paths have a length limit
    port = free_port()
    ports = {f"--{name}": str(free_port()) for name in (
        "node-manager-port", "object-manager-port", "ray-client-server-port", "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port")}
    low = worker_ports_clear_of([port, *map(int, ports.values())])
    argv = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
            f"--num-cpus={num_cpus}", "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats",
            f"--temp-dir={temp}", f"--min-worker-port={low}", f"--max-worker-port={low + 200}",
            *[f"{k}={v}" for k, v in ports.items()]]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = open(Path(temp) / "ray-start.log", "w")
    head = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not answers(port):
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start did not come up on 127.0.0.1:{port}: "
                                   + (Path(temp) / "ray-start.log").read_text()[-2000:])
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        _stop(head, temp)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _stop(head: subprocess.Popen, temp: str) -> None:
    head.terminate()        # `ray start --block` stops the processes it started (2-3 s)
    try:
        head.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)     # its group: only what this started
        head.wait()
    for _ in range(20):                         # workers that left the group still name the temp dir
        left = _ours(temp)
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.25)


@contextlib.contextmanager
def prefect_server(home: Path) -> Iterator[str]:
    """Prefect's server on a free port (its own database under `home`); yields the API URL."""
    port = free_port()
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_API_URL="")
    home.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        import urllib.request
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prefect server did not come up on port {port}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def seed_store(cache: Path, base_folder: Path) -> None:
    """A fresh store holding only the base model (a copy of its artifact folder)."""
    cache.mkdir(parents=True)
    shutil.copytree(base_folder, cache / base_folder.name)


def run_flow(runner: str, cache: Path, home: Path, api: str, preset: str = "smoke",
             overrides: Sequence[str] = (), address: str | None = None, timeout: int = 900) -> tuple[float, str]:
    """`ggpo run offline` in a subprocess with its own store and state; (seconds, output).
    Raises with the output's tail when the run fails."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    env.update(GGPO_CACHE=str(cache), GGPO_HOME=str(home), PREFECT_API_URL=api)
    argv = [str(BIN / "ggpo"), "run", "offline", "--preset", preset, "--set", f"experiment.task_runner={runner}"]
    if address:
        argv += ["--set", f"experiment.ray_address={address}"]
    for o in overrides:
        argv += ["--set", o]
    start = time.perf_counter()
    res = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - start
    out = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f"{runner} flow failed (exit {res.returncode}):\n{out[-4000:]}")
    return seconds, out


def digests(cache: Path) -> dict[str, str]:
    """sha256 of the pools (rollout and filter Parquet) and every trained weights file in a
    store, by path: folders are named by stage and key, so equal paths mean equal inputs."""
    paths = [*cache.glob("rollout-*/rollouts.parquet"), *cache.glob("filter-*/train_pool.parquet"),
             *cache.glob("train-*/**/*.safetensors")]
    return {str(p.relative_to(cache)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(paths)}


def base_folder(preset: str, overrides: list[str]) -> Path:
    """The preset's base model artifact, built into the default store when missing."""
    from pipeline.core.config import load_config
    from stages import base_model
    return Path(base_model.run(load_config(preset, overrides)).folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="smoke")
    ap.add_argument("--cpus", type=int, default=2, help="CPUs of the Ray cluster")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    source = base_folder(args.preset, args.overrides)
    with tempfile.TemporaryDirectory(prefix="ggpo-ray-bench-") as name:
        tmp = Path(name)
        with prefect_server(tmp / "prefect") as api, local_cluster(args.cpus) as address:
            times, stores = {}, {}
            for runner in ("threads", "ray"):
                stores[runner] = tmp / runner / "cache"
                seed_store(stores[runner], source)
                times[runner], _ = run_flow(runner, stores[runner], tmp / runner / "home", api, args.preset,
                                            args.overrides, address if runner == "ray" else None)
                print(f"{runner:8s} {times[runner]:7.1f}s", flush=True)
        same = digests(stores["threads"]) == digests(stores["ray"]) and digests(stores["ray"])
        print(f"pools and weights byte-identical: {bool(same)} ({len(digests(stores['ray']))} files)")
        print(f"ray / threads wall time: {times['ray'] / times['threads']:.2f}x "
              f"(preset {args.preset}, Ray cluster of {args.cpus} CPUs on this machine, running before the flow)")


if __name__ == "__main__":
    main()
