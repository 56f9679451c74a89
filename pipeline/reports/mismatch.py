"""The mismatch every method trains under, and what each method's rule did about it.

Every training row (TRAIN_METRICS; ONLINE_METRICS online) carries, whatever the loss, the
learner-vs-behavior mismatch of its update: `abs_log_ratio` (token mean |log pi_theta -
log pi_beh|), `max_abs_log_ratio` (its largest token; online rows only), `k3_mismatch`
(K3 of behavior to learner), `chi2_token` / `chi2_seq` (chi-square of learner vs behavior
per token and per response, verl's rollout_corr names) and, at the end of each block of
`train.diagnostics_block` updates, `ess` (normalized sequence ESS of the behavior weights).
A method whose rule clips, truncates or masks also reports the share it did (RULES:
tokens, or responses for the `seq_` ones; null for a method without that rule;
docs/math.md section 14).

Records written before a column existed lack it: `with_nulls` adds each missing one as
null, so an old cache reports "" there and never fails. The tables average each seed over
the report's common window (offline.window_means), then mean ± sample std over seeds.
"""
from __future__ import annotations

import math
from typing import Any

import polars as pl

MISMATCH = ("abs_log_ratio", "max_abs_log_ratio", "k3_mismatch", "chi2_token", "chi2_seq", "ess")
RULES = ("clip_frac", "trunc_frac", "mask_frac", "seq_clip_frac", "seq_trunc_frac", "seq_mask_frac", "m2_mask_frac")
COLUMNS = MISMATCH + RULES
OFFLINE = tuple(c for c in MISMATCH if c != "max_abs_log_ratio")     # TRAIN_METRICS has no per-update max
RULE_HEAD = "clipped / truncated / masked"

TITLE = ("Mismatch against the behavior policy, whatever the loss (each seed's mean over the window, then mean ± "
         "sample std over seeds): abs_log_ratio token mean |log pi_theta - log pi_beh|{max}, K3, chi-square per "
         "token and per response, ess the normalized sequence ESS of the behavior weights; and the share of tokens "
         "(seq_: responses) the method's own rule clipped, truncated or masked (docs/math.md section 14; blank: no "
         "such rule, or records from before the column).")


def title(online: bool) -> str:
    return TITLE.format(max=", max_abs_log_ratio its largest token" if online else "")


def with_nulls(frame: pl.DataFrame, names: tuple[str, ...] | list[str]) -> pl.DataFrame:
    """`frame` with every column of `names` it lacks added as Float64 nulls (old records)."""
    return frame.with_columns(*[pl.lit(None, pl.Float64).alias(n) for n in names if n not in frame.columns])


def number(mean: Any, std: Any) -> str:
    """'0.5812 ± 0.031', the mean alone with one seed, '' where there is no value."""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return ""
    return f"{mean:.4g}" if std is None or (isinstance(std, float) and math.isnan(std)) else f"{mean:.4g} ± {std:.2g}"


def rule_text(row: dict[str, Any]) -> str:
    """The rule's shares a row has: 'clip_frac 0.012 ± 0.003, seq_mask_frac 0.05'; '-' for none."""
    parts = [f"{r} {number(row.get(r), row.get(f'{r}_std'))}" for r in RULES if row.get(r) is not None
             and not (isinstance(row[r], float) and math.isnan(row[r]))]
    return ", ".join(parts) or "-"


def markdown(diag: pl.DataFrame, ids: list[str], values: tuple[str, ...], heading: str, seeds=None) -> str:
    """A window_means frame as the mismatch table: the ids, seeds (`seeds(row)` text, else the
    count), each of `values` as mean ± std, and the rule's shares in one column."""
    diag = with_nulls(diag, [*values, *RULES, *(f"{v}_std" for v in (*values, *RULES))])
    lines = [heading, "", "| " + " | ".join([*ids, "seeds", *values, RULE_HEAD]) + " |",
             "|" + "---|" * (len(ids) + 2 + len(values))]
    for r in diag.iter_rows(named=True):
        lines.append("| " + " | ".join([str(r[c]) for c in ids] + [seeds(r) if seeds else str(r["seeds"])]
                                       + [number(r[v], r[f"{v}_std"]) for v in values] + [rule_text(r)]) + " |")
    return "\n".join(lines) + "\n"
