"""How a stage runs: key, cache lookup, build into the store, manifest last.

A stage module defines `SPEC = StageSpec(...)` and a `build(config, inputs, folder)` that
writes its files into `folder` and returns `Built`. `run_stage` turns that into the
cached, atomic `run(config, inputs) -> Manifest` every stage exposes. A stage whose build
needs what a long-lived caller holds in memory (an online cell's engine or learner, never
a file) declares its type as `context`; its build is `build(config, inputs, folder, ctx)`
and run_stage passes the caller's `ctx`. Without one, a cache hit still answers and a
miss raises MissingContext with the spec's `without_context` line (what builds it).

Files a stage reads from outside the store enter its key by content: a stage that reads
the `task` section and whose `task.name` is a file gets that file's sha256, and a spec's
`extra_key(config)` adds more (evaluate: its benchmark files). Editing such a file in
place therefore rebuilds what depends on it. Inputs are checked against their manifests
(presence, size, Parquet footer, sha256) before a build reads them: a damaged input raises
`DamagedArtifact` with one line, it is never read.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from pipeline.core import interrupt, kernels
from pipeline.core.config import PipelineConfig
from pipeline.core.errors import DamagedArtifact, MissingContext
from pipeline.core.store import Manifest, Store, check, file_entry, is_disk_full, now_iso, stage_key
from pipeline.tasks import catalog

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
    build: Callable[..., Built]     # (config, inputs, folder), or with `context` (config, inputs, folder, ctx)
    keep_on_rebuild: tuple[str, ...] = ()   # e.g. checkpoints/, so a rerun resumes
    ignores: tuple[str, ...] = ()           # dotted fields under `reads` that are not content (train.updates)
    # content hashes of files outside the store the stage reads: {"label": sha256}
    extra_key: Callable[[PipelineConfig], dict[str, str]] | None = None
    context: type | None = None     # what the build needs from its caller's memory (not part of the key)
    without_context: str = ""       # what to run instead, when it is missing
    # the output is computed by torch (a model's forward, sampling, training): on the CPU the
    # key carries the kernels' numerics (pipeline/core/kernels.py), so the reproducible and
    # the native mode never share a cached result
    numerics: bool = False


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


def outcome(manifest: Manifest) -> str:
    """"built in 3.2s", or for a cache hit what it saved: "cache hit (built in 92.2s on
    2026-11-30 14:02 UTC)"."""
    built = f"built in {manifest.seconds:.1f}s"
    if not manifest.cache_hit:
        return built
    when = manifest.created_at.replace("T", " ")[:16] + " UTC"     # 2026-11-30T14:02:11Z
    return f"cache hit ({built} on {when})"


def content_key(spec: StageSpec, config: PipelineConfig) -> dict[str, str]:
    """sha256 of each outside file the stage reads: the task file (when the stage reads
    the task section and task.name is a path) and the spec's own `extra_key`."""
    out = {}
    if any(r == "task" or r.startswith("task.") for r in spec.reads):
        out.update(catalog.content_key(config.task))
    if spec.extra_key is not None:
        out.update(spec.extra_key(config))
    if spec.numerics and (numerics := kernels.key_fingerprint()) is not None:
        out["kernels"] = numerics
    return out


def key_for(spec: StageSpec, config: PipelineConfig, input_keys: dict[str, str],
            content: dict[str, str] | None = None) -> str:
    """The stage's cache key; `content` (content_key's result) when the caller has it."""
    content = content_key(spec, config) if content is None else content
    return stage_key(spec.name, spec.version, config.slice(spec.reads, spec.ignores), input_keys, content)


def verify_inputs(spec: StageSpec, inputs: dict[str, Manifest]) -> None:
    """Raise DamagedArtifact (one line) when any input's files do not match its manifest."""
    for name, manifest in sorted(inputs.items()):
        problems = check(manifest)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise DamagedArtifact(
                f"{spec.name}: input '{name}' is damaged: {problems[0]}{more}; rebuild it with "
                f"`ggpo stage {manifest.stage} --force` (same --preset/--set) or rerun the flow, "
                f"which rebuilds damaged artifacts")


# Exceptions stage runs raised in this process, oldest first: a flow that fails reports
# "upstream task not completed"; the CLI names the stage failure that caused it instead.
_failures: list[tuple[str, Exception]] = []


def failures() -> list[tuple[str, Exception]]:
    """(stage, exception) of every failed stage run in this process since `clear_failures`."""
    return list(_failures)


def clear_failures() -> None:
    _failures.clear()


def run_stage(spec: StageSpec, config: PipelineConfig, inputs: dict[str, Manifest],
              store: Store | None = None, force: bool = False, ctx: Any = None) -> Manifest:
    """The stage's manifest: cached, or built now (with `ctx` when the spec has a context)."""
    try:
        return _run_stage(spec, config, inputs, store, force, ctx)
    except Exception as exc:
        _failures.append((spec.name, exc))
        raise


def check_context(spec: StageSpec, key: str, ctx: Any) -> tuple[Any, ...]:
    """The build's extra argument: () for a stage without a context, else (ctx,) when it is
    of the spec's type; a missing one is MissingContext, said where it is found missing."""
    if spec.context is None:
        return ()
    if not isinstance(ctx, spec.context):
        raise MissingContext(f"{spec.name} {key[:16]} is not in the cache and is not built alone: {spec.without_context}")
    return (ctx,)


def _run_stage(spec: StageSpec, config: PipelineConfig, inputs: dict[str, Manifest],
               store: Store | None, force: bool, ctx: Any) -> Manifest:
    store = store or Store()
    input_keys = {name: m.key for name, m in sorted(inputs.items())}
    content = content_key(spec, config)
    key = key_for(spec, config, input_keys, content)
    if not force and (hit := cached(spec, store, key)) is not None:
        return hit
    # one build of a key at a time, across processes (Store.build_lock): a second process
    # waits here, then finds the artifact the first one built
    with store.build_lock(spec.name, key, on_wait=lambda: interrupt.check(f"{spec.name} waiting for {key[:16]}")):
        if not force and (hit := cached(spec, store, key)) is not None:
            return hit
        return build(spec, config, inputs, store, force, ctx, key, content)


def cached(spec: StageSpec, store: Store, key: str) -> Manifest | None:
    """The intact artifact of `key` as a cache hit (logged), or None."""
    hit = store.load(spec.name, key)
    if hit is None:
        return None
    log.info("%s: %s, %s", spec.name, outcome(hit.model_copy(update={"cache_hit": True})), key[:16])
    return hit.model_copy(update={"cache_hit": True})


def build(spec: StageSpec, config: PipelineConfig, inputs: dict[str, Manifest], store: Store, force: bool,
          ctx: Any, key: str, content: dict[str, str]) -> Manifest:
    """Build `key` into its folder and commit it, manifest last (under its build lock)."""
    extra = check_context(spec, key, ctx)
    interrupt.check(f"{spec.name} not started")     # stopping: begin nothing new
    verify_inputs(spec, inputs)
    input_keys = {name: m.key for name, m in sorted(inputs.items())}
    # a forced rerun starts from scratch; an interrupted one keeps what lets it resume
    folder = store.begin(spec.name, key, keep=() if force else spec.keep_on_rebuild)
    log.info("%s: building %s in %s", spec.name, key[:16], folder)
    start = time.perf_counter()
    try:
        built = spec.build(config, inputs, folder, *extra)
        files = {name: file_entry(folder, rel, rows) for name, (rel, rows) in built.files.items()}
        manifest = Manifest(
            stage=spec.name, key=key, version=spec.version, folder=str(folder),
            config=config.slice(spec.reads, spec.ignores), inputs=input_keys, files=files,
            summary=built.summary, created_at=now_iso(),
            seconds=round(time.perf_counter() - start, 3), content=content,
        )
        return store.commit(manifest)
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        # the manifest was not written (it is last), so no run reads this build; its files
        # go so they hold no space, except what the rerun resumes from
        raise store.abandon(folder, spec.name, spec.keep_on_rebuild, exc) from exc
