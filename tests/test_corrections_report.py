"""The corrections table (pipeline/reports/corrections.py) from real inputs: grid cells of the
`corrections` preset, each online round's metrics a Parquet file of the ONLINE_METRICS
schema read through online.cell_curves, each offline training's a TRAIN_METRICS file read
through offline.training_curves, evaluations through online.record and the offline flow's
record form. Checked against float64 sums written out here: the finals, the paired
difference to GRPO+TIS with its t-interval, stalls k/n, the mismatch diagnostics and the
share each rule clipped or masked; records from before the new columns report them as
blank / null. Each test costs well under a second of its own (polars and one matplotlib
figure), plus the torch import of tests/tolerance.py once."""
from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.core import grid
from pipeline.core.config import load_config
from pipeline.core.errors import ConfigError
from pipeline.core.schemas import ONLINE_METRICS, TRAIN_METRICS, typed_table
from pipeline.core.store import FileEntry, Manifest
from pipeline.reports import corrections, mismatch, offline, online

from tolerance import rounding_tol

SEEDS = (42, 1234, 2027)
T2 = 4.302652729749462      # t_{0.975, 2 dof} (tests/test_stats.py checks it against a table)
UPDATES = 8
# (method, setting) -> {seed: final accuracy}; cispo N=4 seed 1234 stalls at update 4
FINALS = {
    ("grpo_tis", "N=1"): {42: 0.20, 1234: 0.14, 2027: 0.18}, ("grpo_tis", "N=4"): {42: 0.15, 1234: 0.10, 2027: 0.12},
    ("cispo", "N=1"): {42: 0.22, 1234: 0.15, 2027: 0.21}, ("cispo", "N=4"): {42: 0.13, 1234: 0.01, 2027: 0.14},
    ("icepop", "N=1"): {42: 0.19, 1234: 0.16, 2027: 0.17}, ("icepop", "N=4"): {42: 0.16, 1234: 0.12, 2027: 0.10},
    ("grpo_tis", "offline"): {42: 0.11, 1234: 0.13, 2027: 0.12}, ("cispo", "offline"): {42: 0.10, 1234: 0.15, 2027: 0.09},
    ("icepop", "offline"): {42: 0.12, 1234: 0.12, 2027: 0.14},
}
STOP = {("cispo", 4, 1234): 4}
RULE = {"grpo_tis": "trunc_frac", "cispo": "clip_frac", "icepop": "mask_frac"}     # the share each one reports


def manifest(stage: str, folder: Path, files: dict | None = None, summary: dict | None = None) -> Manifest:
    return Manifest(stage=stage, key=hashlib.sha256(str(folder).encode()).hexdigest(), version=1, folder=str(folder),
                    config={}, inputs={}, files=files or {}, summary=summary or {}, created_at="", seconds=0.0)


def metric(method: str, seed: int, u: int, col: str) -> float:
    """A distinct value per method, seed, update and column (what the rows hold)."""
    return len(method) * 1e-2 + seed * 1e-6 + u * 1e-3 + mismatch.COLUMNS.index(col) * 1e-4


def metrics_file(folder: Path, method: str, seed: int, updates: list[int], schema, extra: dict, old: bool) -> Manifest:
    """One metrics Parquet file (a round's, or an offline run's) with the new columns, or
    as a record from before them (`old`: no chi-square, no rule shares, no max |log rho|)."""
    folder.mkdir(parents=True)
    rows: dict[str, list] = {f.name: [None] * len(updates) for f in schema}
    rows |= {"update": updates, **extra} | {c: [metric(method, seed, u, c) for u in updates] for c in
                                             ("abs_log_ratio", "k3_mismatch", "chi2_token", "chi2_seq",
                                              "max_abs_log_ratio", RULE.get(method, "")) if c in rows}
    rows["ess"] = [metric(method, seed, u, "ess") if u % 4 == 0 else None for u in updates]
    table = typed_table(rows, schema)
    if old:
        table = table.drop_columns(["chi2_token", "chi2_seq", "max_abs_log_ratio", *mismatch.RULES[2:]]
                                   if "max_abs_log_ratio" in table.column_names
                                   else ["chi2_token", "chi2_seq", *mismatch.RULES[2:]])
    pq.write_table(table, folder / "metrics.parquet")
    return manifest("train", folder, {"metrics": FileEntry(path="metrics.parquet", bytes=0, sha256="")})


def corrections_cache(tmp: Path, old: bool = False, methods=("grpo_tis", "cispo", "icepop")):
    """The two parts' evaluations and curves as the corrections flow collects them: real
    cells of the corrections preset (N in {1, 4}, 8 updates, three seeds)."""
    cfg = load_config("corrections", {"experiment.methods": list(methods), "train.updates": UPDATES,
                                      "experiment.grid": {"train.updates_per_step": [1, 4]},
                                      "experiment.seeds": list(SEEDS)})
    records, curves = [], []
    for cell in grid.cells(cfg):
        n = cell.config.train.updates_per_step
        stop = STOP.get((cell.method, n, cell.seed), UPDATES)
        rounds = [metrics_file(tmp / f"{cell.slug}-{cell.seed}-{r}", cell.method, cell.seed,
                               list(range(r * n + 1, (r + 1) * n + 1)), ONLINE_METRICS,
                               {"round": [r] * n, "round_drift": [None] * (n - 1) + [0.01 * (r + 1)]}, old)
                  for r in range(stop // n)]
        curves.append(online.cell_curves(cell, cfg, rounds))
        final = FINALS.get((cell.method, f"N={n}"), {}).get(cell.seed, 0.1)
        records += [online.record(cell, cfg, u, manifest("evaluate", tmp / "e", summary={"mean_at_8": a}))
                    for u, a in ((0, 0.07), (stop, final))]
    off_records, off_curves = [], []
    for cell in grid.cells(corrections.offline_config(cfg)):
        trained = metrics_file(tmp / f"off-{cell.slug}-{cell.seed}", cell.method, cell.seed,
                               list(range(1, UPDATES + 1)), TRAIN_METRICS, {}, old)
        off_curves.append(offline.training_curves(trained, cell.method, cell.seed))
        off_records += [{"method": cell.method, "seed": cell.seed, "update": u, "accuracy": a}
                        for u, a in ((0, 0.07), (UPDATES, FINALS.get((cell.method, "offline"), {}).get(cell.seed, 0.1)))]
    return (pl.DataFrame(records), pl.concat(curves, how="diagonal_relaxed"), pl.DataFrame(off_records),
            pl.concat(off_curves))


def interval(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, float]:
    """fp64 paired difference (percentage points) of a minus b by seed: mean, low, high."""
    d = [100 * (a[s] - b[s]) for s in SEEDS]
    mean = math.fsum(d) / 3
    half = T2 * math.sqrt(math.fsum((x - mean) ** 2 for x in d) / 2) / math.sqrt(3)
    return mean, mean - half, mean + half


def close(got: float, want: float) -> bool:
    return abs(got - want) <= rounding_tol(torch.float64, max(abs(want), 1.0), 8)


def test_the_table_holds_finals_paired_intervals_stalls_and_diagnostics(tmp_path):
    on_evals, on_curves, off_evals, off_curves = corrections_cache(tmp_path / "cache")
    text, paths, csv = corrections.write(on_evals, on_curves, off_evals, off_curves, tmp_path / "report", "mean@8")
    assert [p.name for p in paths] == ["corrections.md", "corrections.csv", "corrections.png"]
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "report" / "corrections.md").read_text() == text
    # final accuracy: one row per method, one column per setting (the ladder, then offline), stalls k/n online
    assert "| method | N=1 | N=4 | offline |" in text
    assert "| GRPO+TIS (`grpo_tis`) | 17.33 ± 3.06; stalls 0/3 | 12.33 ± 2.52; stalls 0/3 | 12.00 ± 1.00 |" in text
    assert "| CISPO (`cispo`) | 19.33 ± 3.79; stalls 0/3 | 42: 13.00, 1234: 1.00 (stopped at 4), 2027: 14.00; stalls 1/3 |" \
        in text
    # each method minus GRPO+TIS at each setting, paired by seed, with its t-interval (2 dof)
    for method in ("cispo", "icepop"):
        for setting in ("N=1", "N=4", "offline"):
            mean, low, high = interval(FINALS[(method, setting)], FINALS[("grpo_tis", setting)])
            row = csv.filter((pl.col("method") == method) & (pl.col("setting") == setting)).row(0, named=True)
            assert close(100 * row["diff"], mean) and close(100 * row["diff_low"], low) and close(100 * row["diff_high"], high)
            assert row["diff_n"] == 3 and row["reference"] == "grpo_tis"
    mean, low, high = interval(FINALS[("cispo", "N=4")], FINALS[("grpo_tis", "N=4")])
    assert f"{mean:+.2f} [{low:+.2f}, {high:+.2f}]" in text.split("Paired difference")[1]
    assert csv.filter(pl.col("method") == "grpo_tis")["diff"].null_count() == 3        # the reference itself
    stall = csv.filter((pl.col("method") == "cispo") & (pl.col("setting") == "N=4")).row(0, named=True)
    assert (stall["stalled"], stall["seeds"]) == (1, 3)
    # diagnostics over updates 7-8 (the window), mean over the seeds that reached it
    row = csv.filter((pl.col("method") == "icepop") & (pl.col("setting") == "N=1")).row(0, named=True)
    for col in ("abs_log_ratio", "k3_mismatch", "chi2_token", "chi2_seq", "mask_frac"):
        want = math.fsum(metric("icepop", s, u, col) for s in SEEDS for u in (7, 8)) / 6
        assert close(row[col], want), col
    assert close(row["max_abs_log_ratio"], math.fsum(metric("icepop", s, u, "max_abs_log_ratio")
                                                     for s in SEEDS for u in (7, 8)) / 6)
    assert close(row["ess"], math.fsum(metric("icepop", s, 8, "ess") for s in SEEDS) / 3)
    assert row["clip_frac"] is None and row["trunc_frac"] is None          # icepop's rule masks
    off = csv.filter((pl.col("method") == "cispo") & (pl.col("setting") == "offline")).row(0, named=True)
    assert close(off["clip_frac"], math.fsum(metric("cispo", s, u, "clip_frac") for s in SEEDS for u in (7, 8)) / 6)
    assert off["max_abs_log_ratio"] is None and off["round_drift"] is None          # online only
    stalled = csv.filter((pl.col("method") == "cispo") & (pl.col("setting") == "N=4")).row(0, named=True)
    assert (stalled["diag_stopped"], stalled["diag_stopped_at"]) == (1, "4")
    assert "| cispo | N=4 | 2 of 3; 1 stopped at 4 | " in text and "| icepop | N=1 | 3 | " in text
    assert "mask_frac " in text and "clip_frac " in text
    # the whole table's p-values, Holm-adjusted: against a float64 step-down over the same rows
    tested = csv.filter(pl.col("p").is_not_null()).sort("p")
    m, running, want = tested.height, 0.0, []
    for j, p in enumerate(tested["p"].to_list()):
        running = max(running, min(1.0, (m - j) * p))
        want.append(running)
    assert all(close(got, w) for got, w in zip(tested["p_holm"].to_list(), want)) and m == 6
    settled = [f"{r['method']} {r['setting']}" for r in tested.filter(pl.col("p_holm") < 0.05).iter_rows(named=True)]
    line = next(t for t in text.splitlines() if t.startswith(f"Of the {m} differences"))
    assert line.endswith("none.") == (not settled)


def test_records_from_before_the_new_columns_report_them_as_null(tmp_path):
    """Rounds and offline runs written before chi-square, the rule shares and max |log rho|
    existed: the tables print them blank, the CSVs hold nulls, drift.csv too; a cell whose
    rounds mix old and new records reads both."""
    on_evals, on_curves, off_evals, off_curves = corrections_cache(tmp_path / "cache", old=True)
    assert "chi2_token" not in pl.read_parquet(tmp_path / "cache" / "off-cispo-42" / "metrics.parquet").columns
    text, _, csv = corrections.write(on_evals, on_curves, off_evals, off_curves, tmp_path / "report", "mean@8")
    assert csv["chi2_token"].null_count() == csv.height and csv["mask_frac"].null_count() == csv.height
    assert csv["abs_log_ratio"].null_count() == 0 and csv["clip_frac"].null_count() < csv.height   # old columns stay
    drift = online.drift_rounds(on_curves)          # drift.csv's frame
    assert drift["chi2_seq"].null_count() == drift.height and drift["round_drift"].null_count() == 0
    assert drift["abs_log_ratio"].null_count() == 0
    diag = offline.diagnostics(off_curves)          # the offline report's diagnostics.csv
    assert diag["chi2_token"].null_count() == 3 and "chi2_token" in offline.diagnostics_markdown(diag)
    # one cell with an old round and a new one
    new = metrics_file(tmp_path / "new", "cispo", 42, [3, 4], ONLINE_METRICS, {"round": [1, 1]}, old=False)
    old = metrics_file(tmp_path / "old", "cispo", 42, [1, 2], ONLINE_METRICS, {"round": [0, 0]}, old=True)
    cfg = load_config("corrections", {"experiment.methods": ["cispo"], "train.updates": 4,
                                      "experiment.grid": {"train.updates_per_step": [2]}})
    both = online.cell_curves(grid.cells(cfg)[0], cfg, [old, new])
    assert both["chi2_token"].to_list()[:2] == [None, None] and both["chi2_token"].null_count() == 2


def test_the_report_says_so_before_any_final(tmp_path):
    empty = pl.DataFrame()
    text, paths, csv = corrections.write(empty, empty, empty, empty, tmp_path, "mean@8")
    assert "no cell has a final evaluation yet" in text and [p.name for p in paths] == ["corrections.md", "corrections.csv"]


def test_the_preset_runs_every_registered_method_on_the_ladder_three_seeds_and_the_pool():
    """corrections: 'all' is every method of the table (15 built in, 4 x 3 seeds each
    online: 180 cells; 45 offline trainings on the seeds' pools), and its sections are
    tiny-regime's but for three settings outside a round's key (evaluation at the end only,
    the round drift every 4th round, pools shared between bit-identical rounds), so the four
    original methods' rounds have the testbed's keys."""
    from pipeline.core import methods
    from pipeline.dag import graph
    cfg = load_config("corrections")
    assert cfg.experiment.methods == list(methods.names()) and cfg.experiment.flow == "corrections"
    seeds = [42, 1234, 2027, 3407, 8191]      # the preset's five (issue #45)
    assert cfg.experiment.seeds == seeds and cfg.experiment.grid == {"train.updates_per_step": [1, 4, 16, 64]}
    assert len(grid.cells(cfg)) == len(methods.names()) * 4 * len(seeds)
    assert len(grid.cells(corrections.offline_config(cfg))) == len(methods.names()) * len(seeds)
    schedules = {"experiment": True, "train": {"eval_every"}, "online": {"drift_every", "share_pools"}}
    testbed = load_config("tiny-regime")
    assert cfg.model_dump(exclude=schedules) == testbed.model_dump(exclude=schedules)
    assert (cfg.train.eval_every, cfg.online.drift_every, cfg.online.share_pools) == (None, 4, True)
    assert (testbed.train.eval_every, testbed.online.drift_every, testbed.online.share_pools) == (64, 1, False)
    ladder = grid.cells(load_config("tiny-regime", {"experiment.grid": {"train.updates_per_step": [1, 4, 16, 64]},
                                                    "experiment.seeds": seeds}))
    ours = {(c.seed, c.label): c.config for c in grid.cells(cfg)}
    for cell in ladder:        # the testbed's cells are ours: the same stage keys (one round's, for time)
        assert graph.online_keys(ours[(cell.seed, cell.label)], 0) == graph.online_keys(cell.config, 0)


def test_the_parent_runs_metrics_name_method_and_setting(tmp_path):
    on_evals, on_curves, off_evals, off_curves = corrections_cache(tmp_path / "cache", methods=("grpo_tis", "cispo"))
    _, _, csv = corrections.write(on_evals, on_curves, off_evals, off_curves, tmp_path / "report", "mean@8")
    summary: dict[str, Any] = corrections.summary_metrics(csv, "mean@8")
    assert close(summary["final_mean_at_8/cispo-offline"], math.fsum(FINALS[("cispo", "offline")].values()) / 3)
    assert "diff_to_reference/cispo-N:4" in summary and "diff_to_reference/grpo_tis-N:4" not in summary
    assert "mismatch/chi2_token/cispo-N:1" in summary and "mismatch/clip_frac/cispo-N:1" in summary


def test_every_new_column_is_logged_to_mlflow_per_update(tmp_path):
    """A training run's MLflow points (tracking.training_curves: every metrics column but
    `update`, one point per update that has a value): chi-square, the rule's share and, in an
    online round, max |log rho| and the round drift are among them; an old record's absent
    columns are simply not logged."""
    from pipeline.services import tracking
    new = metrics_file(tmp_path / "new", "icepop", 42, [1, 2], ONLINE_METRICS,
                       {"round": [0, 0], "round_drift": [None, 0.5]}, old=False)
    points = {(name, step): value for name, value, step in tracking.training_curves(new)}
    for col in ("chi2_token", "chi2_seq", "mask_frac", "abs_log_ratio", "max_abs_log_ratio", "k3_mismatch"):
        assert points[(f"train/{col}", 2)] == metric("icepop", 42, 2, col)
    assert points[("train/round_drift", 2)] == 0.5 and ("train/round_drift", 1) not in points
    assert ("train/ess", 2) not in points and ("train/ess", 4) not in points       # ess only at block ends
    old = metrics_file(tmp_path / "old", "icepop", 42, [1, 2], TRAIN_METRICS, {}, old=True)
    names = {name for name, _, _ in tracking.training_curves(old)}
    assert "train/abs_log_ratio" in names and "train/chi2_token" not in names


def test_ggpo_run_and_report_take_the_corrections_flow(tmp_path, capsys, monkeypatch):
    """`ggpo run corrections` parses (default preset corrections); `ggpo report --preset
    corrections` on a cache without its cells says how to build them, not a traceback."""
    from pipeline import cli
    args = cli.parser().parse_args(["run", "corrections", "--set", "experiment.seeds=[42]"])
    assert args.flow == "corrections" and cli.DEFAULT_PRESET[args.flow] == "corrections"
    monkeypatch.setenv("GGPO_CACHE", str(tmp_path / "empty"))
    sets = ['experiment.methods=["grpo_tis","cispo"]', "experiment.seeds=[42]", "train.updates=8",
            'experiment.grid={"train.updates_per_step": [4]}']
    assert cli.main(["report", "--preset", "corrections", *(a for s in sets for a in ("--set", s))]) == 0
    out = capsys.readouterr().out
    assert "nothing evaluated yet for this experiment: run it with `ggpo run corrections --preset corrections`" in out
    assert "ggpo-online" in out


def test_a_method_identical_to_the_reference_on_every_seed_is_not_a_test(tmp_path, monkeypatch):
    """IcePop at N = 1 given GRPO+TIS's finals seed for seed (its rule never fired): the
    cell says so, its p is null and Holm's family leaves it out; a difference that is 0 on
    average but not seed by seed stays a test."""
    monkeypatch.setitem(FINALS, ("icepop", "N=1"), dict(FINALS[("grpo_tis", "N=1")]))
    monkeypatch.setitem(FINALS, ("cispo", "offline"), {42: 0.12, 1234: 0.11, 2027: 0.13})    # mean 0, sd > 0
    on_evals, on_curves, off_evals, off_curves = corrections_cache(tmp_path / "cache")
    text, _, csv = corrections.write(on_evals, on_curves, off_evals, off_curves, tmp_path / "report", "mean@8")
    row = csv.filter((pl.col("method") == "icepop") & (pl.col("setting") == "N=1")).row(0, named=True)
    assert row["identical"] is True and row["p"] is None and row["p_holm"] is None and row["diff"] == 0.0
    paired_table = text.split("Paired difference")[1]
    assert "| IcePop (`icepop`) | identical on every seed | " in paired_table
    zero = csv.filter((pl.col("method") == "cispo") & (pl.col("setting") == "offline")).row(0, named=True)
    assert zero["identical"] is False and zero["p"] is not None and abs(zero["diff"]) < 1e-12
    assert csv.filter(pl.col("identical"))["method"].to_list() == ["icepop"]
    assert any(t.startswith("Of the 5 differences") for t in text.splitlines())      # 6 tested less the identical one


def test_resolution_line_says_nothing_resolves_with_one_seed():
    """One seed: no difference has an interval, so the line says so instead of ending in an
    empty list; two seeds: each setting's median half-width and 80 %-power difference."""
    one = pl.DataFrame({"point": ["N=1"], "low": [None], "high": [None], "n": [1], "p": [None]},
                       schema={"point": pl.String, "low": pl.Float64, "high": pl.Float64, "n": pl.Int64,
                               "p": pl.Float64})
    assert corrections.resolution_text(one, ["N=1"]) == (
        "What the table resolves: nothing yet (no difference has a 95 % interval: a paired t-test needs two "
        "seeds or more).")
    two = pl.DataFrame({"point": ["N=1", "N=1"], "low": [-0.1, -0.3], "high": [0.1, 0.1], "n": [3, 3],
                        "p": [0.9, 0.4]})
    text = corrections.resolution_text(two, ["N=1", "offline"])
    assert text.endswith("N=1: ±15.0, " + f"{100 * corrections.resolution(two, 'low', 'high', 'n', 'point')['N=1'][1]:.1f}.")
    assert "offline" not in text


def by_seed(frames, seeds) -> tuple[pl.DataFrame, ...]:
    return tuple(f.filter(pl.col("seed").is_in(list(seeds))) for f in frames)


def test_results_folders_of_distinct_seeds_merge_into_the_one_runs_table(tmp_path):
    """A run's seeds saved apart (seed 42; 1234 and 2027) and merged: the table, its CSV and
    its figure's inputs are the single run's, byte for byte."""
    frames = corrections_cache(tmp_path / "cache")
    whole, _, _ = corrections.write(*frames, tmp_path / "whole", "mean@8")
    a = corrections.save_results(by_seed(frames, [42]), tmp_path / "a")
    corrections.save_results(by_seed(frames, [1234, 2027]), tmp_path / "b")
    assert [p.name for p in a] == [f"{n}.parquet" for n in corrections.FRAMES]
    merged = corrections.load_results([tmp_path / "a", tmp_path / "b"])
    text, _, _ = corrections.write(*merged, tmp_path / "merged", "mean@8")
    assert text == whole and "stalls 1/3" in text
    assert (tmp_path / "merged" / "corrections.csv").read_bytes() == (tmp_path / "whole" / "corrections.csv").read_bytes()
    # the other way round: the seeds in that order (a stalled cell lists its seeds so), the
    # CSV's values within fp64 rounding of the single run's (sums in another order)
    again, _, other = corrections.write(*corrections.load_results([tmp_path / "b", tmp_path / "a"]),
                                        tmp_path / "ba", "mean@8")
    assert "1234: 1.00 (stopped at 4), 2027: 14.00, 42: 13.00" in again
    one = pl.read_csv(tmp_path / "whole" / "corrections.csv")
    assert other.columns == one.columns and other.height == one.height
    for col in ("mean", "std", "diff", "diff_low", "diff_high", "p", "abs_log_ratio", "ess"):
        for got, want in zip(other[col].to_list(), one[col].to_list()):
            assert (got is None and want is None) or close(got, want), col


def test_merging_refuses_a_seed_twice_a_missing_frame_and_another_experiment(tmp_path):
    frames = corrections_cache(tmp_path / "cache")
    corrections.save_results(by_seed(frames, [42, 1234]), tmp_path / "a")
    corrections.save_results(by_seed(frames, [1234, 2027]), tmp_path / "b")
    with pytest.raises(ConfigError, match=r"/b: seed 1234 is also in .*/a: merge folders of distinct seeds"):
        corrections.load_results([tmp_path / "a", tmp_path / "b"])
    corrections.save_results(by_seed(frames, [2027]), tmp_path / "c")
    (tmp_path / "c" / "offline_curves.parquet").unlink()
    with pytest.raises(ConfigError, match=r"/c: no offline_curves.parquet: not a results folder"):
        corrections.load_results([tmp_path / "a", tmp_path / "c"])
    narrow = by_seed(frames, [2027])
    narrow = (narrow[0].filter(pl.col("method") != "icepop"), *narrow[1:])
    corrections.save_results(narrow, tmp_path / "d")   # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"/d: its methods and settings differ from .*/a's \(first difference: "
                                          r"icepop at N=1\)"):
        corrections.load_results([tmp_path / "a", tmp_path / "d"])


def test_ggpo_report_saves_and_merges_results_folders(tmp_path, capsys, monkeypatch):
    """`ggpo report --preset corrections --merge A B --save OUT`, as typed: the merged table,
    OUT a results folder that merges again; --save on another flow's preset is refused."""
    from pipeline import cli
    frames = corrections_cache(tmp_path / "cache")
    corrections.save_results(by_seed(frames, [42]), tmp_path / "a")
    corrections.save_results(by_seed(frames, [1234, 2027]), tmp_path / "b")
    whole, _, _ = corrections.write(*frames, tmp_path / "whole", "mean@8")
    out_dir = tmp_path / "out"
    assert cli.main(["report", "--preset", "corrections", "--merge", str(tmp_path / "a"), str(tmp_path / "b"),
                     "--save", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "seeds [42, 1234, 2027]" in out and whole in out and f"report files: {out_dir}" in out
    assert (out_dir / "corrections.csv").read_bytes() == (tmp_path / "whole" / "corrections.csv").read_bytes()
    assert all((out_dir / f"{n}.parquet").is_file() for n in corrections.FRAMES)
    assert corrections.write(*corrections.load_results([out_dir]), tmp_path / "again", "mean@8")[0] == whole
    assert cli.main(["report", "--preset", "smoke", "--save", str(tmp_path / "x")]) == 2
    assert "--save and --merge are for the corrections flow" in capsys.readouterr().err


def test_the_flows_report_folder_is_a_results_folder_logged_to_mlflow(tmp_path):
    """corrections.log (the flow's report) writes the four frames beside the table and logs
    them to the parent run's report/ (a real MLflow store); the folder merges as it is."""
    from pipeline.services import tracking
    frames = corrections_cache(tmp_path / "cache")
    client = tracking.Resilient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.create_run(client.create_experiment("c", artifact_location=str(tmp_path / "art"))).info.run_id
    cfg = load_config("corrections", {"experiment.seeds": list(SEEDS)})
    result = corrections.log(client, parent, *frames, cfg, tmp_path / "report")
    logged = {a.path for a in client.list_artifacts(parent, "report")}
    assert {f"report/{n}.parquet" for n in corrections.FRAMES} | {"report/corrections.csv"} <= logged
    assert corrections.write(*corrections.load_results([tmp_path / "report"]), tmp_path / "m", "mean@8")[0] \
        == result["table"]
