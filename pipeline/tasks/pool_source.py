"""Reading a pool you already have (`pool.source`): completions with correctness flags.

A source is a Parquet or JSONL file, a folder written by `datasets`' `save_to_disk`, or a
dataset id read through `datasets.load_dataset(id, split=pool.split or "train")`. Two
shapes, told apart by their columns (after `pool.map` renames them):

- one row per response: `problem`, `answer`, `response`, optional `reward`,
  `behavior_logprobs` (one float per response token), `group` (rows with the same group
  are one group; default: the problem id), `id` (the problem id; default: the group, else
  `<file stem>-p<k>` for the k-th distinct problem). Each row is a distinct sample, so a
  (problem id, response) pair that occurs twice is refused as a duplicated row; samples
  that repeat a text belong in one list of the other shape;
- one row per problem: `problem`, `answer`, `responses` (a list), optional `rewards` and
  `behavior_logprobs` (lists of the same length), `id` (default `<file stem>-<row>`);
  two rows with the same id are refused.

`load(pool_config)` validates everything that needs no tokenizer and returns the groups
in source order; every bad input is a PoolError naming the source, the row (JSONL: the
line) and the field as the source spells it: a missing or mis-mapped column, an empty
response list, rewards that are not numbers or booleans (booleans are 0/1), log-probs
that are NaN or +inf, partly missing log-probs, duplicates, an unloadable dataset id. A
group whose responses are all the same string is kept with a warning (counted). Parsed
once per content per process: `ggpo run` checks the source before any work and the stage
reuses the result. `digest(pool_config)` is what enters the import's key: the file's
sha256, or the sha256 of the dataset id, split and fingerprint.
"""
from __future__ import annotations

import hashlib
import logging
import math
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pipeline.core import methods
from pipeline.core.config import PoolConfig, TrainConfig
from pipeline.core.errors import PoolError
from pipeline.core.paths import project_file
from pipeline.core.store import canonical_json, sha256_cached
from pipeline.tasks.catalog import iter_jsonl

log = logging.getLogger("ggpo")
FILE_SUFFIXES = (".parquet", ".jsonl")


@dataclass(frozen=True)
class Response:
    text: str
    reward: float | None            # given; None when the source has none for it
    logprobs: tuple[float, ...] | None
    row: int                        # 0-based row of the source
    index: int                      # position in the row's list (0 for one row per response)
    where: str                      # "line 4" or "row 3", for messages


@dataclass(frozen=True)
class Group:
    prompt_id: str
    problem: str
    answer: str
    where: str                      # "line 4" or "row 3": where the group starts
    responses: tuple[Response, ...]


@dataclass(frozen=True)
class Source:
    name: str                       # as the messages name it (a path, or "dataset X (split S)")
    kind: str                       # file | saved | dataset
    digest: str
    rows: int
    shape: str                      # "response" (one row per response) | "problem"
    groups: list[Group]
    has_rewards: bool
    has_behavior: bool
    identical: int                  # groups whose responses are all one string


@dataclass
class _Table:
    """Rows of a source as dicts, where each row is (line N / row N), its columns."""
    name: str
    rows: list[dict[str, Any]]
    where: list[str]
    columns: list[str]
    stem: str


# ------------------------------------------------------------------ where the rows come from

def _locate(pc: PoolConfig) -> tuple[str, Path | str]:
    """(kind, path or id): an existing file, a saved dataset folder, else a dataset id."""
    assert pc.source is not None    # callers read a pool only when pool.source is set
    path = project_file(pc.source)
    if path.is_file():
        if path.suffix not in FILE_SUFFIXES:
            raise PoolError(f"{path}: a pool source file must be .parquet or .jsonl")
        if pc.split:
            raise PoolError(f"pool.split={pc.split}: {path} is a file, which has no splits; drop --split")
        return "file", path
    if path.is_dir():
        return "saved", path
    if path.suffix in FILE_SUFFIXES or str(pc.source).startswith((".", "/", "~")):
        raise PoolError(f"{path}: no such file (pool.source)")
    return "dataset", pc.source


def _dataset(kind: str, where: Path | str, split: str | None):
    """The `datasets` Dataset of a saved folder or a dataset id (one split)."""
    import datasets
    split = split or "train"
    try:
        ds = datasets.load_from_disk(str(where)) if kind == "saved" else _hub(where, split)
    except Exception as exc:          # offline, unknown id, not a dataset folder: one line
        why = (str(exc).strip().splitlines() or [""])[0][:200]
        hint = "" if kind == "saved" else (" (no internet here? a .parquet/.jsonl file or a folder saved with "
                                           "datasets' save_to_disk works offline)")
        what = "the folder" if kind == "saved" else "dataset id"
        raise PoolError(f"cannot load {what} {where}: {type(exc).__name__}: {why}{hint}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise PoolError(f"{where}: no split '{split}' (splits: {', '.join(ds)}); pick one with --split")
        ds = ds[split]
    return ds


@lru_cache(maxsize=8)
def _hub(dataset_id: str, split: str):
    """A hub dataset, loaded once per process (`datasets` caches its files on disk as well)."""
    import datasets
    return datasets.load_dataset(dataset_id, split=split)


def digest(pc: PoolConfig) -> str:
    """What enters the import's key: the file's sha256, or the sha256 of the dataset's id
    (not a saved folder's path), split and fingerprint."""
    kind, where = _locate(pc)
    if kind == "file":
        return sha256_cached(where)
    fingerprint = _dataset(kind, where, pc.split)._fingerprint
    ident = {"split": pc.split or "train", "fingerprint": fingerprint} | ({"dataset": where} if kind == "dataset" else {})
    return hashlib.sha256(canonical_json(ident).encode()).hexdigest()


def _read(pc: PoolConfig) -> tuple[str, _Table]:
    kind, where = _locate(pc)
    if kind == "file" and Path(where).suffix == ".jsonl":   # Path(): a file comes as its Path already
        numbered = list(iter_jsonl(Path(where), PoolError))
        rows = [row for _, row in numbered]
        columns = list(dict.fromkeys(k for row in rows for k in row))
        return kind, _Table(str(where), rows, [f"line {n}" for n, _ in numbered], columns, Path(where).stem)
    if kind == "file":
        import polars as pl
        try:
            frame = pl.read_parquet(where)
        except Exception as exc:
            raise PoolError(f"{where}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None
        rows, columns, name, stem = frame.to_dicts(), frame.columns, str(where), Path(where).stem
    else:
        ds = _dataset(kind, where, pc.split)
        rows, columns = ds.to_list(), list(ds.column_names)
        name = f"dataset {where} (split {pc.split or 'train'})" if kind == "dataset" else str(where)
        stem = Path(str(where)).name
    return kind, _Table(name, rows, [f"row {i}" for i in range(len(rows))], columns, stem)


# ------------------------------------------------------------------ values

class _Fields:
    """The source's column for each of our fields (pool.map), and messages that name it."""

    def __init__(self, table: _Table, mapping: dict[str, str]):
        self.table, self.map = table, mapping
        for field, column in mapping.items():
            if column not in table.columns:
                raise PoolError(f"{table.name}: --map {field}={column}: the source has no column '{column}' "
                                f"(columns: {', '.join(table.columns) or 'none'})")

    def column(self, field: str) -> str:
        return self.map.get(field, field)

    def has(self, field: str) -> bool:
        return self.column(field) in self.table.columns

    def named(self, field: str) -> str:
        column = self.column(field)
        return f"'{column}'" if column == field else f"'{column}' (pool field {field})"

    def require(self, field: str, also: str = "") -> None:
        if not self.has(field):
            raise PoolError(f"{self.table.name}: missing required column '{self.column(field)}'{also} "
                            f"(columns: {', '.join(self.table.columns) or 'none'}); name yours with "
                            f"--map {field}=COLUMN")

    def error(self, i: int, field: str, what: str) -> PoolError:
        return PoolError(f"{self.table.name}: {self.table.where[i]}: field {self.named(field)} {what}")

    def get(self, i: int, field: str) -> Any:
        return self.table.rows[i].get(self.column(field))

    def text(self, i: int, field: str) -> str:
        """A string field; a number is read as its text (answers such as 80), except a response."""
        value = self.get(i, field)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and field != "response":
            value = str(value)
        if not isinstance(value, str) or (field != "response" and not value.strip()):
            raise self.error(i, field, "is missing" if value is None or value == "" else
                             f"holds {short(value)}, not a string")
        return value

    def reward(self, i: int, field: str, value: Any, k: int | None = None) -> float | None:
        at = "" if k is None else f" at response {k}"
        if value is None:
            return None
        if isinstance(value, bool):
            return float(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
        raise self.error(i, field, f"holds {short(value)}{at}, not a number or boolean")

    def logprobs(self, i: int, value: Any, k: int | None = None) -> tuple[float, ...] | None:
        at = "" if k is None else f" (response {k})"
        if value is None:
            return None
        if not isinstance(value, (list, tuple)):
            raise self.error(i, "behavior_logprobs", f"holds {short(value)}{at}, not a list of floats")
        for t, x in enumerate(value):
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise self.error(i, "behavior_logprobs", f"holds {short(x)} at token {t}{at}, not a float")
            if math.isnan(x) or x == math.inf:
                raise self.error(i, "behavior_logprobs", f"holds {x} at token {t}{at}; log-probs must be "
                                 f"finite or -inf")
        return tuple(float(x) for x in value)


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ------------------------------------------------------------------ the two shapes

def _problem_rows(f: _Fields) -> list[Group]:
    """One row per problem: lists of responses (and rewards, log-probs)."""
    groups: list[Group] = []
    seen: dict[str, int] = {}
    for i in range(len(f.table.rows)):
        pid = str(f.get(i, "id")) if f.has("id") and f.get(i, "id") is not None else f"{f.table.stem}-{i}"
        if pid in seen:
            raise f.error(i, "id", f"repeats {f.table.where[seen[pid]]}'s id {pid!r}: one row per problem "
                          "in this shape (put every response of a problem in its list)")
        seen[pid] = i
        texts = f.get(i, "responses")
        if texts is None:
            raise f.error(i, "responses", "is missing")
        if not isinstance(texts, (list, tuple)):
            raise f.error(i, "responses", f"holds {short(texts)}, not a list of strings")
        if not texts:
            raise f.error(i, "responses", "is an empty list")
        bad = next((k for k, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise f.error(i, "responses", f"holds {short(texts[bad])} at response {bad}, not a string")
        rewards = _parallel(f, i, "rewards", len(texts))
        lps = _parallel(f, i, "behavior_logprobs", len(texts))
        responses = tuple(Response(t, f.reward(i, "rewards", r, k), f.logprobs(i, lp, k), i, k, f.table.where[i])
                          for k, (t, r, lp) in enumerate(zip(texts, rewards, lps)))
        groups.append(Group(pid, f.text(i, "problem"), f.text(i, "answer"), f.table.where[i], responses))
    return groups


def _parallel(f: _Fields, i: int, field: str, n: int) -> list:
    """A list column that runs alongside `responses` (None for each when absent or null)."""
    value = f.get(i, field) if f.has(field) else None
    if value is None:
        return [None] * n
    if not isinstance(value, (list, tuple)):
        raise f.error(i, field, f"holds {short(value)}, not a list")
    if len(value) != n:
        raise f.error(i, field, f"has {len(value)} entries for {n} responses")
    return list(value)


def _response_rows(f: _Fields) -> list[Group]:
    """One row per response, grouped by `group` (else the problem id), in order of first row."""
    groups: dict[str, list] = {}
    pids: dict[str, str] = {}
    firsts: dict[str, tuple[int, str, str, str]] = {}     # group -> its first row, problem, answer, id
    seen: dict[tuple[str, str], int] = {}
    for i in range(len(f.table.rows)):
        problem, answer = f.text(i, "problem"), f.text(i, "answer")
        given_id = f.get(i, "id") if f.has("id") else None
        given_group = f.get(i, "group") if f.has("group") else None
        key = str(given_group if given_group is not None else given_id if given_id is not None else
                  pids.setdefault(problem, f"{f.table.stem}-p{len(pids)}"))
        pid = str(given_id) if given_id is not None else key
        text = f.text(i, "response")
        if (pid, text) in seen:
            raise f.error(i, "response", f"repeats {f.table.where[seen[pid, text]]}: the same problem id {pid!r} "
                          "and response (a duplicated row; samples that repeat a text go in one 'responses' list)")
        seen[pid, text] = i
        first = firsts.setdefault(key, (i, problem, answer, pid))
        for field, value, expected in (("problem", problem, first[1]), ("answer", answer, first[2]), ("id", pid, first[3])):
            if value != expected:
                raise f.error(i, field, f"is {short(value)} but {f.table.where[first[0]]} of the same group "
                              f"says {short(expected)}")
        reward = f.reward(i, "reward", f.get(i, "reward")) if f.has("reward") else None
        lps = f.logprobs(i, f.get(i, "behavior_logprobs")) if f.has("behavior_logprobs") else None
        groups.setdefault(key, []).append(Response(text, reward, lps, i, 0, f.table.where[i]))
    return [Group(firsts[k][3], firsts[k][1], firsts[k][2], f.table.where[firsts[k][0]], tuple(rs))
            for k, rs in groups.items()]


# ------------------------------------------------------------------ the whole source

def _check_complete(f: _Fields, groups: list[Group], pc: PoolConfig, reward_field: str) -> tuple[bool, bool]:
    """(has rewards, has behavior log-probs). Log-probs come for every response or none;
    --trust-rewards needs a reward for every response."""
    flat = [r for g in groups for r in g.responses]
    missing_lp = next((r for r in flat if r.logprobs is None), None)
    has_behavior = any(r.logprobs is not None for r in flat)
    if has_behavior and missing_lp is not None:
        raise f.error(missing_lp.row, "behavior_logprobs", f"is empty for response {missing_lp.index} while other "
                      "responses have log-probs: give every response's log-probs or none")
    has_rewards = any(r.reward is not None for r in flat)
    if pc.trust_rewards:
        if not f.has(reward_field):
            raise PoolError(f"{f.table.name}: --trust-rewards (pool.trust_rewards) but the source has no "
                            f"column '{f.column(reward_field)}'; map it with --map {reward_field}=COLUMN, or let "
                            f"the import grade every response")
        missing = next((r for r in flat if r.reward is None), None)
        if missing is not None:
            raise f.error(missing.row, reward_field, f"has no value for response {missing.index}; "
                          "--trust-rewards needs every reward")
    return has_rewards, has_behavior


def _parse(pc: PoolConfig, content: str) -> Source:
    kind, table = _read(pc)
    f = _Fields(table, pc.map)
    f.require("problem")
    f.require("answer")
    shape = "problem" if f.has("responses") else "response"
    if shape == "response":
        f.require("response", " (or 'responses', a list per problem)")
    groups = _problem_rows(f) if shape == "problem" else _response_rows(f)
    if not groups:
        raise PoolError(f"{table.name}: no rows")
    has_rewards, has_behavior = _check_complete(f, groups, pc, "rewards" if shape == "problem" else "reward")
    identical = [g for g in groups if len(g.responses) > 1 and len({r.text for r in g.responses}) == 1]
    if identical:
        log.warning("%s: %d group(s) have responses that are all the same string (the first: %s, id %s); kept",
                    table.name, len(identical), identical[0].where, identical[0].prompt_id)
    return Source(table.name, kind, content, len(table.rows), shape, groups, has_rewards, has_behavior,
                  len(identical))


_parsed: dict[str, Source] = {}
_lock = threading.Lock()


def load(pc: PoolConfig) -> Source:
    """The validated source of `pc` (module doc), parsed once per content and mapping."""
    content = digest(pc)
    stamp = canonical_json([content, pc.map, pc.trust_rewards])
    with _lock:
        if stamp not in _parsed:
            _parsed[stamp] = _parse(pc, content)
        return _parsed[stamp]


def behavior_refusal(tc: TrainConfig, source: str) -> str:
    """Why a method that needs behavior log-probs cannot train on a pool without them and
    what to do: preflight says it before any work, the train stage if a pool slips through."""
    entry = tc.method_entry()
    what = entry.title if entry.needs_lp_beh else f"{entry.title} with train.anchor={tc.anchor}"
    others = [m.name for m in methods.METHODS.values() if not m.needs_lp_beh and not m.uses_anchor]
    anchored = [f"{m.name} with train.anchor=old" for m in methods.METHODS.values() if m.uses_anchor and not m.needs_lp_beh]
    return (f"train.method={tc.method}: {what} needs behavior log-probs and the pool from {source} has none; "
            f"record some with `ggpo stage score --model PATH` (pool.score_model=PATH in a flow; they are then "
            f"the scoring model's, not the sampler's), or train {', '.join(others[:-1] + [' or '.join(others[-1:] + anchored)])}")
