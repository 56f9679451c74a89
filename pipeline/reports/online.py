"""The online comparison's report (seed Tables 1 / 2 / 4, Figures 1 / 2 / 3 / 7 forms).

Inputs: evaluations (one row per cell, seed and evaluated update: accuracy = mean@n on
the eval split; update 0 is the base policy) and per-update curves (ONLINE_METRICS rows),
both carrying each cell's columns: `method` (the methods entry), `cell` (its label), `N`
(train.updates_per_step), `t_ref`, the grid's fields and `planned_updates`. A seed's final
is its last evaluated update; it stalled when that is below its planned updates (a round
that could not fill its pool, or the drift guard: online.on_stall / on_drift = stop). The
statistics are stats.py's, over seeds: a cell prints mean ± sample std (ddof 1), or each
seed's value where it is bimodal (some but not all seeds stalled), and its stalls k/n.

- evals.csv: every evaluation (base included) with the cells' columns: the results file the
  final and paired tables are computed from (published.py renders them from it).
- final.md/csv (Table 1 form): final accuracy per cell, stalls k/n.
- paired.md/csv: final accuracy paired by seed (a seed's cells share its base model and
  prompt order; compare.py): each method minus GRPO+TIS (else the first method) at every
  grid point, and each grid axis's values minus its first within a method; mean
  difference, 95 % t-interval (n - 1 dof), n, two-sided p, both cells' stalls ("n=1, no
  interval" for one seed).
- staleness.md/csv, figure3.png (Table 4 / Figure 3): final accuracy against N, one row per
  method (and other grid values), when the experiment has more than one N.
- refresh.md/csv (Table 2): final accuracy against t_ref, when it has more than one.
- figure1.png: K3 mismatch, entropy and accuracy against updates.
- figure2.png: cumulative generated responses against updates; accuracy against them.
- diagnostics.md/csv, figure7.png: averaged over one update window common to every cell
  (the last quarter of the shortest planned run, stated in the caption; a seed that stopped
  before its end is left out and named), per cell (and against N in the figure): K3,
  sequence ESS, the mean sequence log ratio to the reference `mean_ell` and the entropy
  (seed Table 7's two rows, there over the last 800 of 8,000 updates), the within-success
  ESS of the GGPO weights `success_ess` (seed Figure 9; groups with at least two successes,
  at the cell's beta), response length, and the learner-to-behavior drift at the rounds'
  ends `round_drift` / `round_drift_seq` (token mean |log ratio| / response mean |log
  sequence weight|, pipeline/training/drift.py); each mean ± sample std over seeds of the
  per-seed averages. Then the mismatch table over the same window (mismatch.py: |log rho|
  and its largest token, K3, chi-square per token and per response, sequence ESS, and the
  share each method's rule clipped, truncated or masked); diagnostics.csv has every column.
- drift.md/csv: the drift at every round's end, per cell (mean ± std over seeds per round in
  the CSV, beside each round's means of the mismatch columns; first, mean, max and last
  round of each seed's own rounds in the table), and in figure1.png.

Rounds recorded before a column existed lack it: it reads as null (never an error).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import polars as pl

from pipeline.core import grid
from pipeline.core.config import PipelineConfig
from pipeline.core.schemas import DRIFT_COLUMNS as DRIFT
from pipeline.core.store import write_file_atomic, write_text_atomic
from pipeline.dag import graph
from pipeline.reports import compare, mismatch, stats
from pipeline.reports.offline import (
    PLANNED,
    markdown_diagnostics,
    over_seeds,
    planned_updates,
    seeds_text,
    window_means,
    window_sentence,
)
from pipeline.services import tracking

KEYS = ("method", "cell", "N", "t_ref")
DIAGNOSTICS = ("k3_mismatch", "ess", "mean_ell", "entropy", "success_ess", "response_length", "round_drift",
               "round_drift_seq")
# the mismatch table's columns not among them (diagnostics.csv holds both)
EXTRA = tuple(c for c in mismatch.COLUMNS if c not in DIAGNOSTICS)


def columns(cell: grid.GridCell, cfg: PipelineConfig) -> dict[str, Any]:
    """A cell's report columns: method, label, N, t_ref (as text) and its grid values."""
    tc = cell.config.train
    out = {"method": cell.method, "cell": cell.label, "N": tc.updates_per_step, "t_ref": str(tc.refresh_every() or "fixed")}
    for field, value in grid.columns(cell, cfg).items():
        if field not in ("cell", "train.updates_per_step", "train.t_ref"):
            out[field] = value
    return out


def record(cell: grid.GridCell, cfg: PipelineConfig, update: int, evaluation) -> dict[str, Any]:
    """One evaluation row: the cell's columns, seed, update, accuracy (mean@n) and the
    updates the cell was to run (PLANNED: a final below it is a stop)."""
    return columns(cell, cfg) | {"seed": cell.seed, "update": update,
                                 "accuracy": evaluation.summary[f"mean_at_{cfg.eval.n_samples}"],
                                 PLANNED: cell.config.train.updates}


def cell_curves(cell: grid.GridCell, cfg: PipelineConfig, rounds: list) -> pl.DataFrame:
    """A cell's per-update rows (ONLINE_METRICS of every round's training) with its columns,
    seed and planned updates."""
    # diagonal: a cell continued after a column was added has rounds without it (null there)
    return (pl.concat([pl.read_parquet(m.path("metrics")) for m in rounds], how="diagonal_relaxed")
            .with_columns(**{k: pl.lit(v) for k, v in columns(cell, cfg).items()}, seed=pl.lit(cell.seed),
                          **{PLANNED: pl.lit(cell.config.train.updates)}))


def from_cache(cfg: PipelineConfig, store) -> tuple[pl.DataFrame, pl.DataFrame, list[tuple[str, float | None]]]:
    """(evaluations, curves, stage timings) of the online experiment `cfg` describes, read
    from the store by the keys the flow builds (graph.online_experiment_keys): the same
    tables the flow reports. A cell and seed still running (its last built round's policy
    not evaluated) contributes its base evaluation only."""
    records, curves, timings, seen = [], [], [], set()

    def load(stage: str, c: PipelineConfig, key: str | None = None):
        key = key or graph.expected_key(stage, c)
        m = store.load(stage, key)
        if (stage, key) not in seen:    # a round's record is written after its updates: their time
            seen.add((stage, key))
            timings.append((stage, (m.summary.get("train_seconds", m.seconds) if stage == "online_train"
                                    else m.seconds) if m else None))
        return m
    load("base", cfg)
    for cell in grid.cells(cfg):
        c, tc = cell.config, cell.config.train
        base_eval = load("evaluate", c.updated({"eval.target": "base"}))
        records += [record(cell, cfg, 0, base_eval)] if base_eval else []
        rounds = []
        for r in range(tc.updates // tc.updates_per_step):
            keys = graph.online_keys(c, r)
            load("online_pool", c, keys["online_pool"])     # for its timing
            trained = load("online_train", c, keys["online_train"])
            if trained is None:
                break
            rounds.append(trained)
        points = []
        for at in tc.online_eval_updates(len(rounds)):
            e = load("evaluate", c.updated({"eval.target": "online", "eval.update": at}))
            points += [record(cell, cfg, at, e)] if e else []
        # its last built round's policy evaluated: the cell finished or stopped there; else
        # it is still running (or its evaluations are), and a partial run is no final
        if any(p["update"] == len(rounds) * tc.updates_per_step for p in points):
            records += points
            curves.append(cell_curves(cell, cfg, rounds))
    return (pl.DataFrame(records), pl.concat(curves, how="diagonal_relaxed") if curves else pl.DataFrame(), timings)


def finals(evals: pl.DataFrame) -> pl.DataFrame:
    """The last evaluated update of each cell and seed that has one after its base policy."""
    return evals.filter((pl.col("update") == pl.col("update").max().over("cell", "seed")) & (pl.col("update") > 0))


def seed_finals(evals: pl.DataFrame) -> pl.DataFrame:
    """compare.py's per_seed frame of the final accuracies: each cell and seed's last
    evaluated update (finals), `value` its accuracy, `stopped` where that update is below
    the planned one (online.on_stall / on_drift = stop: the cell stalled)."""
    return finals(evals).with_columns(pl.col("accuracy").alias("value"),
                                      (pl.col("update") < planned_updates(evals)).alias("stopped"))


def cell_stats(per_seed: pl.DataFrame, by: list[str]) -> pl.DataFrame:
    """One row per `by` group of per_seed (a cell): mean, std (ddof 1), seeds, update (the
    earliest final), the 95 % t-interval low / high, stalls k (`stalled`), and `text`: mean ±
    std, or each seed's value where the cell is bimodal (compare.cell_text)."""
    rows = []
    for key, g in per_seed.group_by(by, maintain_order=True):
        seeds = g["seed"].to_list()
        values, updates, stopped = (dict(zip(seeds, g[c].to_list())) for c in ("value", "update", "stopped"))
        est = stats.summary(list(values.values()))
        rows.append(dict(zip(by, key)) | {
            "mean": est.mean, "std": est.sd, "seeds": est.n, "update": min(updates.values()), "low": est.low,
            "high": est.high, "stalled": sum(stopped.values()), "text": compare.cell_text(values, stopped, updates)})
    return pl.DataFrame(rows, schema_overrides={"std": pl.Float64, "low": pl.Float64, "high": pl.Float64})


def _agg(frame: pl.DataFrame, by: list[str], value: str = "accuracy") -> pl.DataFrame:
    return frame.group_by(by, maintain_order=True).agg(
        pl.col(value).mean().alias("mean"), pl.col(value).std(ddof=1).alias("std"), pl.len().alias("seeds"),
        pl.col("update").min().alias("update"))


def in_cell_order(evals: pl.DataFrame) -> pl.DataFrame:
    """Rows in the experiment's cell order (the base evaluations come first, one per cell
    in grid order), not in the order the cells finished."""
    order = {c: i for i, c in enumerate(evals.filter(pl.col("update") == 0)["cell"].unique(maintain_order=True))}
    return evals.sort(pl.col("cell").replace_strict(order, default=len(order)), "seed", "update", maintain_order=True)


def stall_text(row: dict[str, Any]) -> str:
    """A cell_stats row's stalls beside its value: 'stalls 1/3', and where every seed
    stalled, the earliest stop."""
    stop = f", stopped at update {row['update']}" if row["stalled"] == row["seeds"] and row["stalled"] else ""
    return f"stalls {row['stalled']}/{row['seeds']}{stop}"


def pivot_table(evals: pl.DataFrame, field: str, title: str) -> tuple[str, pl.DataFrame] | None:
    """Final accuracy with `field` as columns, one row per method and other grid values;
    each entry mean ± std (per-seed values where bimodal) with its stalls k/n; None unless
    some method ran with more than one value of `field`."""
    values = evals[field].unique(maintain_order=True).to_list()
    # polars types a column's max as any scalar: here a count (evals is never empty)
    if cast(int, evals.group_by("method").agg(pl.col(field).n_unique())[field].max()) < 2:
        return None     # one value per method (GRPO fixed, GGPO 160 by default): nothing to compare
    rows = [c for c in evals.columns if c not in ("cell", "seed", "update", "accuracy", PLANNED, field)]
    agg = cell_stats(seed_finals(evals), rows + [field])
    if not agg.height:
        return None
    lines = [title + " (mean ± sample std over seeds, or each seed's value where some but not all stalled; stalls "
             "k/n: seeds whose cell stopped before its last update)", "",
             "| " + " | ".join(rows) + " | " + " | ".join(f"{field}={v}" for v in values) + " |",
             "|" + "---|" * (len(rows) + len(values))]
    for key in agg.select(rows).unique(maintain_order=True).iter_rows():
        sub = agg.filter(pl.all_horizontal([pl.col(c) == v for c, v in zip(rows, key)]))
        by_value = {r[field]: r for r in sub.iter_rows(named=True)}
        cells = [f"{by_value[v]['text']}; {stall_text(by_value[v])}" if v in by_value else "" for v in values]
        lines.append("| " + " | ".join(map(str, key)) + " | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", agg


def identity(frame: pl.DataFrame) -> list[str]:
    """The columns that name a cell: method, cell, N, t_ref and the grid's other fields."""
    return [c for c in frame.columns if c in KEYS or c.count(".")]


def line_label(frame: pl.DataFrame) -> pl.Expr:
    """What one line of an against-N figure is: the method and every other field of the
    cell but N (t_ref, the grid's other values), so lines never average across cells."""
    rest = [c for c in identity(frame) if c not in ("cell", "N")]
    return pl.concat_str([pl.col(c).cast(pl.Utf8) for c in rest], separator=" ").alias("line")


def diagnostics(curves: pl.DataFrame) -> pl.DataFrame:
    """Spec-9 diagnostics and the round drift averaged over one window common to every cell
    (offline.window_means: the last quarter of the shortest planned run; Figure 7), then
    mean, `<name>_std` (sample std) and `seeds` over the seeds that reached its end, with
    those that stopped before it (`stopped`, `stopped_at`) and the window (`window`); the
    mismatch table's columns (EXTRA) after them."""
    return window_means(curves, identity(curves), list(DIAGNOSTICS + EXTRA))


DIAGNOSTICS_TITLE = "Diagnostics (each seed's mean over the window, then mean ± sample std over seeds)."
DRIFT_TITLE = ("Learner-to-behavior drift at each round's end (round_drift: token mean |log ratio| after the "
               "round's N updates; its first round, mean and max over rounds, last round, over each seed's own "
               "rounds, fewer where a seed stopped; mean ± sample std over seeds; every round in drift.csv)")


def with_drift(curves: pl.DataFrame) -> pl.DataFrame:
    """`curves` with the drift columns and `round` (None where absent: records written before
    the drift existed, hand-made frames)."""
    missing = [pl.lit(None, pl.Float64).alias(c) for c in DRIFT if c not in curves.columns]
    return curves.with_columns(*missing, *([pl.lit(None, pl.Int32).alias("round")] if "round" not in curves.columns else []))


def drift_rounds(curves: pl.DataFrame) -> pl.DataFrame:
    """drift.csv: one row per cell and round, the drift at the round's end (round_drift,
    round_drift_seq at its last update) and the round's mismatch (mismatch.COLUMNS: each the
    mean over the round's updates that have it; max_abs_log_ratio the round's largest),
    then mean and `_std` over seeds; null where the rounds predate a column."""
    present = mismatch.with_nulls(with_drift(curves), mismatch.COLUMNS)
    by = ["cell", "seed", "round"]
    ends = present.filter(pl.col("update") == pl.col("update").max().over(by))
    means = present.group_by(by).agg(*[(pl.col(c).drop_nulls().max() if c == "max_abs_log_ratio"
                                        else pl.col(c).drop_nulls().mean()) for c in mismatch.COLUMNS])
    rounds = ends.drop(mismatch.COLUMNS).join(means, on=by, how="left", nulls_equal=True, maintain_order="left")
    return over_seeds(rounds.sort("round", maintain_order=True), identity(curves) + ["round", "update"],
                      list(DRIFT + mismatch.COLUMNS))


def drift_summary(curves: pl.DataFrame) -> pl.DataFrame:
    """Per cell: round_drift of its first round, mean and max over its rounds and of its last
    round, each per seed and then mean and `_std` over seeds."""
    present = with_drift(curves)
    ids, d = identity(curves), pl.col("round_drift").drop_nulls()
    per_seed = present.sort("update", maintain_order=True).group_by(ids + ["seed"], maintain_order=True).agg(
        pl.col("round").max() + 1, d.first().alias("first"), d.mean().alias("mean"), d.max().alias("max"),
        d.last().alias("last"))
    return over_seeds(per_seed, ids, ["round", "first", "mean", "max", "last"]).rename({"round": "rounds", "round_std": "rounds_std"})


def markdown_final(evals: pl.DataFrame, metric: str) -> str:
    """One row per cell: its seeds, earliest final update, final accuracy (mean ± std, or
    each seed's value where bimodal) and stalls k/n; a cell not evaluated yet says so."""
    agg = cell_stats(seed_finals(evals), ["cell", "N", "t_ref"])
    base = evals.filter(pl.col("update") == 0)["accuracy"].mean()
    # None when the cache holds no base evaluation (`ggpo report` on a partly built experiment)
    base_text = f"base policy {100 * base:.2f}" if isinstance(base, float) else "base policy not evaluated"
    lines = [f"Final accuracy ({metric}, %; {base_text}): mean ± sample std over seeds, or each seed's value "
             "(seed: value) where some but not all seeds stalled; stalls k/n: seeds whose cell stopped before its "
             "last update", "", "| cell | N | t_ref | seeds | update | final | stalls |", "|---|---|---|---|---|---|---|"]
    rows = {r["cell"]: r for r in agg.iter_rows(named=True)}
    for c in evals.select("cell", "N", "t_ref").unique(maintain_order=True).iter_rows(named=True):
        r = rows.get(c["cell"])
        lines.append(f"| {c['cell']} | {c['N']} | {c['t_ref']} | {r['seeds']} | {r['update']} | {r['text']} | "
                     f"{r['stalled']}/{r['seeds']} |" if r else
                     f"| {c['cell']} | {c['N']} | {c['t_ref']} | 0 | - | not evaluated yet | - |")
    if agg.height and cast(int, agg["stalled"].sum()):
        full = cast(int, evals.select(planned_updates(evals).max()).item())
        lines += ["", f"A cell whose update is below {full} stopped there: a round after it "
                      "could not fill its pool with mixed-reward groups within online.max_draws (its policy solved or "
                      "failed nearly every prompt; online.on_stall = stop), or the round ending there left "
                      "online.max_round_drift (online.on_drift = stop; its round_drift in drift.csv), and its policy at "
                      "that update is its final."]
    return "\n".join(lines) + "\n"


def paired_tables(evals: pl.DataFrame, metric: str) -> tuple[str, pl.DataFrame]:
    """Final accuracy paired by seed (compare.py): each method minus the reference at each
    grid point, and along each grid axis within a method; (Markdown, both as one frame
    with a `comparison` column for paired.csv)."""
    per_seed = seed_finals(evals)
    if not per_seed.height:
        return "", pl.DataFrame()
    ref, to_ref = compare.paired_to_reference(per_seed)
    along = compare.paired_along_axes(per_seed)
    parts, frames = [], []
    if to_ref.height:
        parts.append(compare.markdown_paired(to_ref, PAIRED_TITLE.format(metric=metric, ref=ref)))
        frames.append(to_ref.with_columns(comparison=pl.lit("reference")))
    if along.height:
        parts.append(compare.markdown_paired(along, AXES_TITLE.format(metric=metric), **compare.AXIS_COLUMNS))
        frames.append(along.with_columns(comparison=pl.lit("axis")))
    return "\n".join(parts), pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame()


PAIRED_TITLE = ("Paired differences in final accuracy ({metric}, percentage points): each method minus {ref} at the "
                "same grid point, seed by seed (a seed's cells share its base model and the seeded prompt order). "
                "Mean difference, 95% t-interval (n - 1 dof), n = seeds in both cells, two-sided p of no difference; "
                "stalls k/n of the method's cell and of {ref}'s (a stalled seed counts with its final at the stop).")
AXES_TITLE = ("Paired differences in final accuracy ({metric}, percentage points) along each grid axis: within a "
              "method, each value minus the axis's first value, the other axes held, seed by seed (95% t-interval, "
              "n - 1 dof; stalls k/n of the cell and of the first value's cell).")


def _lines(ax, frame: pl.DataFrame, x: str, y: str, label: str = "cell") -> None:
    for name in frame[label].unique(maintain_order=True).to_list():
        sub = frame.filter(pl.col(label) == name).group_by(x, maintain_order=True).agg(pl.col(y).mean()).sort(x)
        sub = sub.drop_nulls()
        if sub.height:
            ax.plot(sub[x].to_list(), sub[y].to_list(), marker=".", label=name)


def figures(evals: pl.DataFrame, curves: pl.DataFrame, diag: pl.DataFrame, folder: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    trained = evals.filter(pl.col("update") > 0)
    spend = curves.select("cell", "seed", "update", "responses_generated")
    acc_spend = trained.join(spend, on=["cell", "seed", "update"], how="left")
    paths = []
    fig, axes = plt.subplots(1, 4, figsize=(21, 4))
    drift = curves if "round_drift" in curves.columns else curves.with_columns(round_drift=pl.lit(None, pl.Float64))
    for ax, (frame, y, name) in zip(axes, ((curves, "k3_mismatch", "K3 behavior-learner"), (curves, "entropy", "entropy"),
                                           (drift, "round_drift", "drift at round ends (token mean |log ratio|)"),
                                           (evals, "accuracy", "accuracy"))):
        _lines(ax, frame, "update", y)
        ax.set(xlabel="update", title=name)
    axes[-1].legend(fontsize=6)
    paths.append(_save(fig, folder / "figure1.png"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    _lines(axes[0], curves, "update", "responses_generated")
    axes[0].set(xlabel="update", title="cumulative generated responses")
    _lines(axes[1], acc_spend.drop_nulls("responses_generated"), "responses_generated", "accuracy")
    axes[1].set(xlabel="generated responses", title="accuracy")
    axes[1].legend(fontsize=6)
    paths.append(_save(fig, folder / "figure2.png"))
    if diag["N"].n_unique() > 1:
        ns = sorted(diag["N"].unique().to_list())
        agg = _agg(finals(evals).with_columns(line_label(evals)), ["line", "N"])
        diag = diag.with_columns(line_label(diag))
        fig, axes = plt.subplots(1, 1 + len(DIAGNOSTICS), figsize=(3.3 * (1 + len(DIAGNOSTICS)), 4))
        for ax, (frame, y) in zip(axes, [(agg, "mean")] + [(diag, d) for d in DIAGNOSTICS]):
            for name in frame["line"].unique(maintain_order=True).to_list():
                sub = frame.filter(pl.col("line") == name).sort("N")
                ax.plot([ns.index(n) for n in sub["N"]], sub[y].to_list(), marker="o", label=name)
            ax.set(xticks=range(len(ns)), xticklabels=ns, xlabel="N", title="final accuracy" if y == "mean" else y)
        axes[0].legend(fontsize=6)
        paths.append(_save(fig, folder / "figure3_7.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    write_file_atomic(path, lambda tmp: fig.savefig(tmp, dpi=90))
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def curve_tables(evals: pl.DataFrame, curves: pl.DataFrame, folder: Path, paths: list[Path]) -> list[str]:
    """The diagnostics and drift tables (Markdown), their CSVs, curves.csv and the figures
    into `folder` (appended to `paths`)."""
    diag = diagnostics(curves)
    drift = drift_summary(curves)
    shown = diag.drop([c for c in diag.columns if c.count(".")] or [])
    parts = [markdown_diagnostics(shown, list(DIAGNOSTICS), DIAGNOSTICS_TITLE),
             mismatch.markdown(shown, [c for c in ("cell", "N", "t_ref") if c in shown.columns], mismatch.MISMATCH,
                               mismatch.title(online=True) + window_sentence(shown), seeds_text),
             markdown_diagnostics(drift.drop([c for c in drift.columns if c.count(".")] or []),
                                  ["rounds", "first", "mean", "max", "last"], DRIFT_TITLE)]
    write_file_atomic(folder / "diagnostics.csv", diag.write_csv)
    write_file_atomic(folder / "drift.csv", drift_rounds(curves).write_csv)
    write_file_atomic(folder / "curves.csv", curves.write_csv)
    paths += [folder / "diagnostics.csv", folder / "drift.csv", folder / "curves.csv"] + figures(evals, curves, diag, folder)
    return parts


def pivot_tables(evals: pl.DataFrame, metric: str) -> dict[str, tuple[str, pl.DataFrame]]:
    """staleness (against N) and refresh (against t_ref), each where the experiment has more
    than one value: name -> (Markdown, frame)."""
    found = {}
    for field, name, title in (("N", "staleness", f"Final accuracy ({metric}, %) against synchronization delay N"),
                               ("t_ref", "refresh", f"Final accuracy ({metric}, %): fixed vs refreshed reference")):
        table = pivot_table(evals, field, title)
        if table is not None:
            found[name] = table
    return found


def tables(evals: pl.DataFrame, metric: str) -> str:
    """The report's accuracy tables as write prints them: final, the pivots, the paired
    differences (what published.py renders from evals.csv)."""
    evals = in_cell_order(evals)
    parts = [markdown_final(evals, metric), *(t for t, _ in pivot_tables(evals, metric).values())]
    paired_md, _ = paired_tables(evals, metric)
    return "\n".join(parts + ([paired_md] if paired_md else []))


def write(evals: pl.DataFrame, curves: pl.DataFrame, folder: Path, metric: str) -> tuple[str, list[Path]]:
    """Every table and figure into `folder`: (the Markdown of all tables, the files)."""
    evals = in_cell_order(evals)
    parts = [markdown_final(evals, metric)]
    # evals.csv: every evaluation, the results file the tables are computed from (published.py
    # renders the final and paired tables from it for README and docs)
    write_file_atomic(folder / "evals.csv", evals.write_csv)
    write_file_atomic(folder / "final.csv", finals(evals).write_csv)
    paths = [folder / "evals.csv", folder / "final.csv"]
    for name, (text, frame) in pivot_tables(evals, metric).items():
        parts.append(text)
        write_file_atomic(folder / f"{name}.csv", frame.write_csv)
        paths.append(folder / f"{name}.csv")
    paired_md, paired = paired_tables(evals, metric)
    if paired.height:
        parts.append(paired_md)
        write_file_atomic(folder / "paired.csv", paired.write_csv)
        paths.append(folder / "paired.csv")
    if curves.height:
        parts += curve_tables(evals, curves, folder, paths)
    else:       # `ggpo report` while every cell is still running
        parts.append("No cell has finished yet: no diagnostics.\n")
    markdown = "\n".join(parts)
    write_text_atomic(folder / "report.md", markdown)
    return markdown, [folder / "report.md"] + paths


def log(client, parent: str, evals: pl.DataFrame, curves: pl.DataFrame, cfg: PipelineConfig, folder: Path) -> dict:
    """The report into `folder` and as artifacts (`report/`); final accuracies as metrics of
    the parent run."""
    evals = in_cell_order(evals)
    metric = f"mean@{cfg.eval.n_samples}"
    table, paths = write(evals, curves, folder, metric)
    for path in paths:
        client.log_artifact(parent, str(path), artifact_path="report")
    agg = _agg(finals(evals), ["cell"])
    summary = {f"final_{metric.replace('@', '_at_')}/{grid.slug(r['cell'])}": r["mean"] for r in agg.iter_rows(named=True)}
    # the flow waits for every cell's base evaluation: the mean is a float
    summary[f"base_{metric.replace('@', '_at_')}"] = cast(float, evals.filter(pl.col("update") == 0)["accuracy"].mean())
    tracking.log_params_metrics(client, parent, {}, tracking.summary_metrics(
        {k: v for k, v in summary.items() if v is not None and not math.isnan(v)}))
    return {"table": table, "summary": summary}
