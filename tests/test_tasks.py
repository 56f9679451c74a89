"""Built-in tasks and prompt files: determinism, disjoint splits, correct answers, bad rows."""
import json

import polars as pl
import pytest

from pipeline.core.config import TaskConfig, load_config
from pipeline.core.errors import DatasetError
from pipeline.core.store import MANIFEST
from pipeline.tasks import catalog
from pipeline.tasks.catalog import load_file, splits


@pytest.mark.parametrize("name", ["digit_sort", "arithmetic", "countdown", "countdown_work:4"])
@pytest.mark.parametrize("difficulty", [1, 2])
def test_splits_deterministic_disjoint_and_correct(name, difficulty):
    cfg = TaskConfig(name=name, difficulty=difficulty, n_train=100, n_eval=50)
    a, b = splits(cfg), splits(cfg)
    assert a == b and len(a["train"]) == 100 and len(a["eval"]) == 50
    assert not {p.problem for p in a["train"]} & {p.problem for p in a["eval"]}
    for p in a["train"] + a["eval"]:
        if name == "digit_sort":
            assert p.answer == "".join(sorted(p.problem)) and "0" not in p.problem
        elif name.startswith("countdown"):      # the reference names the problem's numbers and target
            assert p.answer == "countdown:" + p.problem.replace(">", "=")
        else:
            assert int(p.answer) == eval(p.problem)
    assert splits(TaskConfig(name=name, difficulty=difficulty, n_train=100, n_eval=50, split_seed=1)) != a


def test_file_task_loads_and_splits(tmp_path):
    path = tmp_path / "probs.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"p{i}", "problem": f"{i}+1", "answer": str(i + 1)}) for i in range(30)))
    s = splits(TaskConfig(name=str(path), n_train=20, n_eval=10))
    assert len(s["train"]) == 20 and len(s["eval"]) == 10
    assert {p.id for p in s["train"]} | {p.id for p in s["eval"]} == {f"p{i}" for i in range(30)}


def test_unusable_rows_are_skipped_and_counted_up_to_one_percent(tmp_path):
    """At most 1 % of rows without a usable problem or answer: skipped, counted, named; more:
    an error naming the file and the first such row."""
    answers = [str(i) for i in range(200)]
    answers[57], answers[130] = None, "  "
    path = tmp_path / "few.parquet"
    pl.DataFrame({"id": [f"q{i}" for i in range(200)], "problem": [f"{i}+0" for i in range(200)],
                  "answer": answers}).write_parquet(path)
    assert [p.id for p in load_file(path)] == [f"q{i}" for i in range(200) if i not in (57, 130)]
    report = catalog.file_report(TaskConfig(name=str(path)))
    assert report == {"task_rows": 200, "task_rows_skipped": 2, "task_rows_skipped_ids": "q57, q130"}
    bad = tmp_path / "bad.parquet"
    pl.DataFrame({"problem": ["1+1", "2+2", "3+3"], "answer": ["2", None, "6"]}).write_parquet(bad)
    with pytest.raises(DatasetError, match=r"bad\.parquet: 1 of 3 rows have no usable problem or answer "
                                           r"\(more than 1%; the first: row 1 \(id bad-1\) has no answer\)"):
        load_file(bad)


def test_the_shipped_math_train_file_skips_its_two_empty_answers():
    report = catalog.file_report(TaskConfig(name="data/benchmarks/math_train.parquet"))
    assert (report["task_rows"], report["task_rows_skipped"]) == (12000, 2)
    assert report["task_rows_skipped_ids"] == "train/number_theory/7115.json, train/number_theory/7117.json"


def test_missing_column_names_file_and_column(tmp_path):
    path = tmp_path / "nocol.parquet"
    pl.DataFrame({"question": ["1+1"], "answer": ["2"]}).write_parquet(path)
    with pytest.raises(DatasetError, match=r"nocol\.parquet: missing required column 'problem'"):
        load_file(path)


def test_bad_dataset_writes_nothing(tmp_path, base_manifest):
    """The rollout stage fails before writing: no manifest, no Parquet."""
    from pipeline.core.store import Store
    from stages import rollout
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n" + json.dumps({"problem": "", "answer": "3"}))
    cfg = load_config("smoke", {"task.name": str(path), "task.n_eval": 1, "task.n_train": 1})
    store = Store(tmp_path / "cache")
    with pytest.raises(DatasetError, match=r"bad\.jsonl: 1 of 2 rows .* row 1 .*has no problem"):
        rollout.run(cfg, {"base": base_manifest}, store=store)
    written = list((tmp_path / "cache").rglob("*"))
    assert not [p for p in written if p.name == MANIFEST or p.suffix == ".parquet"]


@pytest.mark.parametrize("preset, width", [("tiny-regime-long-w4", 4), ("tiny-regime-long", 10)])
def test_length_axis_presets_load_and_fit_their_traces(preset, width):
    """The length axis (issue #34): tiny-regime on countdown_work:W, its response budgets the
    task's (the longest trace fits), within the tiny model's context; the rest is tiny-regime's.
    ~0.1 s."""
    from pipeline.models.tiny_model import build_model, build_tokenizer
    from pipeline.tasks import countdown_work
    cfg, short = load_config(preset), load_config("tiny-regime")
    assert cfg.task.name == f"countdown_work:{width}"
    budget = catalog.response_budget(cfg.task)
    assert cfg.rollout.max_new_tokens == cfg.eval.max_new_tokens == budget == countdown_work.budget(width)
    context = build_model(cfg.model, len(build_tokenizer())).config.max_position_embeddings
    assert len(catalog.format_prompt("9 9 9>999")) + budget < context
    assert cfg.model_dump(exclude={"task", "rollout", "eval"}) == short.model_dump(exclude={"task", "rollout", "eval"})
    assert cfg.task.model_dump(exclude={"name"}) == short.task.model_dump(exclude={"name"})
