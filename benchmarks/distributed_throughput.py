"""Two-rank (gloo, FSDP2) training throughput against one process, side by side (run on
demand, not a test).

    .venv/bin/python benchmarks/distributed_throughput.py [--updates 8] [--nproc 2] [--set key=value ...]

Builds (or reuses) the tiny preset's base model and seed-42 pool in the cache, then trains
the same config in a throw-away store with train.nproc=1 and train.nproc=N, alternating
(--repeats times), and prints training tokens per second (metrics rows: update time on
rank 0, which includes every collective) and the stage's wall time (which adds torchrun's
start, the process group, sharding and the final gather). On a 2-core CPU the ratio is the
communication and process overhead of gloo, not a speed-up: the ranks share the cores.
Ratios from one run are what to quote: absolute times vary with machine load.
"""
from __future__ import annotations

import argparse
import tempfile
import time

from pipeline.core.config import load_config
from pipeline.core.store import Store
from stages import base_model, filter as filt, rollout, train, verify


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    cfg = load_config("tiny", args.overrides + [f"train.updates={args.updates}", "train.eval_every=null",
                                                f"train.checkpoint_every={args.updates}"])
    b = base_model.run(cfg)
    roll = rollout.run(cfg, {"base": b})
    ver = verify.run(cfg, {"rollout": roll})
    pool = filt.run(cfg, {"rollout": roll, "verify": ver})
    rates: dict[int, list[tuple[float, float]]] = {1: [], args.nproc: []}
    for _ in range(args.repeats):
        for n in rates:
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                m = train.run(cfg.updated({"train.nproc": n}), {"base": b, "pool": pool}, store=Store(tmp))
                rates[n].append((m.summary["tokens_per_second"], time.perf_counter() - start))
    tc = cfg.train
    print(f"{'ranks':>5s} {'tokens/s':>10s} {'stage s':>8s}   ({args.updates} updates x {tc.groups_per_update} groups x "
          f"{cfg.rollout.group_size}, micro-batch {tc.micro_batch_groups} groups, method {tc.method}, gloo on CPU)")
    mean = {n: sum(r for r, _ in v) / len(v) for n, v in rates.items()}
    for n, v in rates.items():
        print(f"{n:5d} {mean[n]:10.0f} {sum(s for _, s in v) / len(v):8.1f}")
    print(f"{args.nproc} ranks / 1 process, tokens/s: {mean[args.nproc] / mean[1]:.3f}")


if __name__ == "__main__":
    main()
