"""Arrow schemas of every Parquet artifact, declared once, and the one writer that uses them.

Writes go to a temporary name in the same folder, are fsynced, then renamed: a reader
never sees half a file. No timestamps are written, so equal data gives equal bytes.
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.store import atomic_path

PROMPTS = pa.schema([
    ("prompt_id", pa.string()), ("group", pa.int32()), ("problem", pa.string()),
    ("answer", pa.string()), ("prompt", pa.string()), ("prompt_token_ids", pa.list_(pa.int32())),
])

ROLLOUTS = pa.schema([
    ("prompt_id", pa.string()), ("group", pa.int32()), ("sample", pa.int32()),
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("response_token_ids", pa.list_(pa.int32())),
    ("behavior_logprobs", pa.list_(pa.float32())),
    ("response_text", pa.string()), ("response_length", pa.int32()),
    ("finish_reason", pa.string()),
    ("temperature", pa.float64()), ("top_p", pa.float64()), ("max_new_tokens", pa.int32()),
    ("seed", pa.int64()), ("engine", pa.string()), ("logprobs_mode", pa.string()),
])

REWARDS = pa.schema([
    ("prompt_id", pa.string()), ("group", pa.int32()), ("sample", pa.int32()),
    ("reward", pa.float64()), ("status", pa.string()), ("seconds", pa.float64()),
])

# the training pool: rollout columns of kept groups plus reward and status (no timings,
# so the same config and seed give a byte-identical file)
TRAIN_POOL = pa.schema(list(ROLLOUTS) + [("reward", pa.float64()), ("status", pa.string())])

# where each response of an imported pool (stages/pool_import.py) came from: its source row
# and list position, the reward the source gave and the one the pool uses, whether its
# tokens were cut at rollout.max_new_tokens, and whether its group passed the mixed filter
POOL_PROVENANCE = pa.schema([
    ("group", pa.int32()), ("sample", pa.int32()), ("prompt_id", pa.string()),
    ("source_row", pa.int64()), ("source_index", pa.int32()), ("given_reward", pa.float64()),
    ("reward", pa.float64()), ("status", pa.string()), ("truncated", pa.bool_()), ("kept", pa.bool_()),
])

TRAIN_METRICS = pa.schema([
    ("update", pa.int32()), ("loss", pa.float64()), ("pg_loss", pa.float64()),
    ("reward", pa.float64()), ("entropy", pa.float64()), ("grad_norm", pa.float64()),
    ("clip_frac", pa.float64()), ("kl_ref_k3", pa.float64()), ("response_length", pa.float64()),
    ("tokens", pa.int64()), ("lr", pa.float64()), ("seconds", pa.float64()),
    # spec section 9 diagnostics; null where a method has no such quantity, `ess` only at
    # the last update of each block of `train.diagnostics_block` updates
    ("trunc_frac", pa.float64()), ("k3_mismatch", pa.float64()), ("abs_log_ratio", pa.float64()),
    ("mean_ell", pa.float64()), ("ggpo_raw_loss", pa.float64()), ("success_ess", pa.float64()),
    ("ess", pa.float64()), ("ref_refreshed", pa.bool_()),
    # the mismatch every method sees, whatever its loss (chi-square of learner vs behavior, per
    # token and per response), and the share each correction's rule masked, truncated or
    # clipped (null for a method without that rule; docs/math.md section 14)
    ("chi2_token", pa.float64()), ("chi2_seq", pa.float64()),
    ("mask_frac", pa.float64()), ("seq_mask_frac", pa.float64()), ("seq_trunc_frac", pa.float64()),
    ("seq_clip_frac", pa.float64()), ("m2_mask_frac", pa.float64()),
])

# the online loop's rows (stage online_train): the offline columns, the largest |log rho|
# (behavior vs learner) of the update, its round, its staleness j (the j-th update of a
# step is j updates stale), what was generated up to its round (paper Figure 2) and, on the
# round's last row only, the learner-to-behavior drift at its end (pipeline/training/drift.py)
ONLINE_METRICS = pa.schema(list(TRAIN_METRICS) + [
    ("max_abs_log_ratio", pa.float64()), ("round", pa.int32()), ("staleness", pa.int32()),
    ("prompts_drawn", pa.int64()), ("responses_generated", pa.int64()),
    ("round_drift", pa.float64()), ("round_drift_seq", pa.float64()),
])
DRIFT_COLUMNS = ("round_drift", "round_drift_seq")

EVAL_SAMPLES = pa.schema([
    ("benchmark", pa.string()), ("prompt_id", pa.string()), ("sample", pa.int32()), ("reward", pa.float64()),
    ("status", pa.string()), ("response_length", pa.int32()), ("response_text", pa.string()),
])


def typed_table(rows: dict[str, list] | pa.Table, schema: pa.Schema) -> pa.Table:
    """`rows` (column lists or a table) as `schema`'s columns and types: what write_parquet
    writes, so a table handed on in memory holds the values a re-read of the file gives."""
    table = rows if isinstance(rows, pa.Table) else pa.table(rows, schema=schema)
    return table.select(schema.names).cast(schema)


def write_parquet(rows: dict[str, list] | pa.Table, schema: pa.Schema, path: Path) -> int:
    """Write `rows` (column lists or a table) with `schema` atomically; return row count."""
    table = typed_table(rows, schema)
    # the uncompressed size: what the file needs at most (a full disk names it)
    with atomic_path(path, table.nbytes) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return table.num_rows
