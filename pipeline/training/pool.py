"""The training pool in memory and how an update's groups become micro-batches.

`load_pool` reads a TRAIN_POOL Parquet file into groups (index j = the j-th kept group,
samples 0..m-1), refusing what would poison an update (missing or non-finite behavior
log-probs, lengths that disagree, groups of the wrong size). `micro_batches` splits an
update's groups into micro-batches of whole groups: `micro_batch_groups` at a time, or
under the `micro_batch_tokens` budget (packing.py), whose cost is rows x longest row when
padded and the real tokens when packed. `batch` builds a micro-batch's model input
(policy.make_batch), `stack_groups` a [G, m, T] tensor from per-group [m, T_g] rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import torch
import torch.nn.functional as F

from pipeline.core.config import TrainConfig
from pipeline.core.errors import TrainingError
from pipeline.training.packing import group_width, pack_groups, pack_tokens, split_by_count
from pipeline.training.policy import Batch, Buckets, make_batch


@dataclass
class Pool:
    """The training pool grouped: index j holds the j-th kept group, samples 0..m-1."""
    group_ids: list[int]
    prompt_ids: list[list[int]]
    responses: list[list[list[int]]]     # [n_groups][m][len]
    # [n_groups][m][len]; None for a pool without behavior log-probs (an imported one): the
    # methods that read them are refused at load, and the diagnostics that compare the learner
    # with the behavior policy (K3, |log rho|, ESS) are None. Never filled in
    lp_beh: list[list[list[float]]] | None
    rewards: torch.Tensor                # [n_groups, m] float64
    group_size: int
    _behavior: dict = field(default_factory=dict, repr=False)    # group -> [m, T_g] tensor
    # mean reward per group, host floats: the trainer's reward metric reads no tensor
    reward_means: list[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.reward_means = [sum(r) / len(r) for r in self.rewards.tolist()]

    @property
    def has_behavior(self) -> bool:
        return self.lp_beh is not None

    def behavior(self, g: int) -> torch.Tensor:
        """Group g's behavior log-probs as an [m, T_g] float32 tensor (built once)."""
        if self.lp_beh is None:
            raise TrainingError("this pool has no behavior log-probs")
        if g not in self._behavior:
            self._behavior[g] = padded_rows(self.lp_beh[g])
        return self._behavior[g]

    def tokens(self, g: int) -> int:
        """Prompt + response tokens of group g (its cost in a packed micro-batch)."""
        return self.group_size * len(self.prompt_ids[g]) + sum(len(r) for r in self.responses[g])


def load_pool(path: Path, group_size: int, tc: TrainConfig | None = None, frame: pl.DataFrame | None = None) -> Pool:
    """The pool for training `tc` (None: read it whole, behavior log-probs where every row
    has them). A pool missing behavior log-probs that `tc`'s method reads is refused in one
    line naming the file, the column and the method; for other methods a pool missing
    them in any row loads without them (lp_beh None), never with a stand-in. `frame`: the
    file's content already in memory (the online round just written); errors still name
    `path`."""
    df = (pl.read_parquet(path) if frame is None else frame).sort(["group", "sample"])
    if df.height == 0:
        raise TrainingError(f"{path}: the training pool is empty (no mixed-reward groups)")
    missing = df.filter(pl.col("behavior_logprobs").is_null())
    if missing.height and tc is not None and tc.needs_behavior_logprobs():
        raise TrainingError(f"{path}: column behavior_logprobs is empty in row (group {missing['group'][0]}, sample "
                            f"{missing['sample'][0]}) and {missing.height - 1} more, but train.method={tc.method} "
                            f"({_why_behavior(tc)}) reads it")
    has_behavior = missing.height == 0
    if has_behavior:
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
        lp_beh=[lpb[j * m:(j + 1) * m] for j in range(n)] if has_behavior else None,
        rewards=torch.tensor(df["reward"].to_list(), dtype=torch.float64).view(n, m), group_size=m)


def _why_behavior(tc: TrainConfig) -> str:
    """Why `tc`'s method reads behavior log-probs, from its METHODS entry."""
    entry = tc.method_entry()
    return "its importance weights" if entry.needs_lp_beh else f"its ratio anchor, train.anchor={tc.anchor}"


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


def padded_rows(rows: list[list[float]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Ragged rows -> [len(rows), longest] (0 beyond each row's end)."""
    out = torch.zeros(len(rows), max((len(r) for r in rows), default=0), dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=dtype)
    return out


def stack_groups(rows: list[torch.Tensor], width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Per-group [m, T_g] tensors -> [G, m, width] on `device` in `dtype` (zero-padded)."""
    return torch.stack([F.pad(r.to(device=device, dtype=dtype), (0, width - r.shape[1])) for r in rows])


def batch(pool: Pool, groups: list[int], pad_id: int, packed: bool = False,
          bucket_overhead: float | None = None) -> Batch | Buckets:
    """The model input of some whole groups (rows g0 s0..s(m-1), g1 s0, ...); padded rows
    in length buckets when `bucket_overhead` is given (policy.make_batch)."""
    m = pool.group_size
    return make_batch([pool.prompt_ids[g] for g in groups for _ in range(m)],
                      [r for g in groups for r in pool.responses[g]], pad_id, packed, bucket_overhead)


def micro_batches(pool: Pool, groups: list[int], tc: TrainConfig, packed: bool = False) -> list[list[int]]:
    """An update's (or step's) groups split into micro-batches of whole groups."""
    if tc.micro_batch_tokens is None:
        return split_by_count(groups, tc.micro_batch_groups)
    if packed:
        return pack_tokens(groups, {g: pool.tokens(g) for g in groups}, tc.micro_batch_tokens)
    widths = {g: group_width(len(pool.prompt_ids[g]), [len(r) for r in pool.responses[g]]) for g in groups}
    return pack_groups(groups, widths, pool.group_size, tc.micro_batch_tokens)


def check_token_ids(pool: Pool, vocab_size: int, where: str = "the pool") -> None:
    """Every prompt and response id is a row of the model's embedding (checked once here,
    so the LM head never reads ids back from the device)."""
    top = max(max((max(r, default=0) for rs in pool.responses for r in rs), default=0),
              max((max(p, default=0) for p in pool.prompt_ids), default=0))
    if top >= vocab_size:
        raise TrainingError(f"{where}: token id {top} is outside the model's vocabulary of {vocab_size}; "
                            "the pool was tokenized for another model")
