"""The offline training loop on a fixed pool (spec sections 7, 8.4).

One optimizer update = G_mb whole groups from the seeded order, split into micro-batches
(whole groups under `train.micro_batch_tokens`, longest first, see packing.py; or
`micro_batch_groups` groups each) whose losses are already divided by the update's global
token count T_tot, so their gradients sum to the update's gradient whatever the split.
Then: global grad norm (before clipping), clip, a finiteness check (a bad update is never
applied), the optimizer step, reference refresh every t_ref updates, a metrics row, and
an atomic checkpoint every `checkpoint_every` updates. Device, precision and gradient
checkpointing come prepared in a `Runtime` (pipeline/models/runtime.py); the loss never sees them.
The functions take two objects: `TrainState` (what updates change and checkpoints keep:
policy, reference, optimizer, update index, lp_old, ESS block, reference cache) and
`TrainContext` (frozen: config, pool, runtime, pad id, loss, the run's schedule and folder).
Under torchrun (distributed.py) every rank runs this same loop on its shard of each
update's groups; T_tot, the metrics and the ESS block stay global.
"""
from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from pipeline.core import interrupt
from pipeline.core.config import PipelineConfig, TrainConfig
from pipeline.core.errors import DiskFull, NonFiniteUpdate, TrainingError
from pipeline.core.store import disk_full, is_disk_full
from pipeline.models.hf import load_model
from pipeline.models.runtime import Runtime, make_runtime
from pipeline.services.progress import Progress
from pipeline.training import checkpoint, distributed, optim
from pipeline.training.diagnostics import micro_batch_stats, normalized_ess
from pipeline.training.losses import LossFn, LossInputs, get_loss
from pipeline.training.order import groups_for_update
from pipeline.training.policy import Batch, Buckets, token_logprobs
from pipeline.training.pool import LP_BEH_FLOOR, Pool, batch, check_token_ids, load_pool, micro_batches, padded_rows, stack_groups  # noqa: F401 - loop's API too
from pipeline.training.reference import ReferenceCache

log = logging.getLogger("ggpo")
# the metrics that compare the learner with the behavior log-probs (ess too, per block)
BEHAVIOR_DIAGNOSTICS = ("k3_mismatch", "abs_log_ratio", "max_abs_log_ratio", "chi2_token", "chi2_seq")


def policy_logprobs(model, batch: Batch | Buckets, rt: Runtime, temperature: float, with_entropy: bool = False,
                    device: torch.device | None = None):
    """token_logprobs on the model's device under the runtime's precision; results on rt.device."""
    with rt.autocast((device or rt.device).type):
        # an FSDP policy's registered forward method (distributed.shard_policy), else the function
        fn = getattr(model, "ggpo_token_logprobs", None) or (lambda *a: token_logprobs(model, *a))
        lp, entropy = fn(batch.to(device or rt.device), temperature, with_entropy, rt.logprob_impl, rt.chunk_tokens)
    return lp.to(rt.device), entropy


def group_rows(lp: torch.Tensor, pool: Pool, groups: list[int]) -> dict[int, torch.Tensor]:
    """[G * m, T] log-probs of a micro-batch -> {group: [m, T_g]}, each cut to its longest response."""
    m = pool.group_size
    return {g: lp[j * m:(j + 1) * m, :max(len(r) for r in pool.responses[g])] for j, g in enumerate(groups)}


@dataclass(frozen=True)
class TrainContext:
    """What a run of updates reads and none of its updates changes: the config, the pool and
    its pad id, the runtime (device, precision, batch layout) and the method's loss; for
    run_updates also its schedule (`groups_of(u)`: update u's pool positions;
    `step_groups_of(u)`: every group of the step starting at u, the step anchor's), its
    progress label and, for the offline stage, where it writes (`folder`: checkpoints and
    snapshots, `tokenizer`: saved with each snapshot; None in an online cell, which
    checkpoints at round boundaries). What changes lives in TrainState."""
    cfg: PipelineConfig
    pool: Pool
    rt: Runtime
    pad_id: int
    groups_of: Callable[[int], list[int]] | None = None
    step_groups_of: Callable[[int], list[int]] | None = None
    desc: str = "train"
    folder: Path | None = None
    tokenizer: Any = None
    loss: LossFn = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss", get_loss(self.cfg.train.method))

    @property
    def tc(self) -> TrainConfig:
        return self.cfg.train

    @property
    def temperature(self) -> float:
        return self.cfg.rollout.temperature

    def batch(self, groups: list[int]) -> Batch | Buckets:
        """The model input of some whole groups in this runtime's layout."""
        return batch(self.pool, groups, self.pad_id, self.rt.packed, self.rt.bucket_overhead)


@torch.no_grad()
def step_anchor(model, ctx: TrainContext, groups: list[int], first: list[int] | None = None) -> dict[int, torch.Tensor]:
    """lp_old (spec 8.1): the trainer's log-probs of a step's groups at the step start,
    {group: [m, T_g]} on the training device. `first`: the step's first update's groups;
    an anchor micro-batch that is also one of that update's micro-batches (the same groups
    in the same order: the same input) is left out here and read from the update's own
    forward, on the same weights (`anchor_from_update`; train.anchor_reuse)."""
    out: dict[int, torch.Tensor] = {}
    rt = ctx.rt
    reused = reused_chunks(ctx, first)
    for chunk, real in my_micro_batches(ctx.pool, sorted(set(groups)), ctx.tc, rt.packed):
        if tuple(chunk) in reused:
            continue
        lp, _ = policy_logprobs(model, ctx.batch(chunk), rt, ctx.temperature)
        if real:
            out |= group_rows(lp, ctx.pool, chunk)
    d = distributed.current()     # each rank did its shard; every rank keeps the whole anchor
    if d is None:
        return out
    parts = d.gather({g: t.cpu() for g, t in out.items()})
    return {g: t.to(rt.device) for part in parts for g, t in part.items()}


def reused_chunks(ctx: TrainContext, first: list[int] | None) -> set[tuple[int, ...]]:
    """The first update's micro-batches whose anchor its own forward gives (step_anchor).
    Why it is exact: lp_old is the policy's log-probs at the step start, and the step's first
    update runs the policy at the step-start weights on the same batch (dropout off, the same
    kernels with or without autograd: tests/test_online_cell.py compares a cell byte for byte
    with train.anchor_reuse off). Not under torchrun (every rank runs the anchor's micro-batches
    in lockstep) and not when off."""
    if first is None or not ctx.tc.anchor_reuse or distributed.current() is not None:
        return set()
    return {tuple(c) for c in micro_batches(ctx.pool, first, ctx.tc, ctx.rt.packed)}


def anchor_from_update(st: TrainState, ctx: TrainContext, groups: list[int], lp: torch.Tensor) -> None:
    """st.lp_old for `groups`, a micro-batch of the step's first update that step_anchor left
    out, read from that update's forward `lp` [G * m, T] (before any step: the step-start
    weights). A group missing later in a step is a bug, never filled from moved weights."""
    if st.lp_old is None or all(g in st.lp_old for g in groups):
        return
    if st.update % ctx.tc.updates_per_step != 0:
        raise TrainingError(f"update {st.update + 1}: the step anchor lacks groups {[g for g in groups if g not in st.lp_old]}"
                            " after the step's first update")
    st.lp_old |= group_rows(lp.detach(), ctx.pool, groups)


def my_micro_batches(pool: Pool, groups: list[int], tc: TrainConfig, packed: bool = False
                     ) -> list[tuple[list[int], bool]]:
    """This process's micro-batches of `groups`, each flagged real. Under torchrun: this
    rank's contiguous shard of whole groups, padded with non-real micro-batches to the
    largest rank's count (FSDP needs the same forwards/backwards on every rank)."""
    d = distributed.current()
    if d is None:
        return [(c, True) for c in micro_batches(pool, groups, tc, packed)]
    return d.lockstep([micro_batches(pool, s, tc, packed) for s in d.shards(groups)])


@dataclass
class MicroBatch:
    """One micro-batch's contribution, all on the device: the loss (already / T_tot), the
    loss's metrics and the diagnostics (micro_batch_stats), and its entropy sum."""
    loss: torch.Tensor
    sums: dict[str, torch.Tensor]
    seq_log_ratio: torch.Tensor
    max_abs_log_ratio: torch.Tensor


def micro_batch_loss(st: TrainState, ctx: TrainContext, groups: list[int], t_tot: int, n_seq: int) -> MicroBatch:
    """Loss, metrics and diagnostics of some whole groups of the update whose totals are
    t_tot tokens and n_seq responses; nothing leaves the device."""
    pool, rt, tc = ctx.pool, ctx.rt, ctx.tc
    lp_old = st.lp_old if tc.needs_step_anchor() else None
    b = ctx.batch(groups)
    lp, entropy = policy_logprobs(st.model, b, rt, ctx.temperature, with_entropy=True)
    if lp_old is not None:
        anchor_from_update(st, ctx, groups, lp)
    shape = (len(groups), pool.group_size, b.mask.shape[1])

    def stacked(rows: list[torch.Tensor]) -> torch.Tensor:
        return stack_groups(rows, shape[2], rt.device, lp.dtype)
    lp_ref = st.ref_cache.get(st.reference, pool, groups, ctx.pad_id, rt, ctx.temperature, policy_logprobs)
    lp_beh = stacked([pool.behavior(g) for g in groups]) if pool.has_behavior else None
    inputs = LossInputs(lp=lp.view(shape), lp_beh=lp_beh,
                        lp_ref=stacked(lp_ref), mask=b.mask.view(shape).to(rt.device),
                        # the pool's float64 rewards in the training precision, at least float32
                        # (a float64 run computes its advantages in float64; never bf16)
                        rewards=pool.rewards[groups].to(rt.device, torch.promote_types(lp.dtype, torch.float32)),
                        t_tot=float(t_tot), n_seq_tot=n_seq,
                        lp_old=None if lp_old is None else stacked([lp_old[g] for g in groups]))
    loss, metrics = ctx.loss(inputs, tc)
    stats = micro_batch_stats(inputs, tc.beta)
    sums = metrics | {"loss": loss.detach(), "entropy": entropy.sum() / t_tot}
    sums |= {k: v for k, v in stats.items() if k not in ("seq_log_ratio", "max_abs_log_ratio")}
    return MicroBatch(loss, sums, stats["seq_log_ratio"], stats["max_abs_log_ratio"])


def run_update(st: TrainState, ctx: TrainContext, groups: list[int]) -> dict:
    """Forward/backward of one optimizer update on `groups` (no step; st.lp_old is the step
    anchor where the method reads one); returns its metrics row (plus `seq_log_ratio`, the
    responses' s_i, for the block ESS). Everything stays on the device until the update's
    end, then one transfer brings it to the host (`to_host`)."""
    tc, pool, m = ctx.tc, ctx.pool, ctx.pool.group_size
    t_tot = sum(len(r) for g in groups for r in pool.responses[g])
    model = st.model
    parts: list[MicroBatch] = []
    for chunk, real in my_micro_batches(pool, groups, tc, ctx.rt.packed):
        if interrupt.requested() and distributed.current() is None:   # ranks stop together or not at all
            raise interrupt.Interrupted("mid-update")     # the update is dropped; the caller checkpoints
        out = micro_batch_loss(st, ctx, chunk, t_tot, len(groups) * m)
        if not real:             # a rank's padding pass: collectives only, no contribution
            (out.loss * 0.0).backward()
            continue
        out.loss.backward()
        parts.append(out)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    if hasattr(grad_norm, "full_tensor"):    # FSDP: a DTensor, already reduced over the mesh
        grad_norm = grad_norm.full_tensor()
    row, norm = to_host(parts, grad_norm)
    d = distributed.current()
    if d is not None:            # global sums over the ranks' shards (T_tot is global already)
        row = distributed.combine(d.gather(row))
    n_seq = len(groups) * m
    count = row.pop("success_ess_count", 0)
    row |= {"mean_ell": row.pop("ell_sum", 0.0) / n_seq, "ggpo_raw_loss": row.pop("ggpo_raw_sum", 0.0) / len(groups),
            "success_ess": row.pop("success_ess_sum", 0.0) / count if count else None, "grad_norm": norm,
            "reward": sum(pool.reward_means[g] for g in groups) / len(groups), "response_length": t_tot / n_seq,
            "tokens": t_tot}
    if not pool.has_behavior:     # no behavior policy to compare with: left empty, not faked
        row |= dict.fromkeys(BEHAVIOR_DIAGNOSTICS)
    return row


def to_host(parts: list[MicroBatch], grad_norm: torch.Tensor) -> tuple[dict, float]:
    """The one device-to-host transfer of an update: every summed metric, the largest
    |log rho|, the grad norm and the sequence log ratios, in one tensor, read once."""
    names = sorted({k for p in parts for k in p.sums})
    scalars = [torch.stack([p.sums[k].to(torch.float64) for p in parts if k in p.sums]).sum() for k in names]
    peak = torch.stack([p.max_abs_log_ratio.to(torch.float64) for p in parts]).max() if parts else None
    head = torch.stack(scalars + ([peak] if peak is not None else []) + [grad_norm.to(torch.float64).to(scalars[0].device)
                                                             if scalars else grad_norm.to(torch.float64)])
    seq = [p.seq_log_ratio.to(device=head.device, dtype=torch.float64) for p in parts]
    values = torch.cat([head] + seq).tolist()
    row = dict(zip(names, values))
    k = len(names)
    if parts:
        row["max_abs_log_ratio"], k = values[k], k + 1
    row["seq_log_ratio"] = values[k + 1:]
    return row, values[k]


def snapshot_dir(folder: Path, update: int) -> Path:
    return folder / "snapshots" / f"update_{update:05d}"


def snapshot_files(updates) -> dict[str, tuple[str, None]]:
    """A training artifact's manifest entries for its snapshots after `updates`
    (stages.base_model.model_path finds them by these names)."""
    return {f"snapshot_{u}": (f"{snapshot_dir(Path('.'), u).as_posix()}/model.safetensors", None) for u in updates}


def save_policy(model, tokenizer, final: Path) -> None:
    """An HF folder (weights, config, tokenizer), written to a temp name then renamed."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if distributed.is_sharded(model):      # gathered on every rank (collective), rank 0 writes
        distributed.save_sharded_policy(model, tokenizer, tmp, final)
        return
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except Exception as exc:     # a full disk: the half-written folder goes, `final` stays as it was
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc) and not isinstance(exc, DiskFull):
            raise disk_full(final, checkpoint.state_bytes(model.state_dict())) from exc
        raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


@dataclass
class TrainState:
    """Everything an update needs and a checkpoint keeps: policy, reference, optimizer, the
    number of updates done, metrics rows, the current step's anchor log-probs (lp_old) and
    the sequence log ratios of the unfinished ESS block; and, not checkpointed, the
    reference log-probs of the current reference window (reference.py)."""
    model: PreTrainedModel     # FSDP-wrapped under torchrun (a subclass)
    reference: torch.nn.Module
    opt: torch.optim.Optimizer
    update: int = 0
    rows: list[dict] = field(default_factory=list)
    lp_old: dict | None = None
    block_s: list[float] = field(default_factory=list)
    ref_cache: ReferenceCache = field(default_factory=ReferenceCache)


def new_state(cfg: PipelineConfig, policy_path: str, reference_path: str, rt: Runtime) -> TrainState:
    """Policy from `policy_path`, reference from `reference_path`, a fresh AdamW."""
    tc = cfg.train
    model, reference = rt.prepare(load_model(policy_path)), rt.prepare_reference(load_model(reference_path))
    model = distributed.shard_policy(model, rt.autocast_dtype, tc.fsdp_param_dtype)   # under torchrun only; before the optimizer
    # torch's AdamW, with a processor-independent fp32 CPU step in the reproducible mode (optim.py)
    opt = optim.AdamW(model.parameters(), lr=tc.lr, betas=tc.adam_betas, weight_decay=tc.weight_decay)
    return TrainState(model, reference, opt)


def resume(st: TrainState, state: dict | None, where: Path) -> TrainState:
    """`st` with a checkpoint's weights, optimizer, reference (when it holds one), RNG,
    update index, rows, lp_old and ESS block applied (None: `st` unchanged). lp_old of the
    current step survives a resume (it was taken with the step-start weights, which a
    resumed run no longer has)."""
    if state is None:
        return st
    st.update, st.rows = checkpoint.restore(state, model=st.model, optimizer=st.opt, reference=st.reference)
    st.lp_old, st.block_s = anchor_tensors(state.get("lp_old")), state.get("block_s", [])
    log.info("train: resuming after update %d from %s", st.update, where)
    return st


def anchor_tensors(lp_old: dict | None) -> dict[int, torch.Tensor] | None:
    """A checkpoint's lp_old as {group: [m, T_g] tensor} (older checkpoints hold lists)."""
    if lp_old is None:
        return None
    return {g: v if isinstance(v, torch.Tensor) else padded_rows(v) for g, v in lp_old.items()}


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


def one_update(st: TrainState, ctx: TrainContext, groups: list[int]) -> dict:
    """Update st.update + 1 on `groups`: forward/backward, finiteness check (a bad update is
    never applied), optimizer step, reference refresh, ESS block; returns its metrics row."""
    tc, u, t0 = ctx.tc, st.update, time.perf_counter()
    t_ref, pool = tc.refresh_every(), ctx.pool
    row = run_update(st, ctx, groups)
    if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
        kept = f"in {ctx.folder / 'checkpoints'}" if ctx.folder is not None else "at the last round boundary"
        raise NonFiniteUpdate(f"update {u + 1} (method {tc.method}): non-finite loss {row['loss']} or grad norm "
                            f"{row['grad_norm']}; the last good checkpoint is kept {kept}")
    st.opt.step()
    st.opt.zero_grad(set_to_none=True)
    refresh = t_ref is not None and (u + 1) % t_ref == 0   # spec 7: refresh after update u
    if refresh:
        st.reference.load_state_dict(distributed.policy_state(st.model))
        st.ref_cache.clear()         # a new reference: its log-probs are new
    st.block_s += row.pop("seq_log_ratio")
    ess = None
    if (u + 1) % tc.diagnostics_block == 0 or u + 1 == tc.updates:
        ess, st.block_s = normalized_ess(torch.tensor(st.block_s, dtype=torch.float64)), []
        ess = ess if pool.has_behavior else None
    st.update = u + 1
    return row | {"update": u + 1, "lr": tc.lr, "seconds": time.perf_counter() - t0, "ess": ess,
                  "ref_refreshed": refresh}


def run_updates(st: TrainState, ctx: TrainContext, stop: int, after_update=None) -> TrainState:
    """Updates st.update .. stop-1 on ctx's schedule (ctx.groups_of, ctx.step_groups_of: the
    step anchor's groups, at u % N == 0). With ctx.folder (the offline train stage):
    snapshots after the updates in train.snapshot_updates (before the checkpoint, so a resume
    never skips one), a checkpoint every train.checkpoint_every updates, after the last, and
    when interrupted. Without one (an online cell, which checkpoints at round boundaries):
    `after_update(u)` after each."""
    tc, folder, desc = ctx.tc, ctx.folder, ctx.desc
    if ctx.groups_of is None or ctx.step_groups_of is None:
        raise ValueError("run_updates needs a TrainContext with groups_of and step_groups_of")
    groups_of, step_groups_of = ctx.groups_of, ctx.step_groups_of
    ckpt_dir = folder / "checkpoints" if folder is not None else None
    snapshots = set(tc.snapshot_updates()) if folder is not None else set()
    check_token_ids(ctx.pool, st.model.config.vocab_size)
    st.ref_cache = ReferenceCache(enabled=tc.reference_cache)    # a pool's groups: a cache of their own
    st.model.train()
    with Progress(desc, total=stop, unit="update", start=st.update) as bar:
        while st.update < stop:
            u = st.update
            try:
                if interrupt.requested() and distributed.current() is None:
                    raise interrupt.Interrupted("between updates")
                if tc.needs_step_anchor() and u % tc.updates_per_step == 0:
                    st.lp_old = step_anchor(st.model, ctx, step_groups_of(u), first=groups_of(u))
                row = one_update(st, ctx, groups_of(u))
            except interrupt.Interrupted:
                # the state after the last complete update: a rerun resumes exactly there
                st.opt.zero_grad(set_to_none=True)
                if ckpt_dir is not None:
                    save_checkpoint(st, ckpt_dir, tc)
                raise interrupt.stopped(f"{desc} at update {st.update}") from None
            st.rows.append(row)
            if u + 1 in snapshots and u + 1 < stop and folder is not None:     # snapshots: with a folder only
                save_policy(st.model, ctx.tokenizer, snapshot_dir(folder, u + 1))
            if ckpt_dir is not None and ((u + 1) % tc.checkpoint_every == 0 or u + 1 == stop):
                save_checkpoint(st, ckpt_dir, tc)
            if after_update is not None:
                after_update(u + 1)
            bar.update(1, loss=f"{row['loss']:.4f}", reward=f"{row['reward']:.3f}",
                       tok_s=f"{row['tokens'] / row['seconds']:.0f}")
    return st


def train(cfg: PipelineConfig, pool: Pool, base_path: str, tokenizer, folder: Path) -> TrainState:
    """Runs (or resumes) the offline updates, saves the final policy in `folder/model`,
    returns the final state (metrics rows in .rows)."""
    tc, rt, n_groups = cfg.train, make_runtime(cfg.train), len(pool.group_ids)
    ckpt_dir = folder / "checkpoints"
    st = resume(new_state(cfg, base_path, base_path, rt), checkpoint.load(ckpt_dir), ckpt_dir)
    ctx = TrainContext(cfg, pool, rt, tokenizer.pad_token_id,
                       groups_of=lambda u: groups_for_update(u, tc.groups_per_update, n_groups, cfg.seed),
                       step_groups_of=lambda u: _step_groups(u, tc, n_groups, cfg.seed),
                       desc=f"train {tc.method} seed {cfg.seed}", folder=folder, tokenizer=tokenizer)
    run_updates(st, ctx, tc.updates)
    save_policy(st.model, tokenizer, folder / "model")
    return st
