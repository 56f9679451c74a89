"""The corrections table (issue 35): every method on the staleness ladder and on the fixed pool.

Inputs: the online experiment's evaluations and curves (online.py: one cell per method, N
and seed) and the offline trainings' (offline.py: per seed every method on that seed's one
pool, at the preset's own N: `offline_config`, the experiment without its grid). A
*setting* is where a method ran: "N=4" (an online cell; other grid values follow, "N=4
t_ref=fixed"), or "offline". Each method at each setting is one cell over seeds.

- Final accuracy: per method and setting, mean ± sample std over seeds (each seed's value
  where some but not all stalled: compare.cell_text) with its stalls k/n (online cells; an
  offline run trains every update and never stalls).
- Paired difference to GRPO+TIS (compare.paired_to_reference: `grpo_tis` where the
  experiment has it, else its first method): at each setting, each method's final minus
  the reference's, seed by seed (a seed's cells share its base model and the seeded prompt
  order; offline also its pool), with the 95 % t-interval over seeds (n - 1 dof) and p;
  and p_holm, the p-values adjusted over the whole table (stats.holm): 14 methods at five
  settings are up to 70 tests, ~3.5 of which exclude zero at 5 % by chance alone, so the
  report names the differences that hold with the table's family-wise error at 5 %. A
  method identical to the reference on every seed is no test and leaves the family.
- Mismatch diagnostics (mismatch.py) per method and setting, each seed averaged over one
  window common to every cell of its part (the last quarter of the shortest planned run),
  then mean ± std over seeds; online also the round drift.

`write` puts corrections.md, corrections.csv (one row per method and setting: final,
difference to the reference, diagnostics, each with its spread) and corrections.png
(final accuracy, the paired difference with its interval, and |log rho| against the
setting) into a folder. `from_cache` reads what the corrections flow (flows/corrections.py)
built; `ggpo report --preset corrections` prints `write`'s Markdown.

A *results folder* holds the four frames a table is computed from (FRAMES, as Parquet:
`save_results`); the flow's report folder is one, and `ggpo report --preset corrections
--save DIR` writes one from the cache. `load_results` joins folders of distinct seeds into
one table's frames (`ggpo report --preset corrections --merge DIR DIR ...`): seeds run on
other machines or on other days make one table, and in the reproducible kernel mode a seed's
cells are the same bits wherever they ran, so the joined table is the one a single run of all
the seeds writes (tests/test_corrections_report.py).
"""
from __future__ import annotations

import math
import statistics
from functools import partial
from pathlib import Path
from typing import Any

import polars as pl

from pipeline.core import methods as method_table
from pipeline.core.config import PipelineConfig
from pipeline.core.errors import ConfigError
from pipeline.core.store import write_file_atomic, write_text_atomic
from pipeline.reports import compare, mismatch, offline, online, stats

OFFLINE = "offline"        # the fixed pool's setting
ONLINE_VALUES = mismatch.MISMATCH + ("round_drift", "round_drift_seq")


def offline_config(cfg: PipelineConfig) -> PipelineConfig:
    """The offline part of a corrections experiment: its methods and seeds on each seed's
    pool at the preset's own geometry (the grid, the ladder's N, dropped)."""
    return cfg.updated({"experiment.grid": {}})


def online_setting(frame: pl.DataFrame) -> pl.Expr:
    """An online row's setting: 'N=4', then its other grid values ('N=4 t_ref=fixed')."""
    rest = pl.col("cell").str.slice(pl.col("method").str.len_chars()).str.strip_chars()
    rest = rest.str.replace_all(r"(^| )(train\.)?updates_per_step=\S+", "").str.strip_chars()
    head = pl.lit("N=") + pl.col("N").cast(pl.Utf8)
    return pl.when(rest == "").then(head).otherwise(head + pl.lit(" ") + rest).alias("setting")


def per_seed(online_evals: pl.DataFrame, offline_evals: pl.DataFrame) -> pl.DataFrame:
    """compare.py's per_seed over both parts: method, setting, cell ('<method> <setting>'),
    seed, value (final accuracy), update (its update), stopped (the cell stalled there)."""
    cols = ["method", "setting", "cell", "seed", "value", "update", "stopped"]
    parts = []
    if online_evals.height:
        on = online.seed_finals(online_evals)
        parts.append(on.with_columns(online_setting(on)).with_columns(
            cell=pl.col("method") + pl.lit(" ") + pl.col("setting")).select(cols))
    if offline_evals.height:
        off = offline.seed_finals(offline.summarize(offline_evals))
        parts.append(off.with_columns(setting=pl.lit(OFFLINE), cell=pl.col("method") + pl.lit(f" {OFFLINE}"))
                     .select(cols))
    schema = {"method": pl.Utf8, "setting": pl.Utf8, "cell": pl.Utf8, "seed": pl.Int64, "value": pl.Float64,
              "update": pl.Int64, "stopped": pl.Boolean}
    return pl.concat([p.cast(schema) for p in parts]) if parts else pl.DataFrame(schema=schema)  # type: ignore[arg-type]


def diagnostics(online_curves: pl.DataFrame, offline_curves: pl.DataFrame) -> pl.DataFrame:
    """Per method and setting: mismatch.COLUMNS (and the round drift online) over each
    part's common window, mean and `_std` over seeds, `seeds` (those that reached the
    window's end), `stopped` / `stopped_at` and `window`."""
    parts = []
    if online_curves.height:
        diag = online.diagnostics(online_curves)
        parts.append(diag.with_columns(online_setting(diag)))
    if offline_curves.height:
        parts.append(offline.diagnostics(offline_curves).with_columns(setting=pl.lit(OFFLINE)))
    keep = ["method", "setting", "seeds", "stopped", "stopped_at", "window"]
    values = list(dict.fromkeys(mismatch.COLUMNS + ONLINE_VALUES))
    frames = [mismatch.with_nulls(p, values + [f"{v}_std" for v in values])
              .with_columns(pl.col("stopped_at").cast(pl.Utf8)) for p in parts]
    return (pl.concat([f.select(keep + values + [f"{v}_std" for v in values]) for f in frames], how="vertical_relaxed")
            if frames else pl.DataFrame())


def title_of(method: str) -> str:
    """The method's title in the table ("GRPO+TIS"); a variant's name as it is."""
    try:
        return method_table.get(method).title
    except ValueError:
        return method


def finals_table(seeds: pl.DataFrame) -> pl.DataFrame:
    """One row per method and setting: online.cell_stats (mean, std, seeds, update, low,
    high, stalled, text)."""
    return online.cell_stats(seeds, ["method", "setting"])


def paired(seeds: pl.DataFrame) -> tuple[str, pl.DataFrame]:
    """(the reference, compare.paired_to_reference rows: method, point = setting, diff, low,
    high, n, p, seeds, stalls, stalls_other; `identical`: every seed's difference is exactly
    0, so there is nothing to test (no t statistic; p None); and p_holm: p adjusted over every
    other row of the table, stats.holm, since the table tests each method at each setting at
    once). Identical rows are common: a correction whose rule never fires trains bit for bit
    as the reference does (IcePop online, whose engine ratio never leaves its band)."""
    if not seeds.height:
        return compare.REFERENCE, pl.DataFrame()
    ref, pairs = compare.paired_to_reference(seeds)
    if pairs.height:
        identical = ((pl.col("n") >= 2) & (pl.col("diff") == 0.0) & (pl.col("sd") == 0.0)).fill_null(False)
        pairs = pairs.with_columns(identical=identical, p=pl.when(identical).then(None).otherwise(pl.col("p")))
        pairs = pairs.with_columns(p_holm=pl.Series(stats.holm(pairs["p"].to_list()), dtype=pl.Float64))
    return ref, pairs


def settled_text(pairs: pl.DataFrame, level: float = stats.LEVEL) -> str:
    """The differences that exclude zero with the whole table's error held at 1 - level
    (Holm), and how many of the per-row intervals exclude zero."""
    tested = pairs.filter(pl.col("p").is_not_null())
    alpha = 1.0 - level
    row_wise = tested.filter(pl.col("p") < alpha).height
    held = tested.filter(pl.col("p_holm") < alpha)
    names = ", ".join(f"{title_of(r['method'])} at {r['point']} ({100.0 * r['diff']:+.2f}, Holm p "
                      f"{stats.p_text(r['p_holm'])})" for r in held.iter_rows(named=True))
    return (f"Of the {tested.height} differences, {row_wise} have p < {alpha:g} on their own (about "
            f"{alpha * tested.height:.1f} would by chance if no difference were real); with the whole table's "
            f"chance of a false exclusion held at {alpha:g} (Holm's adjustment over the {tested.height}): "
            + (names if names else "none") + ".")


def resolution(tested: pl.DataFrame, low: str, high: str, n: str, setting: str,
               level: float = stats.LEVEL, target: float = 0.8) -> dict[str, tuple[float, float]]:
    """Per setting, (the median half-width of its tests' intervals, the difference a paired
    t-test of its seeds finds with probability `target` at the median spread): the spread of
    each test's differences is sd = half-width sqrt(n) / q(n - 1), recovered from its interval,
    and stats.detectable takes the median sd and the setting's largest n. Settings whose tests
    have fewer than two seeds are left out."""
    out = {}
    for s in tested[setting].unique(maintain_order=True).to_list():
        rows = [r for r in tested.filter(pl.col(setting) == s).iter_rows(named=True)
                if r[n] is not None and r[n] >= 2 and r[low] is not None]
        if not rows:
            continue
        half = [(r[high] - r[low]) / 2.0 for r in rows]
        sd = [h * math.sqrt(r[n]) / stats.t_quantile(level, r[n] - 1) for h, r in zip(half, rows)]
        med_sd = statistics.median(sd)
        out[s] = (statistics.median(half),
                  stats.detectable(med_sd, max(r[n] for r in rows), target, level) if med_sd > 0 else 0.0)
    return out


def resolution_text(pairs: pl.DataFrame, settings: list[str], scale: float = 100.0) -> str:
    """One line: per setting the median 95 % half-width and the 80 %-power difference."""
    res = resolution(pairs.filter(pl.col("p").is_not_null()), "low", "high", "n", "point")
    parts = [f"{s}: ±{scale * res[s][0]:.1f}, {scale * res[s][1]:.1f}" for s in settings if s in res]
    if not parts:       # no difference has an interval: one seed, or every cell identical
        return ("What the table resolves: nothing yet (no difference has a 95 % interval: a paired t-test "
                "needs two seeds or more).")
    return ("What the table resolves, per setting: the median half-width of its 95 % intervals, then the "
            "difference a paired t-test of these seeds finds four times in five at the setting's median spread "
            "of the differences (80 % power, two-sided 5 %, per test; stats.detectable): " + "; ".join(parts) + ".")


def _pivot(rows: dict[tuple[str, str], str], methods: list[str], settings: list[str]) -> list[str]:
    lines = ["| method | " + " | ".join(settings) + " |", "|" + "---|" * (len(settings) + 1)]
    for m in methods:
        lines.append(f"| {title_of(m)} (`{m}`) | " + " | ".join(rows.get((m, s), "") for s in settings) + " |")
    return lines


def markdown(seeds: pl.DataFrame, diag: pl.DataFrame, metric: str, base: float | None) -> str:
    """The three tables: final accuracy with stalls, paired difference to the reference,
    mismatch diagnostics."""
    if not seeds.height:
        return "Corrections table: no cell has a final evaluation yet.\n"
    methods = seeds["method"].unique(maintain_order=True).to_list()
    settings = seeds["setting"].unique(maintain_order=True).to_list()
    settings = [s for s in settings if s != OFFLINE] + [s for s in settings if s == OFFLINE]
    stats_rows = {(r["method"], r["setting"]): r for r in finals_table(seeds).iter_rows(named=True)}
    acc = {k: f"{r['text']}; stalls {r['stalled']}/{r['seeds']}" if k[1] != OFFLINE else r["text"]
           for k, r in stats_rows.items()}
    base_text = f"base policy {100 * base:.2f}" if base is not None else "base policy not evaluated"
    n_seeds = seeds["seed"].n_unique()
    parts = ["\n".join([f"Final accuracy ({metric}, %; {base_text}; {n_seeds} seed(s)) per method on the staleness "
                        "ladder (online, N updates per round) and on the fixed offline pool: mean ± sample std over "
                        "seeds, or each seed's value where some but not all seeds stalled; stalls k/n: seeds whose "
                        "cell stopped before its last update (online.on_stall / on_drift).", "",
                        *_pivot(acc, methods, settings)]) + "\n"]
    ref, pairs = paired(seeds)
    if pairs.height:
        cells = {}
        for r in pairs.iter_rows(named=True):
            p = f"; p {stats.p_text(r['p'])}" if r["p"] is not None else ""
            n = f"; n={r['n']}" if r["n"] != n_seeds else ""
            text = "identical on every seed" if r["identical"] else compare.difference_text(r, 100.0) + p
            cells[(r["method"], r["point"])] = text + n
        parts.append("\n".join([f"Paired difference to {title_of(ref)} (`{ref}`) in final accuracy (percentage "
                                "points): each method minus it at the same setting, seed by seed (a seed's cells share "
                                "its base model and the seeded prompt order, offline also its pool); mean difference "
                                "[95% t-interval, n - 1 dof] and the two-sided p of no difference; n where fewer "
                                "seeds than the experiment's are in both cells. A stalled seed counts with its final "
                                "at the stop (stalls above). Identical on every seed: the reference's final accuracy "
                                "on each seed to the last digit (typically a rule that never fired: its share in the "
                                "mismatch table); not a test, and left out of the count below.", "",
                                *_pivot(cells, [m for m in methods if m != ref], settings), "",
                                settled_text(pairs), "", resolution_text(pairs, settings)]) + "\n")
    if diag.height:
        ordered = diag.sort(pl.col("method").replace_strict({m: i for i, m in enumerate(methods)}, default=len(methods)),
                            pl.col("setting").replace_strict({s: i for i, s in enumerate(settings)},
                                                             default=len(settings)), maintain_order=True)
        parts.append(mismatch.markdown(ordered, ["method", "setting"], ONLINE_VALUES,
                                       mismatch.title(online=True) + WINDOW_NOTE, offline.seeds_text))
    return "\n".join(parts)


WINDOW_NOTE = (" Online cells over the last quarter of the shortest planned run, a seed that stopped before it left "
               "out and named; offline runs over the last quarter of theirs (max_abs_log_ratio and the round drift "
               "exist online only).")


def table(seeds: pl.DataFrame, diag: pl.DataFrame) -> pl.DataFrame:
    """corrections.csv: one row per method and setting: title, final (mean, std, low, high,
    seeds, stalled), the paired difference to the reference (diff, diff_low, diff_high,
    diff_n, identical, p, p_holm, reference) and the diagnostics with their `_std`."""
    if not seeds.height:
        return pl.DataFrame()
    finals = finals_table(seeds).rename({"text": "final_text", "update": "final_update"})
    ref, pairs = paired(seeds)
    out = finals.with_columns(title=pl.col("method").map_elements(title_of, return_dtype=pl.Utf8),
                              reference=pl.lit(ref))
    if pairs.height:
        pairs = pairs.select("method", pl.col("point").alias("setting"), pl.col("diff"), pl.col("low").alias("diff_low"),
                             pl.col("high").alias("diff_high"), pl.col("n").alias("diff_n"), "identical", "p",
                             "p_holm")
        out = out.join(pairs, on=["method", "setting"], how="left", maintain_order="left")
    if diag.height:
        out = out.join(diag.drop("seeds").rename({"stopped": "diag_stopped", "stopped_at": "diag_stopped_at",
                                                  "window": "diag_window"}),
                       on=["method", "setting"], how="left", maintain_order="left")
    return out


def figure(csv: pl.DataFrame, path: Path) -> None:
    """Final accuracy (%), the paired difference to the reference with its interval
    (percentage points) and |log rho| against the setting, one line per method over the
    ladder and an unconnected square for the offline pool."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    settings = csv["setting"].unique(maintain_order=True).to_list()
    settings = [s for s in settings if s != OFFLINE] + [s for s in settings if s == OFFLINE]
    x = {s: i for i, s in enumerate(settings)}
    panels = [("mean", None, 100.0, "final accuracy (%)"),
              ("diff", ("diff_low", "diff_high"), 100.0, "difference to the reference (points, 95% interval)"),
              ("abs_log_ratio", None, 1.0, "|log rho| against behavior (token mean)")]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    palette = plt.get_cmap("tab20")
    for i, method in enumerate(csv["method"].unique(maintain_order=True).to_list()):
        color = palette((2 * i) % 20 + (2 * i // 20) % 2)      # the dark shades first, then the light ones
        rows = sorted(csv.filter(pl.col("method") == method).iter_rows(named=True), key=lambda r: x[r["setting"]])
        for ax, (col, band, scale, _) in zip(axes, panels):
            pts = [(x[r["setting"]], scale * r[col], r["setting"] == OFFLINE,
                    (scale * r[band[0]], scale * r[band[1]]) if band and r.get(band[0]) is not None else None)
                   for r in rows if r.get(col) is not None and not math.isnan(r[col])]
            ladder = [p for p in pts if not p[2]]
            if ladder:
                ax.plot([p[0] for p in ladder], [p[1] for p in ladder], marker="o", color=color, label=title_of(method))
            for px, py, off, ci in pts:
                if off:
                    ax.plot([px], [py], marker="s", color=color, linestyle="none")
                if ci is not None:
                    ax.errorbar([px], [py], yerr=[[py - ci[0]], [ci[1] - py]], fmt="none", color=color, capsize=2)
    for ax, (_, _, _, name) in zip(axes, panels):
        ax.set(xticks=range(len(settings)), xticklabels=settings, xlabel="setting", title=name)
        if OFFLINE in x and len(settings) > 1:
            ax.axvline(x[OFFLINE] - 0.5, color="grey", linestyle=":", linewidth=0.8)
    axes[1].axhline(0.0, color="grey", linewidth=0.8)
    axes[0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    write_file_atomic(path, lambda tmp: fig.savefig(tmp, dpi=90))
    plt.close(fig)


def base_accuracy(online_evals: pl.DataFrame, offline_evals: pl.DataFrame) -> float | None:
    """Mean accuracy of the base policy (update 0) over the seeds that have it."""
    frames = [f.filter(pl.col("update") == 0).select("seed", "accuracy") for f in (online_evals, offline_evals)
              if f.height]
    base = pl.concat(frames).unique("seed") if frames else pl.DataFrame()
    return float(base["accuracy"].mean()) if base.height else None  # type: ignore[arg-type]


def write(online_evals: pl.DataFrame, online_curves: pl.DataFrame, offline_evals: pl.DataFrame,
          offline_curves: pl.DataFrame, folder: Path, metric: str) -> tuple[str, list[Path], pl.DataFrame]:
    """corrections.md, corrections.csv and corrections.png into `folder`: (the Markdown,
    the paths (no figure while no cell has a final), the CSV's frame)."""
    folder.mkdir(parents=True, exist_ok=True)
    seeds = per_seed(online_evals, offline_evals)
    diag = diagnostics(online_curves, offline_curves)
    text = markdown(seeds, diag, metric, base_accuracy(online_evals, offline_evals))
    csv = table(seeds, diag)
    paths = [folder / "corrections.md", folder / "corrections.csv"]
    write_text_atomic(paths[0], text)
    write_file_atomic(paths[1], csv.write_csv)
    if csv.height:
        figure(csv, folder / "corrections.png")
        paths.append(folder / "corrections.png")
    return text, paths, csv


# a results folder's files, in the order write() takes them
FRAMES = ("online_evals", "online_curves", "offline_evals", "offline_curves")
Frames = tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame, pl.DataFrame]


def save_results(frames: Frames, folder: Path) -> list[Path]:
    """The four frames as `folder`/<name>.parquet (each written whole, atomically)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{name}.parquet" for name in FRAMES]
    for path, frame in zip(paths, frames):
        write_file_atomic(path, partial(_parquet, frame))
    return paths


def _parquet(frame: pl.DataFrame, path: Path) -> None:
    frame.write_parquet(path, compression="zstd")


def seeds_of(frames: Frames) -> list[int]:
    """The seeds a table's frames hold (either part's evaluations), sorted."""
    return sorted(set(frames[0]["seed"]) | set(frames[2]["seed"]))


def _cells(frames: Frames) -> set[tuple[str, str]]:
    """The (method, setting) pairs a folder's evaluations cover, offline as OFFLINE."""
    on, off = frames[0], frames[2]
    online_cells = set(on.select("method", online_setting(on)).iter_rows()) if on.height else set()
    return online_cells | ({(m, OFFLINE) for m in off["method"].unique()} if off.height else set())


def load_results(folders: list[Path]) -> Frames:
    """One table's frames from results folders of distinct seeds, in the folders' order (a
    run's frames hold its seeds in the config's order: folders named in that order give its
    table to the byte; another order lists and sums the seeds in that order, the same figures
    within fp64 rounding); a missing file, a seed in two folders or folders of other methods or
    settings is a ConfigError naming the folder."""
    parts: list[list[pl.DataFrame]] = [[] for _ in FRAMES]
    owner: dict[int, Path] = {}
    first: set[tuple[str, str]] = set()
    for folder in folders:
        missing = [n for n in FRAMES if not (folder / f"{n}.parquet").is_file()]
        if missing:
            raise ConfigError(f"{folder}: no {missing[0]}.parquet: not a results folder (the corrections flow's "
                              "report folder, or `ggpo report --preset corrections --save DIR`)")
        frames: Frames = tuple(pl.read_parquet(folder / f"{n}.parquet") for n in FRAMES)  # type: ignore[assignment]
        for seed in seeds_of(frames):
            if seed in owner:
                raise ConfigError(f"{folder}: seed {seed} is also in {owner[seed]}: merge folders of distinct seeds")
            owner[seed] = folder
        cells = _cells(frames)
        first = first or cells
        if cells != first:
            other = sorted(cells ^ first)[0]
            raise ConfigError(f"{folder}: its methods and settings differ from {folders[0]}'s "
                              f"(first difference: {other[0]} at {other[1]}): one table merges one experiment")
        for part, frame in zip(parts, frames):
            part.append(frame)
    return tuple(pl.concat(p, how="diagonal_relaxed") for p in parts)  # type: ignore[return-value]


def from_cache(cfg: PipelineConfig, store) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame, pl.DataFrame,
                                                    list[tuple[str, float | None]]]:
    """(online evals, online curves, offline evals, offline curves, stage timings) of the
    corrections experiment `cfg`, read from the store by the keys both parts build."""
    on_evals, on_curves, on_timings = online.from_cache(cfg, store)
    off_evals, off_curves, off_timings = offline.from_cache(offline_config(cfg), store)
    # the base model is one stage of both parts: timed once
    return on_evals, on_curves, off_evals, off_curves, on_timings + [t for t in off_timings if t[0] != "base"]


def summary_metrics(csv: pl.DataFrame, metric: str) -> dict[str, Any]:
    """The parent run's metrics: per method and setting the final accuracy, the paired
    difference to the reference and the mismatch means (window, over seeds)."""
    from pipeline.core.grid import slug
    out: dict[str, Any] = {}
    key = f"final_{metric.replace('@', '_at_')}"
    for r in csv.iter_rows(named=True):
        name = slug(f"{r['method']} {r['setting']}")
        values = {key: r["mean"], "diff_to_reference": r.get("diff")} | {
            f"mismatch/{c}": r.get(c) for c in ONLINE_VALUES + mismatch.RULES}
        out |= {f"{k}/{name}": v for k, v in values.items()
                if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))}
    return out


def log(client, parent: str, online_evals: pl.DataFrame, online_curves: pl.DataFrame, offline_evals: pl.DataFrame,
        offline_curves: pl.DataFrame, cfg: PipelineConfig, folder: Path) -> dict:
    """The corrections report into `folder` (corrections.*, the results frames; the online part's
    full report in online/, the offline part's in offline/) and the MLflow parent run's report/, with
    summary_metrics on that run; {table, summary}."""
    from pipeline.services import tracking
    metric = f"mean@{cfg.eval.n_samples}"
    text, paths, csv = write(online_evals, online_curves, offline_evals, offline_curves, folder, metric)
    # the report folder is a results folder: its seeds can join another run's (load_results)
    paths += save_results((online_evals, online_curves, offline_evals, offline_curves), folder)
    logged = [(p, "report") for p in paths]
    if online_evals.height and online_curves.height:
        (folder / "online").mkdir(exist_ok=True)
        _, more = online.write(online.in_cell_order(online_evals), online_curves, folder / "online", metric)
        logged += [(p, "report/online") for p in more]
    if offline_evals.height and offline_curves.height:
        more_paths = offline.write(offline_evals, offline_curves, folder / "offline", metric)
        logged += [(p, "report/offline") for p in more_paths.values()]
    for path, where in logged:
        client.log_artifact(parent, str(path), artifact_path=where)
    summary = summary_metrics(csv, metric)
    tracking.log_params_metrics(client, parent, {}, tracking.summary_metrics(summary))
    return {"table": text, "summary": summary}
