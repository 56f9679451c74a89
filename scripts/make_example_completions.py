"""Writes data/example_completions.jsonl: completions you already have, in the one-row-per-
problem shape that `ggpo pool import` reads (data/README.md).

The 48 training problems of the built-in digit_sort task (level 1, task.split_seed 0: the
smoke preset's training prompts), 8 responses each, sampled at temperature 1 by the
built-in tiny model warmed up by the `base` stage (the smoke and tiny presets' base model,
built into $GGPO_CACHE if it is not there: about 2 minutes on 2 cores), with the stream
(0, "example_completions/sample"), and graded by math-verify (rewards 1 or 0).

    .venv/bin/python scripts/make_example_completions.py [OUT]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.core.config import load_config
from pipeline.core.seeding import derive_seed
from pipeline.core.store import model_path
from pipeline.models.engines import SamplingParams, make_engine
from pipeline.tasks import catalog
from pipeline.tasks.grading import grade_many
from stages import base_model

PROBLEMS, RESPONSES = 48, 8


def main(out: Path) -> None:
    cfg = load_config("smoke")
    engine = make_engine("transformers", model_path(base_model.run(cfg)), batch_prompts=64, threads=1, device="cpu")
    problems = catalog.splits(cfg.task)["train"][:PROBLEMS]
    params = SamplingParams(RESPONSES, 1.0, 1.0, cfg.rollout.max_new_tokens, derive_seed(0, "example_completions/sample"),
                            logprobs=False)
    outs = engine.generate([catalog.format_prompt(p.problem) for p in problems], params)
    texts = [c.text for group in outs for c in group]
    graded = grade_many(texts, [(p.answer,) for p in problems for _ in range(RESPONSES)], 5.0, workers=1)
    with open(out, "w") as f:
        for j, (p, group) in enumerate(zip(problems, outs)):
            rewards = [int(g[0]) for g in graded[j * RESPONSES:(j + 1) * RESPONSES]]
            f.write(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer,
                                "responses": [c.text for c in group], "rewards": rewards}) + "\n")
    print(f"{out}: {len(problems)} problems x {RESPONSES} responses, mean reward "
          f"{sum(g[0] for g in graded) / len(graded):.3f}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "data/example_completions.jsonl"))
