"""Stage `online_train`: the N updates of one round of the online loop (spec 8.1).

Built only inside an online cell (stages/online_cell.py), whose learner (policy, AdamW,
reference and its refresh counter, update index, ESS block) stays in memory across rounds;
this artifact is the round's record, not its state. Inputs: `base` (pi_0), `pool` (this
round's `online_pool`: N * G_mb mixed groups in collection order C) and, from round 1 on,
`state` (the previous round's `online_train`, which names the chain). Reads `seed`,
`train` (but not `train.updates`, `train.eval_every` or `train.checkpoint_every`: a round
is the same round whatever the run's length, so a longer run reuses it) and `rollout`.

    if needed (GRPO+TIS, clipped GGPO): lp_old <- trainer log-probs of C at the round start
    for j in 0..N-1:    update u = round * N + j on C[j*G_mb : (j+1)*G_mb]  (j updates stale)
        loss; backward; clip; step; u += 1; refresh pi_ref when u % t_ref == 0

The updates are the offline loop's (pipeline/training/loop.py): same loss, micro-batches and
diagnostics. Writes `metrics.parquet` (ONLINE_METRICS: the offline columns plus round,
staleness j, max |log rho|, the cumulative prompts drawn and responses generated, and on
the round's last row its learner-to-behavior drift, pipeline/training/drift.py) and a summary
that the next round's pool starts from (prompt cursor, cumulative counts) and holds the
drift. Records written before the drift existed lack it (the report shows it empty): the
drift is a function of the round's key (its final weights and pool), so the key stays.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pyarrow as pa

from pipeline.core.config import PipelineConfig
from pipeline.core.errors import TrainingError
from pipeline.core.schemas import ONLINE_METRICS, write_parquet
from pipeline.core.store import Manifest
from pipeline.dag.spec import Built, StageSpec
from pipeline.training.drift import drift_sample, round_drift
from pipeline.training.loop import TrainContext, TrainState, load_pool, run_updates
from stages.online_round import RoundPool, RoundRecord

# what a round's key does not depend on (the run's length, evaluation and checkpoint schedules)
NOT_ROUND_CONTENT = ("train.updates", "train.eval_every", "train.checkpoint_every")


def check(cfg: PipelineConfig, inputs: dict[str, Manifest], update: int) -> tuple[int, int]:
    """(first update, stop) of this round for a learner at `update`; a pool that is not this
    round's fails before any update."""
    pool, tc = RoundPool.from_summary(inputs["pool"].summary), cfg.train
    sampler = inputs["state"].key if "state" in inputs else inputs["base"].key
    if inputs["pool"].inputs.get("policy") != sampler:
        raise TrainingError(f"online_train: the pool {inputs['pool'].key[:16]} was sampled by "
                            f"{inputs['pool'].inputs.get('policy', '?')[:16]}, not by this round's policy {sampler[:16]}")
    if pool.start_update != update:
        raise TrainingError(f"online_train: the pool {inputs['pool'].key[:16]} was drawn after update "
                            f"{pool.start_update} but the learner is at update {update}")
    if pool.groups_kept != tc.updates_per_step * tc.groups_per_update:
        raise TrainingError(f"online_train: the pool has {pool.groups_kept} groups, the round needs "
                            f"train.updates_per_step x train.groups_per_update = {tc.updates_per_step * tc.groups_per_update}")
    return update, update + tc.updates_per_step


def train_round(st: TrainState, cfg: PipelineConfig, inputs: dict[str, Manifest], tokenizer, rt,
                after_update=None, table: pa.Table | None = None) -> list[dict]:
    """The round's N updates on the resident learner `st`; its ONLINE_METRICS rows.
    `after_update(u)` runs after each (the cell saves evaluation policies there). `table`:
    the round's pool as its sampler wrote it (schemas.typed_table, equal to the file), so a
    round sampled in this process is not read back from disk; None reads the file."""
    tc, pool_m = cfg.train, inputs["pool"]
    first, stop = check(cfg, inputs, st.update)
    frame = None if table is None else pl.DataFrame(table)
    pool = load_pool(pool_m.path("train_pool"), cfg.rollout.group_size, tc, frame=frame)
    g, st.rows = tc.groups_per_update, []
    s = RoundPool.from_summary(pool_m.summary)
    ctx = TrainContext(cfg, pool, rt, tokenizer.pad_token_id,
                       groups_of=lambda u: list(range((u - first) * g, (u - first + 1) * g)),
                       step_groups_of=lambda u: list(range(len(pool.group_ids))),
                       desc=f"round {s.round} {tc.method} seed {cfg.seed}")
    run_updates(st, ctx, stop, after_update=after_update)
    # the learner after the round's N updates against the round's behavior log-probs: on
    # its last row (the round's end), the other rows None (pipeline/training/drift.py)
    drift = round_drift(st.model, pool, drift_sample(len(pool.group_ids), g, cfg.seed, s.round), cfg,
                        tokenizer.pad_token_id, rt)
    return [r | {"round": s.round, "staleness": r["update"] - 1 - first, "prompts_drawn": s.cumulative_prompts,
                 "responses_generated": s.cumulative_responses}
            | (drift if r is st.rows[-1] else dict.fromkeys(drift)) for r in st.rows]


@dataclass(frozen=True)
class Trained:
    """What an online cell hands its round's record build: the ONLINE_METRICS rows of the N
    updates its resident learner has just taken (train_round)."""
    rows: list[dict]


def round_record(cfg: PipelineConfig, pool: RoundPool, rows: list[dict]) -> RoundRecord:
    """The round's outcome from its pool and its updates' rows: where the next round starts
    (the pool's cursor and counts, carried on) and how the round went."""
    tc = cfg.train
    return RoundRecord(
        method=tc.method, seed=cfg.seed, round=pool.round, first_update=rows[0]["update"] - 1,
        updates=rows[-1]["update"], t_ref=tc.refresh_every() or "fixed", prompt_cursor=pool.prompt_cursor,
        cumulative_prompts=pool.cumulative_prompts, cumulative_responses=pool.cumulative_responses,
        train_seconds=round(sum(r["seconds"] for r in rows), 3), final_reward=rows[-1]["reward"],
        final_loss=rows[-1]["loss"], k3_mismatch_first=rows[0]["k3_mismatch"],
        max_abs_log_ratio_first=rows[0]["max_abs_log_ratio"], round_drift=rows[-1]["round_drift"],
        round_drift_seq=rows[-1]["round_drift_seq"])


def build(cfg: PipelineConfig, inputs: dict[str, Manifest], folder: Path, ctx: Trained) -> Built:
    """The round's artifact: its metrics rows and its record (where the next round starts)."""
    rows = ctx.rows
    n = write_parquet({k: [r.get(k) for r in rows] for k in ONLINE_METRICS.names}, ONLINE_METRICS,
                      folder / "metrics.parquet")
    record = round_record(cfg, RoundPool.from_summary(inputs["pool"].summary), rows)
    return Built(files={"metrics": ("metrics.parquet", n)}, summary=record.to_summary())


SPEC = StageSpec(name="online_train", numerics=True, version=2, reads=("seed", "train", "rollout"), build=build,
                 ignores=NOT_ROUND_CONTENT, context=Trained,
                 without_context="an online round is trained by its cell's resident learner: run the cell "
                 "(`ggpo stage online` or `ggpo run online`), which builds or replays every round")
