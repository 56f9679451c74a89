"""The offline training loop on a fixed pool (spec sections 7, 8.4).

One optimizer update = G_mb whole groups from the seeded order, split into micro-batches
of `micro_batch_groups` groups whose losses are already divided by the update's global
token count T_tot, so their gradients sum to the update's gradient. Then: global grad
norm (before clipping), clip, a finiteness check (a bad update is never applied), the
optimizer step, reference refresh every t_ref updates, a metrics row, and an atomic
checkpoint every `checkpoint_every` updates.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import torch

from pipeline.config import PipelineConfig, TrainConfig
from pipeline.hf import load_model
from stages.train import checkpoint
from stages.train.losses import LossInputs, get_loss
from stages.train.order import groups_for_update
from stages.train.policy import make_batch, token_logprobs


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


def load_pool(path: Path, group_size: int) -> Pool:
    df = pl.read_parquet(path).sort(["group", "sample"])
    if df.height == 0:
        raise TrainingError(f"{path}: the training pool is empty (no mixed-reward groups)")
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


def _pad(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r)
    return out


def micro_batch_loss(model, reference, pool: Pool, groups: list[int], tc: TrainConfig,
                     temperature: float, pad_id: int, t_tot: int, n_seq: int):
    """Loss of some whole groups (already / T_tot), its metrics and entropy sum."""
    m = pool.group_size
    responses = [r for g in groups for r in pool.responses[g]]
    batch = make_batch([pool.prompt_ids[g] for g in groups for _ in range(m)], responses, pad_id)
    lp, entropy = token_logprobs(model, batch, temperature, with_entropy=True)
    with torch.no_grad():
        lp_ref, _ = token_logprobs(reference, batch, temperature)
    shape = (len(groups), m, batch.mask.shape[1])
    lp_beh = _pad([x for g in groups for x in pool.lp_beh[g]], shape[2])
    inputs = LossInputs(lp=lp.view(shape), lp_beh=lp_beh.view(shape), lp_ref=lp_ref.view(shape),
                        mask=batch.mask.view(shape), rewards=pool.rewards[groups].float(),
                        t_tot=float(t_tot), n_seq_tot=n_seq)
    loss, metrics = get_loss(tc.method)(inputs, tc)
    return loss, metrics, float(entropy.detach().sum())


def run_update(model, reference, pool: Pool, groups: list[int], cfg: PipelineConfig, pad_id: int) -> dict:
    """Forward/backward of one optimizer update (no step); returns its metrics row."""
    tc, m = cfg.train, pool.group_size
    t_tot = sum(len(r) for g in groups for r in pool.responses[g])
    row = {"loss": 0.0, "pg_loss": 0.0, "clip_frac": 0.0, "kl_ref_k3": 0.0, "entropy": 0.0}
    for start in range(0, len(groups), tc.micro_batch_groups):
        chunk = groups[start:start + tc.micro_batch_groups]
        loss, metrics, ent = micro_batch_loss(model, reference, pool, chunk, tc,
                                              cfg.rollout.temperature, pad_id, t_tot, len(groups) * m)
        loss.backward()
        row["loss"] += loss.item()
        row["entropy"] += ent / t_tot
        for k in ("pg_loss", "clip_frac", "kl_ref_k3"):
            row[k] += metrics[k]
    row["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip))
    row["reward"] = float(pool.rewards[groups].mean())
    row["response_length"] = t_tot / (len(groups) * m)
    row["tokens"] = t_tot
    return row


def train(cfg: PipelineConfig, pool: Pool, base_path: str, pad_id: int, folder: Path) -> tuple[list[dict], torch.nn.Module]:
    """Runs (or resumes) the updates; returns the metrics rows; leaves the model in `folder/model`."""
    tc = cfg.train
    model, reference = load_model(base_path), load_model(base_path)
    reference.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tuple(tc.adam_betas), weight_decay=tc.weight_decay)
    ckpt_dir = folder / "checkpoints"
    state = checkpoint.load(ckpt_dir)
    start, rows = (0, []) if state is None else checkpoint.restore(state, model=model, optimizer=opt, reference=reference)
    model.train()
    for u in range(start, tc.updates):
        t0 = time.perf_counter()
        groups = groups_for_update(u, tc.groups_per_update, len(pool.group_ids), cfg.seed)
        row = run_update(model, reference, pool, groups, cfg, pad_id)
        if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
            raise TrainingError(f"update {u + 1} (method {tc.method}): non-finite loss {row['loss']} or grad norm "
                                f"{row['grad_norm']}; the last good checkpoint is kept in {ckpt_dir}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if tc.t_ref and (u + 1) % tc.t_ref == 0:   # spec section 7: refresh after update u
            reference.load_state_dict(model.state_dict())
        rows.append(row | {"update": u + 1, "lr": tc.lr, "seconds": time.perf_counter() - t0})
        if (u + 1) % tc.checkpoint_every == 0 or u + 1 == tc.updates:
            checkpoint.save(ckpt_dir, update=u + 1, model=model, optimizer=opt, reference=reference, metrics=rows)
    return rows, model
