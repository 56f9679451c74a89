"""Benchmark loaders on the real files the project ships in data/benchmarks, and grading them."""
import re

import polars as pl
import pytest

from pipeline.core.errors import BenchmarkError
from pipeline.core.store import sha256_file
from pipeline.tasks.benchmarks import KNOWN, load
from pipeline.tasks.grading import grade_many

from conftest import REPO

DATA = REPO / "data" / "benchmarks"


def test_shipped_files_match_their_readme():
    """Every shipped file has the row count and sha256 its README states, and nothing else ships."""
    readme = (DATA / "README.md").read_text()
    rows = re.findall(r"^\| `(\w+\.parquet)` \| ([\d,]+) \|.*\| `([0-9a-f]{64})` \|$", readme, re.M)
    assert sorted(f for f, _, _ in rows) == sorted(p.name for p in DATA.glob("*.parquet")) and len(rows) == 6
    for name, count, digest in rows:
        assert sha256_file(DATA / name) == digest, name
        assert pl.read_parquet(DATA / name, columns=["id"]).height == int(count.replace(",", "")), name


@pytest.mark.parametrize("name, rows", [("math500", 500), ("aime24", 30), ("aime25", 30),
                                        ("olympiadbench", 675), ("minerva_math", 272), ("math_train", 12000)])
def test_load_every_benchmark(name, rows):
    problems = load(name, DATA)
    assert len(problems) == rows and len({p.id for p in problems}) == rows
    assert all(p.benchmark == name and p.problem and p.answers for p in problems)


def test_minerva_carries_latex_alternatives():
    problems = {p.id: p for p in load("minerva_math", DATA)}
    with_alt = [p for p in problems.values() if len(p.answers) == 2]
    assert len(with_alt) == 61
    e_notation = [p for p in with_alt if "e" in p.answers[0] and "\\times 10^" in p.answers[1]]
    assert len(e_notation) == 58
    p = e_notation[0]
    latex_prediction = f"The answer is \\boxed{{{p.answers[1]}}}"
    both = grade_many([latex_prediction], [p.answers], 10.0, workers=1)[0]
    raw_only = grade_many([latex_prediction], [p.answers[:1]], 10.0, workers=1)[0]
    assert both[:2] == (1.0, "ok") and raw_only[:2] == (0.0, "ok")   # e-notation alone reads as Euler's e


def test_math500_reference_solutions_score_500_of_500():
    problems = load("math500", DATA)
    solutions = pl.read_parquet(DATA / "math500.parquet", columns=["id", "solution"])
    by_id = dict(zip(solutions["id"], solutions["solution"]))
    graded = grade_many([by_id[p.id] for p in problems], [p.answers for p in problems], 10.0, workers=2)
    assert sum(g[0] for g in graded) == 500, [p.id for p, g in zip(problems, graded) if g[0] < 1][:10]


def test_unknown_benchmark_lists_known():
    with pytest.raises(BenchmarkError, match="unknown benchmark 'gsm8k'; known: " + ", ".join(KNOWN)):
        load("gsm8k", DATA)


def test_missing_column_and_repeated_id(tmp_path):
    pl.DataFrame({"id": ["a"], "problem": ["1+1"]}).write_parquet(tmp_path / "aime24.parquet")
    with pytest.raises(BenchmarkError, match=r"aime24\.parquet: missing required column 'answer'"):
        load("aime24", tmp_path)
    pl.DataFrame({"id": ["a", "b", "a"], "problem": ["x", "y", "z"], "answer": ["1", "2", "3"]}).write_parquet(tmp_path / "aime25.parquet")
    with pytest.raises(BenchmarkError, match=r"aime25\.parquet: id 'a' appears 2 times"):
        load("aime25", tmp_path)


def test_evaluate_stage_on_benchmarks_writes_report_and_caches(tmp_path, base_manifest):
    from pipeline.core.config import load_config
    from pipeline.core.store import Store
    from stages import evaluate
    names = ["math500", "aime24", "aime25", "olympiadbench", "minerva_math"]
    cfg = load_config("smoke", {"eval.benchmarks": names, "eval.data_dir": str(DATA), "eval.limit": 2,
                                "eval.n_samples": 2, "eval.max_new_tokens": 4, "eval.target": "base"})
    store = Store(tmp_path)
    m = evaluate.run(cfg, {"model": base_manifest}, store=store)
    samples = pl.read_parquet(m.path("samples"))
    assert samples.height == 5 * 2 * 2 and samples["benchmark"].unique(maintain_order=True).to_list() == names
    assert set(samples["status"]) <= {"ok", "no_answer", "parse_error", "timeout"}
    report = pl.read_csv(m.path("report_csv"))
    assert report["benchmark"].to_list() == names + ["avg"] and report["problems"].to_list() == [2] * 5 + [10]
    assert {"mean_at_2", "pass_at_1", "math500/mean_at_2"} <= set(m.summary)
    assert "plain" in m.summary["prompt_template"] and "\\boxed{}" in m.path("report_md").read_text()
    again = evaluate.run(cfg, {"model": base_manifest}, store=store)
    assert again.cache_hit and again.key == m.key


def test_hub_path_through_datasets_library(monkeypatch):
    """The `datasets` code path, offline: the parquet builder on the local file stands in
    for a hub id (load_dataset takes both the same way)."""
    from pipeline.tasks import benchmarks
    monkeypatch.setitem(benchmarks.HUB, "math500", {"path": "parquet", "data_files": str(DATA / "math500.parquet"),
                                                    "split": "train", "id": "id"})
    via_hub = load("math500", "hub")
    assert via_hub == load("math500", DATA)
    with pytest.raises(BenchmarkError, match="'olympiadbench' has no default dataset id"):
        load("olympiadbench", "hub")
