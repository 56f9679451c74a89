"""The comparison report: mean ± sample std (ddof 1) over seeds, method order, files."""
import math

import polars as pl
import pytest

from pipeline import report


def evals():
    rows = []
    for seed, (b, g, t) in zip((42, 1234, 2027), ((0.40, 0.50, 0.45), (0.42, 0.56, 0.47), (0.38, 0.53, 0.40))):
        rows += [{"method": "ggpo", "seed": seed, "update": 0, "accuracy": b},
                 {"method": "ggpo", "seed": seed, "update": 16, "accuracy": g},
                 {"method": "grpo", "seed": seed, "update": 0, "accuracy": b},
                 {"method": "grpo", "seed": seed, "update": 16, "accuracy": t}]
    return pl.DataFrame(rows)


def test_summary_mean_and_sample_std():
    s = report.summarize(evals())
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
    paths = report.write(evals(), curves, tmp_path, "mean@8")
    md = paths["markdown"].read_text()
    assert "| method | update 0 | update 16 |" in md and "| ggpo | 40.00 ± 2.00 | 53.00 ± 3.00 |" in md
    assert pl.read_csv(paths["csv"]).height == 4
    assert paths["figure"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
