"""Two cells' work side by side: in threads of one process, or in two processes (#26).

The tiny model's steps are Python-bound (a decode step of 64 rows is ~2 ms of interpreter
work for ~2 ms of kernels), and threads of one process share its interpreter lock, so two
online cells in threads (`experiment.task_runner = "threads"`) may run no faster than one.
This times one unit of a cell's work, the transformers engine drawing one N = 1 round's
batch (8 prompts x 8 responses, 24 new tokens, bf16, one torch thread), `--calls` times:

- alone: one engine, in this process;
- threads: two engines, each in a thread of this process;
- processes: two engines, each in a process of its own (spawned, as the processes runner does).

It prints calls per second for each and the speed-ups over alone; alone and the pairs are
alternated `--reps` times (each pair measured right after an alone run, medians), so load on
the machine moves the ratios less than the rates.

    .venv/bin/python benchmarks/runner_parallelism.py [--preset tiny-regime] [--calls 30] [--reps 3]

The preset's base model is built (or found) in the usual cache (GGPO_CACHE).
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time
from typing import Any

PROMPTS = [f"Q:{i % 9 + 1} 5 7>22\nA:" for i in range(8)]


def work(path: str, calls: int, start: Any = None) -> float:
    """Seconds for `calls` draws of one engine (built before the clock starts)."""
    import torch

    from pipeline.models.engines import SamplingParams
    from pipeline.models.engines.hf import TransformersEngine
    torch.set_num_threads(1)
    engine = TransformersEngine(path, threads=1, dtype="bfloat16")
    engine.generate(PROMPTS, SamplingParams(8, 1.0, 1.0, 24, 0))      # warm
    if start is not None:
        start.wait()
    t0 = time.perf_counter()
    for k in range(calls):
        engine.generate(PROMPTS, SamplingParams(8, 1.0, 1.0, 24, k))
    return time.perf_counter() - t0


def _in_process(path: str, calls: int, start, out) -> None:
    out.put(work(path, calls, start))


def pair_threads(path: str, calls: int) -> float:
    """Seconds until both threads' calls are done (clock from the common start)."""
    start, out = threading.Barrier(3), []
    threads = [threading.Thread(target=lambda: out.append(work(path, calls, start))) for _ in range(2)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def pair_processes(path: str, calls: int) -> float:
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_in_process, args=(path, calls, start, out)) for _ in range(2)]
    for p in procs:
        p.start()
    start.wait()
    t0 = time.perf_counter()
    got = [out.get() for _ in procs]
    for p in procs:
        p.join()
    assert len(got) == 2
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-regime")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from pipeline.core.config import load_config
    from pipeline.core.store import model_path
    from stages import base_model
    path = str(model_path(base_model.run(load_config(args.preset))))
    rates: dict[str, list[float]] = {"alone": [], "threads": [], "processes": []}
    for rep in range(args.reps):
        for name, run, calls in (("alone", work, args.calls), ("threads", pair_threads, 2 * args.calls),
                                 ("alone", work, args.calls), ("processes", pair_processes, 2 * args.calls)):
            seconds = run(path, args.calls)
            rates[name].append(calls / seconds)
            print(f"rep {rep} {name:9s}: {calls / seconds:6.2f} calls/s")
    alone = statistics.median(rates["alone"])
    for name in ("threads", "processes"):
        r = statistics.median(rates[name])
        print(f"{name:9s}: {r:6.2f} calls/s, {r / alone:.2f}x one engine alone ({alone:.2f} calls/s)")


if __name__ == "__main__":
    main()
