"""Verifiable reward: math-verify against the reference answer(s), with a time limit.

Status codes: `ok` (parsed and compared; reward 1 or 0), `no_answer` (no `\\boxed`),
`parse_error` (a box math-verify cannot parse), `timeout` (over the per-response limit).
Only `ok` can earn reward 1. math-verify's own signal timeouts are disabled and replaced
by one interval timer around parse+verify, so the limit is a float and covers both.
Grading runs in worker processes (one per core by default); signals need each worker's
main thread, which is where the pool runs them. Small batches on the main thread are
graded in-process.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor, TimeoutError as FutureTimeout
from functools import lru_cache
import multiprocessing as mp

STATUSES = ("ok", "no_answer", "parse_error", "timeout")


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


@lru_cache(maxsize=65536)
def _gold(answer: str):
    # each reference is parsed once per process, not once per response (4 ms each)
    from math_verify import parse
    return parse(f"\\boxed{{{answer}}}", parsing_timeout=None)


def _grade_untimed(response: str, answers: tuple[str, ...]) -> tuple[float, str]:
    from math_verify import parse, verify
    if "\\boxed" not in response:
        return 0.0, "no_answer"
    pred = parse(response, parsing_timeout=None)
    if not pred:
        return 0.0, "parse_error"
    for answer in answers:
        if verify(_gold(answer), pred, timeout_seconds=None):
            return 1.0, "ok"
    return 0.0, "ok"


def grade(response: str, answers: tuple[str, ...], timeout_s: float) -> tuple[float, str, float]:
    """(reward, status, seconds) for one response. Must run in a main thread.

    math-verify catches exceptions internally (also our timer's), so the timer repeats
    every 20 ms after the limit until one lands outside its handlers, and the elapsed
    time decides: a result that arrives after the limit is still a timeout."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    start = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s, 0.02)
    try:
        reward, status = _grade_untimed(response, answers)
    except _Timeout:
        reward, status = 0.0, "timeout"
    except Exception:  # math-verify raising on odd LaTeX is a parse failure, not a crash
        reward, status = 0.0, "parse_error"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    seconds = time.perf_counter() - start
    if seconds > timeout_s:
        reward, status = 0.0, "timeout"
    return reward, status, seconds


def warm_up() -> None:
    """Import and exercise math-verify once, so its ~1 s import never counts as a timeout."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    _grade_untimed("\\boxed{1}", ("1",))


def _grade_chunk(items: list[tuple[str, tuple[str, ...]]], timeout_s: float):
    return [grade(resp, answers, timeout_s) for resp, answers in items]


def grade_many(responses: list[str], answers: list[tuple[str, ...]], timeout_s: float,
               workers: int = 0, chunk: int = 256) -> list[tuple[float, str, float]]:
    """Grade in `workers` processes (0 = all cores). A chunk that overruns its whole
    budget (a limit that failed to fire inside C code) is marked `timeout`: never hang."""
    items = list(zip(responses, answers))
    workers = workers or os.cpu_count() or 1
    chunks = [items[i:i + chunk] for i in range(0, len(items), chunk)]
    # the time limit is a signal, which only the main thread receives: off it (a flow
    # runs stages in threads) grading always goes to worker processes
    on_main = threading.current_thread() is threading.main_thread()
    if on_main and (workers == 1 or len(items) < 64):
        warm_up()
        return _grade_chunk(items, timeout_s)
    results = []
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                               initializer=warm_up)
    try:
        futures = [pool.submit(_grade_chunk, c, timeout_s) for c in chunks]
        for c, fut in zip(chunks, futures):
            try:
                results.extend(fut.result(timeout=timeout_s * len(c) + 60))
            except FutureTimeout:
                results.extend([(0.0, "timeout", timeout_s)] * len(c))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return results
