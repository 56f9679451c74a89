"""Ctrl-C and SIGTERM: stop at the next safe point, keep what resumes, say one line.

`handlers()` (a context manager, main thread) turns SIGINT and SIGTERM into a process-wide
request instead of an exception in whatever the main thread happens to run. Work checks
the request at its safe points with `check(where)`, which raises `Interrupted`:

- training: between micro-batches and after every update; the loop then writes a
  checkpoint of the last complete update (pipeline/training/loop.py), so a rerun resumes;
- generation: between sampled tokens and batches (the transformers engine);
- grading: while waiting for the worker pool (the workers are stopped at exit);
- any stage before it starts building (pipeline/dag/spec.py), so nothing new begins.

A flow that sees `Interrupted` waits for its running stages to reach their safe point
and ends Cancelled (Prefect) and KILLED (MLflow); `ggpo` prints `summary()` as one line
and exits 130. A served deployment's run cancelled in Prefect gets SIGTERM from the
runner: the same path. A second signal while stopping leaves the default behaviour to
the third: a user who insists gets out.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from pipeline.core.errors import Interrupted

EXIT_CODE = 130        # 128 + SIGINT, what shells expect of an interrupted command

_requested = threading.Event()
_signals = [0]
_where: list[str] = []           # where work stopped, in the order it did
_lock = threading.Lock()


def requested() -> bool:
    return _requested.is_set()


_listeners: list[Callable[[], None]] = []    # told of every request: worker processes (placement)


def on_request(listener: Callable[[], None]) -> Callable[[], None]:
    """Call `listener` at every stop request of this process from now on (a signal or
    `request`); returns what unregisters it. placement's process runner passes requests
    on to its worker processes this way."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def _tell_listeners() -> None:
    for listener in list(_listeners):
        listener()


def request() -> None:
    """Ask all work in this process to stop at its next safe point (as a signal does)."""
    _requested.set()
    _tell_listeners()


def reset() -> None:
    _requested.clear()
    _signals[0] = 0
    with _lock:
        _where.clear()


def check(where: str) -> None:
    """At a safe point: raise Interrupted(where) if a stop was requested."""
    if _requested.is_set():
        raise stopped(where)


def stopped(where: str) -> Interrupted:
    """Record where work stopped (for the one-line summary) and return the exception."""
    with _lock:
        if where not in _where:
            _where.append(where)
    return Interrupted(where)


def summary() -> str:
    """`interrupted at update 12 (train grpo seed 42); rerun resumes`: where work stopped."""
    with _lock:
        places = list(_where)
    if not places:
        return "interrupted before any work started; rerun starts it"
    return f"interrupted ({'; '.join(places)}); rerun resumes"


def _on_signal(signum, frame) -> None:
    _signals[0] += 1
    _requested.set()
    _tell_listeners()
    if _signals[0] >= 3:             # the user insists: the next one is the default
        signal.signal(signum, signal.SIG_DFL)


@contextmanager
def handlers() -> Iterator[None]:
    """SIGINT and SIGTERM request a stop while the body runs (main thread; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
