"""The comparison report (seed Table 5 / Figure 4 forms).

Table: accuracy (mean@n on the eval split) per method per evaluated update, as
mean ± sample std (ddof = 1) over seeds, and n seeds; update 0 is the shared base policy.
Then the final accuracy's paired differences (compare.py, stats.py): each method minus
GRPO+TIS (else the first method) at each grid point, and each grid axis's values minus its
first value within a method, seed by seed (a seed's cells share its pool and group order),
with the 95 % t-interval (n - 1 dof), n and p; "n=1, no interval" for one seed. Offline
training runs every update, so no cell stalls. Diagnostics table: each run's spec-9
diagnostics averaged over one window common to every cell (the last quarter of the
shortest planned run, stated in the caption), then mean ± sample std over seeds;
`abs_log_ratio` (token mean |log pi_theta - log pi_beh|) is the learner's drift from the
pool's policy. Then the mismatch table (mismatch.py: |log rho|, K3, chi-square per token
and per response, sequence ESS, and the share each method's rule clipped, truncated or
masked) over the same window; diagnostics.csv holds every column of both, an old cache's
missing columns as null. One seed: no ±. Figure: accuracy, token-mean |log ratio| learner/behavior,
normalized sequence ESS and grad norm against updates, one line per method (seed means).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import cast

import polars as pl
import pyarrow.parquet as pq

from pipeline.core import grid
from pipeline.core.config import PipelineConfig
from pipeline.core.store import write_file_atomic, write_text_atomic
from pipeline.dag import graph
from pipeline.reports import compare, mismatch
from pipeline.services import tracking

# the offline diagnostics table's columns (TRAIN_METRICS), drift from the pool first
DIAGNOSTICS = ("abs_log_ratio", "k3_mismatch", "ess", "mean_ell", "entropy", "success_ess", "grad_norm")
# and the mismatch table's (mismatch.py) not among them: diagnostics.csv has both
CURVE_COLUMNS = DIAGNOSTICS + tuple(c for c in mismatch.OFFLINE + mismatch.RULES if c not in DIAGNOSTICS)


def training_curves(trained, method: str, seed: int, cell: str | None = None) -> pl.DataFrame:
    """The figure's and the diagnostics table's per-update series of one training manifest,
    labelled by method and seed (and by its grid cell's label, when the experiment has a grid)."""
    path = trained.path("metrics")
    present = set(pq.read_schema(path).names)      # a record from before a column: null there
    curves = (mismatch.with_nulls(pl.read_parquet(path, columns=["update", *(c for c in CURVE_COLUMNS if c in present)]),
                                  CURVE_COLUMNS).select("update", *CURVE_COLUMNS)
              .with_columns(pl.lit(method).alias("method"), pl.lit(seed).alias("seed")))
    return curves if cell is None else curves.with_columns(pl.lit(cell).alias("cell"))


def label_column(frame: pl.DataFrame) -> str:
    """What a row of the table is: the grid cell ("ggpo t_ref=8 lr=1e-4") when the records
    carry one (pipeline/core/grid.py columns), else the method."""
    return "cell" if "cell" in frame.columns else "method"


def summarize(evals: pl.DataFrame) -> pl.DataFrame:
    """evals: method, seed, update, accuracy [, cell, grid fields] -> method (or cell),
    update, mean, std, seeds [, method, grid fields], then each seed's accuracy as
    `seed_<seed>` (what the paired differences are computed from): one row per cell and
    update."""
    by = label_column(evals)
    extra = [c for c in evals.columns if c not in (by, "seed", "update", "accuracy")]   # constant per cell
    order = {m: i for i, m in enumerate(evals[by].unique(maintain_order=True).to_list())}
    seeds = evals["seed"].unique(maintain_order=True).to_list()
    return (evals.group_by([by, "update"], maintain_order=True)
            .agg(pl.col("accuracy").mean().alias("mean"), pl.col("accuracy").std(ddof=1).alias("std"),
                 pl.len().alias("seeds"), *[pl.col(c).first() for c in extra],
                 *[pl.col("accuracy").filter(pl.col("seed") == s).first().alias(f"{SEED}{s}") for s in seeds])
            .sort([pl.col(by).replace_strict(order), pl.col("update")]))


SEED = "seed_"      # summarize's per-seed columns: seed_42, seed_1234, ...


def seed_finals(summary: pl.DataFrame) -> pl.DataFrame:
    """From summarize's frame: one row per cell and seed at its planned last update
    (compare.py's per_seed: cell, method, seed, value, update, stopped; offline training
    runs every update, so nothing stopped). A cell not evaluated there yet (`ggpo report`
    on a partly built cache) has no row, so no comparison pairs two different updates."""
    by = label_column(summary)
    final = summary.filter(pl.col("update") == planned_updates(summary))
    cols = [c for c in final.columns if c.startswith(SEED)]
    rows = [{"cell": r[by], "method": r.get("method", r[by]), "seed": int(c[len(SEED):]), "value": r[c],
             "update": r["update"], "stopped": False}
            for r in final.iter_rows(named=True) for c in cols if r[c] is not None]
    return pl.DataFrame(rows, schema={"cell": pl.Utf8, "method": pl.Utf8, "seed": pl.Int64, "value": pl.Float64,
                                      "update": pl.Int64, "stopped": pl.Boolean})


def cell(mean: float, std: float | None) -> str:
    if std is None or math.isnan(std):
        return f"{100 * mean:.2f}"
    return f"{100 * mean:.2f} ± {100 * std:.2f}"


def number(mean: float | None, std: float | None) -> str:
    """A diagnostic as text: '0.5812 ± 0.031' (the mean to 4 significant digits, its spread
    to 2), the mean alone with one seed (std None) and '' where the run has no such value."""
    if mean is None or math.isnan(mean):
        return ""
    return f"{mean:.4g}" if std is None or math.isnan(std) else f"{mean:.4g} ± {std:.2g}"


def over_seeds(per_seed: pl.DataFrame, ids: list[str], values: list[str]) -> pl.DataFrame:
    """One row per (ids, seed) -> one row per ids: each value's mean over seeds, its sample
    std (ddof 1; None with one seed) as `<value>_std`, and the number of seeds."""
    return per_seed.group_by(ids, maintain_order=True).agg(
        *[pl.col(v).mean() for v in values], *[pl.col(v).std(ddof=1).alias(f"{v}_std") for v in values],
        pl.len().alias("seeds"))


PLANNED = "planned_updates"    # an online record's column: the updates its cell was to run


def planned_updates(frame: pl.DataFrame) -> pl.Expr:
    """The updates each row's run was to make: PLANNED where the rows carry it (online
    records and curves), its `train.updates` where the grid sweeps it, else the largest
    update in `frame` (every cell runs the experiment's train.updates)."""
    for name in (PLANNED, "train.updates"):
        if name in frame.columns:
            return pl.col(name).cast(pl.Int64)
    return pl.lit(frame["update"].max() if frame.height else 0, pl.Int64)


def common_window(curves: pl.DataFrame) -> tuple[int, int]:
    """(first, last) update of the diagnostics' window: the last quarter of the shortest
    planned run (update > 3/4 of it), the same window for every cell compared."""
    last = int(cast(int, curves.select(planned_updates(curves).min()).item()))
    return math.floor(3 * last / 4) + 1, last


def window_means(curves: pl.DataFrame, ids: list[str], values: list[str]) -> pl.DataFrame:
    """Each run's (ids, seed) values averaged over the common window (common_window; None
    where the run has no value there); then mean and `_std` over the seeds that reached the
    window's last update, their number `seeds`, the seeds that stopped before it `stopped`
    and their stops `stopped_at` ("16 28"), and the window as text `window` ("97-128")."""
    present = curves.with_columns(*[pl.lit(None, pl.Float64).alias(v) for v in values if v not in curves.columns])
    first, last = common_window(present)
    reached = present.group_by(ids + ["seed"], maintain_order=True).agg(pl.col("update").max().alias("reached"))
    inside = present.filter(pl.col("update").is_between(first, last))
    means = inside.group_by(ids + ["seed"]).agg(*[pl.col(v).drop_nulls().mean() for v in values])
    per_seed = reached.join(means, on=ids + ["seed"], how="left", nulls_equal=True, maintain_order="left")
    ok = pl.col("reached") >= last
    per_seed = per_seed.with_columns(*[pl.when(ok).then(pl.col(v)).otherwise(None).alias(v) for v in values],
                                     ok.alias("in_window"))
    stops = pl.col("reached").filter(~pl.col("in_window")).sort()
    return per_seed.group_by(ids, maintain_order=True).agg(
        *[pl.col(v).mean() for v in values], *[pl.col(v).std(ddof=1).alias(f"{v}_std") for v in values],
        pl.col("in_window").sum().cast(pl.Int64).alias("seeds"),
        (~pl.col("in_window")).sum().cast(pl.Int64).alias("stopped"),
        stops.cast(pl.Utf8).str.join(" ").alias("stopped_at"), pl.lit(f"{first}-{last}").alias("window"))


def diagnostics(curves: pl.DataFrame) -> pl.DataFrame:
    """The offline runs' diagnostics (CURVE_COLUMNS: DIAGNOSTICS, then the mismatch table's
    others) over the common window (window_means), mean and `_std` over seeds, one row per
    cell (or method)."""
    if not curves.height:        # nothing trained yet (`ggpo report` on a partly built experiment)
        return pl.DataFrame()
    return window_means(curves, [label_column(curves)], list(CURVE_COLUMNS))


def diagnostics_markdown(diag: pl.DataFrame) -> str:
    """The diagnostics table (DIAGNOSTICS) and the mismatch table of a diagnostics frame."""
    if not diag.height:
        return ""
    return (markdown_diagnostics(diag, list(DIAGNOSTICS), DIAGNOSTICS_TITLE) + "\n"
            + mismatch.markdown(diag, [label_column(diag)], mismatch.OFFLINE, mismatch.title(online=False) + window_sentence(diag),
                                seeds_text))


WINDOW_COLUMNS = ("stopped", "stopped_at", "window")


def window_sentence(diag: pl.DataFrame) -> str:
    """The caption's statement of the window window_means used ('' for frames without one)."""
    if "window" not in diag.columns or not diag.height:
        return ""
    first, last = diag["window"][0].split("-")
    return (f" Every cell over the same updates {first}-{last} (the last quarter of the shortest planned run); "
            f"a seed whose cell stopped before update {last} is left out of its cell's mean and named under seeds.")


def seeds_text(r: dict) -> str:
    """'3', or '2 of 3; 1 stopped at 16' where seeds stopped before the window's end."""
    if not r.get("stopped"):
        return str(r["seeds"])
    return f"{r['seeds']} of {r['seeds'] + r['stopped']}; {r['stopped']} stopped at {r['stopped_at'].replace(' ', ', ')}"


def markdown_diagnostics(diag: pl.DataFrame, values: list[str], title: str) -> str:
    """A diagnostics frame (over_seeds or window_means columns) as Markdown: the ids, the
    seeds (and those that stopped before the window), 'mean ± std'."""
    skip = set(values) | set(WINDOW_COLUMNS) | {"seeds"}
    # ids: what is neither a value shown nor one left out (each value has its `_std`)
    ids = [c for c in diag.columns if c not in skip and not c.endswith("_std") and f"{c}_std" not in diag.columns]
    lines = [title + window_sentence(diag), "", "| " + " | ".join(ids + ["seeds"] + values) + " |",
             "|" + "---|" * (len(ids) + 1 + len(values))]
    for r in diag.iter_rows(named=True):
        lines.append("| " + " | ".join([str(r[c]) for c in ids] + [seeds_text(r)]
                                       + [number(r[v], r[f"{v}_std"]) for v in values]) + " |")
    return "\n".join(lines) + "\n"


def markdown(summary: pl.DataFrame, metric: str) -> str:
    """The accuracy table (mean ± sample std over seeds per cell and update, n seeds), then
    the paired differences at each cell's final update (paired_tables)."""
    updates = sorted(summary["update"].unique().to_list())
    by = label_column(summary)
    head = f"| {by} | " + " | ".join(f"update {u}" for u in updates) + " | seeds |"
    lines = [f"Accuracy ({metric}, %, mean ± sample std over seeds; offline training runs every update: no stalls)",
             "", head, "|" + "---|" * (len(updates) + 2)]
    for method in summary[by].unique(maintain_order=True).to_list():
        rows = {r["update"]: r for r in summary.filter(pl.col(by) == method).iter_rows(named=True)}
        cells = [cell(rows[u]["mean"], rows[u]["std"]) if u in rows else "" for u in updates]
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {rows[max(rows)]['seeds']} |")
    return "\n".join(lines) + "\n" + paired_tables(summary, metric)


def paired_tables(summary: pl.DataFrame, metric: str) -> str:
    """Final accuracy, paired by seed (one seed's cells share its pool and group order):
    each method minus the reference (compare.reference_method) at each grid point, and
    along each grid axis within a method; '' without per-seed columns or comparisons."""
    per_seed = seed_finals(summary)
    if not per_seed.height:
        return ""
    ref, to_ref = compare.paired_to_reference(per_seed)
    along = compare.paired_along_axes(per_seed)
    parts = []
    if to_ref.height:
        parts.append(compare.markdown_paired(to_ref, PAIRED_TITLE.format(metric=metric, ref=ref)))
    if along.height:
        parts.append(compare.markdown_paired(along, AXES_TITLE.format(metric=metric), **compare.AXIS_COLUMNS))
    return "".join("\n" + p for p in parts)


PAIRED_TITLE = ("Paired differences in final accuracy ({metric}, percentage points): each method minus {ref} at the "
                "same grid point, seed by seed (a seed's cells share its pool and the seeded group order). Mean "
                "difference, 95% t-interval (n - 1 dof), n = seeds in both cells, two-sided p of no difference; "
                "stalls k/n of the method's cell and of {ref}'s.")
AXES_TITLE = ("Paired differences in final accuracy ({metric}, percentage points) along each grid axis: within a "
              "method, each value minus the axis's first value, the other axes held, seed by seed (95% t-interval, "
              "n - 1 dof).")


def figure(evals: pl.DataFrame, curves: pl.DataFrame, path: Path) -> None:
    """curves: method, seed, update, abs_log_ratio, ess, grad_norm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    by = label_column(evals)      # one line per cell with a grid, per method without
    acc = evals.group_by([by, "update"]).agg(pl.col("accuracy").mean()).sort("update")
    panels = [("accuracy", acc, "accuracy (eval mean@n)")]
    for col, title in [("abs_log_ratio", "|log pi_theta - log pi_beh| (token mean)"),
                       ("ess", "normalized ESS (sequence weights)"), ("grad_norm", "grad norm")]:
        data = (curves.drop_nulls(col).group_by([by, "update"]).agg(pl.col(col).mean()).sort("update"))
        panels.append((col, data, title))
    for ax, (col, data, title) in zip(axes, panels):
        for method in evals[by].unique(maintain_order=True).to_list():
            d = data.filter(pl.col(by) == method)
            ax.plot(d["update"].to_list(), d[col].to_list(), label=method, marker="o" if col == "accuracy" else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("update")
    axes[0].legend()
    fig.tight_layout()
    write_file_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100))
    plt.close(fig)


DIAGNOSTICS_TITLE = ("Diagnostics (each seed's mean over the window, then mean ± sample std over seeds; abs_log_ratio: "
                     "drift from the pool's policy, token mean |log ratio|).")


def write(evals: pl.DataFrame, curves: pl.DataFrame, folder: Path, metric: str) -> dict[str, Path]:
    """report.md (accuracy and diagnostics tables), report.csv, diagnostics.csv, curves.png
    in `folder`; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    summary = summarize(evals)
    diag = diagnostics(curves)
    paths = {"markdown": folder / "report.md", "csv": folder / "report.csv", "diagnostics": folder / "diagnostics.csv",
             "figure": folder / "curves.png"}
    # each file written whole or not at all (a full disk leaves the previous report)
    write_text_atomic(paths["markdown"], markdown(summary, metric) + (
        "\n" + diagnostics_markdown(diag) if diag.height else ""))
    write_file_atomic(paths["csv"], summary.write_csv)
    write_file_atomic(paths["diagnostics"], diag.write_csv)
    figure(evals, curves, paths["figure"])
    return paths


def from_cache(cfg, store) -> tuple[pl.DataFrame, pl.DataFrame, list[tuple[str, float | None]]]:
    """(evals, curves, stage timings) of the experiment `cfg` describes, read from the
    store by expected keys; stages not built yet have timing None and no rows."""

    def load(stage, c):
        return store.load(stage, graph.expected_key(stage, c))

    key = f"mean_at_{cfg.eval.n_samples}"
    timings, records, curves = [], [], []
    base = load("base", cfg)
    timings.append(("base", base.seconds if base else None))
    seen = set()       # pools and base evaluations that grid cells share are timed once
    for cell in grid.cells(cfg):
        cm, seed, method, label = cell.config, cell.seed, cell.method, cell.label
        columns = grid.columns(cell, cfg)
        for stage in graph.pool_stages(cm):
            m = load(stage, cm)
            if (stage, graph.expected_key(stage, cm)) not in seen:
                seen.add((stage, graph.expected_key(stage, cm)))
                timings.append((f"{stage} seed {seed}", m.seconds if m else None))
        cb = cm.updated({"eval.target": "base"})
        base_eval = load("evaluate", cb)
        if ("evaluate", graph.expected_key("evaluate", cb)) not in seen:
            seen.add(("evaluate", graph.expected_key("evaluate", cb)))
            timings.append((f"evaluate base seed {seed}", base_eval.seconds if base_eval else None))
        trained = load("train", cm)
        timings.append((f"train {label} seed {seed}", trained.seconds if trained else None))
        if trained:
            curves.append(training_curves(trained, method, seed, columns.get("cell")))
        evals = [base_eval] + [load("evaluate", cm.updated({"eval.update": u}))
                               for u in cm.train.snapshot_updates() + [None]]
        for e in evals[1:]:
            timings.append((f"evaluate {label} seed {seed}", e.seconds if e else None))
        records += [{"method": method, "seed": seed, "update": e.summary["update"], "accuracy": e.summary[key]}
                    | columns for e in evals if e]
    return pl.DataFrame(records), (pl.concat(curves) if curves else pl.DataFrame()), timings


def benchmark_tables(finals: pl.DataFrame, n: int, ks: list[int]) -> tuple[str, str, pl.DataFrame, pl.DataFrame]:
    """Seed Table 1 and Table 3 forms from final evaluations.

    finals: method, seed, and each run's per-benchmark report rows (benchmark, mean_at_n,
    pass_at_K...; the problem-weighted row is benchmark "avg"). Returns (table 1 md,
    table 3 md, table 1 frame, table 3 frame): mean ± sample std over seeds of per-seed
    values, the Avg column being each seed's problem-weighted average (spec 10)."""
    score = f"mean_at_{n}"
    t1 = (finals.group_by(["method", "benchmark"], maintain_order=True)
          .agg(pl.col(score).mean().alias("mean"), pl.col(score).std(ddof=1).alias("std")))
    benches = finals["benchmark"].unique(maintain_order=True).to_list()
    methods = finals["method"].unique(maintain_order=True).to_list()
    lines = [f"Accuracy ({score.replace('_at_', '@')}, %, mean ± sample std over seeds; avg = problem-weighted)", "",
             "| method | " + " | ".join(benches) + " |", "|---" * (len(benches) + 1) + "|"]
    for m in methods:
        row = {r["benchmark"]: cell(r["mean"], r["std"]) for r in t1.filter(pl.col("method") == m).iter_rows(named=True)}
        lines.append(f"| {m} | " + " | ".join(row.get(b, "") for b in benches) + " |")
    avg_name = benches[-1]
    cols = [f"pass_at_{k}" for k in ks]
    t3 = (finals.filter(pl.col("benchmark") == avg_name).group_by("method", maintain_order=True)
          .agg([pl.col(c).mean().alias(f"{c}_mean") for c in cols] + [pl.col(c).std(ddof=1).alias(f"{c}_std") for c in cols]))
    lines3 = [f"pass@K ({avg_name}, %, mean ± sample std over seeds)", "",
              "| method | " + " | ".join(f"K={k}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
    for r in t3.iter_rows(named=True):
        lines3.append(f"| {r['method']} | " + " | ".join(cell(r[f'{c}_mean'], r[f'{c}_std']) for c in cols) + " |")
    return "\n".join(lines) + "\n", "\n".join(lines3) + "\n", t1, t3


def pass_at_k_figure(t3: pl.DataFrame, ks: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 4))
    for r in t3.iter_rows(named=True):
        ax.plot(ks, [r[f"pass_at_{k}_mean"] for k in ks], marker="o", label=r["method"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("K")
    ax.set_ylabel("pass@K")
    ax.legend()
    fig.tight_layout()
    write_file_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100))
    plt.close(fig)


def write_benchmarks(finals: list[pl.DataFrame], cfg: PipelineConfig, folder: Path) -> list[Path]:
    """Table 1 / Table 3 forms and the pass@K figure from the final evaluations."""
    ks = [k for k in cfg.eval.pass_k if k <= cfg.eval.n_samples]
    t1_md, t3_md, t1, t3 = benchmark_tables(pl.concat(finals, how="diagonal_relaxed"), cfg.eval.n_samples, ks)
    paths = [folder / n for n in ("benchmarks.md", "benchmarks.csv", "pass_at_k.md", "pass_at_k.csv", "pass_at_k.png")]
    write_text_atomic(paths[0], t1_md)
    write_file_atomic(paths[1], t1.write_csv)
    write_text_atomic(paths[2], t3_md)
    write_file_atomic(paths[3], t3.write_csv)
    pass_at_k_figure(t3, ks, paths[4])
    return paths


def log(client, parent: str, records: list[dict], curves: list[pl.DataFrame], finals: list[pl.DataFrame],
        cfg: PipelineConfig, folder: Path) -> dict:
    """The offline flow's report: its files into `folder` and the MLflow parent run's
    report/, its summary metrics (final and base accuracy) on that run; {table, summary}."""
    evals = pl.DataFrame(records)
    metric = f"mean@{cfg.eval.n_samples}"
    paths = write(evals, pl.concat(curves), folder, metric)
    extra = write_benchmarks(finals, cfg, folder)
    for path in list(paths.values()) + extra:
        client.log_artifact(parent, str(path), artifact_path="report")
    table = paths["markdown"].read_text() + "\n" + extra[0].read_text() + "\n" + extra[2].read_text()
    by = label_column(evals)        # "cell" with a grid, else "method"
    final = evals.filter(pl.col("update") == pl.col("update").max().over(by))
    # polars types a mean as any scalar: of these non-empty float columns it is a float
    summary = {f"final_{metric.replace('@', '_at_')}/{grid.slug(m)}": cast(float, final.filter(pl.col(by) == m)["accuracy"].mean())
               for m in final[by].unique(maintain_order=True)}
    base = evals.filter(pl.col("update") == 0)["accuracy"].mean()
    summary[f"base_{metric.replace('@', '_at_')}"] = cast(float, base)
    tracking.log_params_metrics(client, parent, {}, tracking.summary_metrics(summary))
    return {"table": table, "summary": summary}
