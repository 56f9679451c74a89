"""The project's expected errors and shared names, in a leaf module that imports nothing of
the project: every layer raises these, and the CLI turns each into one line (exit 2).

Each message names the file, row, field or setting at fault and what to do.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A setting that cannot work (config, preset, flow parameters, a missing prerequisite)."""


class DatasetError(ValueError):
    """A prompt file (task.name) that cannot be read as a task."""


class PoolError(DatasetError):
    """A pool source (pool.source: a completions file or dataset) that cannot be imported."""


class BenchmarkError(ValueError):
    """A benchmark file (eval.data_dir) that cannot be read."""


class StoreError(ConfigError):
    """The artifact store cannot be used (URL, credentials, endpoint, permissions)."""


class DamagedArtifact(RuntimeError):
    """A cached artifact whose files do not match its manifest."""


class TrainingError(RuntimeError):
    """Training stopped: a bad pool, a non-finite update, a failed rank, a bad checkpoint."""


class WeightSyncError(RuntimeError):
    """A sampler refused the learner's weights (names or shapes that are not its model's)."""


# the benchmark files eval.benchmarks may name (pipeline/benchmarks.py reads them)
BENCHMARKS = ("math500", "aime24", "aime25", "olympiadbench", "minerva_math", "math_train")
