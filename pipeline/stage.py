"""How a stage runs: key, cache lookup, build into the store, manifest last.

A stage module defines `SPEC = StageSpec(...)` and a `build(config, inputs, folder)` that
writes its files into `folder` and returns `Built`. `run_stage` turns that into the
cached, atomic `run(config, inputs) -> Manifest` every stage exposes.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from pipeline.config import PipelineConfig
from pipeline.store import Manifest, Store, file_entry, now_iso, stage_key

log = logging.getLogger("ggpo")


@dataclass
class Built:
    files: dict[str, tuple[str, int | None]]       # name -> (relative path, rows)
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StageSpec:
    name: str
    version: int                    # bump when the stage's output changes for the same inputs
    reads: tuple[str, ...]          # config sections that enter the key
    build: Callable[[PipelineConfig, dict[str, Manifest], Path], Built]
    keep_on_rebuild: tuple[str, ...] = ()   # e.g. checkpoints/, so a rerun resumes


# How many stage builds may run at once in this process (flows run stages in threads).
# Kept here, not in the flow module: Prefect pickles flows, and a lock cannot be pickled.
_build_slots = threading.BoundedSemaphore(1 << 16)


def set_parallel_builds(n: int) -> None:
    global _build_slots
    _build_slots = threading.BoundedSemaphore(n)


@contextmanager
def build_slot() -> Iterator[None]:
    slots = _build_slots
    with slots:
        yield


def key_for(spec: StageSpec, config: PipelineConfig, input_keys: dict[str, str]) -> str:
    return stage_key(spec.name, spec.version, config.slice(spec.reads), input_keys)


def run_stage(spec: StageSpec, config: PipelineConfig, inputs: dict[str, Manifest],
              store: Store | None = None, force: bool = False) -> Manifest:
    store = store or Store()
    input_keys = {name: m.key for name, m in sorted(inputs.items())}
    key = key_for(spec, config, input_keys)
    if not force:
        hit = store.load(spec.name, key)
        if hit is not None:
            log.info("%s: cache hit %s", spec.name, key[:16])
            return hit.model_copy(update={"cache_hit": True})
    # a forced rerun starts from scratch; an interrupted one keeps what lets it resume
    folder = store.begin(spec.name, key, keep=() if force else spec.keep_on_rebuild)
    log.info("%s: building %s in %s", spec.name, key[:16], folder)
    start = time.perf_counter()
    built = spec.build(config, inputs, folder)
    files = {name: file_entry(folder, rel, rows) for name, (rel, rows) in built.files.items()}
    manifest = Manifest(
        stage=spec.name, key=key, version=spec.version, folder=str(folder),
        config=config.slice(spec.reads), inputs=input_keys, files=files,
        summary=built.summary, created_at=now_iso(),
        seconds=round(time.perf_counter() - start, 3),
    )
    return store.commit(manifest)
