"""The sampler's lean decode step against transformers' forward, side by side (#26).

    .venv/bin/python benchmarks/decode_step.py [--preset tiny-regime] [--prompts 8 64] [--draws 8] [--reps 5]

One TransformersEngine over the preset's base model (built, or found, in the usual cache,
GGPO_CACHE), in the preset's rollout dtype, one thread. For each prompt count (m = the
preset's group size responses each, so 8 prompts are one 64-row batch, 64 prompts a 512-row
one), --draws seeded draws of countdown prompts with the lean step (engines/decode.py) and
with transformers' forward, alternated --reps times. Prints the median of the paired time
ratios lean / transformers, which load on the machine moves far less than either time, and
whether every draw gave the same tokens and log-probs (it must: the logits are equal bit for
bit, so any difference is a bug).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a plain script

import torch  # noqa: E402


def timed_draws(engine, prompts: list[str], params: list) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = [engine.generate(prompts, p) for p in params]
    return time.perf_counter() - t0, [(c.token_ids, c.logprobs) for o in outs for g in o for c in g]


def measure(preset: str, prompt_counts: list[int], draws: int, reps: int) -> dict:
    from pipeline.core.config import load_config
    from pipeline.models.engines import SamplingParams
    from pipeline.models.engines.decode import lean_supported
    from pipeline.models.engines.hf import TransformersEngine
    from pipeline.tasks import catalog
    from stages import base_model as base_stage
    from stages.base_model import model_path

    cfg = load_config(preset, [])
    engine = TransformersEngine(model_path(base_stage.run(cfg)), threads=1, dtype=cfg.rollout.dtype)
    problems = catalog.splits(cfg.task)["train"]
    result: dict = {"preset": preset, "dtype": cfg.rollout.dtype, "group_size": cfg.rollout.group_size,
                    "lean_supported": lean_supported(engine.model)}     # else both runs are transformers'

    for n in prompt_counts:
        prompts = [catalog.format_prompt(p.problem) for p in problems[:n]]
        params = [SamplingParams(cfg.rollout.group_size, cfg.rollout.temperature, 1.0, cfg.rollout.max_new_tokens,
                                 seed) for seed in range(draws)]
        ratios, same = [], True
        for rep in range(reps):
            order = (True, False) if rep % 2 == 0 else (False, True)
            seconds, drawn = {}, {}
            for lean in order:
                engine.lean = lean
                seconds[lean], drawn[lean] = timed_draws(engine, prompts, params)
            ratios.append(seconds[True] / seconds[False])
            same = same and drawn[True] == drawn[False]
        result[f"rows_{n * cfg.rollout.group_size}"] = {"lean_over_transformers": round(statistics.median(ratios), 3),
                                                         "ratios": [round(r, 3) for r in ratios], "same_draws": same}
        print(f"{n} prompts x {cfg.rollout.group_size}: lean / transformers {statistics.median(ratios):.2f}x "
              f"(median of {reps}), same draws: {same}", flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-regime")
    ap.add_argument("--prompts", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.preset, args.prompts, args.draws, args.reps)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
