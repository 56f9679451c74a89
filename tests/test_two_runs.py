"""Two runs on one cache, as a user starts them: two `ggpo run offline --preset smoke` (the
real CLI, each with its own GGPO_HOME, its own temporary Prefect server and MLflow store) on
one fresh GGPO_CACHE. A build of a stage key holds the store's build lock
(pipeline/core/store.py, Store.build_lock), so:

- started together, both exit 0 without a traceback, every stage key is built once (by one
  of them; the other says it waits, in one line naming the builder, then takes the cache
  hit), and the cache holds what a single run makes;
- the first SIGKILLed while it builds the base model: its lock goes with it, the second
  (waiting for it) builds the key itself, in a clean folder, and finishes.

"What a single run makes": the second run of the kill test built every key alone (the
killed one committed nothing), so its cache is a single run's; the two caches hold the same
files, bit for bit, except the wall-clock `seconds` columns of the Parquet files (compared
without them) and the training's resume state (checkpoints/, which holds those rows too).

Cost: one smoke run's wall time for each test (two runs side by side), and the kill test's
first run up to its base build: about 2 x 3 min on a 2-core machine (see the module's
durations). Marked `servers`: each run starts Prefect's temporary server."""
from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import polars as pl
import pytest

from conftest import BIN, REPO, free_port

pytestmark = pytest.mark.servers

BUILDING = re.compile(r"ggpo (\w+): building ([0-9a-f]{16}) in ")
HIT = re.compile(r"ggpo (\w+): cache hit \(.*\), ([0-9a-f]{16})$", re.MULTILINE)
WAITING = re.compile(r"ggpo (\w+): ([0-9a-f]{16}) is being built by process (\d+) on host \S+ \(since [^)]*\); "
                     r"waiting for it \(lock [^)]*\)$", re.MULTILINE)
TIMEOUT_S = 1800        # a safety net for a hung run, not a verdict


def user(root: Path, name: str, cache: Path) -> dict:
    """The environment of one user's shell: the shared cache, a state folder and ports of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME")}
    return env | {"GGPO_CACHE": str(cache), "GGPO_HOME": str(root / name), "GGPO_PREFECT_PORT": str(free_port()),
                  "GGPO_MLFLOW_PORT": str(free_port())}


def start(root: Path, name: str, cache: Path) -> tuple[subprocess.Popen, Path]:
    log = root / f"{name}.log"
    argv = [str(BIN / "ggpo"), "run", "offline", "--preset", "smoke"]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=user(root, name, cache), stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def finished(proc: subprocess.Popen, log: Path) -> str:
    """The run's output, once it has exited 0 without a traceback."""
    proc.wait(timeout=TIMEOUT_S)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    return text


def committed(cache: Path) -> set[str]:
    """`<stage>-<key16>` of every complete artifact."""
    return {p.parent.name for p in cache.glob("*/manifest.json")}


def contents(cache: Path) -> dict[str, str]:
    """relative path -> sha256 of every artifact file (Parquet: of its rows without the
    wall-clock `seconds` column); not manifests (they hold build times) nor checkpoints/."""
    out = {}
    for path in sorted(cache.glob("*/**/*")):
        rel = path.relative_to(cache)
        if not path.is_file() or path.name == "manifest.json" or "checkpoints" in rel.parts:
            continue
        if path.suffix == ".parquet":
            df = pl.read_parquet(path)
            data = df.drop([c for c in df.columns if c == "seconds"]).write_ipc(None).getvalue()
        else:
            data = path.read_bytes()
        out[str(rel)] = hashlib.sha256(data).hexdigest()
    return out


@pytest.fixture(scope="module")
def together(tmp_path_factory):
    """Two runs started together on one fresh cache: (cache, [output of each])."""
    root = tmp_path_factory.mktemp("together")
    runs = [start(root, name, root / "cache") for name in ("first", "second")]
    return root / "cache", [finished(proc, log) for proc, log in runs]


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The first run SIGKILLed while it builds the base model, the second waiting for it:
    (cache, the killed run's exit code and output, the second's output)."""
    from pipeline.core.config import load_config
    from pipeline.dag import graph
    root = tmp_path_factory.mktemp("killed")
    cache = root / "cache"
    key = graph.expected_key("base", load_config("smoke"))
    lock = cache / f".base-{key[:16]}.build.lock"
    first, first_log = start(root, "first", cache)
    wait_for(lambda: lock.exists() and f'"pid":{first.pid},' in lock.read_text(), first, first_log)
    second, second_log = start(root, "second", cache)
    wait_for(lambda: f"base: {key[:16]} is being built by process {first.pid} " in second_log.read_text(),
             second, second_log)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    return cache, key, (first.returncode, first_log.read_text()), finished(second, second_log)


def wait_for(condition, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.1)


def test_two_runs_started_together_build_each_key_once(together):
    cache, outputs = together
    built = [{(s, k) for s, k in BUILDING.findall(out)} for out in outputs]
    hits = [{(s, k) for s, k in HIT.findall(out)} for out in outputs]
    counts = Counter(pair for b in built for pair in b)
    assert counts and set(counts.values()) == {1}, counts            # each key built by one run, once
    keys = set(counts)
    assert {f"{s}-{k}" for s, k in keys} == committed(cache)
    for b, h in zip(built, hits):
        assert b | h == keys and not b & h       # each run: what it did not build was a cache hit
    waits = [WAITING.findall(out) for out in outputs]
    assert any(waits), outputs                  # started together: one waited for the other (the base model)
    for run, w in enumerate(waits):
        pairs = [(s, k) for s, k, _ in w]
        assert len(pairs) == len(set(pairs)), w                 # one line a wait
        assert set(pairs) <= built[1 - run] & hits[run], w      # waited for what the other built, then a hit


def test_the_first_killed_mid_build_the_second_builds_the_key_and_finishes(killed):
    cache, key, (code, first_out), second_out = killed
    assert code == -signal.SIGKILL
    assert "base: building" in first_out
    waited = WAITING.findall(second_out)
    assert waited and waited[0][:2] == ("base", key[:16])
    assert ("base", key[:16]) in BUILDING.findall(second_out)        # the killed build was not taken as done
    assert {f"{s}-{k}" for s, k in BUILDING.findall(second_out)} == committed(cache)


def test_the_cache_of_two_runs_holds_what_a_single_run_makes(together, killed):
    a, b = contents(together[0]), contents(killed[0])
    assert a.keys() == b.keys() and a, sorted(set(a) ^ set(b))
    assert a == b, [differs(together[0], killed[0], k) for k in sorted(a) if a[k] != b[k]]


def differs(one: Path, two: Path, rel: str) -> str:
    """What differs in a file of two caches: the file, and for Parquet its columns."""
    if not rel.endswith(".parquet"):
        return rel
    x, y = pl.read_parquet(one / rel), pl.read_parquet(two / rel)
    if x.columns != y.columns:
        return f"{rel}: columns {sorted(set(x.columns) ^ set(y.columns))} in one only"
    return f"{rel}: columns {[c for c in x.columns if not x[c].equals(y[c])]}"
