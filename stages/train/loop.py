"""The offline training loop on a fixed pool (spec sections 7, 8.4).

One optimizer update = G_mb whole groups from the seeded order, split into micro-batches
(whole groups under `train.micro_batch_tokens`, longest first, see packing.py; or
`micro_batch_groups` groups each) whose losses are already divided by the update's global
token count T_tot, so their gradients sum to the update's gradient whatever the split.
Then: global grad norm (before clipping), clip, a finiteness check (a bad update is never
applied), the optimizer step, reference refresh every t_ref updates, a metrics row, and
an atomic checkpoint every `checkpoint_every` updates. Device, precision and gradient
checkpointing come prepared in a `Runtime` (pipeline/runtime.py); the loss never sees them.
Under torchrun (distributed.py) every rank runs this same loop on its shard of each
update's groups; T_tot, the metrics and the ESS block stay global.
"""
from __future__ import annotations

import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import torch

from pipeline import interrupt
from pipeline.config import PipelineConfig, TrainConfig
from pipeline.errors import TrainingError
from pipeline.hf import load_model
from pipeline.progress import Progress
from pipeline.runtime import Runtime, make_runtime
from stages.train import checkpoint, distributed
from stages.train.diagnostics import micro_batch_stats, normalized_ess
from stages.train.losses import LossInputs, get_loss
from stages.train.order import groups_for_update
from stages.train.packing import group_width, pack_groups, split_by_count
from stages.train.policy import Batch, make_batch, token_logprobs


log = logging.getLogger("ggpo")


@dataclass
class Pool:
    """The training pool grouped: index j holds the j-th kept group, samples 0..m-1."""
    group_ids: list[int]
    prompt_ids: list[list[int]]
    responses: list[list[list[int]]]     # [n_groups][m][len]
    lp_beh: list[list[list[float]]]      # [n_groups][m][len]
    rewards: torch.Tensor                # [n_groups, m] float64
    group_size: int


def load_pool(path: Path, group_size: int, need_behavior: bool = True) -> Pool:
    df = pl.read_parquet(path).sort(["group", "sample"])
    if df.height == 0:
        raise TrainingError(f"{path}: the training pool is empty (no mixed-reward groups)")
    missing = df.filter(pl.col("behavior_logprobs").is_null())
    if missing.height and need_behavior:
        raise TrainingError(f"{path}: row (group {missing['group'][0]}, sample {missing['sample'][0]}) has no "
                            "behavior_logprobs, which this method needs (GRPO's behavior anchor, GRPO+TIS)")
    if missing.height:   # AGRO / GGPO never read lp_beh; mismatch diagnostics become meaningless
        df = df.with_columns(pl.when(pl.col("behavior_logprobs").is_null())
                             .then(pl.col("response_token_ids").list.eval(pl.element() * 0.0))
                             .otherwise(pl.col("behavior_logprobs")).alias("behavior_logprobs"))
    df = _guard_behavior_logprobs(df, path)
    bad = df.filter(pl.col("behavior_logprobs").list.len() != pl.col("response_token_ids").list.len())
    if bad.height:
        raise TrainingError(f"{path}: row (group {bad['group'][0]}, sample {bad['sample'][0]}) has "
                            "behavior_logprobs of a different length than its response")
    sizes = df.group_by("group").len().filter(pl.col("len") != group_size)
    if sizes.height:
        raise TrainingError(f"{path}: group {sizes['group'][0]} has {sizes['len'][0]} responses but "
                            f"rollout.group_size is {group_size}")
    m, n = group_size, df.height // group_size
    resp, lpb, prm = df["response_token_ids"].to_list(), df["behavior_logprobs"].to_list(), df["prompt_token_ids"].to_list()
    return Pool(
        group_ids=df["group"].to_list()[::m], prompt_ids=prm[::m],
        responses=[resp[j * m:(j + 1) * m] for j in range(n)],
        lp_beh=[lpb[j * m:(j + 1) * m] for j in range(n)],
        rewards=torch.tensor(df["reward"].to_list(), dtype=torch.float64).view(n, m), group_size=m)


# A behavior log-prob of -inf (a token the engine gave zero probability, e.g. under
# truncation) is held at this floor; the losses' ratio guard then caps its ratio at e^20.
LP_BEH_FLOOR = -100.0


def _guard_behavior_logprobs(df: pl.DataFrame, path: Path) -> pl.DataFrame:
    """NaN or +inf behavior log-probs are an engine fault: a clear pool error naming the
    row and token. -inf is clamped to LP_BEH_FLOOR (never a NaN update)."""
    flagged = df.with_row_index("_row").explode("behavior_logprobs").with_columns(
        pl.int_range(pl.len()).over("_row").alias("_token")).filter(
        pl.col("behavior_logprobs").is_nan() | (pl.col("behavior_logprobs") == float("inf")))
    if flagged.height:
        r = flagged.row(0, named=True)
        raise TrainingError(f"{path}: row (group {r['group']}, sample {r['sample']}) has behavior log-prob "
                            f"{r['behavior_logprobs']} at response token {r['_token']} ({flagged.height} such "
                            "tokens in the pool); the rollout engine produced it: rebuild the pool "
                            "(`ggpo stage rollout --force`) or check the engine's logprobs mode")
    return df.with_columns(pl.col("behavior_logprobs").list.eval(
        pl.when(pl.element() == float("-inf")).then(LP_BEH_FLOOR).otherwise(pl.element())))


def _pad(rows: list[list[float]], width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r)
    return out


def _batch(pool: Pool, groups: list[int], pad_id: int):
    m = pool.group_size
    return make_batch([pool.prompt_ids[g] for g in groups for _ in range(m)],
                      [r for g in groups for r in pool.responses[g]], pad_id)


def micro_batches(pool: Pool, groups: list[int], tc: TrainConfig) -> list[list[int]]:
    """An update's (or step's) groups split into micro-batches of whole groups."""
    if tc.micro_batch_tokens is None:
        return split_by_count(groups, tc.micro_batch_groups)
    widths = {g: group_width(len(pool.prompt_ids[g]), [len(r) for r in pool.responses[g]]) for g in groups}
    return pack_groups(groups, widths, pool.group_size, tc.micro_batch_tokens)


def policy_logprobs(model, batch: Batch, rt: Runtime, temperature: float, with_entropy: bool = False,
                    device: torch.device | None = None):
    """token_logprobs on the model's device under the runtime's precision; results on rt.device."""
    with rt.autocast():
        # an FSDP policy's registered forward method (distributed.shard_policy), else the function
        fn = getattr(model, "ggpo_token_logprobs", None) or (lambda *a: token_logprobs(model, *a))
        lp, entropy = fn(batch.to(device or rt.device), temperature, with_entropy, rt.logprob_impl, rt.chunk_tokens)
    return lp.to(rt.device), entropy


@torch.no_grad()
def step_anchor(model, pool: Pool, groups: list[int], cfg: PipelineConfig, pad_id: int,
                rt: Runtime) -> dict[int, list[list[float]]]:
    """lp_old (spec 8.1): the trainer's log-probs of a step's groups at the step start."""
    out = {}
    for chunk, real in my_micro_batches(pool, sorted(set(groups)), cfg.train):
        batch = _batch(pool, chunk, pad_id)
        lp, _ = policy_logprobs(model, batch, rt, cfg.rollout.temperature)
        if not real:
            continue
        rows = [row[:int(n)] for row, n in zip(lp.tolist(), batch.mask.sum(1).tolist())]
        for j, g in enumerate(chunk):
            out[g] = rows[j * pool.group_size:(j + 1) * pool.group_size]
    d = distributed.current()     # each rank did its shard; every rank keeps the whole anchor
    return out if d is None else {g: v for part in d.gather(out) for g, v in part.items()}


def my_micro_batches(pool: Pool, groups: list[int], tc: TrainConfig) -> list[tuple[list[int], bool]]:
    """This process's micro-batches of `groups`, each flagged real. Under torchrun: this
    rank's contiguous shard of whole groups, padded with non-real micro-batches to the
    largest rank's count (FSDP needs the same forwards/backwards on every rank)."""
    d = distributed.current()
    if d is None:
        return [(c, True) for c in micro_batches(pool, groups, tc)]
    return d.lockstep([micro_batches(pool, s, tc) for s in d.shards(groups)])


def micro_batch_loss(model, reference, pool: Pool, groups: list[int], tc: TrainConfig,
                     temperature: float, pad_id: int, t_tot: int, n_seq: int,
                     lp_old: dict[int, list[list[float]]] | None, rt: Runtime):
    """Loss of some whole groups (already / T_tot), its metrics and entropy sum."""
    m = pool.group_size
    batch = _batch(pool, groups, pad_id)
    lp, entropy = policy_logprobs(model, batch, rt, temperature, with_entropy=True)
    with torch.no_grad():
        lp_ref, _ = policy_logprobs(reference, batch, rt, temperature, device=rt.reference_device)
    shape = (len(groups), m, batch.mask.shape[1])

    def padded(rows: list[list[float]]) -> torch.Tensor:
        return _pad(rows, shape[2], lp.dtype).view(shape).to(rt.device)
    inputs = LossInputs(lp=lp.view(shape), lp_beh=padded([x for g in groups for x in pool.lp_beh[g]]),
                        lp_ref=lp_ref.view(shape), mask=batch.mask.view(shape).to(rt.device),
                        rewards=pool.rewards[groups].float().to(rt.device),
                        t_tot=float(t_tot), n_seq_tot=n_seq,
                        lp_old=None if lp_old is None else padded([x for g in groups for x in lp_old[g]]))
    loss, metrics = get_loss(tc.method)(inputs, tc)
    return loss, metrics, float(entropy.detach().sum()), micro_batch_stats(inputs, tc.beta)


def run_update(model, reference, pool: Pool, groups: list[int], cfg: PipelineConfig, pad_id: int,
               lp_old: dict[int, list[list[float]]] | None = None, runtime: Runtime | None = None) -> dict:
    """Forward/backward of one optimizer update (no step); returns its metrics row
    (plus `seq_log_ratio`, the responses' s_i, for the block ESS)."""
    tc, m = cfg.train, pool.group_size
    t_tot = sum(len(r) for g in groups for r in pool.responses[g])
    row: dict = {"loss": 0.0, "entropy": 0.0, "seq_log_ratio": []}
    sums = {"k3_mismatch": 0.0, "abs_log_ratio": 0.0, "ell_sum": 0.0, "ggpo_raw_sum": 0.0,
            "success_ess_sum": 0.0, "success_ess_count": 0}
    rt = runtime or make_runtime(tc)
    for chunk, real in my_micro_batches(pool, groups, tc):
        if interrupt.requested() and distributed.current() is None:   # ranks stop together or not at all
            raise interrupt.Interrupted("mid-update")     # the update is dropped; the caller checkpoints
        loss, metrics, ent, stats = micro_batch_loss(model, reference, pool, chunk, tc, cfg.rollout.temperature,
                                                     pad_id, t_tot, len(groups) * m, lp_old, rt)
        if not real:             # a rank's padding pass: collectives only, no contribution
            (loss * 0.0).backward()
            continue
        loss.backward()
        row["loss"] += loss.item()
        row["entropy"] += ent / t_tot
        for k, v in metrics.items():          # additive by the loss contract
            row[k] = row.get(k, 0.0) + v
        row["seq_log_ratio"] += stats.pop("seq_log_ratio")
        row["max_abs_log_ratio"] = max(row.get("max_abs_log_ratio", 0.0), stats.pop("max_abs_log_ratio"))
        for k in sums:
            sums[k] += stats[k]
    d = distributed.current()
    if d is not None:            # global sums over the ranks' shards (T_tot is global already)
        parts = d.gather((row, sums))
        row, sums = distributed.combine([p[0] for p in parts]), distributed.combine([p[1] for p in parts])
    n_seq = len(groups) * m
    row |= {"k3_mismatch": sums["k3_mismatch"], "abs_log_ratio": sums["abs_log_ratio"],
            "mean_ell": sums["ell_sum"] / n_seq, "ggpo_raw_loss": sums["ggpo_raw_sum"] / len(groups),
            "success_ess": sums["success_ess_sum"] / sums["success_ess_count"] if sums["success_ess_count"] else None}
    row["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip))
    row["reward"] = float(pool.rewards[groups].mean())
    row["response_length"] = t_tot / n_seq
    row["tokens"] = t_tot
    return row


def snapshot_dir(folder: Path, update: int) -> Path:
    return folder / "snapshots" / f"update_{update:05d}"


def snapshot_files(updates) -> dict[str, tuple[str, None]]:
    """A training artifact's manifest entries for its snapshots after `updates`
    (stages.base.model_path finds them by these names)."""
    return {f"snapshot_{u}": (f"{snapshot_dir(Path('.'), u).as_posix()}/model.safetensors", None) for u in updates}


def save_policy(model, tokenizer, final: Path) -> None:
    """An HF folder (weights, config, tokenizer), written to a temp name then renamed."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if distributed.is_sharded(model):      # gathered on every rank (collective), rank 0 writes
        distributed.save_sharded_policy(model, tokenizer, tmp, final)
        return
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


@dataclass
class TrainState:
    """Everything an update needs and a checkpoint keeps: policy, reference, optimizer, the
    number of updates done, metrics rows, the current step's anchor log-probs (lp_old) and
    the sequence log ratios of the unfinished ESS block."""
    model: torch.nn.Module
    reference: torch.nn.Module
    opt: torch.optim.Optimizer
    update: int = 0
    rows: list[dict] = field(default_factory=list)
    lp_old: dict | None = None
    block_s: list[float] = field(default_factory=list)


def new_state(cfg: PipelineConfig, policy_path: str, reference_path: str, rt: Runtime) -> TrainState:
    """Policy from `policy_path`, reference from `reference_path`, a fresh AdamW."""
    tc = cfg.train
    model, reference = rt.prepare(load_model(policy_path)), rt.prepare_reference(load_model(reference_path))
    model = distributed.shard_policy(model, rt.autocast_dtype, tc.fsdp_param_dtype)   # under torchrun only; before the optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tuple(tc.adam_betas), weight_decay=tc.weight_decay)
    return TrainState(model, reference, opt)


def resume(st: TrainState, state: dict | None, where: Path) -> TrainState:
    """`st` with a checkpoint's weights, optimizer, reference (when it holds one), RNG,
    update index, rows, lp_old and ESS block applied (None: `st` unchanged). lp_old of the
    current step survives a resume (it was taken with the step-start weights, which a
    resumed run no longer has)."""
    if state is None:
        return st
    st.update, st.rows = checkpoint.restore(state, model=st.model, optimizer=st.opt, reference=st.reference)
    st.lp_old, st.block_s = state.get("lp_old"), state.get("block_s", [])
    log.info("train: resuming after update %d from %s", st.update, where)
    return st


def reference_refreshed(tc: TrainConfig, update: int) -> bool:
    """Has the reference been refreshed by `update`? Until then it is pi_0, which every
    resume loads anyway, so checkpoints and round states store it only from then on."""
    t_ref = tc.refresh_every()
    return t_ref is not None and update >= t_ref


def save_checkpoint(st: TrainState, folder: Path, tc: TrainConfig) -> None:
    """The state after st.update updates, atomically (the reference once refreshed)."""
    refreshed = reference_refreshed(tc, st.update)
    checkpoint.save(folder, update=st.update, model=st.model, optimizer=st.opt,
                    reference=st.reference if refreshed else None, metrics=st.rows,
                    lp_old=st.lp_old if tc.needs_step_anchor() else None, block_s=st.block_s)


def _step_groups(u: int, tc: TrainConfig, n_groups: int, seed: int) -> list[int]:
    """Every group of the step (N updates) that starts at update u."""
    step = range(u, min(u + tc.updates_per_step, tc.updates))
    return [g for v in step for g in groups_for_update(v, tc.groups_per_update, n_groups, seed)]


def one_update(st: TrainState, pool: Pool, groups: list[int], cfg: PipelineConfig, pad_id: int,
               rt: Runtime, ckpt_dir: Path) -> dict:
    """Update st.update + 1 on `groups`: forward/backward, finiteness check (a bad update is
    never applied), optimizer step, reference refresh, ESS block; returns its metrics row."""
    tc, u, t0 = cfg.train, st.update, time.perf_counter()
    needs_anchor, t_ref = tc.needs_step_anchor(), tc.refresh_every()
    row = run_update(st.model, st.reference, pool, groups, cfg, pad_id, st.lp_old if needs_anchor else None, rt)
    if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
        raise TrainingError(f"update {u + 1} (method {tc.method}): non-finite loss {row['loss']} or grad norm "
                            f"{row['grad_norm']}; the last good checkpoint is kept in {ckpt_dir}")
    st.opt.step()
    st.opt.zero_grad(set_to_none=True)
    refresh = t_ref is not None and (u + 1) % t_ref == 0   # spec 7: refresh after update u
    if refresh:
        st.reference.load_state_dict(distributed.policy_state(st.model))
    st.block_s += row.pop("seq_log_ratio")
    ess = None
    if (u + 1) % tc.diagnostics_block == 0 or u + 1 == tc.updates:
        ess, st.block_s = normalized_ess(torch.tensor(st.block_s, dtype=torch.float64)), []
    st.update = u + 1
    return row | {"update": u + 1, "lr": tc.lr, "seconds": time.perf_counter() - t0, "ess": ess,
                  "ref_refreshed": refresh}


def run_updates(st: TrainState, pool: Pool, cfg: PipelineConfig, tokenizer, folder: Path, stop: int,
                groups_of, step_groups_of, rt: Runtime, desc: str, last_checkpoint: bool = True) -> TrainState:
    """Updates st.update .. stop-1. groups_of(u): update u's pool positions; step_groups_of(u):
    every group of the step starting at u (the step anchor's groups, at u % N == 0).
    Snapshots after the updates in train.snapshot_updates (before the checkpoint, so a resume
    never skips one); a checkpoint every train.checkpoint_every updates and after the last
    (unless not last_checkpoint: the caller saves the end state itself)."""
    tc, pad_id, ckpt_dir = cfg.train, tokenizer.pad_token_id, folder / "checkpoints"
    snapshots = set(tc.snapshot_updates())
    st.model.train()
    with Progress(desc, total=stop, unit="update", start=st.update) as bar:
        while st.update < stop:
            u = st.update
            try:
                if interrupt.requested() and distributed.current() is None:
                    raise interrupt.Interrupted("between updates")
                if tc.needs_step_anchor() and u % tc.updates_per_step == 0:
                    st.lp_old = step_anchor(st.model, pool, step_groups_of(u), cfg, pad_id, rt)
                row = one_update(st, pool, groups_of(u), cfg, pad_id, rt, ckpt_dir)
            except interrupt.Interrupted:
                # the state after the last complete update: a rerun resumes exactly there
                st.opt.zero_grad(set_to_none=True)
                save_checkpoint(st, ckpt_dir, tc)
                raise interrupt.stopped(f"{desc} at update {st.update}") from None
            st.rows.append(row)
            if u + 1 in snapshots and u + 1 < stop:
                save_policy(st.model, tokenizer, snapshot_dir(folder, u + 1))
            if (u + 1 < stop and (u + 1) % tc.checkpoint_every == 0) or (u + 1 == stop and last_checkpoint):
                save_checkpoint(st, ckpt_dir, tc)
            bar.update(1, loss=f"{row['loss']:.4f}", reward=f"{row['reward']:.3f}",
                       tok_s=f"{row['tokens'] / row['seconds']:.0f}")
    return st


def train(cfg: PipelineConfig, pool: Pool, base_path: str, tokenizer, folder: Path) -> list[dict]:
    """Runs (or resumes) the offline updates, saves the final policy in `folder/model`,
    returns the metrics rows."""
    tc, rt, n_groups = cfg.train, make_runtime(cfg.train), len(pool.group_ids)
    ckpt_dir = folder / "checkpoints"
    st = resume(new_state(cfg, base_path, base_path, rt), checkpoint.load(ckpt_dir), ckpt_dir)
    run_updates(st, pool, cfg, tokenizer, folder, tc.updates,
                lambda u: groups_for_update(u, tc.groups_per_update, n_groups, cfg.seed),
                lambda u: _step_groups(u, tc, n_groups, cfg.seed), rt, f"train {tc.method} seed {cfg.seed}")
    save_policy(st.model, tokenizer, folder / "model")
    return st.rows
