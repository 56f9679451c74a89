"""vLLM's CPU build on the built-in tiny model: engine start time, behavior log-probs
against the trainer's fp32 log-probs, the in-place sync, and a vLLM-sampled pool's
engine-trainer mismatch.

Needs .venv-vllm (`make install VLLM=cpu`). The base model comes from the cache
(GGPO_CACHE, or a fresh temporary one with --fresh); nothing is written elsewhere.

    .venv-vllm/bin/python benchmarks/vllm_cpu.py [--fresh] [--prompts 48] [--n 8]

Prints one JSON object: start_seconds (make_engine, in-process engine), logprob_max_abs_diff /
logprob_mean_abs_diff (every sampled token of prompts x n samples at T = 1, vLLM against
the trainer's log softmax in fp32), sync_seconds (load_weights of the learner's
named_parameters into the running engine, mean of 3), and the pool's mismatch over all
its tokens (pool_k3 = mean(rho - 1 - log rho), pool_abs_log_ratio = mean |log rho|,
rho = exp(lp_trainer - lp_behavior)) next to the rollout stage's own sampled estimate.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any


def trainer_logprobs(model, prompt_ids, responses, temperature, train_cfg):
    import torch

    from pipeline.models.runtime import make_runtime
    from pipeline.training.loop import policy_logprobs
    from pipeline.training.policy import make_batch
    out = []
    for start in range(0, len(responses), 64):
        batch = make_batch(prompt_ids[start:start + 64], responses[start:start + 64], 0)
        with torch.no_grad():
            lp, _ = policy_logprobs(model, batch, make_runtime(train_cfg), temperature)
        out += [lp[i, :len(r)].tolist() for i, r in enumerate(responses[start:start + 64])]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fresh", action="store_true", help="a new temporary cache (builds the base model)")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--n", type=int, default=8)
    args = parser.parse_args()
    if args.fresh:
        os.environ["GGPO_CACHE"] = tempfile.mkdtemp(prefix="ggpo-vllm-bench-")
    import polars as pl
    import torch

    from pipeline.core.config import load_config
    from pipeline.models.engines import SamplingParams, make_engine
    from pipeline.models.engines.vllm_engine import VLLMEngine
    from pipeline.models.hf import load_model
    from pipeline.tasks import catalog
    from stages import base_model, rollout
    from stages.base_model import model_path

    cfg = load_config("smoke", {"rollout.engine": "vllm"})
    folder = model_path(base_model.run(cfg))
    model = load_model(folder).eval()
    t0 = time.perf_counter()
    engine = make_engine("vllm", folder, rollout_cfg=cfg.rollout, seed=cfg.seed, resident=True)
    assert isinstance(engine, VLLMEngine)
    result: dict[str, Any] = {"start_seconds": round(time.perf_counter() - t0, 1)}
    problems = catalog.splits(cfg.task)["train"][:args.prompts]
    prompts = [catalog.format_prompt(p.problem) for p in problems]
    outs = engine.generate(prompts, SamplingParams(args.n, 1.0, 1.0, cfg.rollout.max_new_tokens, 1))
    ids = [engine.tokenizer(p)["input_ids"] for p in prompts]
    rows = [(p, c) for p, g in zip(ids, outs) for c in g]
    want = trainer_logprobs(model, [p for p, _ in rows], [c.token_ids for _, c in rows], 1.0, cfg.train)
    d = [abs(a - b) for (_, c), w in zip(rows, want) for a, b in zip(c.logprobs, w)]
    result |= {"logprob_tokens": len(d), "logprob_max_abs_diff": max(d), "logprob_mean_abs_diff": sum(d) / len(d)}
    named = list(model.named_parameters())
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        engine.load_weights(named)
        times.append(time.perf_counter() - t0)
    result["sync_seconds"] = round(sum(times) / len(times), 4)
    engine.close()

    pool = rollout.run(cfg, {"base": base_model.run(cfg)})
    table = pl.read_parquet(pool.path("rollouts"))
    want = trainer_logprobs(model, table["prompt_token_ids"].to_list(), table["response_token_ids"].to_list(),
                            cfg.rollout.temperature, cfg.train)
    log_rho = torch.tensor([w - b for w_row, b_row in zip(want, table["behavior_logprobs"].to_list())
                            for w, b in zip(w_row, b_row)], dtype=torch.float64)
    result |= {"pool_responses": table.height, "pool_tokens": log_rho.numel(),
               "pool_k3": float((log_rho.exp() - 1 - log_rho).mean()), "pool_abs_log_ratio": float(log_rho.abs().mean()),
               "pool_max_abs_log_ratio": float(log_rho.abs().max()),
               "rollout_summary": {k: v for k, v in pool.summary.items() if k.startswith("mismatch")}}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":      # vLLM's engine core is a spawned process
    main()
