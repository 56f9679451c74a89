"""Packed vs padded micro-batches, side by side, on a pool with realistic, skewed lengths.

    .venv/bin/python benchmarks/packing_throughput.py [--repeats 3] [--device cpu|cuda]

A random Qwen3-style model (hidden 256, 4 layers, vocab 4,096 on the CPU; Qwen3-1.7B's shape
with --full on a GPU) trains on one update of `--groups` groups x 8 responses whose lengths
are log-normal (median ~ --median tokens, a long tail cut at --max), as real reasoning
responses are: most short, a few at the budget. Each layout runs the same update (forward,
backward) under the same token budget, alternating layouts per repeat so load drifts hit
both; reported: response tokens/s (median of repeats), the ratio packed/padded, and the
share of the padded layout's body tokens that are padding (what packing removes).

On the CPU, packed rows use sdpa with a dense block-diagonal mask: its attention is
quadratic in the whole micro-batch, so for long micro-batches it can lose to padding; the
figure that matters is on CUDA with flash-attn (varlen) or flex attention (block-sparse),
where packing removes the padding's body FLOPs without that cost.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a plain script

import torch  # noqa: E402


def lengths(n: int, median: int, top: int, seed: int) -> list[int]:
    """Log-normal response lengths (sigma 0.8: a long right tail), clipped to [8, top]."""
    rng = random.Random(seed)
    return [max(8, min(top, int(rng.lognormvariate(math.log(median), 0.8)))) for _ in range(n)]


def make_pool(groups: int, m: int, vocab: int, median: int, top: int, seed: int):
    from pipeline.training.pool import Pool
    rng = random.Random(seed)
    lens = lengths(groups * m, median, top, seed)
    responses = [[[rng.randrange(3, vocab) for _ in range(lens[g * m + i])] for i in range(m)] for g in range(groups)]
    rewards = torch.tensor([[float(i % 2) for i in range(m)] for _ in range(groups)], dtype=torch.float64)
    return Pool(group_ids=list(range(groups)), prompt_ids=[[rng.randrange(3, vocab) for _ in range(32)] for _ in range(groups)],
                responses=responses, lp_beh=[[[-5.0] * len(r) for r in grp] for grp in responses],
                rewards=rewards, group_size=m)


def build_model(full: bool, vocab: int, device: torch.device):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    shape: dict[str, Any] = (dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=6144) if full else
             dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, intermediate_size=768))
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, tie_word_embeddings=True, **shape))


def one_update(model, pool, cfg, packing: str) -> float:
    """Seconds of one update's forward + backward under `packing` (on | off)."""
    import copy

    from pipeline.models.runtime import make_runtime
    from pipeline.training.loop import TrainContext, TrainState, run_update
    from pipeline.training.reference import ReferenceCache
    c = cfg.updated({"train.packing": packing})
    rt = make_runtime(c.train)
    policy = rt.prepare(model)
    reference = rt.prepare_reference(copy.deepcopy(model))
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    st = TrainState(policy, reference, torch.optim.AdamW(policy.parameters()), ref_cache=ReferenceCache(enabled=False))
    run_update(st, TrainContext(c, pool, rt, 0), list(range(len(pool.group_ids))))
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    policy.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--median", type=int, default=160)
    ap.add_argument("--max", type=int, default=768)
    ap.add_argument("--budget", type=int, default=8192, help="train.micro_batch_tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--full", action="store_true", help="Qwen3-1.7B's shape (a GPU)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from pipeline.core.config import load_config
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vocab = 151_936 if args.full else 4096
    pool = make_pool(args.groups, 8, vocab, args.median, args.max, seed=0)
    model = build_model(args.full, vocab, device)
    cfg = load_config("tiny", {"train.groups_per_update": args.groups, "train.micro_batch_tokens": args.budget,
                               "train.method": "ggpo", "train.device": device.type})
    tokens = sum(len(r) for g in pool.responses for r in g)
    from pipeline.training.pool import micro_batches
    padded_cells = sum(len(b) * 8 * max(32 + max(len(r) for r in pool.responses[g]) for g in b)
                       for b in micro_batches(pool, list(range(args.groups)), cfg.train, packed=False))
    real = sum(pool.tokens(g) for g in range(args.groups))
    lens = sorted(len(r) for g in pool.responses for r in g)
    print(f"device {device}, {args.groups} groups x 8 responses, response tokens {tokens} (median {lens[len(lens) // 2]}, "
          f"max {lens[-1]}), budget {args.budget}; padded layout: {padded_cells} body tokens, "
          f"{100 * (1 - real / padded_cells):.1f}% padding")
    times: dict[str, list[float]] = {"off": [], "on": []}
    one_update(model, pool, cfg, "off")              # warm-up (allocator, kernels)
    for r in range(args.repeats):
        for packing in (("off", "on") if r % 2 == 0 else ("on", "off")):
            times[packing].append(one_update(model, pool, cfg, packing))
    rate = {k: tokens / statistics.median(v) for k, v in times.items()}
    print(f"padded: {rate['off']:.0f} response tokens/s; packed: {rate['on']:.0f} response tokens/s; "
          f"packed / padded = {rate['on'] / rate['off']:.2f} (median of {args.repeats}, alternating)")


if __name__ == "__main__":
    main()
