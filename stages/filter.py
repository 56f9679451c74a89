"""Stage `filter`: mixed-reward filtering (spec section 8.2).

Reads `rollout.group_size`; inputs `rollout`, `verify`. Keeps group g iff
max_i r[g,i] > min_i r[g,i] (binary rewards: 0 < successes < m); groups with all-equal
rewards carry no learning signal for any method and are dropped before any loss.
Writes `train_pool.parquet` (schema TRAIN_POOL: the kept groups' rollout rows with reward
and status, sorted by group then sample) and stats: groups kept, all-correct, all-wrong.
"""
from __future__ import annotations

from pathlib import Path
from typing import cast

import polars as pl

from pipeline.core.config import PipelineConfig
from pipeline.core.schemas import TRAIN_POOL, write_parquet
from pipeline.core.store import Manifest, Store
from pipeline.dag.spec import Built, StageSpec, run_stage


def keep_mixed(rows: pl.DataFrame, m: int, where: str = "filter") -> tuple[pl.DataFrame, dict]:
    """(the rows of mixed-reward groups sorted by group and sample, counts). `rows` has one
    row per response with `group`, `sample`, `reward`; every group must hold m rows. The
    imported pools (stages/pool_import.py) are filtered here too."""
    per_group = rows.group_by("group").agg(
        pl.len().alias("n"), pl.col("reward").max().alias("hi"), pl.col("reward").min().alias("lo"))
    bad = per_group.filter(pl.col("n") != m)
    if bad.height:
        raise ValueError(f"{where}: group {bad['group'][0]} has {bad['n'][0]} responses, "
                         f"expected rollout.group_size={m}")
    kept = per_group.filter(pl.col("hi") > pl.col("lo"))["group"]
    pool = rows.filter(pl.col("group").is_in(kept.implode())).sort(["group", "sample"])
    same = per_group.filter(pl.col("lo") == pl.col("hi"))
    stats = {
        "groups_total": per_group.height, "groups_kept": kept.len(),
        "groups_all_correct": same.filter(pl.col("hi") > 0.5).height,
        "groups_all_wrong": same.filter(pl.col("hi") <= 0.5).height,
        # polars types a mean as any scalar: of a non-empty float column it is a float
        "responses_kept": pool.height, "pool_mean_reward": cast(float, pool["reward"].mean()) if pool.height else 0.0,
    }
    return pool, stats


def build(cfg: PipelineConfig, inputs: dict[str, Manifest], folder: Path) -> Built:
    rewards = pl.read_parquet(inputs["verify"].path("rewards"), columns=["group", "sample", "reward", "status"])
    rows = pl.read_parquet(inputs["rollout"].path("rollouts")).join(rewards, on=["group", "sample"], how="inner")
    pool, stats = keep_mixed(rows, cfg.rollout.group_size)
    n = write_parquet(pool.to_arrow(), TRAIN_POOL, folder / "train_pool.parquet")
    return Built(files={"train_pool": ("train_pool.parquet", n)}, summary=stats)


SPEC = StageSpec(name="filter", version=1, reads=("rollout",), build=build)


def run(config: PipelineConfig, inputs: dict[str, Manifest], store: Store | None = None,
        force: bool = False) -> Manifest:
    return run_stage(SPEC, config, inputs, store, force)
