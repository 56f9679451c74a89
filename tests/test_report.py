"""The comparison report: mean ± sample std (ddof 1) over seeds, method order, files."""
import math

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
    rows = []
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
