"""Math benchmarks in one schema: (id, benchmark, problem, answers).

Sources: a local folder of `<name>.parquet` or `<name>.jsonl` files (`eval.data_dir`,
default the shipped `data/benchmarks`, see its README), or `eval.data_dir = "hub"`: dataset ids through the
`datasets` library, for users with internet (HUB below; the ids with a default are
those we found used for these sets in public evaluation code; OlympiadBench and Minerva
have no agreed id, so they need files). Required columns: id, problem, answer. `answers` holds the
answer and every alternative form the file offers (Minerva's `answer_latex`, which
rewrites e-notation that math-verify would read as Euler's e); a grader accepts a match
on any of them. Sizes of the problem-weighted average (spec 10): OlympiadBench counts 674
there although the file has 675 rows. JSONL files are parsed line by line, so a malformed
line is reported with its line number. `content_key` gives the sha256 of each benchmark
file an evaluation reads, for the evaluate stage's cache key.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl

from pipeline.core.errors import BENCHMARKS, BenchmarkError
from pipeline.core.paths import project_file
from pipeline.core.store import sha256_cached
from pipeline.tasks.catalog import read_table

KNOWN = BENCHMARKS
EVAL_SET = KNOWN[:5]
PAPER_SIZES = {"math500": 500, "aime24": 30, "aime25": 30, "olympiadbench": 674, "minerva_math": 272}
ALTERNATIVE_ANSWER_COLUMNS = ("answer_latex",)


HUB = {   # name -> load_dataset arguments and the column that holds the problem id
    "math500": {"path": "HuggingFaceH4/MATH-500", "split": "test", "id": "unique_id"},
    "aime24": {"path": "HuggingFaceH4/aime_2024", "split": "train", "id": "id"},
    "aime25": {"path": "math-ai/aime25", "split": "test", "id": "id"},
}


@dataclass(frozen=True)
class BenchProblem:
    id: str
    benchmark: str
    problem: str
    answers: tuple[str, ...]


def _file(name: str, data_dir: str | Path) -> Path:
    if name not in KNOWN:
        raise BenchmarkError(f"unknown benchmark '{name}'; known: {', '.join(KNOWN)}")
    for suffix in (".parquet", ".jsonl"):
        path = project_file(Path(data_dir) / f"{name}{suffix}")
        if path.exists():
            return path
    raise BenchmarkError(f"benchmark '{name}': no {name}.parquet or {name}.jsonl in {data_dir}; "
                         f"--set eval.data_dir=FOLDER to a folder that has it")


def _from_hub(name: str) -> tuple[pl.DataFrame, str]:
    if name not in KNOWN:
        raise BenchmarkError(f"unknown benchmark '{name}'; known: {', '.join(KNOWN)}")
    if name not in HUB:
        raise BenchmarkError(f"benchmark '{name}' has no default dataset id; put {name}.parquet or "
                             f"{name}.jsonl in a folder and set eval.data_dir to it")
    from datasets import load_dataset
    spec = dict(HUB[name])
    id_column = spec.pop("id")
    ds = load_dataset(**spec)
    df = pl.from_arrow(ds.data.table)
    assert isinstance(df, pl.DataFrame)     # from a Table (a Series comes from an Array)
    if id_column in df.columns and id_column != "id":
        df = df.rename({id_column: "id"})
    return df.with_columns(pl.col("id").cast(pl.Utf8)) if "id" in df.columns else df, f"{spec['path']} ({spec['split']})"


def content_key(names: list[str], data_dir: str | Path | None) -> dict[str, str]:
    """{"benchmark/<name>": sha256 of its file} for a local folder; {} for the hub, whose
    dataset ids (in the config) name the data."""
    if not names or data_dir is None or str(data_dir) == "hub":
        return {}
    return {f"benchmark/{name}": sha256_cached(_file(name, data_dir)) for name in names}


def load(name: str, data_dir: str | Path) -> list[BenchProblem]:
    path: str | Path        # the hub's dataset id and split, or the file
    if str(data_dir) == "hub":
        df, path = _from_hub(name)
    else:
        path = _file(name, data_dir)
        df = read_table(path, BenchmarkError)
    for column in ("id", "problem", "answer"):
        if column not in df.columns:
            raise BenchmarkError(f"{path}: missing required column '{column}'")
    repeated = df.group_by("id").len().filter(pl.col("len") > 1)
    if repeated.height:
        raise BenchmarkError(f"{path}: id '{repeated['id'][0]}' appears {repeated['len'][0]} times")
    alternatives = [c for c in ALTERNATIVE_ANSWER_COLUMNS if c in df.columns]
    problems = []
    for i, row in enumerate(df.select(["id", "problem", "answer", *alternatives]).iter_rows(named=True)):
        if not row["problem"] or row["answer"] is None:
            raise BenchmarkError(f"{path}: row {i} (id {row['id']}) has no {'problem' if not row['problem'] else 'answer'}")
        answers = tuple(dict.fromkeys([row["answer"], *(row[c] for c in alternatives if row[c])]))
        problems.append(BenchProblem(str(row["id"]), name, row["problem"], answers))
    return problems
