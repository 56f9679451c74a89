"""Training throughput per method, side by side on one pool (run on demand, not a test).

    .venv/bin/python benchmarks/train_throughput.py [--updates 8] [--impls chunked,full] [--set key=value ...]

Builds (or reuses) the tiny preset's base model and seed-42 pool in the cache, then
trains each method for a few updates in a throw-away store and prints tokens per second
and the ratio to plain GRPO. With two log-prob implementations (`train.logprob_impl`:
`full` is the old full-logits path, `chunked` the LM head in chunks) each method runs
under both, interleaved, and the chunked/full ratio is printed. Ratios from one run are
what to quote: absolute times vary 2-7x with machine load.
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
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--impls", default="chunked", help="comma-separated train.logprob_impl values")
    args = ap.parse_args()
    impls = args.impls.split(",")
    cfg = load_config("tiny", args.overrides + [f"train.updates={args.updates}", "train.eval_every=null"])
    b = base_model.run(cfg)
    roll = rollout.run(cfg, {"base": b})
    ver = verify.run(cfg, {"rollout": roll})
    pool = filt.run(cfg, {"rollout": roll, "verify": ver})
    rates = {}
    for method in ("grpo", "grpo_tis", "agro", "ggpo"):
        for impl in impls:
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                m = train.run(cfg.updated({"train.method": method, "train.logprob_impl": impl}),
                              {"base": b, "pool": pool}, store=Store(tmp))
                rates[method, impl] = (m.summary["tokens_per_second"], time.perf_counter() - start)
    print(f"{'method':10s} {'impl':8s} {'tokens/s':>10s} {'vs grpo':>8s} {'stage s':>8s}   ({args.updates} updates x "
          f"{cfg.train.groups_per_update} groups x {cfg.rollout.group_size}, micro-batch {cfg.train.micro_batch_groups} groups)")
    for (method, impl), (tps, secs) in rates.items():
        print(f"{method:10s} {impl:8s} {tps:10.0f} {tps / rates['grpo', impl][0]:8.2f} {secs:8.1f}")
    if len(impls) == 2:
        a, b_ = impls
        total = {i: sum(rates[m, i][0] for m in ("grpo", "grpo_tis", "agro", "ggpo")) for i in impls}
        print(f"{a}/{b_} tokens/s, summed over methods: {total[a] / total[b_]:.3f}")


if __name__ == "__main__":
    main()
