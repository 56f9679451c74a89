"""Stage `verify`: the verifiable reward of every response.

Reads `verify`; input `rollout`. Writes `rewards.parquet` (schema REWARDS): reward in
{0, 1} from math-verify against the prompt's reference answer, `status` in ok |
no_answer | parse_error | timeout, and grading `seconds` (CPU seconds). Grading runs in
the process's shared worker pool (all cores by default; started once, reused by later
verify and evaluate stages) with a per-response CPU-time limit of `verify.timeout_s`; a
response over it is graded once more in fresh workers with `verify.retry_timeout_s`, so
the rewards do not depend on how busy the machine is. A response that has no box, does
not parse or runs too long gets reward 0 and its status. The summary counts statuses,
retries and final timeouts. Progress: "verify: grade" in responses.
"""
from __future__ import annotations

from pathlib import Path

import polars as pl

from pipeline.core.config import PipelineConfig
from pipeline.core.schemas import REWARDS, write_parquet
from pipeline.core.store import Manifest, Store
from pipeline.dag.spec import Built, StageSpec, run_stage
from pipeline.services import progress
from pipeline.tasks.grading import grade_many, summary


def build(cfg: PipelineConfig, inputs: dict[str, Manifest], folder: Path) -> Built:
    roll = inputs["rollout"]
    answers = pl.read_parquet(roll.path("prompts"), columns=["group", "answer"])
    rows = (pl.read_parquet(roll.path("rollouts"), columns=["prompt_id", "group", "sample", "response_text"])
            .join(answers, on="group", how="left").sort(["group", "sample"]))
    with progress.Progress("verify: grade", total=rows.height, unit="response") as bar:
        graded = grade_many(rows["response_text"].to_list(), [(a,) for a in rows["answer"].to_list()],
                            cfg.verify.timeout_s, cfg.verify.workers, progress=bar.update,
                            retry_timeout_s=cfg.verify.retry_timeout_s)
    table = {
        "prompt_id": rows["prompt_id"].to_list(), "group": rows["group"].to_list(),
        "sample": rows["sample"].to_list(), "reward": [g[0] for g in graded],
        "status": [g[1] for g in graded], "seconds": [g[2] for g in graded],
    }
    n = write_parquet(table, REWARDS, folder / "rewards.parquet")
    return Built(files={"rewards": ("rewards.parquet", n)},
                 summary={"responses": n, "mean_reward": sum(table["reward"]) / max(n, 1), **summary(graded)})


SPEC = StageSpec(name="verify", version=2, reads=("verify",), build=build)


def run(config: PipelineConfig, inputs: dict[str, Manifest], store: Store | None = None,
        force: bool = False) -> Manifest:
    return run_stage(SPEC, config, inputs, store, force)
