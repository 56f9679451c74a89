"""The comparison report: mean ± sample std (ddof 1) over seeds, method order, files."""
import math
from typing import Any

import polars as pl
import pytest

from pipeline.reports import offline


def evals():
    rows = []
    for seed, (b, g, t) in zip((42, 1234, 2027), ((0.40, 0.50, 0.45), (0.42, 0.56, 0.47), (0.38, 0.53, 0.40))):
        rows += [{"method": "ggpo", "seed": seed, "update": 0, "accuracy": b},
                 {"method": "ggpo", "seed": seed, "update": 16, "accuracy": g},
                 {"method": "grpo", "seed": seed, "update": 0, "accuracy": b},
                 {"method": "grpo", "seed": seed, "update": 16, "accuracy": t}]
    return pl.DataFrame(rows)


def test_summary_mean_and_sample_std():
    s = offline.summarize(evals())
    assert s["method"].to_list() == ["ggpo", "ggpo", "grpo", "grpo"]       # first-seen order, not sorted
    row = s.filter((pl.col("method") == "ggpo") & (pl.col("update") == 16)).row(0, named=True)
    values = [0.50, 0.56, 0.53]
    mean = sum(values) / 3
    assert row["mean"] == pytest.approx(mean)
    assert row["std"] == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in values) / 2))
    assert row["seeds"] == 3


def test_markdown_and_files(tmp_path):
    curves = pl.DataFrame({"method": ["ggpo", "grpo"] * 2, "seed": [42] * 4, "update": [8, 8, 16, 16],
                           "abs_log_ratio": [0.01, 0.02, 0.03, 0.04], "ess": [0.9, 0.8, None, None],
                           "grad_norm": [0.3, 0.2, 0.3, 0.2]})
    paths = offline.write(evals(), curves, tmp_path, "mean@8")
    md = paths["markdown"].read_text()
    assert "| method | update 0 | update 16 |" in md and "| ggpo | 40.00 ± 2.00 | 53.00 ± 3.00 |" in md
    assert pl.read_csv(paths["csv"]).height == 4
    assert paths["figure"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_benchmark_tables_table1_and_passk(tmp_path):
    rows = []
    for method, base in (("grpo", 0.40), ("ggpo", 0.50)):
        for seed, shift in ((1, 0.0), (2, 0.02)):
            for bench, n_p, score in (("math500", 500, base + shift), ("aime24", 30, base / 4 + shift), ("avg", 530, None)):
                value = score if score is not None else (500 * (base + shift) + 30 * (base / 4 + shift)) / 530
                rows.append({"method": method, "seed": seed, "benchmark": bench, "problems": n_p, "mean_at_8": value,
                             "pass_at_1": value, "pass_at_8": min(1.0, 2 * value)})
    t1_md, t3_md, t1, t3 = offline.benchmark_tables(pl.DataFrame(rows), 8, [1, 8])
    assert "| method | math500 | aime24 | avg |" in t1_md
    ggpo_avg = t1.filter((pl.col("method") == "ggpo") & (pl.col("benchmark") == "avg")).row(0, named=True)
    per_seed = [(500 * (0.5 + s) + 30 * (0.125 + s)) / 530 for s in (0.0, 0.02)]
    assert ggpo_avg["mean"] == pytest.approx(sum(per_seed) / 2)
    assert ggpo_avg["std"] == pytest.approx(abs(per_seed[0] - per_seed[1]) / math.sqrt(2))
    assert "| method | K=1 | K=8 |" in t3_md and t3["method"].to_list() == ["grpo", "ggpo"]
    offline.pass_at_k_figure(t3, [1, 8], tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_offline_diagnostics_are_mean_and_sample_std_over_seeds(tmp_path):
    """Each run averaged over the last quarter of its updates (updates 7, 8 of 8), then mean
    and std (ddof 1) over seeds, checked against numpy in float64; one seed prints no ±."""
    import numpy as np
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    for method in ("grpo", "ggpo"):
        for seed in (42, 1234, 2027):
            for u in range(1, 9):
                rows.append({"method": method, "seed": seed, "update": u, "abs_log_ratio": float(rng.random()),
                             "ess": float(rng.random()) if u % 4 == 0 else None, "grad_norm": float(rng.random())})
    curves = pl.DataFrame(rows)
    diag = offline.diagnostics(curves)
    for method in ("grpo", "ggpo"):
        got = diag.filter(pl.col("method") == method).row(0, named=True)
        for col in ("abs_log_ratio", "ess", "grad_norm"):
            per_seed = [np.mean([r[col] for r in rows if r["method"] == method and r["seed"] == s and r["update"] > 6
                                 and r[col] is not None]) for s in (42, 1234, 2027)]
            assert got[col] == pytest.approx(np.mean(per_seed), rel=1e-12)
            assert got[f"{col}_std"] == pytest.approx(np.std(per_seed, ddof=1), rel=1e-12)
        assert got["seeds"] == 3 and got["mean_ell"] is None
    paths = offline.write(evals(), curves, tmp_path, "mean@8")
    md = paths["markdown"].read_text()
    g = diag.filter(pl.col("method") == "ggpo").row(0, named=True)
    assert f"| ggpo | 3 | {g['abs_log_ratio']:.4g} ± {g['abs_log_ratio_std']:.2g} |" in md
    assert pl.read_csv(paths["diagnostics"]).columns[:3] == ["method", *offline.DIAGNOSTICS[:2]]
    one = offline.markdown_diagnostics(offline.diagnostics(curves.filter(pl.col("seed") == 42)), list(offline.DIAGNOSTICS), "t")
    assert "±" not in one and "| grpo | 1 |" in one


# --------------------------------------------------------------------------- statistics over seeds

T2 = 4.302652729749462      # t_{0.975, 2 dof}, standard tables (tests/test_stats.py checks it)
FINALS = {   # (method, N) -> {seed: (final update, final accuracy)}; ggpo N=4 seed 1234 stalls
    ("grpo_tis", 1): {42: (8, 0.20), 1234: (8, 0.14), 2027: (8, 0.18)},
    ("grpo_tis", 4): {42: (8, 0.15), 1234: (8, 0.10), 2027: (8, 0.12)},
    ("ggpo", 1): {42: (8, 0.22), 1234: (8, 0.15), 2027: (8, 0.21)},
    ("ggpo", 4): {42: (8, 0.13), 1234: (4, 0.01), 2027: (8, 0.14)},
}


def online_cache(tmp_path, seeds):
    """An online experiment's records as the flow and `ggpo report` build them: real grid
    cells of tiny-regime (grpo_tis and ggpo, N in {1, 4}, 8 updates), each round's metrics
    a Parquet file of the ONLINE_METRICS schema read through online.cell_curves, each
    evaluation a manifest read through online.record."""
    import hashlib

    import pyarrow.parquet as pq

    from pipeline.core import grid
    from pipeline.core.config import load_config
    from pipeline.core.schemas import ONLINE_METRICS, typed_table
    from pipeline.core.store import FileEntry, Manifest
    from pipeline.reports import online
    cfg = load_config("tiny-regime", {"experiment.seeds": seeds, "experiment.methods": ["grpo_tis", "ggpo"],
                                      "experiment.grid": {"train.updates_per_step": [1, 4]}, "train.updates": 8})

    def manifest(stage, folder, files=None, summary=None):
        return Manifest(stage=stage, key=hashlib.sha256(str(folder).encode()).hexdigest(), version=1, folder=str(folder),
                        config={}, inputs={}, files=files or {}, summary=summary or {}, created_at="", seconds=0.0)
    records, curves = [], []
    for cell in grid.cells(cfg):
        n = cell.config.train.updates_per_step
        stop, final = FINALS[(cell.method, n)][cell.seed]
        rounds = []
        for r in range(stop // n):
            folder = tmp_path / "cache" / f"{cell.slug}-{cell.seed}-{r}"
            folder.mkdir(parents=True)
            updates = list(range(r * n + 1, (r + 1) * n + 1))
            rows: dict[str, list] = {f.name: [None] * n for f in ONLINE_METRICS}
            rows |= {"update": updates, "round": [r] * n, "k3_mismatch": [1e-3 * u + cell.seed * 1e-6 for u in updates],
                     "entropy": [0.1 * n] * n, "responses_generated": [64 * u for u in updates]}
            pq.write_table(typed_table(rows, ONLINE_METRICS), folder / "metrics.parquet")
            rounds.append(manifest("online_train", folder, {"metrics": FileEntry(path="metrics.parquet", bytes=0, sha256="")}))
        curves.append(online.cell_curves(cell, cfg, rounds))
        records += [online.record(cell, cfg, u, manifest("evaluate", tmp_path / "e", summary={"mean_at_8": a}))
                    for u, a in ((0, 0.07), (stop, final))]
    return pl.DataFrame(records), pl.concat(curves, how="diagonal_relaxed")


def test_online_report_prints_paired_intervals_n_and_stalls(tmp_path):
    """Three seeds: every method minus grpo_tis at each N, and N=4 minus N=1 within a method,
    paired by seed with the t-interval (2 dof, the quantile from a table) and n; stalls k/n
    per cell; the cell where one seed of three stalled prints each seed's value; the
    diagnostics over updates 7-8 for every cell, the stalled seed left out and named."""
    import math

    from pipeline.reports import online
    evals, curves = online_cache(tmp_path, [42, 1234, 2027])
    table, paths = online.write(evals, curves, tmp_path, "mean@8")

    def expected(a, b):
        d = [100 * (FINALS[a][s][1] - FINALS[b][s][1]) for s in (42, 1234, 2027)]
        mean = sum(d) / 3
        half = T2 * math.sqrt(sum((x - mean) ** 2 for x in d) / 2) / math.sqrt(3)
        return f"{mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}] | 3 |"
    assert f"| ggpo | updates_per_step=1 | {expected(('ggpo', 1), ('grpo_tis', 1))} 0.074 | 42 1234 2027 | 0/3 | 0/3 |" \
        in table                                  # t = 2 / (1 / sqrt 3): p = 1 - t / sqrt(2 + t^2)
    assert f"| ggpo | updates_per_step=4 | {expected(('ggpo', 4), ('grpo_tis', 4))}" in table
    assert "| 42 1234 2027 | 1/3 | 0/3 |" in table
    assert (f"| ggpo | updates_per_step=4 | updates_per_step=4 - updates_per_step=1 | "
            f"{expected(('ggpo', 4), ('ggpo', 1))}") in table
    assert "| ggpo updates_per_step=4 | 4 | 10 | 3 | 4 | 42: 13.00, 1234: 1.00 (stopped at 4), 2027: 14.00 | 1/3 |" in table
    assert "| grpo_tis updates_per_step=1 | 1 | 10 | 3 | 8 | 17.33 ± 3.06 | 0/3 |" in table
    assert "| grpo_tis | 10 | 17.33 ± 3.06; stalls 0/3 | 12.33 ± 2.52; stalls 0/3 |" in table
    assert "Every cell over the same updates 7-8" in table
    diag = pl.read_csv(tmp_path / "diagnostics.csv").filter(pl.col("cell") == "ggpo updates_per_step=4")
    row = diag.row(0, named=True)
    k3 = [sum(1e-3 * u + s * 1e-6 for u in (7, 8)) / 2 for s in (42, 2027)]       # seed 1234 stopped at 4
    assert (row["seeds"], row["stopped"], row["stopped_at"]) == (2, 1, "4")
    assert row["k3_mismatch"] == pytest.approx(sum(k3) / 2, rel=1e-12)
    assert " | 2 of 3; 1 stopped at 4 | " in table
    paired = pl.read_csv(tmp_path / "paired.csv")
    assert paired.height == 4 and set(paired["comparison"]) == {"reference", "axis"} and set(paired["n"]) == {3}


def test_one_seed_report_says_no_interval(tmp_path):
    """One seed: the paired tables print n=1 and no interval, no p (the tables alone,
    without write's figures)."""
    from pipeline.reports import online
    evals, _ = online_cache(tmp_path, [42])
    evals = online.in_cell_order(evals)
    table = online.markdown_final(evals, "mean@8") + online.paired_tables(evals, "mean@8")[0]
    assert "| ggpo | updates_per_step=1 | +2.00 (n=1, no interval) | 1 | - | 42 | 0/1 | 0/1 |" in table
    assert "| grpo_tis updates_per_step=4 | 4 | 10 | 1 | 8 | 15.00 | 0/1 |" in table


def test_offline_report_pairs_methods_by_seed(tmp_path):
    """Offline: the final accuracy's paired differences to the first method (no grpo_tis
    here) with n, from summarize's per-seed columns (what `ggpo report` prints)."""
    summary = offline.summarize(evals())
    text = offline.markdown(summary, "mean@8")
    d = [100 * (t - g) for g, t in ((0.50, 0.45), (0.56, 0.47), (0.53, 0.40))]
    mean = sum(d) / 3
    half = T2 * math.sqrt(sum((x - mean) ** 2 for x in d) / 2) / math.sqrt(3)
    assert f"| grpo | - | {mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}] | 3 |" in text
    assert "minus ggpo at the same grid point" in text and "| ggpo | 40.00 ± 2.00 | 53.00 ± 3.00 | 3 |" in text


def test_both_reports_carry_the_mismatch_table_for_every_method(tmp_path):
    """Item 2 of issue 35: the offline report's and the online report's diagnostics are
    followed by the mismatch table (|log rho|, K3, chi-square token / sequence, ESS and the
    share each method's rule clipped, truncated or masked) over the same window, and the
    CSVs hold every column; a method without a rule prints '-'. Under a second beyond imports."""
    from pipeline.reports import mismatch, online
    rows: list[dict[str, Any]] = []
    for method, rule in (("grpo", None), ("icepop", "mask_frac")):
        for seed in (42, 1234):
            for u in range(1, 9):
                row = {"method": method, "seed": seed, "update": u, "abs_log_ratio": 0.01 * u, "k3_mismatch": 1e-3,
                       "chi2_token": 0.002 * u + seed * 1e-6, "chi2_seq": 0.05, "grad_norm": 0.3}
                rows.append(row | ({rule: 0.1} if rule else {}))
    paths = offline.write(evals().with_columns(pl.col("method").replace({"ggpo": "icepop"})),
                          pl.DataFrame(rows).with_columns(ess=pl.lit(None, pl.Float64)), tmp_path, "mean@8")
    md = paths["markdown"].read_text()
    chi2 = [sum(0.002 * u + s * 1e-6 for u in (7, 8)) / 2 for s in (42, 1234)]
    assert "Mismatch against the behavior policy" in md
    assert "| icepop | 2 | 0.075 ± 0 | 0.001 ± 0 | " in md and "| mask_frac 0.1 ± 0 |" in md
    grpo = [line for line in md.splitlines() if line.startswith("| grpo | 2 | 0.075 ± 0 | 0.001 ± 0 | ")]
    assert len(grpo) == 2 and grpo[-1].endswith("| - |")     # both tables; the mismatch one names no share
    diag = pl.read_csv(paths["diagnostics"]).filter(pl.col("method") == "icepop").row(0, named=True)
    assert diag["chi2_token"] == pytest.approx(sum(chi2) / 2, rel=1e-12) and diag["m2_mask_frac"] is None
    evals_on, curves_on = online_cache(tmp_path / "online", [42])
    table, _ = online.write(evals_on, curves_on, tmp_path / "online", "mean@8")
    assert mismatch.title(online=True) in table and "| clipped / truncated / masked |" in table
    assert set(mismatch.COLUMNS) <= set(pl.read_csv(tmp_path / "online" / "diagnostics.csv").columns)
