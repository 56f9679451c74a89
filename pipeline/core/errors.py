"""The project's expected errors and shared names, in a leaf module that imports nothing of
the project: every layer raises these, and the CLI turns each into one line (exit 2, or
130 for a stop) by its type (`pipeline/cli.py: expected_error`), never by its message.

Each message names the file, row, field or setting at fault and what to do. Every class
here derives from `ExpectedError`; anything else that escapes a command is a bug and
keeps its traceback.
"""
from __future__ import annotations

import errno
import logging


class ExpectedError(Exception):
    """A failure the user can act on; its message is the whole story (no traceback)."""


class ConfigError(ExpectedError, ValueError):
    """A setting that cannot work (config, preset, flow parameters, a missing prerequisite)."""


class DatasetError(ExpectedError, ValueError):
    """A prompt file (task.name) that cannot be read as a task."""


class PoolError(DatasetError):
    """A pool source (pool.source: a completions file or dataset) that cannot be imported."""


class BenchmarkError(ExpectedError, ValueError):
    """A benchmark file (eval.data_dir) that cannot be read."""


class MissingContext(ConfigError):
    """A stage built only by a process that holds what it needs in memory (an online cell's
    engine or learner) was asked to build without it: its artifact is not cached, and the
    message names what builds it."""


class StoreError(ConfigError):
    """The artifact store cannot be used (URL, credentials, endpoint, permissions)."""


class DamagedArtifact(ExpectedError, RuntimeError):
    """A cached artifact whose files do not match its manifest."""


class MissingInput(ExpectedError, RuntimeError):
    """A stage's input is not in the cache (`ggpo stage NAME` names the stage to run first)."""


class ServiceError(ExpectedError, RuntimeError):
    """A server (Prefect, MLflow, the deployment's serve process) that is needed and not usable."""


class TrainingError(ExpectedError, RuntimeError):
    """Training stopped: a bad pool, a failed rank, a bad checkpoint."""


class NonFiniteUpdate(TrainingError):
    """An update whose loss or gradient norm is not finite (it is never applied)."""


class NonFiniteLogits(ExpectedError, RuntimeError):
    """A sampler's forward gave a NaN or infinite logit: the draw is refused (one line saying
    where), never sampled from or scored."""


class RefillError(ExpectedError, RuntimeError):
    """An online round could not collect its N * G_mb mixed-reward groups within online.max_draws."""


class WeightSyncError(ExpectedError, RuntimeError):
    """A sampler refused the learner's weights (names or shapes that are not its model's)."""


class VLLMOutputError(ExpectedError, RuntimeError):
    """vLLM returned a completion without a finite log-prob for a sampled token."""


class DiskFull(ExpectedError, OSError):
    """A write failed for lack of space (ENOSPC, or a quota): the message names the path and
    the space the write needed. What was half-written is removed and what was complete before
    (the previous checkpoint, manifest or report) is intact, so a rerun once space is freed
    resumes. An OSError too (errno ENOSPC), so code that handles OSError still sees one."""

    def __init__(self, message: str):
        super().__init__(message)
        self.errno = 28     # errno.ENOSPC, without importing errno into this leaf module


class Interrupted(ExpectedError):
    """Work stopped at a safe point because a stop was requested; the message says where."""

    def __init__(self, where: str):
        super().__init__(f"interrupted: {where}")
        self.where = where

    def __reduce__(self):       # from a worker process: rebuilt from `where`, not the message
        return type(self), (self.where,)


class ParseError(ValueError):
    """Internal to the countdown verifier: an answer that does not parse (graded parse_error,
    never shown to the user as an error)."""


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# how libraries that wrap the OS error say it (safetensors' Rust writer, an MLflow server's reply)
NO_SPACE_WORDS = ("No space left on device", "Disk quota exceeded")


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether `exc`, or an exception it was raised from or while handling, is a full disk
    or quota: errno ENOSPC/EDQUOT, or a wrapper whose message says so."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            return True
        if any(w in str(exc) for w in NO_SPACE_WORDS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# the benchmark files eval.benchmarks may name (pipeline/tasks/benchmarks.py reads them)
BENCHMARKS = ("math500", "aime24", "aime25", "olympiadbench", "minerva_math", "math_train")


def drop_expected_traceback(record: logging.LogRecord) -> bool:
    """A logging filter (the CLI's Prefect loggers, and a worker process's): a record of an
    expected error, or of a config that did not validate, keeps its one line and loses its
    traceback, as does Prefect's follow-up "unfinished upstream" record; the CLI says the
    line that matters (--debug keeps them all)."""
    exc = record.exc_info[1] if record.exc_info else None
    if exc is not None and (isinstance(exc, ExpectedError) or type(exc).__name__ in ("ValidationError", "UnfinishedRun")):
        record.exc_info, record.exc_text = None, None
    return True
