"""What one online round hands the next (stages/online_round.py) and how the cell hands its
stages what it holds: typed records that read and write the summaries cached rounds carry,
stage builds that take the cell's context (no build only raises), a one-line answer where
that context is missing, and the round's pool handed on in memory equal to its artifact."""
from __future__ import annotations

import shutil
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from pipeline.core.config import load_config
from pipeline.core.errors import ExpectedError, MissingContext
from pipeline.core.store import Manifest, Store
from pipeline.dag.spec import run_stage
from stages import online_policy, online_pool, online_train
from stages.online_round import RoundPool, RoundRecord, RoundStart

# a record as online_train wrote it before the records existed (the drift columns included)
SUMMARY = {"method": "grpo_tis", "seed": 42, "round": 3, "first_update": 6, "updates": 8, "t_ref": 10,
           "prompt_cursor": 96, "cumulative_prompts": 96, "cumulative_responses": 768, "train_seconds": 1.25,
           "final_reward": 0.5, "final_loss": -0.01, "k3_mismatch_first": 0.0, "max_abs_log_ratio_first": 0.0,
           "round_drift": 0.04, "round_drift_seq": 0.3}


def manifest(stage: str, summary: dict) -> Manifest:
    return Manifest(stage=stage, key="k" * 64, version=1, folder="/nowhere", config={}, inputs={}, files={},
                    summary=summary, created_at="2026-01-01T00:00:00Z", seconds=0.0)


def test_a_round_record_reads_and_writes_the_cached_summary_unchanged():
    record = RoundRecord.from_summary(SUMMARY)
    assert record.to_summary() == SUMMARY and list(record.to_summary()) == list(SUMMARY)
    old = {k: v for k, v in SUMMARY.items() if not k.startswith("round_drift")}    # before the drift existed
    assert RoundRecord.from_summary(old).round_drift is None


def test_a_round_starts_where_the_one_before_ended():
    assert RoundStart.after(manifest("base", {})) == RoundStart(0, 0, 0, 0, 0)
    assert RoundStart.after(manifest("online_train", SUMMARY)) == RoundStart(
        round=4, update=8, prompt_cursor=96, cumulative_prompts=96, cumulative_responses=768)


def test_the_record_carries_the_pools_cursor_and_counts_on():
    pool = RoundPool(round=3, start_update=6, groups_kept=4, prompt_cursor=96, cumulative_prompts=96,
                     cumulative_responses=768)
    rows = [{"update": 7, "seconds": 0.5, "reward": 0.25, "loss": 0.1, "k3_mismatch": 0.0, "max_abs_log_ratio": 0.0,
             "round_drift": None, "round_drift_seq": None},
            {"update": 8, "seconds": 0.75, "reward": 0.5, "loss": -0.01, "k3_mismatch": 0.1, "max_abs_log_ratio": 0.2,
             "round_drift": 0.04, "round_drift_seq": 0.3}]
    cfg = load_config("smoke-online", {"train.method": "grpo_tis", "train.updates_per_step": 2})
    record = online_train.round_record(cfg, pool, rows)
    assert record.next_start() == RoundStart(4, 8, 96, 96, 768)
    assert record.to_summary() == SUMMARY | {"t_ref": cfg.train.refresh_every() or "fixed"}


@pytest.mark.parametrize("spec,inputs", [(online_pool.SPEC, {"policy": "base"}),
                                         (online_train.SPEC, {"base": "base", "pool": "online_pool"}),
                                         (online_policy.SPEC, {"round": "online_train"})])
def test_a_cell_stage_asked_to_build_without_its_cell_says_what_builds_it(tmp_path, spec, inputs):
    """Every online stage's SPEC build builds (given its context); without the context a
    cache miss is one line naming the cell's command, an ExpectedError."""
    cfg = load_config("smoke-online", {})
    given = {name: manifest(stage, {}) for name, stage in inputs.items()}
    with pytest.raises(MissingContext, match=r"is not in the cache and is not built alone: .*`ggpo stage online`") as err:
        run_stage(spec, cfg, given, Store(tmp_path))
    assert isinstance(err.value, ExpectedError) and spec.context is not None
    assert not list(tmp_path.glob(f"{spec.name}-*"))      # nothing begun


def test_the_pool_handed_to_training_in_memory_equals_its_artifact(tmp_path, base_manifest):
    """The sampler's pool goes to training as an Arrow table cast through TRAIN_POOL: the
    same schema and values a re-read of the artifact gives (polars frames equal too)."""
    from pipeline.models.engines import make_engine
    from stages.base_model import model_path
    cfg = load_config("smoke-online", {"train.updates_per_step": 2, "train.method": "grpo_tis"})
    shutil.copytree(base_manifest.folder, tmp_path / Path(base_manifest.folder).name)
    rc = cfg.rollout
    engine = make_engine(rc.engine, model_path(base_manifest), rc.batch_prompts, cfg.model.threads, rollout_cfg=rc,
                         device=cfg.train.device, seed=cfg.seed, resident=True)
    ctx = online_pool.Sampler(engine)
    pool = run_stage(online_pool.SPEC, cfg, {"policy": base_manifest}, Store(tmp_path), ctx=ctx)
    assert ctx.table is not None and not pool.cache_hit
    on_disk = pq.read_table(pool.path("train_pool"))
    assert ctx.table.schema.equals(on_disk.schema) and ctx.table.equals(on_disk)
    assert pl.from_arrow(ctx.table).equals(pl.read_parquet(pool.path("train_pool")))
