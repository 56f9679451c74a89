"""Stage `online`: one online cell (method x seed x grid point) resident in one process.

The paper's Algorithm 1 at scale keeps the learner and the sampler in memory for the whole
run: per round, a model save, a model load and a sampler start (tens of seconds to
minutes at Qwen scale, and ~24 GB of weights and AdamW state on disk) would cost more than
the updates. A cell holds the learner (policy, AdamW, reference and its refresh counter,
update index, ESS block: pipeline/training/loop.TrainState) and one sampler engine, built once:

    learner <- pi_0 (or the cell's latest rolling checkpoint)
    for each round r after it:
        pool_r <- the cached pool of round r, or: engine.load_weights(learner)   (the sync)
                                                  sample, grade, refill          (online_pool)
        N updates of the learner on pool_r                                       (online_train)
        record round r (pool and metrics: content-addressed artifacts keyed by the chain)
        policies at evaluation points (online_policy); a checkpoint every
        online.checkpoint_every rounds and at the end (the last 2 are kept)

A stall (a round after the first that cannot fill its pool in online.max_draws draws: the
learner now solves or fails nearly every prompt) ends the cell with online.on_stall = stop:
the learner after its last full round is kept as an online_policy and evaluated as the
cell's final. One process only (under torchrun a stall fails the cell). The drift guard
(online.max_round_drift) checks each measured round's learner-to-behavior drift at its end
(pipeline/training/drift.py; online.drift_every = k measures rounds 0, k, 2k, ... and the
last, the others' drift is missing, None, and not checked): above the bound it warns in one
line (online.on_drift = warn) or ends the cell after that round (stop), the learner after it
kept as the cell's final, like a stall.

Replay is resume: a killed cell restarts from its latest checkpoint and trains on the
cached pools of the rounds after it without sampling them again (the pools are the log), to
the same weights on CPU (every round at one torch thread count: pin_threads). A longer run
(more train.updates) continues the same chain: round keys do not depend on train.updates,
so finished rounds are cache hits and the final checkpoint of the shorter run is where it
starts. Memory: the trainer's cached blocks go back to the device before the sampler runs,
and a vLLM sampler sleeps between rounds (runtime.release_device_memory, engine.sleep). A
vLLM sampler's share of the GPU is planned at the cell's start from the learner's full
footprint (weights, gradients, AdamW moments, reference, activations at the token budget:
pipeline/models/gpu_memory.py), not measured then: vLLM keeps the size it starts with, and
AdamW's moments, the gradients and the activations only arrive with the first update.

On disk per cell: the rounds' pools and metrics, the evaluation policies, and
`<cache>/online_cell-<key16>/checkpoints/round-NNNNNN/` (latest.pt or DCP shards, and
cell.json written last: the round it closes and that round's key).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from pipeline.core import interrupt
from pipeline.core.config import PipelineConfig
from pipeline.core.errors import ConfigError, DiskFull, TrainingError
from pipeline.core.schemas import DRIFT_COLUMNS
from pipeline.core.store import Manifest, Store, disk_full, is_disk_full, model_path, write_text_atomic
from pipeline.dag import graph
from pipeline.dag.spec import run_stage
from pipeline.models.engines import Engine, make_engine
from pipeline.models.gpu_memory import ModelShape, learner_setup, plan_sampler_memory
from pipeline.models.hf import load_tokenizer
from pipeline.models.runtime import Runtime, device_total_bytes, make_runtime, release_device_memory
from pipeline.training import checkpoint, distributed
from pipeline.training.loop import TrainState, new_state, reference_refreshed, resume, save_policy
from pipeline.training.torchrun import last_error, rank_setup, torchrun_argv
from stages import online_policy, online_pool, online_train
from stages.online_round import RoundStart

log = logging.getLogger("ggpo")
STATE = "online_cell"       # the state folder's name: <cache root>/online_cell-<key16>/
META = "cell.json"          # written last in a checkpoint folder: it is complete
KEEP = 2                    # rolling checkpoints kept
# the slowest sampler a torchrun cell's waiting ranks are sized for (generated tokens / s):
# a tenth of vLLM's ~20 k at Qwen3-1.7B on one H200 (wait_seconds)
WAIT_TOKENS_PER_S = 2_000


@dataclass(frozen=True)
class CellRound:
    """A finished round's artifacts: its pool and its record (online_train)."""
    pool: Manifest
    trained: Manifest


@dataclass(frozen=True)
class CellResult:
    """What a cell hands its caller (a Prefect task, maybe on another machine): small
    manifests (keys, paths, hashes), never tensors. `counts`: engine starts, rounds sampled,
    replayed and skipped, checkpoints, and `rounds` (finished), `update`, `folder`,
    `stalled` (None, or the stop: round, update, reason, cause). `rounds`: every finished
    round's artifacts in order; `policies`: the online_policy at each evaluation point the
    cell reached (train.online_eval_updates of its finished rounds) and at a stop."""
    counts: dict[str, Any]
    rounds: tuple[CellRound, ...]
    policies: dict[int, Manifest]

    @property
    def last(self) -> Manifest | None:
        """The last finished round's record (None: no round finished)."""
        return self.rounds[-1].trained if self.rounds else None


@dataclass
class CellRun:
    """What a cell run knows: its config, store, base model and chain of round keys."""
    cfg: PipelineConfig
    store: Store
    base: Manifest
    chain: list[dict[str, str]]
    folder: Path
    rt: Runtime
    tokenizer: object
    engine: Engine | None = None
    writer: Writer | None = None    # the checkpoint write in flight (one process)
    waits: Any = None               # under torchrun: the CPU group the ranks wait on (wait_group)
    sampler_share: float | None = None     # a vLLM sampler's gpu_memory_utilization (sampler_share)
    drift: dict = field(default_factory=dict)      # the last round's drift at its end (drift.DRIFT_COLUMNS)
    # the pool this process just sampled (its key, its table as written): training takes it
    # from memory instead of reading the file back; replayed rounds read the file
    sampled: tuple[str, Any] | None = None
    counts: dict = field(default_factory=lambda: {"engine_starts": 0, "rounds_sampled": 0, "rounds_replayed": 0,
                                                  "rounds_shared": 0, "rounds_skipped": 0, "checkpoints_written": 0})
    rounds: list[CellRound] = field(default_factory=list)      # the finished rounds' artifacts, in order
    policies: dict[int, Manifest] = field(default_factory=dict)     # update -> online_policy written or found

    @property
    def main(self) -> bool:        # the rank that samples and records (one process: always)
        d = distributed.current()
        return d is None or d.is_main


def state_folder(store: Store, cfg: PipelineConfig) -> Path:
    return store.root / f"{STATE}-{graph.cell_key(cfg)[:16]}"


# --------------------------------------------------------------------------- checkpoints

def checkpoints(folder: Path) -> list[tuple[int, Path, dict]]:
    """The complete rolling checkpoints (round, folder, meta), oldest first."""
    out = []
    for path in sorted((folder / "checkpoints").glob("round-*")):
        if (path / META).exists():
            meta = json.loads((path / META).read_text())
            out.append((meta["round"], path, meta))
    return out


def latest_checkpoint(cell: CellRun, before: int | None = None) -> tuple[int, Path] | None:
    """The furthest checkpoint inside this run's rounds (a longer earlier run may have more)
    and before round `before`; one written for another chain is refused with one line."""
    limit = len(cell.chain) if before is None else min(before, len(cell.chain))
    for r, path, meta in reversed(checkpoints(cell.folder)):
        if r >= limit:
            continue
        if meta["round_key"] != cell.chain[r]["online_train"]:
            raise TrainingError(f"online cell checkpoint {path} closes round {r} of another chain (round key "
                                f"{meta['round_key'][:16]}, this config's is {cell.chain[r]['online_train'][:16]}): it was "
                                f"written by another config; delete {cell.folder} to start this cell over")
        return r, path
    return None


def first_missing_policy(cell: CellRun) -> int | None:
    """The round of the earliest evaluation point whose policy is not in the cache (an earlier
    run of this chain had another train.eval_every): the cell must pass through it again."""
    missing = [r for at, r in sorted(evaluation_points(cell).items()) if not has_policy(cell, at)]
    return missing[0] if missing else None


def has_policy(cell: CellRun, at: int) -> bool:
    """Whether the policy after update `at` is cached (sizes checked, not hashes: the
    evaluation that reads it checks those)."""
    found, problems = cell.store.inspect("online_policy", graph.expected_key(
        "online_policy", cell.cfg.updated({"eval.update": at})), hashes=False)
    return found is not None and not problems


def save_cell_checkpoint(cell: CellRun, r: int, st: TrainState) -> None:
    """The learner after round r, atomically (temp folder, meta last, rename); the oldest of
    more than KEEP removed. One process: the state is copied to CPU memory now and written by
    a background thread while the next rounds run (at most one write in flight; a crash
    mid-write leaves the previous checkpoint). Under torchrun: collective, in place (DCP)."""
    final, t0 = cell.folder / "checkpoints" / f"round-{r:06d}", time.perf_counter()
    reference = st.reference if reference_refreshed(cell.cfg.train, st.update) else None
    meta = {"round": r, "round_key": cell.chain[r]["online_train"], "update": st.update}
    if distributed.current() is None:
        finish_writes(cell)
        state = checkpoint.snapshot(update=st.update, model=st.model, optimizer=st.opt, reference=reference,
                                    block_s=st.block_s)
        cell.writer = Writer(target=commit_checkpoint, args=(cell, final, state, meta), daemon=True)
        cell.writer.start()
    else:
        tmp = final.with_name(final.name + ".tmp")
        if cell.main:
            shutil.rmtree(tmp, ignore_errors=True)
        checkpoint.save(tmp, update=st.update, model=st.model, optimizer=st.opt, reference=reference,
                        metrics=[], lp_old=None, block_s=st.block_s)
        if cell.main:
            commit_checkpoint(cell, final, None, meta)
        barrier(cell)
    cell.counts["checkpoints_written"] += 1
    cell.counts["checkpoint_seconds"] = round(cell.counts.get("checkpoint_seconds", 0.0) + time.perf_counter() - t0, 4)


def commit_checkpoint(cell: CellRun, final: Path, state: dict | None, meta: dict) -> None:
    """`state` (a snapshot; None: already in the temp folder) written, cell.json last, the
    folder renamed into place, the oldest beyond KEEP removed."""
    tmp = final.with_name(final.name + ".tmp")
    try:
        if state is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            checkpoint.write_plain(tmp, state)
        write_text_atomic(tmp / META, json.dumps(meta))
    except Exception as exc:     # a full disk: the half-written round goes, the previous one stays
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc) and not isinstance(exc, DiskFull):
            raise disk_full(final, checkpoint.state_bytes(state), "checkpointing into") from exc
        raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for _, old, _ in checkpoints(cell.folder)[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


class Writer(threading.Thread):
    """A checkpoint write in the background; its exception is raised by finish_writes."""

    def run(self) -> None:
        try:
            super().run()
        except BaseException as exc:        # noqa: BLE001 - handed to the cell's thread
            self.error = exc

    error: BaseException | None = None


def finish_writes(cell: CellRun) -> None:
    """Wait for the checkpoint write in flight (before the next one, and when the cell ends)."""
    if cell.writer is not None:
        cell.writer.join()
        error, cell.writer = cell.writer.error, None
        if isinstance(error, DiskFull):     # its own line: the path, the space, and that it resumes
            latest = checkpoints(cell.folder)
            kept = f"the previous checkpoint {latest[-1][1]} is intact" if latest else "no earlier checkpoint"
            raise DiskFull(f"online cell: {error}; {kept}") from error
        if error is not None:
            raise TrainingError(f"online cell: writing a checkpoint into {cell.folder / 'checkpoints'} failed: "
                                f"{error}") from error


# --------------------------------------------------------------------------- one round

def round_manifest(cell: CellRun, stage: str, r: int) -> Manifest | None:
    """Round r's cached artifact of `stage` (marked a cache hit), or None."""
    found = cell.store.load(stage, cell.chain[r][stage]) if r >= 0 else None
    return found.model_copy(update={"cache_hit": True}) if found is not None else None


def committed(cell: CellRun, stage: str, r: int) -> Manifest:
    """Round r's artifact of `stage` that rank 0 committed before the last barrier."""
    found = round_manifest(cell, stage, r)
    if found is None:
        raise TrainingError(f"online cell: round {r}'s {stage} artifact, written by rank 0, is not in the store at "
                            f"{cell.store.location}: every rank (every node) must use one store (GGPO_CACHE)")
    return found


def wait_seconds(cfg: PipelineConfig) -> float:
    """How long a torchrun cell's ranks wait while rank 0 works alone before they give up: a
    round's sampling at its worst (online.max_draws draws of m samples of the full response
    budget per prompt) at WAIT_TOKENS_PER_S, plus 30 minutes for the engine's start,
    grading and a checkpoint. At the paper's scale one draw alone is 256 x 8 x 3,072 tokens
    (5 minutes at vLLM's pace, and a round may take several): NCCL's default 10 minutes
    would end the cell mid-round."""
    oc, rc = cfg.online, cfg.rollout
    tokens = oc.max_draws * oc.per_draw(cfg.train) * rc.group_size * rc.max_new_tokens
    return 1800.0 + tokens / WAIT_TOKENS_PER_S


def wait_group(cfg: PipelineConfig):
    """A gloo group over every rank, timeout wait_seconds: the ranks wait on the CPU while
    rank 0 samples, grades and records, instead of at an NCCL barrier (a collective held
    open on the GPU for the whole round, which NCCL's watchdog ends at the process group's
    timeout). A collective: every rank creates it, at the cell's start."""
    import torch.distributed as dist
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=wait_seconds(cfg)))


def barrier(cell: CellRun) -> None:
    """Every rank here before any goes on (under torchrun; on the cell's CPU group)."""
    if distributed.current() is not None:
        import torch.distributed as dist
        dist.barrier(group=cell.waits)


def learner_weights(st: TrainState) -> list[tuple[str, torch.Tensor]]:
    """The learner's parameters under their HF names (tied weights once), full tensors. Under
    torchrun a collective, one parameter at a time: only rank 0, which syncs the sampler,
    keeps them; the other ranks get [] (distributed.full_parameters_on_main)."""
    if not distributed.is_sharded(st.model):
        return list(st.model.named_parameters())
    return distributed.full_parameters_on_main(st.model)


def round_pool(cell: CellRun, st: TrainState, cfg_r: PipelineConfig, r: int, policy: Manifest) -> Manifest:
    """Round r's pool: the cached one (replayed, never sampled twice), or sampled now by the
    engine synced to the learner (Algorithm 1 line 3). Under torchrun rank 0 samples and
    commits it, the others read it."""
    pool = round_manifest(cell, "online_pool", r)
    barrier(cell)       # every rank has looked before rank 0 may write it
    if pool is not None:
        cell.counts["rounds_replayed"] += 1
        return pool
    weights = learner_weights(st)
    if cell.main:
        pool = sync_and_sample(cell, weights, cfg_r, policy)
    del weights
    barrier(cell)       # the others wait here while rank 0 samples the whole round
    return pool or committed(cell, "online_pool", r)


def sampler_share(cfg: PipelineConfig, model, rt: Runtime) -> float | None:
    """The share of this GPU a vLLM sampler may take beside the learner `model` for the
    whole cell (pipeline/models/gpu_memory.py; None: no vLLM on a GPU here), logged."""
    if cfg.rollout.engine != "vllm" or rt.device.type != "cuda":
        return None
    d = distributed.current()
    try:
        plan = plan_sampler_memory(ModelShape.of(model), learner_setup(cfg, rt, 1 if d is None else d.world),
                                   device_total_bytes())
    except ValueError as exc:
        raise ConfigError(f"online cell: {exc}; lower train.micro_batch_tokens, set train.gradient_checkpointing=true "
                          "or train.reference_device=cpu, or train over more GPUs (train.nproc)") from None
    log.info("online cell: vLLM sampler memory planned beside the learner: %s", plan.describe())
    return plan.gpu_memory_utilization


def sync_and_sample(cell: CellRun, weights: list, cfg_r: PipelineConfig, policy: Manifest) -> Manifest:
    """The engine (built once per cell, on its first round that samples, with its planned
    share of the GPU) synced to `weights`, then the round's pool; with online.share_pools,
    a pool an earlier round of the same content built is copied, no engine synced."""
    content = None
    if cfg_r.online.share_pools:
        content = online_pool.pool_content_key(cfg_r, cell.base.key, RoundStart.after(policy),
                                               online_pool.weights_sha256(weights))
        if online_pool.shared_pool(cell.store, content) is not None:
            pool = run_stage(online_pool.SPEC, cfg_r, {"policy": policy}, cell.store,
                             ctx=online_pool.Sampler(None, content=content, store=cell.store))
            cell.counts["rounds_shared"] += 1
            return pool
    if cell.engine is None:
        rc = cfg_r.rollout
        if cell.sampler_share is not None:
            rc = rc.model_copy(update={"gpu_memory_utilization": min(rc.gpu_memory_utilization, cell.sampler_share)})
        release_device_memory()
        cell.engine = make_engine(rc.engine, model_path(cell.base), rc.batch_prompts, cfg_r.model.threads,
                                  rollout_cfg=rc, device=cfg_r.train.device, seed=cfg_r.seed, resident=True)
        cell.counts["engine_starts"] += 1
    release_device_memory()        # the trainer's cached blocks back before the sampler runs
    cell.engine.wake()
    t0 = time.perf_counter()
    cell.engine.load_weights(weights)
    cell.counts["sync_seconds"] = round(cell.counts.get("sync_seconds", 0.0) + time.perf_counter() - t0, 4)
    sampler = online_pool.Sampler(cell.engine, content=content, store=cell.store)
    pool = run_stage(online_pool.SPEC, cfg_r, {"policy": policy}, cell.store, ctx=sampler)
    cell.sampled = (pool.key, sampler.table) if sampler.table is not None else None
    cell.engine.sleep()
    if content is not None and "shared_from" not in pool.summary:
        online_pool.remember_pool(cell.store, content, pool.key)
    cell.counts["rounds_sampled"] += 1
    return pool


def evaluation_points(cell: CellRun) -> dict[int, int]:
    """{update: round} of the policies the run keeps (train.eval_every and the end)."""
    return {at: r for r, _, at in cell.cfg.train.online_eval_points()}


def pending(cell: CellRun, at: int) -> Path:
    return cell.folder / "pending" / f"update_{at:06d}"


def keep_policies(cell: CellRun, r: int, trained: Manifest) -> None:
    """Round r's evaluation points: each policy saved after its update (pending/), now
    committed as an online_policy artifact (rank 0)."""
    for at in sorted(u for u, rr in evaluation_points(cell).items() if rr == r):
        if cell.main and pending(cell, at).exists():
            adopt_policy(cell, at, trained)
    barrier(cell)


def adopt_policy(cell: CellRun, at: int, trained: Manifest) -> Manifest:
    """The policy saved after update `at` (pending/) committed as an online_policy artifact
    whose input is `trained`, the record of the round that holds the update (rank 0)."""
    policy = run_stage(online_policy.SPEC, cell.cfg.updated({"eval.update": at}), {"round": trained}, cell.store,
                       ctx=online_policy.Saved(pending(cell, at)))
    cell.policies[at] = policy
    return policy


def record_round(cell: CellRun, cfg_r: PipelineConfig, inputs: dict[str, Manifest], rows: list[dict]) -> Manifest:
    """The round's record (rank 0 writes it; under torchrun the others read it), checked
    against a cached record when the round was replayed."""
    r = cfg_r.online.round
    if cell.main:
        trained = run_stage(online_train.SPEC, cfg_r, inputs, cell.store, ctx=online_train.Trained(rows))
        if trained.cache_hit and trained.summary["final_loss"] != rows[-1]["loss"]:
            log.warning("online round %d replayed to a final loss of %r, its record says %r (bit-exact only on "
                        "the CPU)", r, rows[-1]["loss"], trained.summary["final_loss"])
    barrier(cell)
    return trained if cell.main else committed(cell, "online_train", r)


def one_round(cell: CellRun, st: TrainState, r: int, prev: Manifest | None) -> tuple[Manifest, Manifest]:
    """Round r: its pool (cached, or sampled now), the N updates, its record, its policies."""
    cfg_r = cell.cfg.updated({"online.round": r})
    pool = round_pool(cell, st, cfg_r, r, prev or cell.base)
    inputs = {"base": cell.base, "pool": pool} | ({"state": prev} if prev else {})
    points = evaluation_points(cell)

    def after_update(u: int) -> None:      # the policy at an evaluation point, saved now (collective)
        if u in points and not has_policy(cell, u):
            save_policy(st.model, cell.tokenizer, pending(cell, u))
    table = cell.sampled[1] if cell.sampled and cell.sampled[0] == pool.key else None
    cell.sampled = None
    rows = online_train.train_round(st, cfg_r, inputs, cell.tokenizer, cell.rt, after_update, table)
    cell.drift = {k: rows[-1].get(k) for k in DRIFT_COLUMNS}     # measured now, also when the record is cached
    trained = record_round(cell, cfg_r, inputs, rows)
    keep_policies(cell, r, trained)
    return pool, trained


# --------------------------------------------------------------------------- the cell

def start(cell: CellRun) -> tuple[TrainState, int, Manifest | None]:
    """The learner at the latest checkpoint (or pi_0), the first round to run, the record of
    the round before it."""
    base = model_path(cell.base)
    st = new_state(cell.cfg, base, base, cell.rt)
    found = latest_checkpoint(cell, before=first_missing_policy(cell))
    if found is None:
        return st, 0, None
    r, path = found
    prev = round_manifest(cell, "online_train", r)
    if prev is None:
        raise TrainingError(f"online cell checkpoint {path} closes round {r}, whose record (online_train "
                            f"{cell.chain[r]['online_train'][:16]}) is not in the cache: the chain is missing a round; "
                            f"delete {cell.folder} to start this cell over")
    resume(st, checkpoint.load(path), path)
    cell.counts["rounds_skipped"] = r + 1
    return st, r + 1, prev


def run_cell(cfg: PipelineConfig, store: Store, base: Manifest, on_round=None) -> CellResult:
    """Every round of the cell `cfg` (train.updates // N of them); its counts and the
    manifests it wrote or found (rounds, policies at evaluation points).
    on_round(r, pool, trained) after each round (the flow logs it to MLflow and Prefect).
    train.nproc / nnodes > 1: the cell runs under torchrun (launch).

    The cell's state folder is written outside any stage build, so a second process running
    the same cell (two `ggpo run online` on one cache) waits on the store's build lock of the
    cell's key, then resumes from what the first left: never two learners in one folder.
    Ranks under torchrun run inside their launcher's lock."""
    if distributed.current() is not None:
        return _run_cell(cfg, store, base, on_round)
    with store.build_lock(STATE, graph.cell_key(cfg)):
        return _run_cell(cfg, store, base, on_round)


def _run_cell(cfg: PipelineConfig, store: Store, base: Manifest, on_round=None) -> CellResult:
    if distributed.wanted(cfg.train) and distributed.current() is None:
        return launch(cfg, store, base, on_round)
    tc = cfg.train
    pin_threads(cfg)
    rounds = tc.updates // tc.updates_per_step
    cell = CellRun(cfg, store, base, [graph.online_keys(cfg, r) for r in range(rounds)], state_folder(store, cfg),
                make_runtime(tc), load_tokenizer(model_path(base)))
    if distributed.current() is not None:
        cell.waits = wait_group(cfg)
    t0 = time.perf_counter()
    st, first, prev = start(cell)
    cell.sampler_share = sampler_share(cfg, st.model, cell.rt)
    every = cfg.online.checkpoint_rounds(tc)
    for r in range(first if cell.main else 0):     # finished before: handed on as cached
        done_round(cell.rounds, r, *cached_round(cfg, store, r), on_round)
    stalled = None
    try:
        for r in range(first, rounds):
            try:
                pool, prev = one_round(cell, st, r, prev)
            except online_pool.RefillError as exc:
                if r == 0 or cfg.online.on_stall != "stop" or distributed.current() is not None:
                    raise
                assert prev is not None     # r > 0: the round before it
                stalled = stop_at_stall(cell, st, r, prev, exc)
                break
            if (r + 1) % every == 0 or r + 1 == rounds:
                save_cell_checkpoint(cell, r, st)
            if cell.main:
                done_round(cell.rounds, r, pool, prev, on_round)
            stalled = drift_guard(cell, st, r, prev, rounds)
            if stalled is not None:
                break
    except interrupt.Interrupted:
        finish_writes(cell)
        found = latest_checkpoint(cell)
        raise interrupt.stopped(f"online cell {tc.method} seed {cfg.seed} in round {r} (rerun replays from "
                                f"round {found[0] + 1 if found else 0})") from None
    finally:
        if cell.engine is not None:
            getattr(cell.engine, "close", lambda: None)()
        finish_writes(cell)       # a stopped cell still completes its last checkpoint
    shutil.rmtree(cell.folder / "pending", ignore_errors=True)
    log.info("online cell %s seed %d: %d rounds (%d from a checkpoint, %d replayed from cached pools, %d sampled), "
             "%d engine start(s), %d checkpoint(s) in %.1fs", tc.method, cfg.seed, rounds_done(stalled, rounds),
             cell.counts["rounds_skipped"],
             cell.counts["rounds_replayed"], cell.counts["rounds_sampled"], cell.counts["engine_starts"],
             cell.counts["checkpoints_written"], time.perf_counter() - t0)
    done = rounds_done(stalled, rounds)
    counts = cell.counts | {"rounds": done, "update": st.update, "folder": str(cell.folder), "stalled": stalled}
    return CellResult(counts, tuple(cell.rounds), kept_policies(cfg, store, done, cell.policies) if cell.main else {})


def pin_threads(cfg: PipelineConfig) -> None:
    """Every round of a cell trains at one torch thread count. A transformers sampler sets
    torch's threads to model.threads when it is built (engines/hf.py), at the first round
    that samples; a resumed cell trains the rounds it replays before that, so the count is
    set here first: else those rounds run at the process's default (one thread per core in
    a fresh `ggpo stage online`) and the CPU kernels, which split their sums by thread,
    reach other bits than the uninterrupted run's. Nothing changes for an uninterrupted
    cell (its sampler is built before its first update). A vLLM sampler leaves the count
    alone, and so does the cell (a learner on the GPU, a reference maybe on the CPU)."""
    if cfg.rollout.engine == "transformers":
        torch.set_num_threads(cfg.model.threads)


def done_round(rounds: list[CellRound], r: int, pool: Manifest, trained: Manifest, on_round) -> None:
    """Round r finished (now, or before this run): kept for the result, shown to on_round."""
    rounds.append(CellRound(pool, trained))
    if on_round is not None:
        on_round(r, pool, trained)


def cached_round(cfg: PipelineConfig, store: Store, r: int) -> tuple[Manifest, Manifest]:
    """A round finished before (behind the checkpoint a cell resumed from, or by torchrun's
    ranks): its pool and record, from the cache."""
    keys = graph.online_keys(cfg, r)
    pool, trained = store.load("online_pool", keys["online_pool"]), store.load("online_train", keys["online_train"])
    if pool is None or trained is None:
        raise TrainingError(f"online cell: round {r} is finished, but its {'online_pool' if pool is None else 'online_train'} "
                            f"artifact is not in the cache at {store.location}; delete {state_folder(store, cfg)} to "
                            "start this cell over")
    return pool.model_copy(update={"cache_hit": True}), trained.model_copy(update={"cache_hit": True})


def kept_policies(cfg: PipelineConfig, store: Store, rounds: int, written: dict[int, Manifest]) -> dict[int, Manifest]:
    """{update: online_policy} at the evaluation points of the `rounds` finished rounds (a
    stop's included: train.online_eval_updates): those this run `written`, the rest from the
    cache (an earlier run of the chain wrote them). One missing is said with its update."""
    out = {}
    for at in cfg.train.online_eval_updates(rounds):
        found = written.get(at) or store.load("online_policy", graph.expected_key("online_policy",
                                                                                 cfg.updated({"eval.update": at})))
        if found is None:
            raise TrainingError(f"online cell {cfg.train.method} seed {cfg.seed} finished without its policy after "
                                f"update {at} (online_policy not in {store.location})")
        out[at] = found
    return out


def stop_at_stall(cell: CellRun, st: TrainState, r: int, prev: Manifest, exc: Exception) -> dict:
    """Round r could not fill its pool: the learner after round r - 1 becomes the cell's last
    policy (an online_policy at its update, evaluated by the flow). A rerun replays to here
    and stalls again (the draws are seeded), finding that policy cached."""
    at = st.update
    if not has_policy(cell, at):
        save_policy(st.model, cell.tokenizer, pending(cell, at))
        adopt_policy(cell, at, prev)
    log.warning("online cell %s seed %d stopped after update %d of %d (online.on_stall=stop): %s",
                cell.cfg.train.method, cell.cfg.seed, at, cell.cfg.train.updates, exc)
    return {"round": r, "update": at, "reason": str(exc), "cause": "stall"}


def rounds_done(stopped: dict | None, rounds: int) -> int:
    """Rounds a cell finished: all, or up to its stop (a stall's round did not run; the
    round whose drift stopped the cell did)."""
    if stopped is None:
        return rounds
    return stopped["round"] + (stopped["cause"] == "drift")


def drift_guard(cell: CellRun, st: TrainState, r: int, prev: Manifest, rounds: int) -> dict | None:
    """online.max_round_drift after round r: None to go on (no bound, a round not measured
    under online.drift_every, within it, a warning, or the last round anyway); else the
    stop, with the learner after round r kept as an online_policy at its update (the cell's
    final, evaluated by the flow), as a stall keeps its. Under torchrun a stop fails the
    cell in one line."""
    oc, drift = cell.cfg.online, cell.drift.get("round_drift")
    if oc.max_round_drift is None or drift is None or drift <= oc.max_round_drift:
        return None
    tc = cell.cfg.train
    what = (f"online round {r} ({tc.method} seed {cell.cfg.seed}): learner-to-behavior drift {drift:.4g} (token mean "
            f"|log ratio| after update {st.update}) is above online.max_round_drift = {oc.max_round_drift:g}")
    if oc.on_drift == "warn" or r + 1 == rounds:
        log.warning("%s (online.on_drift=%s)", what, oc.on_drift)
        return None
    if distributed.current() is not None:
        raise TrainingError(f"{what}; online.on_drift=stop ends a cell in one process only")
    at = st.update
    if cell.main and not has_policy(cell, at):
        save_policy(st.model, cell.tokenizer, pending(cell, at))
        adopt_policy(cell, at, prev)
    log.warning("online cell %s seed %d stopped after update %d of %d (online.on_drift=stop): %s",
                tc.method, cell.cfg.seed, at, tc.updates, what)
    return {"round": r, "update": at, "reason": what, "cause": "drift"}


# --------------------------------------------------------------------------- torchrun

def launch(cfg: PipelineConfig, store: Store, base: Manifest, on_round=None) -> CellResult:
    """The cell under torchrun: every rank runs `main` (the learner FSDP2-sharded over them,
    for the whole cell); rank 0 also holds the engine, gathers the full weights for each sync,
    samples and records. A rank failing: one-line TrainingError; a rerun resumes from the
    cell's last checkpoint. The rounds reach on_round once the ranks are done."""
    tc = cfg.train
    with tempfile.TemporaryDirectory(prefix="ggpo-cell-") as tmp:
        conf, out = Path(tmp) / "config.json", Path(tmp) / "counts.json"
        conf.write_text(cfg.model_dump_json())
        argv = torchrun_argv(tc, ["--config", str(conf), "--store", str(store.url or store.root), "--base", base.key,
                                  "--counts", str(out)], module="stages.online_cell")
        env = os.environ | {"OMP_NUM_THREADS": str(cfg.model.threads)}
        proc = subprocess.run(argv, cwd=Path(__file__).resolve().parents[1], env=env, stdout=sys.stderr,
                              stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            last = last_error(proc.stderr)
            raise TrainingError(f"online cell {tc.method} seed {cfg.seed}: torchrun ({tc.nproc} x {tc.nnodes} ranks) "
                                f"exited {proc.returncode}{': ' + last if last else ''}; rerun to resume from "
                                f"its last checkpoint in {state_folder(store, cfg)}")
        counts = json.loads(out.read_text())
    rounds: list[CellRound] = []     # the ranks' manifests stayed in their processes: from the store
    for r in range(counts["rounds"]):
        done_round(rounds, r, *cached_round(cfg, store, r), on_round)
    return CellResult(counts, tuple(rounds), kept_policies(cfg, store, counts["rounds"], {}))


def main(argv: list[str] | None = None) -> None:
    """One rank of a cell under torchrun."""
    args, cfg, d = rank_setup("stages.online_cell", ("--config", "--store", "--base", "--counts"), argv)
    try:
        store = Store(args.store)
        base = store.load("base", args.base)
        if base is None:
            raise TrainingError(f"online cell rank {d.rank}: the base model {args.base[:16]} is not in the store at "
                                f"{store.location}: every rank (every node) must use one store (GGPO_CACHE)")
        result = run_cell(cfg, store, base)
        if d.is_main:
            write_text_atomic(Path(args.counts), json.dumps(result.counts))
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    distributed.finish(d)


if __name__ == "__main__":
    main()
