"""Artifact integrity: a damaged cached artifact (truncated, missing or altered at the same
size) is detected before any read, `ggpo cache verify` names it, `ggpo stage` rebuilds it
from intact inputs, and `ggpo cache gc` removes interrupted builds only when told to.

Artifacts are copied from the session cache into a private store first: the session's
own cache stays intact for the other tests."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.core.errors import DamagedArtifact
from pipeline.core.store import MANIFEST, Manifest, Store, sha256_file
from pipeline.dag import graph
from pipeline.dag.spec import Built, StageSpec, run_stage


def copy_artifact(manifest: Manifest, store: Store) -> Manifest:
    """The artifact copied into `store`, its manifest pointing at the copy."""
    folder = store.root / Path(manifest.folder).name
    shutil.copytree(manifest.folder, folder)
    moved = manifest.model_copy(update={"folder": str(folder), "cache_hit": False})
    (folder / MANIFEST).write_text(moved.model_dump_json(indent=2))
    return moved


def damage(path: Path, how: str) -> None:
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "missing":
        path.unlink()
    else:   # one byte flipped in the middle: size and Parquet footer unchanged
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


def reader_spec(reads: list) -> StageSpec:
    """A stage that records whether its build ever ran (i.e. read its input)."""
    def build(cfg, inputs, folder: Path) -> Built:
        reads.append(inputs["pool"].path("train_pool"))
        (folder / "out.txt").write_text("read")
        return Built(files={"out": ("out.txt", 1)})
    return StageSpec(name="toy", version=1, reads=("seed",), build=build)


@pytest.mark.parametrize("how, says", [("truncated", "manifest says"), ("missing", "is missing"),
                                       ("altered", "altered")])
def test_damaged_input_is_detected_before_any_read(how, says, pool, smoke_cfg, tmp_path, monkeypatch, capsys):
    store = Store(tmp_path / "cache")
    filt = copy_artifact(pool[2], store)
    path = filt.path("train_pool")
    size = path.stat().st_size
    assert store.check(filt) == [] and store.load("filter", filt.key) is not None
    damage(path, how)
    if how == "altered":
        assert path.stat().st_size == size       # only the hash can see this one

    problems = store.check(filt)
    assert len(problems) == 1 and "train_pool.parquet" in problems[0] and says in problems[0]
    assert f"filter-{filt.key[:16]}" in problems[0]
    assert store.load("filter", filt.key) is None         # a damaged artifact is never a cache hit

    reads = []
    with pytest.raises(DamagedArtifact, match=r"input 'pool' is damaged: .*train_pool\.parquet") as err:
        run_stage(reader_spec(reads), smoke_cfg, {"pool": filt}, store)
    assert reads == [] and "\n" not in str(err.value)

    monkeypatch.setenv("GGPO_CACHE", str(store.root))
    assert main(["cache", "verify"]) == 2
    out = capsys.readouterr().out
    assert f"filter-{filt.key[:16]}" in out and "train_pool.parquet" in out and "1 damaged" in out


def test_parquet_footer_checked_without_hashing(pool, tmp_path):
    store = Store(tmp_path / "cache")
    filt = copy_artifact(pool[2], store)
    path = filt.path("train_pool")
    data = bytearray(path.read_bytes())
    data[-1:] = b"X"                                     # same size, no PAR1 at the end
    path.write_bytes(bytes(data))
    assert "does not end with PAR1" in store.check(filt, hashes=False)[0]


def test_stage_rebuilds_a_damaged_input_from_intact_inputs(pool, base_manifest, smoke_cfg, tmp_path, caplog):
    store = Store(tmp_path / "cache")
    for manifest in (base_manifest, *pool):
        copy_artifact(manifest, store)
    filt = store.load("filter", pool[2].key)
    original = filt.files["train_pool"].sha256
    damage(filt.path("train_pool"), "truncated")

    inputs = graph.cached_inputs("train", smoke_cfg, store, "smoke")
    assert not inputs["pool"].cache_hit and inputs["pool"].key == pool[2].key
    assert sha256_file(inputs["pool"].path("train_pool")) == original     # the same pool, rebuilt
    assert any("will be rebuilt" in r.message and "train_pool.parquet" in r.message for r in caplog.records)

    damage(inputs["pool"].path("train_pool"), "missing")
    with pytest.raises(DamagedArtifact, match=r"`ggpo stage filter --preset smoke --force`"):
        graph.cached_inputs("train", smoke_cfg, store, "smoke", rebuild_damaged=False)


def test_cache_gc_dry_run_then_yes(pool, tmp_path, monkeypatch, capsys):
    store = Store(tmp_path / "cache")
    roll = copy_artifact(pool[0], store)
    interrupted = store.root / "rollout-0123456789abcdef"
    interrupted.mkdir()
    (interrupted / "rollouts.parquet").write_bytes(b"x" * 3000)
    resumable = store.root / "train-fedcba9876543210"
    (resumable / "checkpoints").mkdir(parents=True)
    (resumable / "checkpoints" / "state.pt").write_bytes(b"y" * 10)
    stale = json.loads((Path(roll.folder) / MANIFEST).read_text()) | {"version": 0, "key": "ab" * 32}
    stale_folder = store.root / f"rollout-{'ab' * 8}"
    stale_folder.mkdir()
    (stale_folder / MANIFEST).write_text(json.dumps(stale | {"folder": str(stale_folder)}))
    monkeypatch.setenv("GGPO_CACHE", str(store.root))

    assert main(["cache", "gc"]) == 0
    out = capsys.readouterr().out
    assert "would remove rollout-0123456789abcdef" in out and "interrupted build" in out and "2.9K" in out
    assert f"would remove rollout-{'ab' * 8}" in out and f"the code is v{graph.spec('rollout').version}" in out
    assert "train-fedcba9876543210" not in out and Path(roll.folder).name not in out
    assert interrupted.exists() and stale_folder.exists()          # a dry run deletes nothing

    assert main(["cache", "gc", "--yes"]) == 0
    assert not interrupted.exists() and not stale_folder.exists()
    assert resumable.exists() and store.load("rollout", roll.key) is not None
    assert main(["cache", "gc", "--yes", "--all"]) == 0
    assert not resumable.exists() and Path(roll.folder).exists()


def test_hash_is_remembered_per_file_version(tmp_path):
    from pipeline.core.store import sha256_cached
    path = tmp_path / "f.bin"
    path.write_bytes(b"a" * 100)
    first = sha256_cached(path)
    path.write_bytes(b"b" * 100)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert sha256_cached(path) == sha256_file(path) != first


def test_cache_gc_unreferenced_keeps_what_a_preset_expects(pool, tmp_path, monkeypatch, capsys):
    store = Store(tmp_path / "cache")
    roll = copy_artifact(pool[0], store)          # the smoke preset's own pool: kept
    other = json.loads((Path(roll.folder) / MANIFEST).read_text()) | {"key": "cd" * 32}
    folder = store.root / f"rollout-{'cd' * 8}"    # a complete, current artifact of another config
    shutil.copytree(roll.folder, folder)
    (folder / MANIFEST).write_text(json.dumps(other | {"folder": str(folder)}))
    monkeypatch.setenv("GGPO_CACHE", str(store.root))
    assert main(["cache", "gc"]) == 0
    assert "0 folders" in capsys.readouterr().out             # by default complete artifacts stay
    assert main(["cache", "gc", "--unreferenced", "--yes"]) == 0
    out = capsys.readouterr().out
    assert f"removing rollout-{'cd' * 8}" in out and "unreferenced" in out and Path(roll.folder).name not in out
    assert not folder.exists() and store.load("rollout", roll.key) is not None
