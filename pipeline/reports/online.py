"""The online comparison's report (seed Tables 1 / 2 / 4, Figures 1 / 2 / 3 / 7 forms).

Inputs: evaluations (one row per cell, seed and evaluated update: accuracy = mean@n on
the eval split; update 0 is the base policy) and per-update curves (ONLINE_METRICS rows),
both carrying each cell's columns: `method` (the methods entry), `cell` (its label), `N`
(train.updates_per_step), `t_ref` and the grid's fields. Every number is a mean over
seeds; ± is the sample std (ddof 1) where there is more than one seed.

- final.md/csv (Table 1 form): final accuracy per cell.
- staleness.md/csv, figure3.png (Table 4 / Figure 3): final accuracy against N, one row per
  method (and other grid values), when the experiment has more than one N.
- refresh.md/csv (Table 2): final accuracy against t_ref, when it has more than one.
- figure1.png: K3 mismatch, entropy and accuracy against updates.
- figure2.png: cumulative generated responses against updates; accuracy against them.
- diagnostics.md/csv, figure7.png: averaged over the last quarter of each run's updates,
  per cell (and against N in the figure): K3, sequence ESS, the mean sequence log ratio to
  the reference `mean_ell` and the entropy (seed Table 7's two rows, there over the last
  800 of 8,000 updates), the within-success ESS of the GGPO weights `success_ess` (seed
  Figure 9; groups with at least two successes, at the cell's beta), response length, and
  the learner-to-behavior drift at the rounds' ends `round_drift` / `round_drift_seq`
  (token mean |log ratio| / response mean |log sequence weight|, pipeline/training/drift.py);
  each mean ± sample std over seeds of the per-seed averages.
- drift.md/csv: the drift at every round's end, per cell (mean ± std over seeds per round in
  the CSV; first, mean, max and last round in the table), and in figure1.png.
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
from pipeline.reports.offline import cell as fmt_cell, last_quarter, markdown_diagnostics, over_seeds
from pipeline.services import tracking

KEYS = ("method", "cell", "N", "t_ref")
DIAGNOSTICS = ("k3_mismatch", "ess", "mean_ell", "entropy", "success_ess", "response_length", "round_drift",
               "round_drift_seq")


def columns(cell: grid.GridCell, cfg: PipelineConfig) -> dict[str, Any]:
    """A cell's report columns: method, label, N, t_ref (as text) and its grid values."""
    tc = cell.config.train
    out = {"method": cell.method, "cell": cell.label, "N": tc.updates_per_step, "t_ref": str(tc.refresh_every() or "fixed")}
    for field, value in grid.columns(cell, cfg).items():
        if field not in ("cell", "train.updates_per_step", "train.t_ref"):
            out[field] = value
    return out


def record(cell: grid.GridCell, cfg: PipelineConfig, update: int, evaluation) -> dict[str, Any]:
    """One evaluation row: the cell's columns, seed, update and accuracy (mean@n)."""
    return columns(cell, cfg) | {"seed": cell.seed, "update": update,
                                 "accuracy": evaluation.summary[f"mean_at_{cfg.eval.n_samples}"]}


def cell_curves(cell: grid.GridCell, cfg: PipelineConfig, rounds: list) -> pl.DataFrame:
    """A cell's per-update rows (ONLINE_METRICS of every round's training) with its columns."""
    return (pl.concat([pl.read_parquet(m.path("metrics")) for m in rounds])
            .with_columns(**{k: pl.lit(v) for k, v in columns(cell, cfg).items()}, seed=pl.lit(cell.seed)))


def from_cache(cfg: PipelineConfig, store) -> tuple[pl.DataFrame, pl.DataFrame, list[tuple[str, float | None]]]:
    """(evaluations, curves, stage timings) of the online experiment `cfg` describes, read
    from the store by the keys the flow builds (graph.online_experiment_keys): the same
    tables the flow reports. A cell whose rounds are not all built contributes what is."""
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
        for at in tc.online_eval_updates(len(rounds)):
            e = load("evaluate", c.updated({"eval.target": "online", "eval.update": at}))
            records += [record(cell, cfg, at, e)] if e else []
        if rounds:
            curves.append(cell_curves(cell, cfg, rounds))
    return (pl.DataFrame(records), pl.concat(curves, how="diagonal_relaxed") if curves else pl.DataFrame(), timings)


def finals(evals: pl.DataFrame) -> pl.DataFrame:
    """The last evaluated update of each cell and seed."""
    return evals.filter(pl.col("update") == pl.col("update").max().over("cell", "seed"))


def _agg(frame: pl.DataFrame, by: list[str], value: str = "accuracy") -> pl.DataFrame:
    return frame.group_by(by, maintain_order=True).agg(
        pl.col(value).mean().alias("mean"), pl.col(value).std(ddof=1).alias("std"), pl.len().alias("seeds"),
        pl.col("update").min().alias("update"))


def stopped_mark(update: int, full: int) -> str:
    """Beside a final accuracy: where a cell stopped early (online.on_stall: a round that
    could not fill its pool; online.on_drift: a round that drifted past the bound), so a
    collapse reads as one."""
    return f" (stopped at update {update})" if update < full else ""


def in_cell_order(evals: pl.DataFrame) -> pl.DataFrame:
    """Rows in the experiment's cell order (the base evaluations come first, one per cell
    in grid order), not in the order the cells finished."""
    order = {c: i for i, c in enumerate(evals.filter(pl.col("update") == 0)["cell"].unique(maintain_order=True))}
    return evals.sort(pl.col("cell").replace_strict(order, default=len(order)), "seed", "update", maintain_order=True)


def pivot_table(evals: pl.DataFrame, field: str, title: str) -> tuple[str, pl.DataFrame] | None:
    """Final accuracy with `field` as columns, one row per method and other grid values;
    None unless some method ran with more than one value of `field`."""
    values = evals[field].unique(maintain_order=True).to_list()
    # polars types a column's max as any scalar: here a count (evals is never empty)
    if cast(int, evals.group_by("method").agg(pl.col(field).n_unique())[field].max()) < 2:
        return None     # one value per method (GRPO fixed, GGPO 160 by default): nothing to compare
    rows = [c for c in evals.columns if c not in ("cell", "seed", "update", "accuracy", field)]
    agg = _agg(finals(evals), rows + [field])
    lines = [title, "", "| " + " | ".join(rows) + " | " + " | ".join(f"{field}={v}" for v in values) + " |",
             "|" + "---|" * (len(rows) + len(values))]
    full = cast(int, evals["update"].max())
    for key in agg.select(rows).unique(maintain_order=True).iter_rows():
        sub = agg.filter(pl.all_horizontal([pl.col(c) == v for c, v in zip(rows, key)]))
        by_value = {r[field]: r for r in sub.iter_rows(named=True)}
        cells = [fmt_cell(by_value[v]["mean"], by_value[v]["std"]) + stopped_mark(by_value[v]["update"], full)
                 if v in by_value else "" for v in values]
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
    """Spec-9 diagnostics and the round drift averaged over the last quarter of each run's
    updates (Figure 7), then mean, `<name>_std` (sample std) and `seeds` over seeds."""
    return last_quarter(curves, identity(curves), list(DIAGNOSTICS))


DRIFT_TITLE = ("Learner-to-behavior drift at each round's end (round_drift: token mean |log ratio| after the "
               "round's N updates; its first round, mean and max over rounds, last round; mean ± sample std over "
               "seeds; every round in drift.csv)")


def with_drift(curves: pl.DataFrame) -> pl.DataFrame:
    """`curves` with the drift columns and `round` (None where absent: records written before
    the drift existed, hand-made frames)."""
    missing = [pl.lit(None, pl.Float64).alias(c) for c in DRIFT if c not in curves.columns]
    return curves.with_columns(*missing, *([pl.lit(None, pl.Int32).alias("round")] if "round" not in curves.columns else []))


def drift_rounds(curves: pl.DataFrame) -> pl.DataFrame:
    """The drift at each round's end: one row per cell and round (its last update), the
    mean and `_std` over seeds of round_drift and round_drift_seq."""
    present = with_drift(curves)
    ends = present.filter(pl.col("update") == pl.col("update").max().over("cell", "seed", "round"))
    return over_seeds(ends.sort("round", maintain_order=True), identity(curves) + ["round", "update"], list(DRIFT))


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
    agg = _agg(finals(evals), ["cell", "N", "t_ref"])
    base = evals.filter(pl.col("update") == 0)["accuracy"].mean()
    full = cast(int, evals["update"].max())
    # None when the cache holds no base evaluation (`ggpo report` on a partly built experiment)
    base_text = f"base policy {100 * base:.2f}" if isinstance(base, float) else "base policy not evaluated"
    lines = [f"Final accuracy ({metric}, %; {base_text})", "",
             "| cell | N | t_ref | seeds | update | final |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['cell']} | {r['N']} | {r['t_ref']} | {r['seeds']} | {r['update']} | "
              f"{fmt_cell(r['mean'], r['std'])} |" for r in agg.iter_rows(named=True)]
    if cast(int, agg["update"].min()) < full:
        lines += ["", f"A cell whose update is below {full} stopped there: a round after it could not fill its pool "
                      "with mixed-reward groups within online.max_draws (its policy solved or failed nearly every "
                      "prompt; online.on_stall = stop), or the round ending there left online.max_round_drift "
                      "(online.on_drift = stop; its round_drift in drift.csv), and its policy at that update is its "
                      "final."]
    return "\n".join(lines) + "\n"


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


def write(evals: pl.DataFrame, curves: pl.DataFrame, folder: Path, metric: str) -> tuple[str, list[Path]]:
    """Every table and figure into `folder`: (the Markdown of all tables, the files)."""
    evals = in_cell_order(evals)
    parts = [markdown_final(evals, metric)]
    write_file_atomic(folder / "final.csv", finals(evals).write_csv)
    paths = [folder / "final.csv"]
    for field, name, title in (("N", "staleness", f"Final accuracy ({metric}, %) against synchronization delay N"),
                               ("t_ref", "refresh", f"Final accuracy ({metric}, %): fixed vs refreshed reference")):
        table = pivot_table(evals, field, title)
        if table is not None:
            parts.append(table[0])
            write_file_atomic(folder / f"{name}.csv", table[1].write_csv)
            paths.append(folder / f"{name}.csv")
    diag = diagnostics(curves)
    parts.append(markdown_diagnostics(diag.drop([c for c in diag.columns if c.count(".")] or []), list(DIAGNOSTICS),
                                      "Diagnostics over the last quarter of updates (mean ± sample std over seeds)"))
    drift = drift_summary(curves)
    parts.append(markdown_diagnostics(drift.drop([c for c in drift.columns if c.count(".")] or []),
                                      ["rounds", "first", "mean", "max", "last"], DRIFT_TITLE))
    write_file_atomic(folder / "diagnostics.csv", diag.write_csv)
    write_file_atomic(folder / "drift.csv", drift_rounds(curves).write_csv)
    write_file_atomic(folder / "curves.csv", curves.write_csv)
    paths += [folder / "diagnostics.csv", folder / "drift.csv", folder / "curves.csv"] + figures(evals, curves, diag, folder)
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
