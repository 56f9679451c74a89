"""The offline training loop on a fixed pool (spec sections 7, 8.4).

One optimizer update = G_mb whole groups from the seeded order, split into micro-batches
(whole groups under `train.micro_batch_tokens`, longest first, see packing.py; or
`micro_batch_groups` groups each) whose losses are already divided by the update's global
token count T_tot, so their gradients sum to the update's gradient whatever the split.
Then: global grad norm (before clipping), clip, a finiteness check (a bad update is never
applied), the optimizer step, reference refresh every t_ref updates, a metrics row, and
an atomic checkpoint every `checkpoint_every` updates. Device, precision and gradient
checkpointing come prepared in a `Runtime` (pipeline/runtime.py); the loss never sees them.
"""
from __future__ import annotations

import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import torch

from pipeline.config import PipelineConfig, TrainConfig
from pipeline.hf import load_model
from pipeline.progress import Progress
from pipeline.runtime import Runtime, make_runtime
from stages.train import checkpoint
from stages.train.diagnostics import micro_batch_stats, normalized_ess
from stages.train.losses import LossInputs, get_loss
from stages.train.order import groups_for_update
from stages.train.packing import group_width, pack_groups, split_by_count
from stages.train.policy import Batch, make_batch, token_logprobs


log = logging.getLogger("ggpo")


class TrainingError(RuntimeError):
    pass


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


def _pad(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
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
        lp, entropy = token_logprobs(model, batch.to(device or rt.device), temperature, with_entropy,
                                     rt.logprob_impl, rt.chunk_tokens)
    return lp.to(rt.device), entropy


@torch.no_grad()
def step_anchor(model, pool: Pool, groups: list[int], cfg: PipelineConfig, pad_id: int,
                rt: Runtime) -> dict[int, list[list[float]]]:
    """lp_old (spec 8.1): the trainer's log-probs of a step's groups at the step start."""
    out = {}
    for chunk in micro_batches(pool, sorted(set(groups)), cfg.train):
        batch = _batch(pool, chunk, pad_id)
        lp, _ = policy_logprobs(model, batch, rt, cfg.rollout.temperature)
        rows = [row[:int(n)] for row, n in zip(lp.tolist(), batch.mask.sum(1).tolist())]
        for j, g in enumerate(chunk):
            out[g] = rows[j * pool.group_size:(j + 1) * pool.group_size]
    return out


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
        return _pad(rows, shape[2]).view(shape).to(rt.device)
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
    for chunk in micro_batches(pool, groups, tc):
        loss, metrics, ent, stats = micro_batch_loss(model, reference, pool, chunk, tc, cfg.rollout.temperature,
                                                     pad_id, t_tot, len(groups) * m, lp_old, rt)
        loss.backward()
        row["loss"] += loss.item()
        row["entropy"] += ent / t_tot
        for k, v in metrics.items():          # additive by the loss contract
            row[k] = row.get(k, 0.0) + v
        row["seq_log_ratio"] += stats.pop("seq_log_ratio")
        for k in sums:
            sums[k] += stats[k]
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


def save_policy(model, tokenizer, final: Path) -> None:
    """An HF folder (weights, config, tokenizer), written to a temp name then renamed."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def _start(cfg: PipelineConfig, base_path: str, ckpt_dir: Path, rt: Runtime):
    """Policy, reference and optimizer on the runtime's device, resumed from the last
    checkpoint if there is one: (model, reference, opt, start update, rows, lp_old, block_s).
    lp_old of the current step survives a resume inside the checkpoint (it was taken with
    the step-start weights, which a resumed run no longer has)."""
    tc = cfg.train
    model, reference = rt.prepare(load_model(base_path)), rt.prepare_reference(load_model(base_path))
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tuple(tc.adam_betas), weight_decay=tc.weight_decay)
    state = checkpoint.load(ckpt_dir)
    if state is None:
        return model, reference, opt, 0, [], None, []
    start, rows = checkpoint.restore(state, model=model, optimizer=opt, reference=reference)
    log.info("train %s seed %d: resuming after update %d from %s", tc.method, cfg.seed, start, ckpt_dir)
    return model, reference, opt, start, rows, state.get("lp_old"), state.get("block_s", [])


def _step_groups(u: int, tc: TrainConfig, n_groups: int, seed: int) -> list[int]:
    """Every group of the step (N updates) that starts at update u."""
    step = range(u, min(u + tc.updates_per_step, tc.updates))
    return [g for v in step for g in groups_for_update(v, tc.groups_per_update, n_groups, seed)]


def train(cfg: PipelineConfig, pool: Pool, base_path: str, tokenizer, folder: Path) -> list[dict]:
    """Runs (or resumes) the updates, saves the final policy in `folder/model`, returns the
    metrics rows."""
    tc, pad_id, rt = cfg.train, tokenizer.pad_token_id, make_runtime(cfg.train)
    ckpt_dir, n_groups = folder / "checkpoints", len(pool.group_ids)
    model, reference, opt, start, rows, lp_old, block_s = _start(cfg, base_path, ckpt_dir, rt)
    needs_anchor, t_ref = tc.needs_step_anchor(), tc.refresh_every()
    model.train()
    with Progress(f"train {tc.method} seed {cfg.seed}", total=tc.updates, unit="update", start=start) as bar:
        for u in range(start, tc.updates):
            t0 = time.perf_counter()
            groups = groups_for_update(u, tc.groups_per_update, n_groups, cfg.seed)
            if needs_anchor and u % tc.updates_per_step == 0:
                lp_old = step_anchor(model, pool, _step_groups(u, tc, n_groups, cfg.seed), cfg, pad_id, rt)
            row = run_update(model, reference, pool, groups, cfg, pad_id, lp_old if needs_anchor else None, rt)
            if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
                raise TrainingError(f"update {u + 1} (method {tc.method}): non-finite loss {row['loss']} or grad norm "
                                    f"{row['grad_norm']}; the last good checkpoint is kept in {ckpt_dir}")
            opt.step()
            opt.zero_grad(set_to_none=True)
            refresh = t_ref is not None and (u + 1) % t_ref == 0   # spec 7: refresh after update u
            if refresh:
                reference.load_state_dict(model.state_dict())
            block_s += row.pop("seq_log_ratio")
            ess = None
            if (u + 1) % tc.diagnostics_block == 0 or u + 1 == tc.updates:
                ess, block_s = normalized_ess(torch.tensor(block_s, dtype=torch.float64)), []
            rows.append(row | {"update": u + 1, "lr": tc.lr, "seconds": time.perf_counter() - t0,
                               "ess": ess, "ref_refreshed": refresh})
            if u + 1 in tc.snapshot_updates():
                # before the checkpoint, so a resume never skips a snapshot
                save_policy(model, tokenizer, snapshot_dir(folder, u + 1))
            if (u + 1) % tc.checkpoint_every == 0 or u + 1 == tc.updates:
                checkpoint.save(ckpt_dir, update=u + 1, model=model, optimizer=opt, reference=reference,
                                metrics=rows, lp_old=lp_old if needs_anchor else None, block_s=block_s)
            bar.update(1, loss=f"{row['loss']:.4f}", reward=f"{row['reward']:.3f}",
                       tok_s=f"{row['tokens'] / rows[-1]['seconds']:.0f}")
    save_policy(model, tokenizer, folder / "model")
    return rows
