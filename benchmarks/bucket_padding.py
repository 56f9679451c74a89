"""Length buckets vs one padded batch per micro-batch on the CPU (#26 item 4), side by side.

    .venv/bin/python benchmarks/bucket_padding.py [--reps 16] [--overhead 30 60 128 250 500]

The built-in tiny model (hidden 128, 2 layers, 1 thread, as the testbed trains) takes one
GGPO update (`loop.run_update`: policy forward and backward, the reference forward per group,
the loss) of the testbed's geometry (8 groups x 8 responses; prompts of 11-15 tokens,
responses ~N(14.6, 5) clipped to [3, 24], as tiny-regime's pools: ~72 % of a padded row is
real) with `Runtime.bucket_overhead` None (one padded batch) and each --overhead (a forward's
fixed cost in padded tokens, packing.bucket_rows), interleaved, order alternating per
repetition; prints each setting's update time as a ratio to the padded one (median of the
paired ratios), which load on the machine moves far less than either time.
"""
from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a plain script

import torch  # noqa: E402


def make_pool(groups: int, m: int, vocab: int, seed: int):
    from pipeline.training.pool import Pool
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(11, 15))] for _ in range(groups)]
    resp = [[[rng.randrange(5, vocab) for _ in range(max(3, min(24, int(rng.gauss(14.6, 5)))))] for _ in range(m)]
            for _ in range(groups)]
    return Pool(list(range(groups)), prompts, resp, [[[-1.0] * len(r) for r in g] for g in resp],
                torch.tensor([[float(i % 2) for i in range(m)] for _ in range(groups)], dtype=torch.float64), m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--overhead", type=float, nargs="+", default=[30.0, 60.0, 128.0, 250.0, 500.0])
    args = ap.parse_args()
    from pipeline.core.config import ModelConfig, load_config
    from pipeline.models.runtime import make_runtime
    from pipeline.models.tiny_model import build_model, build_tokenizer
    from pipeline.training import loop
    from pipeline.training.reference import ReferenceCache
    torch.set_num_threads(1)
    tok = build_tokenizer()
    model = build_model(ModelConfig(), len(tok))
    pools = [make_pool(8, 8, len(tok), seed) for seed in range(5)]
    real = sum(p.tokens(g) for p in pools for g in range(8))
    padded = sum(64 * max(len(p.prompt_ids[g]) + max(map(len, p.responses[g])) for g in range(8)) for p in pools)
    cfg = load_config("tiny-regime", ["train.method=ggpo", "train.device=cpu", "train.packing=off"])
    rt0 = make_runtime(cfg.train)
    policy, reference = rt0.prepare(model), rt0.prepare_reference(copy.deepcopy(model))
    st = loop.TrainState(policy, reference, torch.optim.AdamW(policy.parameters()), ref_cache=ReferenceCache(enabled=False))
    settings: list[float | None] = [None, *args.overhead]

    def update(overhead: float | None, pool) -> float:
        t0 = time.perf_counter()
        loop.run_update(st, loop.TrainContext(cfg, pool, replace(rt0, bucket_overhead=overhead), 0), list(range(8)))
        policy.zero_grad(set_to_none=True)
        return time.perf_counter() - t0
    for s in settings:              # warm-up
        update(s, pools[0])
    times: dict[float | None, list[float]] = {s: [] for s in settings}
    for r in range(args.reps):
        for s in settings if r % 2 == 0 else settings[::-1]:
            times[s].append(update(s, pools[r % len(pools)]))
    print(f"real / padded tokens {real / padded:.3f}; {args.reps} interleaved repetitions")
    for s in settings[1:]:
        ratio = statistics.median(a / b for a, b in zip(times[s], times[None]))
        print(f"overhead {s:g} tokens: update time / one padded batch = {ratio:.3f}")


if __name__ == "__main__":
    main()
