"""Stages on real data: schemas, verify statuses, filter counts, determinism, resume, CLI."""
import os
import subprocess

import polars as pl
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from pipeline.core import schemas
from pipeline.core.config import load_config
from pipeline.core.errors import TrainingError
from pipeline.core.store import MANIFEST, Store
from pipeline.training import loop
from stages import filter as filt, rollout, train, verify

from conftest import BIN, REPO


def test_artifacts_match_declared_schemas(pool):
    roll, ver, fil = pool
    assert pq.read_schema(roll.path("rollouts")).remove_metadata() == schemas.ROLLOUTS
    assert pq.read_schema(roll.path("prompts")).remove_metadata() == schemas.PROMPTS
    assert pq.read_schema(ver.path("rewards")).remove_metadata() == schemas.REWARDS
    assert pq.read_schema(fil.path("train_pool")).remove_metadata() == schemas.TRAIN_POOL
    df = pl.read_parquet(roll.path("rollouts"))
    assert df.height == roll.files["rollouts"].rows == 48 * 8
    assert (df["behavior_logprobs"].list.len() == df["response_token_ids"].list.len()).all()
    assert set(df["engine"]) == {"transformers"} and set(df["finish_reason"]) <= {"stop", "length"}
    assert set(pl.read_parquet(ver.path("rewards"))["status"]) <= {"ok", "no_answer", "parse_error", "timeout"}


def test_write_parquet_rejects_missing_column_and_leaves_no_temp(tmp_path):
    with pytest.raises(Exception, match="reward"):
        schemas.write_parquet({"prompt_id": ["a"]}, schemas.REWARDS, tmp_path / "r.parquet")
    assert list(tmp_path.iterdir()) == []


def test_filter_counts_match_rewards(pool):
    roll, ver, fil = pool
    k = pl.read_parquet(ver.path("rewards")).group_by("group").agg(pl.col("reward").sum().alias("k"))["k"].to_list()
    s = fil.summary
    assert s["groups_total"] == 48 == len(k)
    assert s["groups_kept"] == sum(0 < x < 8 for x in k) > 0
    assert s["groups_all_correct"] == sum(x == 8 for x in k)
    assert s["groups_all_wrong"] == sum(x == 0 for x in k)
    kept = pl.read_parquet(fil.path("train_pool"))
    assert kept.height == 8 * s["groups_kept"]
    per = kept.group_by("group").agg(pl.col("reward").sum().alias("k"))["k"]
    assert ((per > 0) & (per < 8)).all()


def test_same_config_and_seed_same_pool_bytes_and_weights(tmp_path, smoke_cfg, base_manifest, pool):
    """A second store rebuilds everything from scratch: identical pool bytes, identical weights."""
    other = Store(tmp_path / "cache")
    roll = rollout.run(smoke_cfg, {"base": base_manifest}, store=other)
    ver = verify.run(smoke_cfg, {"rollout": roll}, store=other)
    fil = filt.run(smoke_cfg, {"rollout": roll, "verify": ver}, store=other)
    assert roll.path("rollouts").read_bytes() == pool[0].path("rollouts").read_bytes()
    assert fil.path("train_pool").read_bytes() == pool[2].path("train_pool").read_bytes()
    a = train.run(smoke_cfg, {"base": base_manifest, "pool": fil}, store=other)
    b = train.run(smoke_cfg, {"base": base_manifest, "pool": fil}, store=Store(tmp_path / "cache2"))
    wa, wb = load_file(a.path("weights")), load_file(b.path("weights"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a.summary["group_order_sha256"] == b.summary["group_order_sha256"]
    base_w = load_file(base_manifest.path("weights"))
    assert any(not torch.equal(wa[k], base_w[k]) for k in wa)   # training moved the weights
    other_seed = rollout.run(load_config("smoke", ["seed=7"]), {"base": base_manifest}, store=other)
    assert other_seed.files["rollouts"].sha256 != roll.files["rollouts"].sha256


@pytest.mark.parametrize("overrides", [{}, {"train.anchor": "old", "train.updates_per_step": 4}],
                         ids=["behavior-anchor", "old-anchor-resume-inside-step"])
def test_crash_resumes_from_last_checkpoint(tmp_path, base_manifest, pool, monkeypatch, overrides):
    """Training dies during update 4; the folder keeps the update-2 checkpoint and no
    manifest; the rerun resumes there and ends with the uninterrupted run's weights. With
    the old-policy anchor the checkpoint sits inside a step, so lp_old must come back too."""
    fil, smoke_cfg = pool[2], load_config("smoke", overrides)
    straight = train.run(smoke_cfg, {"base": base_manifest, "pool": fil}, store=Store(tmp_path / "a"))
    store = Store(tmp_path / "b")
    real, calls = loop.run_update, []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt("simulated crash")
        return real(*args, **kwargs)
    monkeypatch.setattr(loop, "run_update", dying)
    with pytest.raises(KeyboardInterrupt):
        train.run(smoke_cfg, {"base": base_manifest, "pool": fil}, store=store)
    folder = store.folder("train", straight.key)
    assert not (folder / MANIFEST).exists() and (folder / "checkpoints" / "latest.pt").exists()
    monkeypatch.setattr(loop, "run_update", real)
    calls.clear()
    resumed = train.run(smoke_cfg, {"base": base_manifest, "pool": fil}, store=store)
    wa, wb = load_file(straight.path("weights")), load_file(resumed.path("weights"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    metrics = pl.read_parquet(resumed.path("metrics"))
    assert metrics["update"].to_list() == [1, 2, 3, 4]
    if overrides:   # at a step start the anchor is the learner itself: nothing is clipped
        assert metrics["clip_frac"][0] == 0.0


def test_train_rejects_mismatched_group_size(smoke_cfg, base_manifest, pool):
    cfg = load_config("smoke", ["rollout.group_size=4"])
    with pytest.raises(TrainingError, match="group_size=4 but the pool was built with group_size=8"):
        train.run(cfg, {"base": base_manifest, "pool": pool[2]}, store=Store(os.environ["GGPO_CACHE"]))


def ggpo(*args, env=None):
    return subprocess.run([str(BIN / "ggpo"), *args], capture_output=True, text=True, cwd=REPO,
                          env=os.environ | (env or {}), timeout=600)


def test_cli_stage_train_without_pool_says_how_to_build_it(tmp_path):
    res = ggpo("stage", "train", "--preset", "smoke", env={"GGPO_CACHE": str(tmp_path)})
    assert res.returncode == 2
    assert "input 'pool' from stage 'filter'" in res.stderr and "ggpo stage filter --preset smoke" in res.stderr


def test_cli_retrain_reuses_pool(pool):
    fil = pool[2]
    before = fil.path("train_pool").stat().st_mtime_ns
    res = ggpo("stage", "train", "--preset", "smoke", "--force", "--set", "train.lr=2e-5", "--no-track")
    assert res.returncode == 0, res.stderr
    assert "train: built" in res.stdout
    again = Store().load("filter", fil.key)
    assert again is not None and again.key == fil.key
    assert fil.path("train_pool").stat().st_mtime_ns == before     # the pool was not rewritten
    listing = ggpo("cache", "ls")
    assert listing.returncode == 0 and "filter" in listing.stdout and fil.key[:16] in listing.stdout
