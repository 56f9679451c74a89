"""The bad day (#25, 3): a full disk loses nothing.

Every write path (manifests, stage artifacts, training checkpoints, the online cell's
rolling checkpoints, reports, MLflow artifacts) under ENOSPC: one line (DiskFull) naming the
path and the space needed, no half-written file left where a later run could read it, the
previous file (checkpoint, manifest, report) intact, and a rerun once space is freed
resumes from it.

Each test runs twice: on a filesystem that really fills (a size-limited tmpfs; skipped
where mounting is not permitted, e.g. CI without privileges) and with the full disk
injected (Python's `open` hands out files whose writes raise OSError(ENOSPC) once a byte
budget is spent), which runs anywhere. Both disks are pipeline/core/full_disk.py's, which
the fault matrix (benchmarks/fault_matrix.py) and the torchrun test use too.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.core import full_disk
from pipeline.core.errors import DiskFull
from pipeline.core.full_disk import MiB, Tmpfs


def RealDisk(root: Path, size: int = 64 * MiB) -> Tmpfs:
    """A tmpfs of `size` bytes at `root` (pipeline/core/full_disk.py); the test is skipped
    where it cannot be mounted."""
    disk = Tmpfs(root, size)
    if disk.why:
        pytest.skip(f"cannot mount a tmpfs here ({disk.why}): the injected variant covers this test")
    return disk


def InjectedDisk(root: Path, monkeypatch) -> full_disk.InjectedDisk:
    """Files opened for writing under `root` by this process get a budget of bytes
    (pipeline/core/full_disk.py); undone with the test's monkeypatch."""
    root.mkdir(parents=True)
    disk = full_disk.InjectedDisk(root)
    disk.install(monkeypatch.setattr)
    return disk


@pytest.fixture(params=["tmpfs", "injected"])
def disk(request, tmp_path, monkeypatch):
    d = RealDisk(tmp_path / "fs") if request.param == "tmpfs" else InjectedDisk(tmp_path / "fs", monkeypatch)
    yield d
    d.close()


def leftovers(folder: Path) -> list[str]:
    """Temporary files a write left behind (ours start with a dot or end in .tmp; a mirror's
    lock file stays by design)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if (p.name.startswith(".") or p.name.endswith(".tmp")) and not p.name.endswith(".lock"))


def test_manifest_write_keeps_the_previous_file(disk):
    from pipeline.core.store import write_text_atomic
    path = disk.root / "manifest.json"
    write_text_atomic(path, "v1")
    disk.fill(256 * 1024)
    with pytest.raises(DiskFull) as err:
        write_text_atomic(path, "x" * (2 * MiB))
    assert str(path) in str(err.value) and "needs about 2.0 MiB" in str(err.value)
    assert err.value.errno == errno.ENOSPC and "\n" not in str(err.value)
    assert path.read_text() == "v1" and not leftovers(disk.root)
    disk.free()
    write_text_atomic(path, "x" * (2 * MiB))
    assert path.stat().st_size == 2 * MiB


def test_training_checkpoint_keeps_the_previous_one(disk):
    from pipeline.training import checkpoint
    folder = disk.root / "checkpoints"
    checkpoint.write_plain(folder, {"update": 1, "w": torch.zeros(1000)})
    disk.fill(512 * 1024)
    with pytest.raises(DiskFull) as err:
        checkpoint.write_plain(folder, {"update": 2, "w": torch.zeros(MiB // 2)})     # 2 MiB of float32
    assert str(folder / checkpoint.NAME) in str(err.value) and "needs about 2.0 MiB" in str(err.value)
    assert checkpoint.load(folder)["update"] == 1 and not leftovers(disk.root)
    disk.free()
    checkpoint.write_plain(folder, {"update": 2, "w": torch.zeros(MiB // 2)})
    assert checkpoint.load(folder)["update"] == 2


def test_training_on_a_disk_that_fills_resumes_bit_exact(disk, tmp_path, base_manifest, pool, monkeypatch, caplog):
    """The train stage (smoke, 12 updates, a checkpoint every 2): the disk fills once the
    checkpoint after update 4 is written, so the one after update 6 fails. One line names
    checkpoints/latest.pt and its size; the run published nothing; the checkpoint after
    update 4 is intact. Space freed, the same call resumes after update 4 and ends with the
    weights and metrics of an undisturbed run."""
    import polars as pl
    from safetensors.torch import load_file

    from pipeline.core.config import load_config
    from pipeline.core.store import MANIFEST, Store
    from pipeline.dag import graph
    from pipeline.training import checkpoint
    from stages import train
    cfg = load_config("smoke", ["train.updates=12", "train.checkpoint_every=2", "train.method=grpo_tis",
                                "train.updates_per_step=3"])
    inputs, store = {"base": base_manifest, "pool": pool[2]}, Store(disk.root / "cache")
    folder = store.folder("train", graph.expected_key("train", cfg))
    save = checkpoint.save

    def save_then_fill(folder, **kwargs):
        save(folder, **kwargs)
        if kwargs["update"] == 4:
            disk.fill(4096)
    monkeypatch.setattr(checkpoint, "save", save_then_fill)
    with pytest.raises(DiskFull) as err:
        train.run(cfg, inputs, store=store)
    assert str(folder / "checkpoints" / checkpoint.NAME) in str(err.value) and "needs about" in str(err.value)
    assert "\n" not in str(err.value) and not (folder / MANIFEST).exists()
    assert checkpoint.load(folder / "checkpoints")["update"] == 4 and not leftovers(folder)
    disk.free()
    caplog.set_level("INFO", logger="ggpo")
    resumed = train.run(cfg, inputs, store=store)
    assert "resuming after update 4" in caplog.text
    straight = train.run(cfg, inputs, store=Store(tmp_path / "straight"))
    wa, wb = load_file(straight.path("weights")), load_file(resumed.path("weights"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert pl.read_parquet(resumed.path("metrics")).drop("seconds").equals(
        pl.read_parquet(straight.path("metrics")).drop("seconds"))


def test_policy_folder_keeps_the_previous_one(disk, base_manifest):
    """A trained policy's HF folder (final weights, snapshots): written whole under a temp
    name or not at all."""
    from pipeline.models.hf import load_model, load_tokenizer
    from pipeline.training import loop
    from stages.base_model import model_path
    model, tokenizer = load_model(model_path(base_manifest)), load_tokenizer(model_path(base_manifest))
    final = disk.root / "snapshots" / "update-4"
    loop.save_policy(model, tokenizer, final)
    before = {p.name: p.read_bytes() for p in final.iterdir()}
    disk.fill(0)
    with pytest.raises(DiskFull) as err:
        loop.save_policy(model, tokenizer, final)
    assert str(final) in str(err.value) and "needs about" in str(err.value)
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before and not leftovers(disk.root)


def _toy_stage():
    """A resumable stage: three checkpointed steps, then a 4 MiB output file."""
    from pipeline.dag.spec import Built, StageSpec
    from pipeline.training import checkpoint

    def build(config, inputs, folder: Path) -> Built:
        state = checkpoint.load(folder / "checkpoints")
        start = state["update"] if state else 0
        for step in range(start, 3):
            checkpoint.write_plain(folder / "checkpoints", {"update": step + 1, "w": torch.full((256,), step)})
        with open(folder / "out.bin", "wb") as f:     # a stage's output, written in place
            for _ in range(4):
                f.write(bytes(MiB))
        return Built(files={"out": ("out.bin", None)}, summary={"resumed_from": start})
    return StageSpec(name="toy", version=1, reads=(), build=build, keep_on_rebuild=("checkpoints",))


def test_stage_build_leaves_no_half_artifact_and_resumes(disk):
    from pipeline.core.config import load_config
    from pipeline.core.store import Store
    from pipeline.dag.spec import key_for, run_stage
    from pipeline.training import checkpoint
    spec, cfg, store = _toy_stage(), load_config("tiny"), Store(disk.root / "cache")
    folder = store.folder("toy", key_for(spec, cfg, {}))
    disk.fill(MiB)
    with pytest.raises(DiskFull) as err:
        run_stage(spec, cfg, {}, store)
    assert str(folder) in str(err.value) and "\n" not in str(err.value)
    assert store.load("toy", key_for(spec, cfg, {})) is None                  # nothing a later run reads
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoints"]        # the half output removed
    assert checkpoint.load(folder / "checkpoints")["update"] == 3 and not leftovers(folder)
    disk.free()
    manifest = run_stage(spec, cfg, {}, store)
    assert manifest.summary["resumed_from"] == 3 and manifest.files["out"].bytes == 4 * MiB
    assert store.load("toy", manifest.key) is not None


def test_manifest_commit_on_a_full_disk_publishes_nothing(disk, monkeypatch):
    """The build's files fit, the manifest does not: no manifest, so no later run reads it."""
    from pipeline.core.config import load_config
    from pipeline.core.store import Store
    from pipeline.dag.spec import key_for, run_stage
    spec, cfg, store = _toy_stage(), load_config("tiny"), Store(disk.root / "cache")
    real_commit = Store.commit

    def commit_on_a_full_disk(self, manifest):
        disk.fill(0)
        return real_commit(self, manifest)
    monkeypatch.setattr(Store, "commit", commit_on_a_full_disk)
    with pytest.raises(DiskFull) as err:
        run_stage(spec, cfg, {}, store)
    assert "manifest.json" in str(err.value)
    assert store.load("toy", key_for(spec, cfg, {})) is None
    monkeypatch.setattr(Store, "commit", real_commit)
    disk.free()
    assert run_stage(spec, cfg, {}, store).summary["resumed_from"] == 3


def test_online_rolling_checkpoint_keeps_the_previous_round(disk):
    from stages import online_cell
    cell = SimpleNamespace(folder=disk.root / "cell", writer=None)
    rounds = cell.folder / "checkpoints"

    def commit(r: int, floats: int) -> None:
        state = {"update": r, "w": torch.zeros(floats)}
        online_cell.commit_checkpoint(cell, rounds / f"round-{r:06d}", state, {"round": r, "update": r})
    commit(0, 1000)
    disk.fill(512 * 1024)
    cell.writer = online_cell.Writer(target=commit, args=(1, MiB // 2), daemon=True)   # in the background, as a cell does
    cell.writer.start()
    with pytest.raises(DiskFull) as err:
        online_cell.finish_writes(cell)
    assert "round-000001" in str(err.value) and "needs about 2.0 MiB" in str(err.value)
    assert f"previous checkpoint {rounds / 'round-000000'} is intact" in str(err.value)
    assert [r for r, _, _ in online_cell.checkpoints(cell.folder)] == [0] and not leftovers(disk.root)
    disk.free()
    commit(1, MiB // 2)
    assert [r for r, _, _ in online_cell.checkpoints(cell.folder)] == [0, 1]


def test_report_files_are_whole_or_the_previous_ones(disk):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipeline.core.store import write_file_atomic, write_text_atomic
    md, png = disk.root / "report.md", disk.root / "curves.png"
    fig = plt.figure(figsize=(30, 30))
    fig.gca().imshow(torch.rand(600, 600).numpy())      # noise: a PNG that does not compress
    write_text_atomic(md, "old report")
    disk.fill(64 * 1024)
    with pytest.raises(DiskFull) as err:
        write_file_atomic(png, lambda tmp: fig.savefig(tmp, dpi=100))
    plt.close(fig)
    assert str(png) in str(err.value) and not png.exists() and not leftovers(disk.root)
    with pytest.raises(DiskFull):
        write_text_atomic(md, "new report " * 20000)
    assert md.read_text() == "old report"


def test_native_writers_on_a_really_full_disk(tmp_path):
    """polars (a report's CSV) and pyarrow (a stage's Parquet) write from native code, which
    the injected `open` cannot see: the real disk only."""
    import polars as pl
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.core.schemas import write_parquet
    from pipeline.core.store import write_file_atomic
    disk = RealDisk(tmp_path / "fs")
    try:
        csv, parquet = disk.root / "report.csv", disk.root / "pool.parquet"
        schema = pa.schema([("text", pa.string())])
        write_file_atomic(csv, pl.DataFrame({"x": [1]}).write_csv)
        write_parquet({"text": ["old"]}, schema, parquet)
        disk.fill(64 * 1024)
        with pytest.raises(DiskFull) as err:
            write_file_atomic(csv, pl.DataFrame({"x": list(range(300_000))}).write_csv)
        assert str(csv) in str(err.value) and csv.read_text() == "x\n1\n"
        with pytest.raises(DiskFull) as err:
            write_parquet({"text": [os.urandom(1024).hex() for _ in range(1024)]}, schema, parquet)
        assert str(parquet) in str(err.value) and "needs about" in str(err.value)
        assert pq.read_table(parquet)["text"].to_pylist() == ["old"] and not leftovers(disk.root)
    finally:
        disk.close()


def test_mlflow_artifact_on_a_full_disk_is_one_line(disk, tmp_path):
    from pipeline.services import tracking
    client = tracking.Resilient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("disk", artifact_location=str(disk.root / "artifacts")))
    big = tmp_path / "table.csv"        # the source is on a roomy disk; the artifact store is full
    big.write_bytes(b"1,2\n" * (MiB // 2))
    disk.fill(64 * 1024)
    with pytest.raises(DiskFull) as err:
        client.log_artifact(run.info.run_id, str(big))
    assert str(big) in str(err.value) and "needs about 2.0 MiB" in str(err.value) and "\n" not in str(err.value)
    disk.free()
    client.log_artifact(run.info.run_id, str(big))


def test_cli_prints_one_line_with_what_to_do():
    from pipeline.cli import expected_error
    line = expected_error(DiskFull("disk full: writing /x/latest.pt needs about 2.0 MiB, 0.1 MiB free there"))
    assert line is not None and line.startswith("disk full: writing /x/latest.pt") and "rerun" in line
    assert "\n" not in line


def test_a_stage_on_a_really_full_disk_is_one_cli_line(tmp_path, monkeypatch, capsys):
    """`ggpo stage base` (the tiny model: safetensors, written from Rust) into a cache on a
    tmpfs that fills right after the preflight's space check passed (another process
    filled it): exit 2 and one line naming the build folder; no manifest; after space is
    freed the same command builds it."""
    from pipeline.cli import main
    from pipeline.core.store import Store
    from pipeline.dag import preflight
    disk = RealDisk(tmp_path / "fs")
    check_disk = preflight.check_disk

    def check_then_fill(*args, **kwargs):
        check_disk(*args, **kwargs)
        if not filled:
            disk.fill(16 * 1024)
            filled.append(True)
    filled: list[bool] = []
    monkeypatch.setattr(preflight, "check_disk", check_then_fill)
    try:
        monkeypatch.setenv("GGPO_CACHE", str(disk.root / "cache"))
        assert main(["stage", "base", "--preset", "tiny"]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ggpo:")]
        assert len(lines) == 1 and lines[0].startswith("ggpo: disk full") and "rerun" in lines[0], lines
        assert str(disk.root / "cache" / "base-") in lines[0]
        assert not Store(disk.root / "cache").entries()
        disk.free()
        assert main(["stage", "base", "--preset", "tiny"]) == 0
        assert [m.stage for m in Store(disk.root / "cache").entries()] == ["base"]
    finally:
        disk.close()


def test_online_cell_on_a_disk_that_fills_resumes_equal(disk, tmp_path, base_manifest, monkeypatch):
    """An online cell (4 rounds, a rolling checkpoint after each): the disk fills once the
    checkpoint after round 1 is written. The cell stops with one line; the round-1
    checkpoint is the latest complete one, nothing half-written is left in its folder;
    space freed, the same call resumes and ends with the policy of an undisturbed cell."""
    from safetensors.torch import load_file

    from pipeline.core.config import load_config
    from pipeline.core.store import Store
    from pipeline.dag import graph
    from stages import online_cell
    cfg = load_config("smoke-online", {"train.updates_per_step": 2, "train.method": "grpo_tis",
                                       "train.eval_every": None, "train.updates": 8, "online.checkpoint_every": 1})
    straight = Store(tmp_path / "straight")
    shutil.copytree(base_manifest.folder, straight.root / Path(base_manifest.folder).name)
    online_cell.run_cell(cfg, straight, base_manifest)
    store = Store(disk.root / "cache")
    shutil.copytree(base_manifest.folder, store.root / Path(base_manifest.folder).name)
    commit = online_cell.commit_checkpoint

    def commit_then_fill(cell, final, state, meta):
        commit(cell, final, state, meta)
        if meta["round"] == 1:
            disk.fill(4096)
    monkeypatch.setattr(online_cell, "commit_checkpoint", commit_then_fill)
    with pytest.raises(DiskFull) as err:
        online_cell.run_cell(cfg, store, base_manifest)
    assert str(store.root) in str(err.value) and "\n" not in str(err.value)
    folder = online_cell.state_folder(store, cfg)
    assert [r for r, _, _ in online_cell.checkpoints(folder)][-1] == 1
    assert not [p for p in (folder / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    disk.free()
    online_cell.run_cell(cfg, store, base_manifest)
    key = graph.expected_key("online_policy", cfg)
    a, b = (load_file(s.load("online_policy", key).path("weights")) for s in (straight, store))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_remote_artifact_mirrored_onto_a_full_disk(disk, tmp_path, monkeypatch):
    """A shared store (`file://` URL) read on a machine whose mirror disk is full: one line
    naming the mirror folder and the artifact's size (not "cannot reach the store"), no
    half mirror read; space freed, the same load mirrors it."""
    from pipeline.core.store import Store
    url = (tmp_path / "shared").as_uri()
    monkeypatch.setenv("GGPO_STAGING", str(tmp_path / "writer"))
    writer = Store(url)
    folder = writer.begin("toy", "a" * 64)
    (folder / "out.bin").write_bytes(os.urandom(2 * MiB))
    from pipeline.core.store import Manifest, file_entry, now_iso
    writer.commit(Manifest(stage="toy", key="a" * 64, version=1, folder=str(folder), config={}, inputs={},
                           files={"out": file_entry(folder, "out.bin")}, created_at=now_iso(), seconds=0.0))
    monkeypatch.setenv("GGPO_STAGING", str(disk.root / "reader"))
    reader = Store(url)
    disk.fill(64 * 1024)
    with pytest.raises(DiskFull) as err:
        reader.load("toy", "a" * 64)
    assert str(reader.folder("toy", "a" * 64)) in str(err.value) and "needs about 2.0 MiB" in str(err.value)
    assert not (reader.folder("toy", "a" * 64) / "manifest.json").exists() and not leftovers(disk.root)
    disk.free()
    assert reader.load("toy", "a" * 64) is not None
