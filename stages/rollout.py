"""Stage `rollout`: the behavior policy pi_beh = pi_0 samples m responses per prompt.

Reads `task`, `rollout`, `seed`; input `base`. Writes `prompts.parquet` (one row per
prompt: id, group index, problem, reference answer, prompt text and token ids) and
`rollouts.parquet` (schema ROLLOUTS: one row per response with its group and sample
index, response token ids, each sampled token's behavior log-prob, finish reason, and the
sampling params and engine name). Sampling uses the stream (seed, "rollout/sample"), so
the same config and seed give a byte-identical pool on CPU. The summary records the
engine-trainer mismatch on a sample of responses (`engine_mismatch`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from pipeline.core.config import PipelineConfig
from pipeline.core.schemas import PROMPTS, ROLLOUTS, write_parquet
from pipeline.core.seeding import derive_seed, py_random
from pipeline.core.store import Manifest, Store, model_path
from pipeline.dag.spec import Built, StageSpec, run_stage
from pipeline.models.engines import SamplingParams, make_engine
from pipeline.models.hf import load_model
from pipeline.models.runtime import make_runtime
from pipeline.services import progress
from pipeline.tasks import catalog
from pipeline.training.loop import policy_logprobs
from pipeline.training.policy import make_batch


def prompt_table(problems: list[catalog.Problem], tokenizer, style: str = "task") -> dict[str, list]:
    texts = [catalog.format_prompt(p.problem, style) for p in problems]
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


def engine_mismatch(cfg: PipelineConfig, path: str, prompts: dict[str, list], outs, pad_id: int) -> dict:
    """Engine-trainer mismatch on a seeded sample of `rollout.mismatch_sample` responses: the
    trainer's log-probs (train.device / dtype, the chunked LM head) against the engine's
    behavior log-probs. rho = exp(lp_trainer - lp_beh) per token; K3 = mean(rho - 1 - log rho)
    estimates KL(pi_beh || pi_trainer) (spec 9); also the share of rho outside [0.9, 1.1]."""

    flat = [(g, i) for g, group in enumerate(outs) for i, c in enumerate(group) if c.token_ids]
    if cfg.rollout.mismatch_sample == 0 or not flat:
        return {}
    picks = sorted(py_random(cfg.seed, "rollout/mismatch").sample(flat, min(cfg.rollout.mismatch_sample, len(flat))))
    rt = make_runtime(cfg.train)
    model = rt.prepare(load_model(path)).eval()       # the trainer's weights and precision
    ratios: list[float] = []
    for start in range(0, len(picks), 8):
        chunk = picks[start:start + 8]
        batch = make_batch([prompts["prompt_token_ids"][g] for g, _ in chunk],
                           [outs[g][i].token_ids for g, i in chunk], pad_id)
        with torch.no_grad():
            lp, _ = policy_logprobs(model, batch, rt, cfg.rollout.temperature)
        for row, (g, i) in zip(lp.tolist(), chunk):
            ratios += [a - b for a, b in zip(row, outs[g][i].logprobs)]
    log_rho = torch.tensor(ratios, dtype=torch.float64).clamp(-20, 20)
    rho = log_rho.exp()
    return {"mismatch_responses": len(picks), "mismatch_k3": float((rho - 1 - log_rho).mean()),
            "mismatch_abs_log_ratio": float(log_rho.abs().mean()),
            "mismatch_ratio_outside_0.9_1.1": float(((rho < 0.9) | (rho > 1.1)).double().mean())}


def build(cfg: PipelineConfig, inputs: dict[str, Manifest], folder: Path) -> Built:
    rc = cfg.rollout
    engine = make_engine(rc.engine, model_path(inputs["base"]), rc.batch_prompts, cfg.model.threads,
                         rollout_cfg=rc, device=cfg.train.device, seed=cfg.seed)
    problems = catalog.splits(cfg.task)["train"]
    prompts = prompt_table(problems, engine.tokenizer, cfg.task.prompt)
    params = SamplingParams(rc.group_size, rc.temperature, rc.top_p, rc.max_new_tokens,
                            derive_seed(cfg.seed, "rollout/sample"))
    with progress.Progress(f"rollout seed {cfg.seed}", total=len(problems), unit="prompt") as bar:
        outs = progress.generate(engine, prompts["prompt"], params, bar)
    getattr(engine, "close", lambda: None)()      # a vLLM engine hands its GPUs back to the trainer
    n_prompts = write_parquet(prompts, PROMPTS, folder / "prompts.parquet")
    n_rows = write_parquet(rollout_table(prompts, outs, params, engine), ROLLOUTS, folder / "rollouts.parquet")
    lengths = [len(c.token_ids) for g in outs for c in g]
    mismatch = engine_mismatch(cfg, model_path(inputs["base"]), prompts, outs, engine.tokenizer.pad_token_id)
    return Built(
        files={"prompts": ("prompts.parquet", n_prompts), "rollouts": ("rollouts.parquet", n_rows)},
        summary={"prompts": n_prompts, "responses": n_rows, "group_size": rc.group_size,
                 "mean_response_length": sum(lengths) / len(lengths), "engine": engine.name,
                 "logprobs_mode": engine.logprobs_mode, **mismatch, **catalog.file_report(cfg.task)},
    )


# version 2 (online_pool 4): the transformers sampler drops finished rows (#26); the same tokens,
# but fp32 log-probs computed at another batch size may differ in their last bits
SPEC = StageSpec(name="rollout", numerics=True, version=2, reads=("seed", "task", "rollout"), build=build)


def run(config: PipelineConfig, inputs: dict[str, Manifest], store: Store | None = None,
        force: bool = False) -> Manifest:
    return run_stage(SPEC, config, inputs, store, force)
