"""Stage `online_train`: the N updates of one round of the online loop (spec 8.1).

Inputs: `base` (pi_0: the initial policy and the reference until its first refresh),
`pool` (this round's `online_pool`: N * G_mb mixed groups in collection order C) and, from
round 1 on, `state` (the previous round's `online_train`: its final policy `model/` and
`state.pt` with the optimizer, the reference once refreshed, the update
index and the unfinished ESS block; no RNG: training draws no randomness). Reads `seed`,
`train`, `rollout`.

    if needed (GRPO+TIS, clipped GGPO): lp_old <- trainer log-probs of C at the round start
    for j in 0..N-1:    update u = round * N + j on C[j*G_mb : (j+1)*G_mb]  (j updates stale)
        loss; backward; clip; step; u += 1; refresh pi_ref when u % t_ref == 0

The updates are the offline loop's (stages/train/loop.py): same loss, micro-batches,
diagnostics, checkpoints. Writes `model/` (the policy after the round: the next round's
sampler), `state.pt`, `metrics.parquet` (ONLINE_METRICS: the offline columns plus round,
staleness j, max |log rho| and the cumulative prompts drawn and responses generated) and
`snapshots/update_NNNNN/` for train.eval_every points inside the round. `checkpoints/`
survives a killed build, so a rerun resumes mid-round to bit-identical weights on CPU.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from pipeline.config import PipelineConfig
from pipeline.hf import load_tokenizer
from pipeline.runtime import make_runtime
from pipeline.schemas import ONLINE_METRICS, write_parquet
from pipeline.stage import Built, StageSpec, run_stage
from pipeline.store import Manifest, Store, fsync_rename, model_path
from stages.train import checkpoint
from pipeline.errors import TrainingError
from stages.train.loop import (TrainState, load_pool, new_state, reference_refreshed, resume,
                               run_updates, save_policy, snapshot_files)

STATE = "state.pt"


def check(cfg: PipelineConfig, inputs: dict[str, Manifest]) -> tuple[int, int]:
    """(first update, stop) of this round; bad chains fail before any work."""
    pool, tc = inputs["pool"].summary, cfg.train
    start = inputs["state"].summary["updates"] if "state" in inputs else 0
    sampler = inputs["state"].key if "state" in inputs else inputs["base"].key
    if inputs["pool"].inputs.get("policy") != sampler:
        raise TrainingError(f"online_train: the pool {inputs['pool'].key[:16]} was sampled by "
                            f"{inputs['pool'].inputs.get('policy', '?')[:16]}, not by this round's policy {sampler[:16]}")
    if pool["start_update"] != start:
        raise TrainingError(f"online_train: the pool {inputs['pool'].key[:16]} was drawn after update "
                            f"{pool['start_update']} but the training state is at update {start}")
    if pool["groups_kept"] != tc.updates_per_step * tc.groups_per_update:
        raise TrainingError(f"online_train: the pool has {pool['groups_kept']} groups, the round needs "
                            f"train.updates_per_step x train.groups_per_update = {tc.updates_per_step * tc.groups_per_update}")
    return start, start + tc.updates_per_step


def save_state(st: TrainState, folder: Path, refreshed: bool) -> None:
    """What the next round needs beyond `model/`, atomically (temp file, fsync, rename)."""
    tmp = folder / f".{STATE}.tmp-{os.getpid()}"
    # no RNG state: training draws no randomness (every random choice of a round comes from a
    # named stream, pipeline/seeding.py), and torch's global generator is shared by the
    # flow's threads, so its state here would depend on what other cells did
    torch.save({"update": st.update, "optimizer": st.opt.state_dict(),
                "reference": st.reference.state_dict() if refreshed else None,
                "block_s": st.block_s}, tmp)
    fsync_rename(tmp, folder / STATE)


def start_state(cfg: PipelineConfig, inputs: dict[str, Manifest], folder: Path, rt) -> TrainState:
    """The previous round's training state (each model read once), or a mid-round checkpoint."""
    base = model_path(inputs["base"])
    if "state" not in inputs:
        st = new_state(cfg, base, base, rt)
    else:
        prev = inputs["state"]
        st = new_state(cfg, model_path(prev), base, rt)
        saved = torch.load(prev.path("state"), weights_only=False, map_location="cpu")
        st.opt.load_state_dict(saved["optimizer"])
        if saved["reference"] is not None:
            st.reference.load_state_dict(saved["reference"])
        st.update, st.block_s = saved["update"], list(saved["block_s"])
    return resume(st, checkpoint.load(folder / "checkpoints"), folder / "checkpoints")


def build(cfg: PipelineConfig, inputs: dict[str, Manifest], folder: Path) -> Built:
    torch.set_num_threads(cfg.model.threads)
    tc, pool_m = cfg.train, inputs["pool"]
    first, stop = check(cfg, inputs)
    tokenizer = load_tokenizer(model_path(inputs["base"]))
    pool = load_pool(pool_m.path("train_pool"), cfg.rollout.group_size, tc.needs_behavior_logprobs())
    rt = make_runtime(tc)
    st = start_state(cfg, inputs, folder, rt)
    g = tc.groups_per_update
    run_updates(st, pool, cfg, tokenizer, folder, stop, lambda u: list(range((u - first) * g, (u - first + 1) * g)),
                lambda u: list(range(len(pool.group_ids))), rt,
                f"round {pool_m.summary['round']} {tc.method} seed {cfg.seed}", last_checkpoint=False)
    save_policy(st.model, tokenizer, folder / "model")
    save_state(st, folder, reference_refreshed(tc, st.update))
    # model/ and state.pt now hold the round's end: the mid-round checkpoint is a duplicate
    # (a crash from here on redoes the round, with the same result)
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    s = pool_m.summary
    rows = [r | {"round": s["round"], "staleness": r["update"] - 1 - first, "prompts_drawn": s["cumulative_prompts"],
                 "responses_generated": s["cumulative_responses"]} for r in st.rows]
    n = write_parquet({k: [r.get(k) for r in rows] for k in ONLINE_METRICS.names}, ONLINE_METRICS,
                      folder / "metrics.parquet")
    snapshots = snapshot_files(u for u in tc.snapshot_updates() if first < u < stop)
    return Built(
        files={"metrics": ("metrics.parquet", n), "weights": ("model/model.safetensors", None),
               "state": (STATE, None)} | snapshots,
        summary={"method": tc.method, "seed": cfg.seed, "round": s["round"],
                 "first_update": first, "updates": stop, "t_ref": tc.refresh_every() or "fixed",
                 "prompt_cursor": s["prompt_cursor"], "cumulative_prompts": s["cumulative_prompts"],
                 "cumulative_responses": s["cumulative_responses"], "final_reward": rows[-1]["reward"],
                 "final_loss": rows[-1]["loss"], "k3_mismatch_first": rows[0]["k3_mismatch"],
                 "max_abs_log_ratio_first": rows[0]["max_abs_log_ratio"]})


SPEC = StageSpec(name="online_train", version=1, reads=("seed", "train", "rollout"), build=build,
                 keep_on_rebuild=("checkpoints", "snapshots"))   # a resume past a snapshot never rewrites it


def run(config: PipelineConfig, inputs: dict[str, Manifest], store: Store | None = None,
        force: bool = False) -> Manifest:
    return run_stage(SPEC, config, inputs, store, force)

