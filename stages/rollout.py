"""Stage `rollout`: the behavior policy pi_beh = pi_0 samples m responses per prompt.

Reads `task`, `rollout`, `seed`; input `base`. Writes `prompts.parquet` (one row per
prompt: id, group index, problem, reference answer, prompt text and token ids) and
`rollouts.parquet` (schema ROLLOUTS: one row per response with its group and sample
index, response token ids, each sampled token's behavior log-prob, finish reason, and the
sampling params and engine name). Sampling uses the stream (seed, "rollout/sample"), so
the same config and seed give a byte-identical pool on CPU.
"""
from __future__ import annotations

from pathlib import Path

from pipeline import tasks
from pipeline.config import PipelineConfig
from pipeline.engines import SamplingParams, make_engine
from pipeline.schemas import PROMPTS, ROLLOUTS, write_parquet
from pipeline.seeding import derive_seed
from pipeline.stage import Built, StageSpec, run_stage
from pipeline.store import Manifest, Store
from stages.base import model_path


def prompt_table(problems: list[tasks.Problem], tokenizer) -> dict[str, list]:
    texts = [tasks.format_prompt(p.problem) for p in problems]
    return {
        "prompt_id": [p.id for p in problems], "group": list(range(len(problems))),
        "problem": [p.problem for p in problems], "answer": [p.answer for p in problems],
        "prompt": texts, "prompt_token_ids": [tokenizer(t)["input_ids"] for t in texts],
    }


def rollout_table(prompts: dict[str, list], outs, params: SamplingParams, engine) -> dict[str, list]:
    cols: dict[str, list] = {name: [] for name in ROLLOUTS.names}
    for g, (pid, ids, group) in enumerate(zip(prompts["prompt_id"], prompts["prompt_token_ids"], outs)):
        for i, c in enumerate(group):
            row = {
                "prompt_id": pid, "group": g, "sample": i, "prompt_token_ids": ids,
                "response_token_ids": c.token_ids, "behavior_logprobs": c.logprobs,
                "response_text": c.text, "response_length": len(c.token_ids),
                "finish_reason": c.finish_reason, "temperature": params.temperature,
                "top_p": params.top_p, "max_new_tokens": params.max_new_tokens,
                "seed": params.seed, "engine": engine.name, "logprobs_mode": engine.logprobs_mode,
            }
            for name, value in row.items():
                cols[name].append(value)
    return cols


def build(cfg: PipelineConfig, inputs: dict[str, Manifest], folder: Path) -> Built:
    rc = cfg.rollout
    engine = make_engine(rc.engine, model_path(inputs["base"]), rc.batch_prompts, cfg.model.threads)
    problems = tasks.splits(cfg.task)["train"]
    prompts = prompt_table(problems, engine.tokenizer)
    params = SamplingParams(rc.group_size, rc.temperature, rc.top_p, rc.max_new_tokens,
                            derive_seed(cfg.seed, "rollout/sample"))
    outs = engine.generate(prompts["prompt"], params)
    n_prompts = write_parquet(prompts, PROMPTS, folder / "prompts.parquet")
    n_rows = write_parquet(rollout_table(prompts, outs, params, engine), ROLLOUTS, folder / "rollouts.parquet")
    lengths = [len(c.token_ids) for g in outs for c in g]
    return Built(
        files={"prompts": ("prompts.parquet", n_prompts), "rollouts": ("rollouts.parquet", n_rows)},
        summary={"prompts": n_prompts, "responses": n_rows, "group_size": rc.group_size,
                 "mean_response_length": sum(lengths) / len(lengths), "engine": engine.name,
                 "logprobs_mode": engine.logprobs_mode},
    )


SPEC = StageSpec(name="rollout", version=1, reads=("seed", "task", "rollout"), build=build)


def run(config: PipelineConfig, inputs: dict[str, Manifest], store: Store | None = None,
        force: bool = False) -> Manifest:
    return run_stage(SPEC, config, inputs, store, force)
