"""Built-in verifiable tasks and file-backed prompt sets, in one row schema (id, problem, answer).

Built-in families (`task.name`), each with a difficulty knob and deterministic train and
eval splits from `task.split_seed`; the first two have one correct answer, an integer
written as `\\boxed{N}` that math-verify grades:
- `digit_sort`: sort a string of digits 1-9 ascending (lengths 3+2d .. 5+2d). Digits
  exclude 0 so the sorted string is an integer whose value pins the exact string: a
  dropped leading zero can never be graded correct.
- `arithmetic`: a op b with op in + - x; d-digit operands (x: d-digit by 1-digit).
- `countdown`: reach a target from 2 + d numbers (at most 5) with + - x, each number once
  (`3 5 7>22` -> `\\boxed{3*5+7}`, `\\boxed{7+5*3}`, ...): many correct responses per
  prompt. Its reference answer `countdown:3 5 7=22` routes grading to the task's own
  verifier, which checks the expression's meaning (pipeline/tasks/countdown.py).
- `countdown_work:W` (`countdown_work` is W = 0): countdown's problems, prompts, references
  and verifier (its splits are countdown's at the same difficulty and split seed), but the
  warm-up's target is a search trace that writes W failed tries, one line per combination,
  before its `\\boxed{}` (pipeline/tasks/countdown_work.py): the length axis of issue #34.
  `response_budget` is the base's sampling budget for it (24 tokens for the others).
Any other `task.name` is a path to a Parquet or JSONL file with `problem` and `answer`
columns (`id` optional; a relative path is looked up from the working directory, then
the project root, `paths.project_file`); the splits are a seeded permutation of its rows.
Rows without a usable problem or answer (null or blank) are skipped and counted
(`file_report`, in the summaries of the stages that read the task); more than
SKIP_LIMIT of a file's rows is an error naming the file. JSONL is parsed line by line, so
a malformed line is reported with the file and its line number. A task file enters the
keys of the stages that read it by its sha256 (`content_key`).
"""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import polars as pl

from pipeline.core.config import TaskConfig
from pipeline.core.errors import DatasetError
from pipeline.core.paths import project_file
from pipeline.core.seeding import permutation, py_random
from pipeline.core.store import sha256_cached
from pipeline.tasks import countdown, countdown_work

BUILTIN = ("digit_sort", "arithmetic", "countdown", "countdown_work")   # and countdown_work:W
SKIP_LIMIT = 0.01       # a file with more unusable rows than this share is refused
log = logging.getLogger("ggpo")
PROMPT_TEMPLATE = "Q:{problem}\nA:"   # the tiny model's format: short, no chat template


def work_width(name: str) -> int | None:
    """W of a `countdown_work:W` name, None for any other; a malformed W is a DatasetError."""
    try:
        return countdown_work.parse_name(name)
    except ValueError as exc:
        raise DatasetError(str(exc)) from None


def is_builtin(name: str) -> bool:
    """A built-in family (BUILTIN, or countdown_work:W), not a task file."""
    return name in BUILTIN or work_width(name) is not None


def stream_name(name: str) -> str:
    """The name a task's random streams are drawn under: countdown_work:W draws countdown's
    problems, so the length axis compares the same prompts."""
    return "countdown" if work_width(name) is not None else name


def response_budget(cfg: TaskConfig) -> int:
    """Tokens the base stage's check samples may take: a search trace's budget for
    countdown_work:W (countdown_work.budget), else 24 (the short tasks' answers)."""
    width = work_width(cfg.name)
    return 24 if width is None else countdown_work.budget(width, countdown.count_of(cfg.difficulty))


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    answer: str


def make_problem(name: str, difficulty: int, rng) -> tuple[str, str]:
    """(problem, reference answer) of a built-in task from the random stream `rng`."""
    return draw(name, difficulty, rng)[:2]


def draw(name: str, difficulty: int, rng) -> tuple[str, str, str]:
    """(problem, reference answer, a correct box content): the box content is the answer
    itself except for countdown, where it is one random solution of many."""
    if name == "digit_sort":
        length = rng.randint(3 + 2 * difficulty, 5 + 2 * difficulty)
        digits = "".join(rng.choice("123456789") for _ in range(length))
        return digits, "".join(sorted(digits)), "".join(sorted(digits))
    if name == "arithmetic":
        lo, hi = 10 ** (difficulty - 1), 10 ** difficulty - 1
        op = rng.choice("+-*")
        a = rng.randint(lo, hi)
        b = rng.randint(1, 9) if op == "*" else rng.randint(lo, hi)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"{a}{op}{b}", str(value), str(value)
    if name == "countdown" or work_width(name) is not None:
        return countdown.make(difficulty, rng)
    raise DatasetError(f"unknown built-in task '{name}'; known: {', '.join(BUILTIN)}")


def sample_problems(cfg: TaskConfig, purpose: str, count: int, exclude: set[str]) -> list[tuple[str, str]]:
    """`count` distinct (problem, answer) pairs of a built-in task from stream `purpose`."""
    rng = py_random(cfg.split_seed, f"task/{stream_name(cfg.name)}/d{cfg.difficulty}/{purpose}")
    seen = set(exclude)
    out: list[tuple[str, str]] = []
    for _ in range(count * 50):
        if len(out) == count:
            return out
        problem, answer = make_problem(cfg.name, cfg.difficulty, rng)
        if problem not in seen:
            seen.add(problem)
            out.append((problem, answer))
    raise DatasetError(f"task '{cfg.name}' level {cfg.difficulty} has too few distinct problems for {count}")


def iter_jsonl(path: Path, error: type[Exception] | None = None):
    """(1-based line number, object) for each non-blank line of a JSONL file; a malformed
    line raises `error` naming the file and the line."""
    error = error or DatasetError
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path}: line {number} is not valid JSON ({exc.msg} at column {exc.colno}); "
                            f"fix or delete that line") from None
            if not isinstance(row, dict):
                raise error(f"{path}: line {number} is a JSON {type(row).__name__}, not an object "
                            f'{{"problem": ..., "answer": ...}}')
            yield number, row


def read_jsonl(path: Path, error: type[Exception] | None = None) -> pl.DataFrame:
    """A JSONL file as a frame, one JSON object per non-blank line (iter_jsonl)."""
    error = error or DatasetError
    rows = [row for _, row in iter_jsonl(path, error)]
    try:
        return pl.from_dicts(rows, infer_schema_length=None) if rows else pl.DataFrame()
    except Exception as exc:        # polars' type errors name no line: say which file
        raise error(f"{path}: the rows do not form a table ({str(exc).splitlines()[0]})") from None


def read_table(path: Path, error: type[Exception] | None = None) -> pl.DataFrame:
    """A .parquet or .jsonl file as a frame; an unreadable file raises `error` naming it."""
    error = error or DatasetError
    if path.suffix != ".parquet":
        return read_jsonl(path, error)
    try:
        return pl.read_parquet(path)
    except Exception as exc:
        raise error(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None


def content_key(cfg: TaskConfig) -> dict[str, str]:
    """{"task_file": sha256} when task.name is a file, else {} (built-ins are code)."""
    if is_builtin(cfg.name):
        return {}
    return {"task_file": sha256_cached(existing_file(cfg.name))}


def existing_file(name: str | Path) -> Path:
    path = project_file(name)
    if not path.is_file():
        raise DatasetError(f"task file {path} does not exist")
    return path


@dataclass(frozen=True)
class TaskFile:
    rows: list[Problem]         # the usable rows, in file order
    total: int                  # rows in the file
    skipped: list[str]          # ids of rows without a usable problem or answer


_files: dict[tuple[str, str], TaskFile] = {}      # (path, sha256) -> parsed file
_files_lock = threading.Lock()


def read_task_file(name: str | Path) -> TaskFile:
    """A Parquet/JSONL prompt file, parsed once per content (sha256) per process. A bad
    file (unreadable, missing column, repeated ids, too many unusable rows) is an error
    naming the file, and the row where there is one."""
    path = existing_file(name)
    stamp = (str(path.resolve()), sha256_cached(path))
    with _files_lock:
        if stamp not in _files:
            _files[stamp] = _parse_task_file(path)
            skipped = _files[stamp].skipped
            if skipped:
                log.warning("%s: skipped %d of %d rows without a usable problem or answer (ids %s)", path,
                            len(skipped), _files[stamp].total, ", ".join(skipped[:5]))
        return _files[stamp]


def _parse_task_file(path: Path) -> TaskFile:
    df = read_table(path)
    for column in ("problem", "answer"):
        if column not in df.columns:
            raise DatasetError(f"{path}: missing required column '{column}' (has {df.columns}); "
                               f"every row needs 'problem' and 'answer'")
    ids = df["id"].cast(pl.Utf8).to_list() if "id" in df.columns else [f"{path.stem}-{i}" for i in range(df.height)]
    rows, skipped, first_bad = [], [], None
    for i, (pid, problem, answer) in enumerate(zip(ids, df["problem"].to_list(), df["answer"].to_list())):
        missing = [f for f, v in (("problem", problem), ("answer", answer)) if v is None or not str(v).strip()]
        if missing:
            skipped.append(str(pid))
            first_bad = first_bad or f"row {i} (id {pid}) has no {missing[0]}"
            continue
        check_reference(path, i, pid, str(answer))
        rows.append(Problem(str(pid), str(problem), str(answer)))
    if len(skipped) > SKIP_LIMIT * len(ids) or not rows:
        raise DatasetError(f"{path}: {len(skipped)} of {len(ids)} rows have no usable problem or answer "
                           f"(more than {SKIP_LIMIT:.0%}; the first: {first_bad})")
    if len({r.id for r in rows}) != len(rows):
        raise DatasetError(f"{path}: column 'id' has repeated values")
    return TaskFile(rows, len(ids), skipped)


def check_reference(path: Path, i: int, pid, answer: str) -> None:
    """A reference that routes to a task's own grader (`countdown:3 5 7=22`) must parse, or
    every response to it would grade as a parse error: the row is named instead."""
    if answer.startswith(countdown.PREFIX):
        try:
            numbers, target = countdown.parse_reference(answer)
            assert numbers and all(1 <= n <= 10**countdown.MAX_DIGITS for n in numbers)
        except (ValueError, AssertionError):
            raise DatasetError(f"{path}: row {i} (id {pid}), field 'answer': '{answer[:60]}' is not a countdown "
                               f"reference ('countdown:3 5 7=22': numbers, '=', the target)") from None


def load_file(path: str | Path) -> list[Problem]:
    """The usable rows of a Parquet/JSONL prompt file (read_task_file)."""
    return read_task_file(path).rows


def file_report(cfg: TaskConfig) -> dict:
    """For a stage's summary: the task file's rows and the unusable rows it skipped ({} for
    a built-in task)."""
    if is_builtin(cfg.name):
        return {}
    f = read_task_file(cfg.name)
    return {"task_rows": f.total, "task_rows_skipped": len(f.skipped), "task_rows_skipped_ids": ", ".join(f.skipped[:5])}


_splits: dict[str, dict[str, list[Problem]]] = {}     # TaskConfig JSON -> a built-in task's splits
_splits_lock = threading.Lock()


def splits(cfg: TaskConfig) -> dict[str, list[Problem]]:
    """{'train': [...], 'eval': [...]}: disjoint, deterministic in cfg. A built-in task's are
    drawn once per config per process (an online round asks every time: 2,248 countdown
    problems cost ~30 ms a round); each caller gets its own lists."""
    if not is_builtin(cfg.name):
        return _file_splits(cfg)
    key = cfg.model_dump_json()
    with _splits_lock:
        if key not in _splits:
            _splits[key] = _builtin_splits(cfg)
        found = _splits[key]
    return {k: list(v) for k, v in found.items()}


def _file_splits(cfg: TaskConfig) -> dict[str, list[Problem]]:
    rows = load_file(cfg.name)
    order = permutation(len(rows), cfg.split_seed, "task/file-split")
    if cfg.n_eval >= len(rows):
        raise DatasetError(f"{cfg.name}: {len(rows)} rows, not enough for n_eval={cfg.n_eval} plus training")
    return {"eval": [rows[i] for i in order[:cfg.n_eval]],
            "train": [rows[i] for i in order[cfg.n_eval:cfg.n_eval + cfg.n_train]]}


def _builtin_splits(cfg: TaskConfig) -> dict[str, list[Problem]]:
    eval_rows = sample_problems(cfg, "eval", cfg.n_eval, set())
    train_rows = sample_problems(cfg, "train", cfg.n_train, {p for p, _ in eval_rows})
    tag = f"{cfg.name}-d{cfg.difficulty}"
    return {
        "train": [Problem(f"{tag}-train-{i:05d}", p, a) for i, (p, a) in enumerate(train_rows)],
        "eval": [Problem(f"{tag}-eval-{i:05d}", p, a) for i, (p, a) in enumerate(eval_rows)],
    }


def sft_stream(cfg: TaskConfig, exclude: set[str]):
    """Endless fresh (problem, box content) pairs for the warm-up (never an eval problem):
    the box content is a correct response's, for countdown a random one of many."""
    rng = py_random(cfg.split_seed, f"task/{stream_name(cfg.name)}/d{cfg.difficulty}/sft")
    while True:
        problem, _, boxed = draw(cfg.name, cfg.difficulty, rng)
        if problem not in exclude:
            yield problem, boxed


def sft_targets(cfg: TaskConfig, exclude: set[str]):
    """Endless (problem, target response) pairs for the warm-up: `\\boxed{answer}` of
    sft_stream's pairs, or for countdown_work:W a search trace of width W over the same
    problems (its own stream draws the search order)."""
    width = work_width(cfg.name)
    if width is None:
        for problem, boxed in sft_stream(cfg, exclude):
            yield problem, format_target(boxed)
        return
    rng = py_random(cfg.split_seed, f"task/{cfg.name}/d{cfg.difficulty}/trace")
    for problem, _ in sft_stream(cfg, exclude):
        numbers, target = countdown.parse_reference(countdown.PREFIX + problem.replace(">", "="))
        yield problem, countdown_work.trace(numbers, target, width, rng)


PLAIN_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def format_prompt(problem: str, style: str = "task") -> str:
    """The training prompt: the built-in task format, or the plain \\boxed{} instruction."""
    return (PLAIN_TEMPLATE if style == "plain" else PROMPT_TEMPLATE).format(problem=problem)


def prompt_builder(kind: str, tokenizer) -> tuple[str, Callable[[str], str]]:
    """(description of the template, problem -> prompt text) for a prompt kind: `chat` (the
    model's chat template around the plain instruction; plain when it has none), `plain`,
    or `task`. Evaluation and an imported pool (pool.prompt=chat) build chat prompts here,
    so the two always agree."""
    if kind == "chat" and getattr(tokenizer, "chat_template", None):
        def chat(problem: str) -> str:
            messages = [{"role": "user", "content": PLAIN_TEMPLATE.format(problem=problem)}]
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return f"chat template of the model, user turn: {shown(PLAIN_TEMPLATE)}", chat
    if kind in ("chat", "plain"):
        return f"plain: {shown(PLAIN_TEMPLATE)}", lambda problem: PLAIN_TEMPLATE.format(problem=problem)
    return f"task: {shown(PROMPT_TEMPLATE)}", format_prompt


def shown(template: str) -> str:
    """A template as it reads, with {problem} kept and newlines visible."""
    return template.format(problem="{problem}").replace("\n", "\\n")


def format_target(answer: str) -> str:
    return f"\\boxed{{{answer}}}"
