"""Stage `evaluate`: mean@n of a policy on the task's held-out eval split (spec section 10).

Reads `seed`, `task`, `eval`; input `model` (a base or train manifest; `eval.target`
picks which one `ggpo stage evaluate` uses; `eval.update` a training snapshot). For
each of the first `eval.limit` eval
problems it samples `eval.n_samples` answers with the stream (seed, "eval/sample"), the
same for every model, grades them like the verify stage, and writes `eval.parquet`
(schema EVAL_SAMPLES: one row per sample). Summary: mean@n = mean over problems of c_p/n,
and pass@n.
"""
from __future__ import annotations

from pathlib import Path

import polars as pl

from pipeline import tasks
from pipeline.config import PipelineConfig
from pipeline.engines import SamplingParams, make_engine
from pipeline.grading import grade_many
from pipeline.metrics import mean_at_k, pass_at_k
from pipeline.schemas import EVAL_SAMPLES, write_parquet
from pipeline.seeding import derive_seed
from pipeline.stage import Built, StageSpec, run_stage
from pipeline.store import Manifest, Store
from stages.base import model_path


def build(cfg: PipelineConfig, inputs: dict[str, Manifest], folder: Path) -> Built:
    ec = cfg.eval
    problems = tasks.splits(cfg.task)["eval"][:ec.limit]
    engine = make_engine(cfg.rollout.engine, model_path(inputs["model"], ec.update), ec.batch_prompts, cfg.model.threads)
    params = SamplingParams(ec.n_samples, ec.temperature, ec.top_p, ec.max_new_tokens,
                            derive_seed(cfg.seed, "eval/sample"))
    outs = engine.generate([tasks.format_prompt(p.problem) for p in problems], params)
    flat = [(p, i, c) for p, group in zip(problems, outs) for i, c in enumerate(group)]
    graded = grade_many([c.text for _, _, c in flat], [(p.answer,) for p, _, _ in flat], cfg.verify.timeout_s, cfg.verify.workers)
    table = {"prompt_id": [p.id for p, _, _ in flat], "sample": [i for _, i, _ in flat],
             "reward": [g[0] for g in graded], "status": [g[1] for g in graded],
             "response_length": [len(c.token_ids) for _, _, c in flat], "response_text": [c.text for _, _, c in flat]}
    n = write_parquet(table, EVAL_SAMPLES, folder / "eval.parquet")
    per_problem = (pl.DataFrame({"prompt_id": table["prompt_id"], "reward": table["reward"]})
                   .group_by("prompt_id", maintain_order=True).agg((pl.col("reward") > 0.5).sum().alias("c")))
    correct = per_problem["c"].to_list()
    k = ec.n_samples
    return Built(files={"samples": ("eval.parquet", n)}, summary={
        "model": inputs["model"].stage, "model_key": inputs["model"].key, "problems": len(problems),
        "update": (ec.update or inputs["model"].summary["updates"]) if inputs["model"].stage == "train" else 0,
        "n_samples": k, f"mean_at_{k}": mean_at_k(correct, k),
        f"pass_at_{k}": sum(pass_at_k(k, c, k) for c in correct) / len(correct)})


SPEC = StageSpec(name="evaluate", version=1, reads=("seed", "task", "eval", "verify"), build=build)


def run(config: PipelineConfig, inputs: dict[str, Manifest], store: Store | None = None,
        force: bool = False) -> Manifest:
    return run_stage(SPEC, config, inputs, store, force)
