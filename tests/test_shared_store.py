"""The store beyond one folder: a copied cache, a `file://` URL, an S3 endpoint.

- A cache copied elsewhere reads only its own files: the original is deleted after the
  copy, the copy still loads, `model_path` points inside it and a stage runs on it.
- `GGPO_CACHE=file://…` and `GGPO_CACHE=s3://bucket/prefix` against a local S3 server
  (moto, bound to 127.0.0.1 on a free port): the real `filter` stage writes through the
  store, another process (its own staging folder) reads the artifact and the base model.
- An artifact whose manifest is missing (files uploaded, manifest not) is never read.
- Bad input is one line before any work: an endpoint that does not answer, no
  credentials, a missing bucket, an unknown protocol or one whose package is missing.

How a user points the store at an S3-compatible endpoint (both are exercised here):
the standard `AWS_ENDPOINT_URL` that botocore reads, or `GGPO_CACHE_OPTIONS` (JSON of
fsspec storage options, e.g. `{"endpoint_url": "http://host:9000"}`). Credentials: the
usual `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (dummy values for moto).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.config import load_config
from pipeline.core.errors import DamagedArtifact, StoreError
from pipeline.core.store import MANIFEST, Manifest, Store, check_store
from stages import filter as filt
from stages.base_model import model_path

from conftest import REPO, free_port

BUCKET = "ggpo-test"


def publish(manifest: Manifest, store: Store) -> Manifest:
    """An artifact of the session cache put into `store` the way a stage would: built into
    the folder `begin` gives, then `commit` (remote: upload, manifest last)."""
    folder = store.begin(manifest.stage, manifest.key)
    shutil.copytree(manifest.folder, folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MANIFEST))
    return store.commit(manifest.model_copy(update={"folder": str(folder), "cache_hit": False}))


def inside(path: str | Path, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


# --- a copied cache --------------------------------------------------------------------

def test_copied_cache_reads_only_its_own_files(tmp_path, smoke_cfg, base_manifest, pool):
    roll, ver, _ = pool
    original = Store(tmp_path / "original")
    for m in (base_manifest, roll, ver):
        publish(m, original)
    # as manifests written before this change did: an absolute path to the original model
    old = json.loads((original.folder("base", base_manifest.key) / MANIFEST).read_text())
    old["summary"]["model_path"] = str(original.folder("base", base_manifest.key) / "model")
    (original.folder("base", base_manifest.key) / MANIFEST).write_text(json.dumps(old))
    shutil.copytree(original.root, tmp_path / "copy")
    shutil.rmtree(original.root)        # whatever the copy reads now, it reads from itself
    copy = Store(tmp_path / "copy")
    base = copy.load("base", base_manifest.key)
    assert base is not None and inside(base.folder, copy.root)
    assert inside(model_path(base), copy.root) and Path(model_path(base), "config.json").exists()
    on_disk = json.loads((Path(base.folder) / MANIFEST).read_text())
    assert on_disk["folder"] == Path(base.folder).name
    inputs = {"rollout": copy.load("rollout", roll.key), "verify": copy.load("verify", ver.key)}
    built = filt.run(smoke_cfg, inputs, store=copy)       # a real stage reading the copy
    assert not built.cache_hit and inside(built.path("train_pool"), copy.root)
    assert built.files["train_pool"].sha256 == pool[2].files["train_pool"].sha256
    assert str(tmp_path) not in (Path(built.folder) / MANIFEST).read_text()     # no absolute path in it


def test_model_path_of_any_stage_with_weights(tmp_path):
    files = {"weights": {"path": "model/model.safetensors", "bytes": 1, "sha256": "0"},
             "snapshot_2": {"path": "snapshots/update_00002/model.safetensors", "bytes": 1, "sha256": "0"}}
    m = Manifest(stage="online_train", key="ab" * 32, version=1, folder=str(tmp_path / "x"), config={},
                 inputs={}, files=files, summary={"model_path": "/elsewhere/model"}, created_at="", seconds=0)
    assert model_path(m) == str(tmp_path / "x" / "model")           # never the summary's path
    assert model_path(m, 2) == str(tmp_path / "x" / "snapshots" / "update_00002")
    with pytest.raises(ValueError, match=r"has snapshots at \[2\]"):
        model_path(m, 3)
    external = m.model_copy(update={"stage": "base", "files": {}, "summary": {"model_path": "Qwen/Qwen3-1.7B"}})
    assert model_path(external) == model_path(external, 5) == "Qwen/Qwen3-1.7B"


# --- a remote store: file:// and S3 ----------------------------------------------------

READER = """
import json, sys
import polars as pl
from pipeline.models.hf import load_tokenizer
from pipeline.core.store import Store
from stages.base_model import model_path
store = Store()
pool, base = store.load("filter", sys.argv[1]), store.load("base", sys.argv[2])
print(json.dumps({"folder": pool.folder, "rows": pl.read_parquet(pool.path("train_pool")).height,
                  "sha": pool.files["train_pool"].sha256, "model": model_path(base),
                  "vocab": len(load_tokenizer(model_path(base))), "missing": store.load("filter", "0" * 64) is None}))
"""


def read_elsewhere(url: str, keys: list[str], staging: Path, env: dict) -> dict:
    """Another process, with its own staging folder, reads the artifacts `keys` from `url`."""
    env = {**os.environ, **env, "GGPO_CACHE": url, "GGPO_STAGING": str(staging)}
    out = subprocess.run([sys.executable, "-c", READER, *keys], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_then_read_elsewhere(url: str, tmp_path, monkeypatch, smoke_cfg, base_manifest, pool, env: dict):
    """The filter stage writes through the store at `url`; another process reads it back."""
    roll, ver, filtered = pool
    monkeypatch.setenv("GGPO_STAGING", str(tmp_path / "writer"))
    store = Store(url)
    assert store.url == url and inside(store.root, tmp_path / "writer")
    base = publish(base_manifest, store)
    inputs = {"rollout": publish(roll, store), "verify": publish(ver, store)}
    built = filt.run(smoke_cfg, inputs, store=store)
    assert not built.cache_hit and built.key == filtered.key and inside(built.folder, store.root)
    remote_manifest = json.loads(store.remote.read_manifest(Path(built.folder).name))
    assert remote_manifest["folder"] == Path(built.folder).name      # relative to the store root
    assert filt.run(smoke_cfg, inputs, store=Store(url)).cache_hit
    got = read_elsewhere(url, [built.key, base.key], tmp_path / "reader", env)
    assert inside(got["folder"], tmp_path / "reader") and inside(got["model"], tmp_path / "reader")
    assert got["rows"] == built.files["train_pool"].rows and got["sha"] == filtered.files["train_pool"].sha256
    assert got["vocab"] > 10 and got["missing"]
    return store, built


def test_file_url_store_write_here_read_elsewhere(tmp_path, monkeypatch, smoke_cfg, base_manifest, pool):
    url = (tmp_path / "shared").as_uri()
    store, built = write_then_read_elsewhere(url, tmp_path, monkeypatch, smoke_cfg, base_manifest, pool, {})
    remote_folder = tmp_path / "shared" / Path(built.folder).name
    assert (remote_folder / MANIFEST).exists() and (remote_folder / "train_pool.parquet").exists()
    # the model folder went whole, including files the manifest does not list
    base_remote = tmp_path / "shared" / f"base-{base_manifest.key[:16]}" / "model"
    assert (base_remote / "tokenizer_config.json").exists()


def test_concurrent_loads_fetch_once(tmp_path, monkeypatch, pool):
    """Threads of a flow loading one remote artifact at once all get it intact."""
    from concurrent.futures import ThreadPoolExecutor
    url = (tmp_path / "shared").as_uri()
    monkeypatch.setenv("GGPO_STAGING", str(tmp_path / "writer"))
    published = publish(pool[0], Store(url))
    monkeypatch.setenv("GGPO_STAGING", str(tmp_path / "reader"))
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda _: Store(url).inspect("rollout", published.key), range(8)))
    assert all(m is not None and problems == [] for m, problems in got)
    assert inside(got[0][0].path("rollouts"), tmp_path / "reader")
    # a manifest made on another machine (the writer's folder) resolved on this one
    monkeypatch.setenv("GGPO_STAGING", str(tmp_path / "worker"))
    here = Store(url).resolve(published)
    assert inside(here.folder, tmp_path / "worker") and Store(url).check(here) == []
    with pytest.raises(DamagedArtifact, match="has no manifest there"):
        Store(url).resolve(published.model_copy(update={"key": "0" * 64}))


@pytest.fixture(scope="module")
def s3_endpoint():
    """A local S3 server (moto) on 127.0.0.1 with one bucket; its URL."""
    from moto.server import ThreadedMotoServer
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import s3fs
    s3fs.S3FileSystem(key="test", secret="test", endpoint_url=endpoint, skip_instance_cache=True).mkdir(BUCKET)
    yield endpoint
    server.stop()


@pytest.fixture
def s3_env(monkeypatch, s3_endpoint):
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def test_s3_store_write_here_read_elsewhere(tmp_path, monkeypatch, s3_endpoint, s3_env, smoke_cfg,
                                            base_manifest, pool, capsys):
    url = f"s3://{BUCKET}/run-{tmp_path.name}"
    # here the endpoint comes from GGPO_CACHE_OPTIONS, in the reader from AWS_ENDPOINT_URL
    monkeypatch.setenv("GGPO_CACHE_OPTIONS", json.dumps({"endpoint_url": s3_endpoint}))
    check_store(url)
    reader_env = s3_env | {"AWS_ENDPOINT_URL": s3_endpoint, "GGPO_CACHE_OPTIONS": ""}
    store, built = write_then_read_elsewhere(url, tmp_path, monkeypatch, smoke_cfg, base_manifest, pool, reader_env)
    from pipeline.cli import main
    monkeypatch.setenv("GGPO_CACHE", url)
    assert main(["cache", "ls"]) == 0 and main(["cache", "verify"]) == 0
    assert main(["cache", "gc"]) == 2
    out = capsys.readouterr()
    assert f"filter    {built.key[:16]}" in out.out and "all intact" in out.out and f"root: {url}" in out.out
    assert "not supported for remote stores yet" in out.err


def test_s3_artifact_without_manifest_is_never_read(tmp_path, monkeypatch, s3_endpoint, s3_env, smoke_cfg, pool):
    roll, ver, filtered = pool
    url = f"s3://{BUCKET}/partial-{tmp_path.name}"
    monkeypatch.setenv("GGPO_CACHE_OPTIONS", json.dumps({"endpoint_url": s3_endpoint}))
    monkeypatch.setenv("GGPO_STAGING", str(tmp_path / "writer"))
    store = Store(url)
    name = Path(filtered.folder).name
    store.remote.upload(Path(filtered.folder), name)            # an upload cut before its manifest
    assert "train_pool.parquet" in store.remote.files(name) and MANIFEST not in store.remote.files(name)
    monkeypatch.setenv("GGPO_STAGING", str(tmp_path / "reader"))
    reader = Store(url)
    assert reader.inspect("filter", filtered.key) == (None, []) and reader.load("filter", filtered.key) is None
    assert not reader.folder("filter", filtered.key).exists()       # nothing was downloaded
    inputs = {"rollout": publish(roll, reader), "verify": publish(ver, reader)}
    rebuilt = filt.run(smoke_cfg, inputs, store=reader)           # a miss: the stage builds it again
    assert not rebuilt.cache_hit and rebuilt.key == filtered.key
    # a published artifact whose file is then lost remotely is not read either
    store.remote.fs.rm(f"{store.remote.path(name)}/train_pool.parquet")
    monkeypatch.setenv("GGPO_STAGING", str(tmp_path / "third"))
    manifest, problems = Store(url).inspect("filter", filtered.key)
    assert len(problems) == 1 and "train_pool.parquet is missing at s3://" in problems[0]


def test_s3_one_build_of_a_key_at_a_time(tmp_path, monkeypatch, s3_endpoint, s3_env):
    """The store's own claim on a key (a conditional put, If-None-Match: *): a second claim
    gets the first one's record, a release that is not the holder's keeps it; a stage run
    whose key another machine builds (its flock is on that machine) stops in one StoreError
    line naming the holder; once the claim is gone the key is built and its claim removed."""
    from test_store import counting_spec

    from pipeline.core import remote_store
    from pipeline.dag.spec import key_for, run_stage
    url = f"s3://{BUCKET}/claims-{tmp_path.name}"
    monkeypatch.setenv("GGPO_CACHE_OPTIONS", json.dumps({"endpoint_url": s3_endpoint}))
    monkeypatch.setenv("GGPO_STAGING", str(tmp_path / "here"))
    store, cfg, calls = Store(url), load_config("smoke"), []
    name = store.folder("toy", key_for(counting_spec(calls), cfg, {})).name
    other = json.dumps({"pid": 7, "host": "another-box", "since": "2026-12-03T10:00:00Z"})
    assert remote_store.claim(store.remote, name, other) is None
    assert remote_store.claim(store.remote, name, "mine") == other
    remote_store.release(store.remote, name, "mine")        # not the holder: kept
    with pytest.raises(StoreError) as err:
        run_stage(counting_spec(calls), cfg, {}, store)
    line = str(err.value)
    assert "\n" not in line and calls == [] and line.startswith(f"artifact {name} (stage toy) at {url} is being built by "
                                                                 f"process 7 on host another-box")
    assert f"(claim {url}/.locks/{name}.json)" in line
    remote_store.release(store.remote, name, other)
    built = run_stage(counting_spec(calls), cfg, {}, store)
    assert not built.cache_hit and len(calls) == 1
    assert not store.remote.fs.exists(remote_store.lock_path(store.remote, name))


# --- bad input -------------------------------------------------------------------------

def test_unreachable_endpoint_is_one_line(monkeypatch, s3_env):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")    # nobody listens
    with pytest.raises(StoreError) as err:      # the store's own connect timeout ends it
        check_store(f"s3://{BUCKET}/x")
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"GGPO_CACHE=s3://{BUCKET}/x: the store does not answer")


def test_missing_credentials_and_bucket_are_one_line(monkeypatch, tmp_path, s3_endpoint, s3_env):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    with pytest.raises(StoreError, match="the bucket 'no-such-bucket' does not exist"):
        check_store("s3://no-such-bucket/x")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreError, match=r"no credentials for 's3'.*AWS_ACCESS_KEY_ID"):
        check_store(f"s3://{BUCKET}/x")


@pytest.mark.parametrize("url, says", [
    ("nosuch://bucket/x", "unknown protocol 'nosuch'"),
    ("gs://bucket/x", "needs a package that is not installed (pip install gcsfs)"),
])
def test_unknown_protocol_is_one_line(url, says):
    if url.startswith("gs://") and importlib.util.find_spec("gcsfs"):
        pytest.skip("gcsfs is installed here")
    with pytest.raises(StoreError) as err:
        check_store(url)
    assert str(err.value).startswith(f"GGPO_CACHE={url}: ") and says in str(err.value)


def test_bad_options_and_local_root(monkeypatch, tmp_path):
    monkeypatch.setenv("GGPO_CACHE_OPTIONS", "{endpoint")
    with pytest.raises(StoreError, match="GGPO_CACHE_OPTIONS is not JSON"):
        check_store("s3://b/x")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StoreError, match="cannot create the cache folder"):
        check_store(blocker / "cache")
    check_store(tmp_path / "fine")
    assert (tmp_path / "fine").is_dir()
