"""Expected failures read as one line naming the file, row or line and what to do, exit 2,
and show the traceback only with `ggpo --debug`; files a stage reads from outside the
store (benchmarks, a task file) enter its key by content."""
from __future__ import annotations

import json
import os

import pytest

from pipeline.cli import main
from pipeline.core import errors as project_errors
from pipeline.core.config import load_config
from pipeline.dag import graph
from pipeline.tasks import benchmarks, catalog


def write_jsonl(path, rows: list, bad_line: int | None = None):
    lines = [json.dumps(r) for r in rows]
    if bad_line is not None:
        lines.insert(bad_line - 1, '{"problem": "3+3", answer: 6}')
    path.write_text("\n".join(lines) + "\n")
    return path


def errors(capsys) -> tuple[list[str], str]:
    err = capsys.readouterr().err
    return [line for line in err.splitlines() if line.startswith("ggpo:")], err


def test_malformed_jsonl_line_is_reported_with_its_number(tmp_path):
    rows = [{"problem": f"{i}+1", "answer": str(i + 1)} for i in range(5)]
    path = write_jsonl(tmp_path / "prompts.jsonl", rows, bad_line=4)
    with pytest.raises(catalog.DatasetError, match=r"prompts\.jsonl: line 4 is not valid JSON"):
        catalog.load_file(path)
    write_jsonl(tmp_path / "aime24.jsonl", [dict(r, id=str(i)) for i, r in enumerate(rows)], bad_line=2)
    with pytest.raises(benchmarks.BenchmarkError, match=r"aime24\.jsonl: line 2 is not valid JSON"):
        benchmarks.load("aime24", tmp_path)
    (tmp_path / "list.jsonl").write_text('{"problem": "1", "answer": "1"}\n[1, 2]\n')
    with pytest.raises(catalog.DatasetError, match=r"list\.jsonl: line 2 is a JSON list"):
        catalog.load_file(tmp_path / "list.jsonl")


def test_jsonl_with_mixed_answer_types_loads(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"problem": "a", "answer": 3}, {"problem": "b", "answer": "x"}])
    assert [p.answer for p in catalog.load_file(path)] == ["3", "x"]


def test_task_file_without_answer_is_one_line_at_the_cli(tmp_path, capsys):
    path = write_jsonl(tmp_path / "noanswer.jsonl", [{"problem": "1+1"}])
    argv = ["stage", "base", "--preset", "smoke", "--no-track", "--set", f"task.name={path}"]
    assert main(argv) == 2
    lines, err = errors(capsys)
    assert len(lines) == 1 and "Traceback" not in err
    assert f"{path}: missing required column 'answer'" in lines[0] and "--set task.name=" in lines[0]
    with pytest.raises(catalog.DatasetError):          # --debug: the exception and its traceback
        main(["--debug", "stage", "rollout", "--preset", "smoke", "--set", f"task.name={tmp_path}/none.jsonl"])


@pytest.mark.parametrize("argv, says", [
    (["stage", "rollout", "--preset", "smoke", "--set", "train.lr=-1"], "train.lr: Input should be greater than 0"),
    (["stage", "rollout", "--preset", "nosuch"], "unknown preset 'nosuch'"),
    (["stage", "rollout", "--preset", "smoke", "--set", "task.name=/nonexistent/p.jsonl"],
     "task file /nonexistent/p.jsonl does not exist"),
    (["stage", "evaluate", "--preset", "smoke", "--set", "eval.benchmarks=[aime24]", "--set", "eval.data_dir=/nonexistent"],
     "no aime24.parquet or aime24.jsonl in /nonexistent"),
])
def test_cli_errors_exit_2_with_one_line(argv, says, capsys):
    assert main(argv) == 2
    lines, err = errors(capsys)
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in err


def test_editing_a_benchmark_file_changes_the_evaluate_key(tmp_path):
    rows = [{"id": str(i), "problem": f"{i}+1", "answer": str(i + 1)} for i in range(3)]
    path = write_jsonl(tmp_path / "aime24.jsonl", rows)
    cfg = load_config("smoke", {"eval.benchmarks": ["aime24"], "eval.data_dir": str(tmp_path)})
    before = graph.expected_key("evaluate", cfg)
    assert graph.expected_key("evaluate", cfg) == before
    train_key = graph.expected_key("train", cfg)
    rows[1]["answer"] = "7"                                   # same size, other content
    write_jsonl(path, rows)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert graph.expected_key("evaluate", cfg) != before
    assert graph.expected_key("train", cfg) == train_key        # only what reads the file changes


def test_editing_a_task_file_changes_the_keys_of_its_readers(tmp_path):
    rows = [{"problem": f"{i}+1", "answer": str(i + 1)} for i in range(20)]
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    cfg = load_config("smoke", {"task.name": str(path)})
    before = {s: graph.expected_key(s, cfg) for s in ("base", "rollout", "evaluate")}
    write_jsonl(path, rows + [{"problem": "x", "answer": "1"}])
    after = {s: graph.expected_key(s, cfg) for s in ("base", "rollout", "evaluate")}
    assert all(after[s] != before[s] for s in before)
    builtin = load_config("smoke")
    assert graph.expected_key("rollout", builtin) == graph.expected_key("rollout", load_config("smoke"))


@pytest.mark.parametrize("bad, says", [
    ("task.name={tmp}/empty.jsonl", "empty.jsonl: missing required column 'problem'"),
    ("task.name={tmp}/broken.jsonl", "broken.jsonl: line 2 is not valid JSON"),
    ("task.name={tmp}/noanswer.jsonl", "noanswer.jsonl: 2 of 2 rows have no usable problem or answer"),
    ("train.lr=minus-one", "train.lr: Input should be a valid number"),
    ("trian.lr=1e-5", "trian: Extra inputs are not permitted"),
])
def test_bad_input_to_a_flow_is_one_line_before_anything_starts(tmp_path, bad, says):
    """`ggpo run` checks config and data before it starts Prefect, MLflow, a grading worker
    or a model: one line on stderr, nothing else anywhere (no Prefect or event noise)."""
    import subprocess

    from conftest import BIN, REPO
    (tmp_path / "empty.jsonl").write_text("")
    write_jsonl(tmp_path / "broken.jsonl", [{"problem": "1+1", "answer": "2"}], bad_line=2)
    write_jsonl(tmp_path / "noanswer.jsonl", [{"problem": "1+1", "answer": ""}, {"problem": "", "answer": "3"}])
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    res = subprocess.run([str(BIN / "ggpo"), "run", "offline", "--preset", "smoke", "--set", bad.format(tmp=tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and res.stdout == "", res.stdout
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("ggpo: ") and says in res.stderr, res.stderr
    assert "prefect" not in res.stderr.lower() and "Traceback" not in res.stderr


def test_every_error_the_project_raises_lives_in_errors_and_is_expected():
    """Every exception class defined in pipeline/, stages/ or flows/ is pipeline.core.errors' (an
    ExpectedError, except the countdown parser's internal verdict), so the CLI can map them
    by type; the modules that raise them only import them."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    defined = []
    for path in [p for d in ("pipeline", "stages", "flows") for p in (repo / d).rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception", "Interrupted"))
                    for b in node.bases):
                defined.append(f"{path.relative_to(repo)}:{node.name}")
    # the grader's own timer, caught where it is raised; the signal raised inside Prefect's
    # events client once its server is gone (pipeline/services/prefect_client.py), never seen by a user
    private = {"pipeline/tasks/grading.py:_Timeout", "pipeline/services/prefect_client.py:ServerGone"}
    assert {d for d in defined if not d.startswith("pipeline/core/errors.py")} == private
    for name in dir(project_errors):
        cls = getattr(project_errors, name)
        if isinstance(cls, type) and issubclass(cls, Exception) and cls is not project_errors.ParseError:
            assert issubclass(cls, project_errors.ExpectedError), name


@pytest.mark.parametrize("exc, line", [
    (project_errors.NonFiniteUpdate("update 3: non-finite loss nan"),
     "update 3: non-finite loss nan (try a smaller learning rate"),
    # the words alone do not make the hint: the type does
    (project_errors.TrainingError("rank 1 failed: non-finite loss nan"),
     "rank 1 failed: non-finite loss nan"),
    (project_errors.RefillError("round: found 0 mixed-reward groups"),
     "round: found 0 mixed-reward groups"),
    (project_errors.PoolError("a.jsonl: row 3"), "a.jsonl: row 3 (fix the source"),
    (project_errors.DiskFull("disk full: writing /c/latest.pt needs about 2.0 MiB, 0.1 MiB free there"),
     "disk full: writing /c/latest.pt needs about 2.0 MiB, 0.1 MiB free there (free space"),
])
def test_the_cli_maps_errors_by_type(exc, line):
    from pipeline.cli import expected_error
    message = expected_error(exc)
    assert message is not None and message.startswith(line)
    assert ("(" in line) == (message != line)      # a hint is added exactly where the type has one
    assert expected_error(RuntimeError("non-finite loss")) is None     # a bug keeps its traceback
