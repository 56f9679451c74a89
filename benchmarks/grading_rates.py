"""Grading rates alone and inside a flow, side by side in one run (on demand, not a test).

    .venv/bin/python benchmarks/grading_rates.py [--n 4096] [--workers 0] [--timeout 2] [--legacy]

Grades the same N realistic responses ("... so the answer is \\boxed{N}": right, wrong,
fractions, a few unboxed) twice, each time from a cold worker pool:
- standalone: one call on the main thread, as `ggpo stage verify` does;
- flow-like: from a worker thread (a flow runs stages in threads), as several calls:
  rollout-round-sized calls of 256 plus one evaluation-sized call of 1,024.
`--legacy` adds the same two measurements for the previous implementation (a new process
pool per call, chunks of 256, so one worker per call below 257 responses), kept here only
for this comparison. Prints responses/s per mode and the flow/standalone ratio; checks
that every mode gave the same grades. Absolute rates vary with machine load: quote ratios
from one run.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import threading
import time
from concurrent.futures import ProcessPoolExecutor, TimeoutError as FutureTimeout

from pipeline.tasks import grading


def responses(n: int, seed: int = 0) -> tuple[list[str], list[tuple[str, ...]]]:
    """n responses to n // 8 problems (8 samples each, like a rollout group)."""
    rng = random.Random(seed)
    texts: list[str] = []
    answers: list[tuple[str, ...]] = []
    for p in range(max(1, n // 8)):
        answer = str(rng.randint(10, 99999))
        for _ in range(8):
            kind = rng.random()
            if kind < 0.5:
                box = answer
            elif kind < 0.85:
                box = str(int(answer) + rng.choice([-10, -1, 1, 2, 100]))
            elif kind < 0.93:
                box = rf"\frac{{{int(answer) * 2}}}{{2}}"   # right, as LaTeX
            else:
                box = None
            steps = " ".join(f"{rng.randint(1, 99)} + {rng.randint(1, 99)} = ..." for _ in range(rng.randint(1, 6)))
            tail = f"so the answer is \\boxed{{{box}}}." if box else f"so the answer is {answer}."
            texts.append(f"Let me work it out. {steps} {tail}")
            answers.append((answer,))
    return texts[:n], answers[:n]


def _legacy_chunk(items, timeout_s):
    return [grading.grade(r, a, timeout_s) for r, a in items]


def legacy_grade_many(responses, answers, timeout_s, workers=0, chunk=256):
    """The implementation before the shared pool: a new pool (and math-verify import) per call."""
    items = list(zip(responses, answers))
    workers = workers or os.cpu_count() or 1
    chunks = [items[i:i + chunk] for i in range(0, len(items), chunk)]
    on_main = threading.current_thread() is threading.main_thread()
    if on_main and (workers == 1 or len(items) < 64):
        grading.warm_up()
        return _legacy_chunk(items, timeout_s)
    results, overran = [], False
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"), initializer=grading.warm_up)
    try:
        futures = [pool.submit(_legacy_chunk, c, timeout_s) for c in chunks]
        for c, fut in zip(chunks, futures):
            try:
                results.extend(fut.result(timeout=timeout_s * len(c) + 60))
            except FutureTimeout:
                results.extend([(0.0, "timeout", timeout_s)] * len(c))
                overran = True
    finally:
        # as before, but joined when nothing overran: the old wait=False printed an
        # OSError traceback at interpreter exit, noise in this benchmark's output
        pool.shutdown(wait=not overran, cancel_futures=True)
    return results


def flow_sizes(n: int) -> list[int]:
    """Rollout-round calls of 256, then one evaluation-sized call of up to 1,024."""
    last = min(1024, n)
    return [256] * ((n - last) // 256) + ([(n - last) % 256] if (n - last) % 256 else []) + [last]


def standalone(fn, texts, answers, args) -> tuple[list, float, int]:
    start = time.perf_counter()
    out = fn(texts, answers, args.timeout, args.workers)
    return out, time.perf_counter() - start, 1


def flow_like(fn, texts, answers, args) -> tuple[list, float, int]:
    sizes, out = flow_sizes(len(texts)), []

    def stage():
        at = 0
        for size in sizes:
            out.extend(fn(texts[at:at + size], answers[at:at + size], args.timeout, args.workers))
            at += size
    start = time.perf_counter()
    worker = threading.Thread(target=stage, name="flow-stage")
    worker.start()
    worker.join()
    return out, time.perf_counter() - start, len(sizes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=0, help="0 = all cores")
    ap.add_argument("--timeout", type=float, default=2.0, help="per response, seconds")
    ap.add_argument("--legacy", action="store_true", help="also measure the per-call pool of before")
    args = ap.parse_args()
    texts, answers = responses(args.n)
    impls = [("shared pool", grading.grade_many)] + ([("legacy", legacy_grade_many)] if args.legacy else [])
    rows, reference = [], None
    for name, fn in impls:
        for mode in (standalone, flow_like):
            grading.close_pool()             # every measurement starts cold: one pool start counted
            out, seconds, calls = mode(fn, texts, answers, args)
            grades = [g[:2] for g in out]
            reference = reference or grades
            rows.append((name, mode.__name__.replace("_", "-"), calls, seconds, len(out) / seconds,
                         sum(a != b for a, b in zip(grades, reference))))
    grading.close_pool()
    workers = args.workers or grading.default_workers()
    print(f"{args.n} responses, {workers} workers, timeout {args.timeout} s; flow-like calls: {flow_sizes(args.n)}")
    print(f"{'implementation':15s} {'mode':11s} {'calls':>5s} {'seconds':>8s} {'resp/s':>8s} {'differ':>6s}")
    for name, how, calls, seconds, rate, differ in rows:
        print(f"{name:15s} {how:11s} {calls:5d} {seconds:8.2f} {rate:8.0f} {differ:6d}")
    for name, _ in impls:
        alone, flow = (r[4] for r in rows if r[0] == name)
        print(f"{name}: flow-like / standalone = {flow / alone:.2f}")
    assert reference is not None    # impls is never empty
    statuses = {s: sum(1 for g in reference if g[1] == s) for s in grading.STATUSES}
    print(f"statuses: {statuses}, mean reward {sum(g[0] for g in reference) / len(reference):.3f}")


if __name__ == "__main__":
    main()
