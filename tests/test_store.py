"""The content-addressed store: hit, miss, force, incomplete folders, key chaining."""
from pathlib import Path

import pytest

from pipeline.core.config import load_config
from pipeline.core.store import MANIFEST
from pipeline.dag import graph
from pipeline.dag.spec import Built, StageSpec, run_stage


def counting_spec(calls: list, fail: bool = False) -> StageSpec:
    def build(cfg, inputs, folder: Path) -> Built:
        calls.append(folder)
        (folder / "out.txt").write_text(f"lr={cfg.train.lr}")
        if fail:
            raise RuntimeError("crash mid-write")
        return Built(files={"out": ("out.txt", 1)}, summary={"lr": cfg.train.lr})
    return StageSpec(name="toy", version=1, reads=("train.lr",), build=build)


def test_miss_then_hit_then_force(store):
    calls, cfg = [], load_config("smoke")
    first = run_stage(counting_spec(calls), cfg, {}, store)
    assert not first.cache_hit and len(calls) == 1
    again = run_stage(counting_spec(calls), cfg, {}, store)
    assert again.cache_hit and len(calls) == 1 and again.key == first.key
    forced = run_stage(counting_spec(calls), cfg, {}, store, force=True)
    assert not forced.cache_hit and len(calls) == 2
    assert forced.files["out"].sha256 == first.files["out"].sha256


def test_key_depends_on_read_fields_only(store):
    calls = []
    a = run_stage(counting_spec(calls), load_config("smoke"), {}, store)
    b = run_stage(counting_spec(calls), load_config("smoke", ["train.lr=3e-5"]), {}, store)
    c = run_stage(counting_spec(calls), load_config("smoke", ["rollout.temperature=0.5"]), {}, store)
    assert a.key != b.key and c.key == a.key and c.cache_hit


def test_incomplete_folder_is_never_read_and_is_rebuilt(store):
    calls, cfg = [], load_config("smoke")
    with pytest.raises(RuntimeError, match="crash"):
        run_stage(counting_spec(calls, fail=True), cfg, {}, store)
    folder = calls[0]
    assert (folder / "out.txt").exists() and not (folder / MANIFEST).exists()
    assert store.load("toy", folder.name) is None
    rebuilt = run_stage(counting_spec(calls), cfg, {}, store)
    assert not rebuilt.cache_hit and len(calls) == 2 and (folder / MANIFEST).exists()


def test_retraining_config_keeps_pool_key():
    a, b = load_config("tiny"), load_config("tiny", ["train.lr=3e-5"])
    for stage in ("base", "rollout", "verify", "filter"):
        assert graph.expected_key(stage, a) == graph.expected_key(stage, b)
    assert graph.expected_key("train", a) != graph.expected_key("train", b)
    assert graph.expected_key("evaluate", a) != graph.expected_key("evaluate", b)
    # a new seed is a new pool, but the same base model
    c = load_config("tiny", ["seed=1234"])
    assert graph.expected_key("base", a) == graph.expected_key("base", c)
    assert graph.expected_key("rollout", a) != graph.expected_key("rollout", c)


def test_missing_input_names_stage_and_command(store):
    with pytest.raises(graph.MissingInput, match=r"(?s)input 'pool' from stage 'filter'.*`ggpo stage filter --preset smoke"):
        graph.cached_inputs("train", load_config("smoke"), store, "smoke")


# ---- one build of a key at a time (Store.build_lock)

# A child process that builds the toy stage's key as run_stage does (build lock, begin,
# commit) and holds the build until `go` exists: the parent meanwhile needs the same key.
# The store alone (not run_stage): it imports in ~1 s, the stage machinery in ~10.
HOLDER = """
import sys, time
from pathlib import Path
from pipeline.core.store import Manifest, Store, file_entry, now_iso
root, key, go = sys.argv[1], sys.argv[2], Path(sys.argv[3])
store = Store(root)
with store.build_lock("toy", key):
    folder = store.begin("toy", key)
    (folder / "out.txt").write_text("lr=1e-06")
    print("building", flush=True)
    while not go.exists():
        time.sleep(0.02)
    store.commit(Manifest(stage="toy", key=key, version=1, folder=str(folder), config={}, inputs={},
                          files={"out": file_entry(folder, "out.txt", 1)}, created_at=now_iso(), seconds=0.0))
"""


def start_holder(store, go: Path):
    """The HOLDER child, once it is building (it holds the key's build lock)."""
    import subprocess
    import sys

    from conftest import REPO
    key = toy_key(load_config("smoke"))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(store.root), key, str(go)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "building", proc.stderr.read()
    return proc


def toy_key(cfg) -> str:
    from pipeline.dag.spec import key_for
    return key_for(counting_spec([]), cfg, {})


def waiting_lines(caplog, key: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if "waiting for it" in r.getMessage() and key[:16] in r.getMessage()]


def test_a_second_process_needing_the_key_waits_then_takes_the_cache_hit(store, caplog, tmp_path):
    """The child builds the key; run_stage here waits (one line naming the child's pid and
    host), and once the child commits it is a cache hit: this process never builds."""
    import logging
    import socket
    import threading
    calls, cfg, go = [], load_config("smoke"), tmp_path / "go"
    holder = start_holder(store, go)
    got = []
    caplog.set_level(logging.INFO, logger="ggpo")
    waiter = threading.Thread(target=lambda: got.append(run_stage(counting_spec(calls), cfg, {}, store)))
    waiter.start()
    for _ in range(500):        # until the waiter has said it waits
        if any("waiting for it" in r.getMessage() for r in caplog.records):
            break
        waiter.join(0.02)
    go.touch()
    waiter.join(60)
    assert holder.wait(60) == 0, holder.stderr.read()
    hit = got[0]
    assert hit.cache_hit and calls == [] and hit.summary == {}      # the child's artifact
    lines = waiting_lines(caplog, hit.key)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"toy: {hit.key[:16]} is being built by process {holder.pid} on host "
                               f"{socket.gethostname()} (since 20"), lines[0]
    assert f"waiting for it (lock {store.root}/.toy-{hit.key[:16]}.build.lock)" in lines[0]
    assert any("cache hit" in r.getMessage() and hit.key[:16] in r.getMessage() for r in caplog.records)


def test_a_holder_killed_with_sigkill_releases_the_key_and_the_waiter_builds_it(store, caplog, tmp_path):
    """SIGKILL mid-build: the kernel drops the child's flock, the waiter takes it, finds no
    manifest (an interrupted build) and builds the key itself, in a clean folder."""
    import logging
    import signal
    import threading
    calls, cfg = [], load_config("smoke")
    holder = start_holder(store, tmp_path / "never")
    caplog.set_level(logging.INFO, logger="ggpo")
    got = []
    waiter = threading.Thread(target=lambda: got.append(run_stage(counting_spec(calls), cfg, {}, store)))
    waiter.start()
    for _ in range(500):
        if any("waiting for it" in r.getMessage() for r in caplog.records):
            break
        waiter.join(0.02)
    assert waiter.is_alive() and calls == []        # waiting, not building
    holder.send_signal(signal.SIGKILL)
    assert holder.wait(30) == -signal.SIGKILL
    waiter.join(60)
    assert not got[0].cache_hit and len(calls) == 1
    assert (calls[0] / MANIFEST).exists() and store.load("toy", got[0].key) is not None


def test_threads_of_one_process_build_a_key_once(store):
    """Two stage runs of one key at once in one process (flows run stages in threads): one builds."""
    import threading
    calls, cfg, started, go = [], load_config("smoke"), threading.Event(), threading.Event()

    def build(c, inputs, folder: Path) -> Built:
        calls.append(folder)
        started.set()
        go.wait(30)
        (folder / "out.txt").write_text("x")
        return Built(files={"out": ("out.txt", 1)})
    spec = StageSpec(name="toy", version=1, reads=("train.lr",), build=build)
    got = []
    first = threading.Thread(target=lambda: got.append(run_stage(spec, cfg, {}, store)))
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=lambda: got.append(run_stage(spec, cfg, {}, store)))
    second.start()
    second.join(0.5)
    assert second.is_alive()        # waiting on the lock, not building
    go.set()
    first.join(30)
    second.join(30)
    assert len(calls) == 1 and sorted(m.cache_hit for m in got) == [False, True]


def test_a_waiting_run_stops_when_asked(store, tmp_path):
    """Ctrl-C while waiting for another process's build: Interrupted, nothing built."""
    import threading

    from pipeline.core import interrupt
    from pipeline.core.errors import Interrupted
    calls, cfg = [], load_config("smoke")
    holder = start_holder(store, tmp_path / "go")
    errors = []

    def wait():
        try:
            run_stage(counting_spec(calls), cfg, {}, store)
        except Interrupted as exc:
            errors.append(exc)
    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(0.5)
    interrupt.request()
    waiter.join(30)
    (tmp_path / "go").touch()
    assert holder.wait(60) == 0
    assert len(errors) == 1 and "toy waiting for" in str(errors[0]) and calls == []


def test_a_remote_claim_of_another_host_is_one_line_and_a_dead_local_one_is_taken_over(tmp_path, caplog):
    """A `file://` store: a claim another host holds stops the build in one StoreError line
    naming the holder and the claim; a claim of a process of this host that is gone (SIGKILL)
    is replaced and the key built here."""
    import json
    import logging
    import socket
    import subprocess
    import sys

    from pipeline.core import remote_store
    from pipeline.core.errors import StoreError
    from pipeline.core.store import Store
    remote = Store(f"file://{tmp_path / 'shared'}")
    calls, cfg = [], load_config("smoke")
    key = toy_key(cfg)
    name = remote.folder("toy", key).name
    path = Path(remote_store.lock_path(remote.remote, name))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pid": 1, "host": "another-box", "since": "2026-12-03T10:00:00Z"}))
    with pytest.raises(StoreError) as err:
        run_stage(counting_spec(calls), cfg, {}, remote)
    assert "\n" not in str(err.value) and calls == [] and "process 1 on host another-box" in str(err.value)
    assert f"claim file://{tmp_path / 'shared'}/.locks/{name}.json" in str(err.value)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path.write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(), "since": "2026-12-03T10:00:00Z"}))
    caplog.set_level(logging.INFO, logger="ggpo")
    built = run_stage(counting_spec(calls), cfg, {}, remote)
    assert not built.cache_hit and len(calls) == 1 and not path.exists()     # released after the commit
    assert any("which is gone; building it here" in r.getMessage() for r in caplog.records)

