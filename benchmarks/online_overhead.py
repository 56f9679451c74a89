"""Per-round overhead of the online loop: what a round costs beyond sampling, grading and
the optimizer updates (orchestration: Prefect tasks, MLflow logging, model loads, artifact
writes and hashing, the flow itself).

Runs the online flow in-process (as `ggpo run online`) on a fresh private cache and state
folder: one method, N updates per round (default 1: the most rounds, the worst case),
builds one at a time, no evaluation in between (the final evaluation is subtracted). Prints
per round: wall time, sampling, grading and training seconds, and the overhead share.

    .venv/bin/python benchmarks/online_overhead.py [--preset tiny-online] [--n 1] [--method ggpo] [--updates 16]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-online")
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--method", default="ggpo")
    ap.add_argument("--updates", type=int, default=16)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ggpo-overhead-"))
    os.environ.setdefault("GGPO_CACHE", str(tmp / "cache"))
    os.environ.setdefault("GGPO_HOME", str(tmp / "home"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pipeline.cli import ensure_prefect_api
    ensure_prefect_api()
    from flows.online import ggpo_online
    from pipeline import dag
    from pipeline.config import load_config
    from pipeline.store import Store
    overrides = {"experiment.methods": [args.method], "train.method": args.method, "train.updates_per_step": args.n, "train.updates": args.updates,
                 "train.eval_every": None, "experiment.parallel": 1}
    cfg = load_config(args.preset, overrides)
    base = dag.run("base", cfg, {}, Store())         # pi_0 before the clock starts: not a round
    ends: list[float] = []      # when each round's training stage returned (tasks run in this process)
    real_run = dag.run

    def timed_run(stage, *a, **k):
        out = real_run(stage, *a, **k)
        if stage == "online_train":
            ends.append(time.perf_counter())
        return out
    dag.run = timed_run
    ggpo_online(preset=args.preset, overrides=overrides)
    store, rounds = Store(), args.updates // args.n
    work = {"generate": 0.0, "grade": 0.0, "train": 0.0}
    builds = 0.0     # the stages' own build time: the rest of the overhead is orchestration
    for r in range(1, rounds):     # round 0 starts with the flow: its wall time includes start-up
        c = cfg.updated({"online.round": r})
        pool = store.load("online_pool", dag.expected_key("online_pool", c))
        trained = store.load("online_train", dag.expected_key("online_train", c))
        import polars as pl
        work["generate"] += pool.summary["generate_seconds"]
        work["grade"] += pool.summary["grade_seconds"]
        work["train"] += float(pl.read_parquet(trained.path("metrics"))["seconds"].sum())
        builds += pool.seconds + trained.seconds
    rounds -= 1
    round_wall = (ends[-1] - ends[0]) / rounds      # from round 0's end to the last round's end
    inner = {k: v / rounds for k, v in work.items()}
    overhead = round_wall - sum(inner.values())
    print(f"preset {args.preset}, method {args.method}, N={args.n}, rounds 1..{rounds} timed, base {base.key[:12]}")
    print(f"per round: wall {round_wall:.3f}s = sampling {inner['generate']:.3f}s + grading {inner['grade']:.3f}s "
          f"+ updates {inner['train']:.3f}s + overhead {overhead:.3f}s")
    print(f"  of the overhead: {builds / rounds - sum(inner.values()):.3f}s inside the stages (model loads, "
          f"artifact writes), {round_wall - builds / rounds:.3f}s outside them (Prefect, MLflow, the flow)")
    print(f"overhead share of a round: {100 * overhead / round_wall:.1f}%")


if __name__ == "__main__":
    main()
