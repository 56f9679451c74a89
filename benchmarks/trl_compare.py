"""One online step of TRL's GRPOTrainer against ggpo's, side by side in one run (#26).

The same geometry on the tiny model of the preset (tiny-regime: countdown): 32 prompts x 8
completions = 256 per step, up to 24 new tokens at temperature 1, then one optimizer step
on all 256 (AdamW at the preset's lr, the reference forward for beta = 0.01); generation and
training both counted. The runs interleave: TRL trains, and after each of its steps a
callback runs one ggpo step (the same 32 prompts), timed apart, so load on the machine
falls on both alike.

ggpo's step is its library's: the resident transformers sampler (rollout.dtype, synced
to the learner), countdown's in-thread grading, the pool written and read back as an
online round's is, and one update of pipeline/training/loop (GGPO's loss). TRL's is
GRPOTrainer.train's own step (generation with the training model, its loss, AdamW).
TRL is not a dependency of the project: install it where you run this
(`pip install trl==1.16`; it leaves torch and transformers as they are).

    .venv/bin/python benchmarks/trl_compare.py [--steps 6] [--preset tiny-regime]

Prints the median seconds per step of each (the first step of each skipped: start-up)
and the ratio ggpo / TRL (the issue's target: <= 0.85).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS_PER_STEP, M = 32, 8


def ggpo_stepper(cfg, base, folder: Path):
    """A function step(problems, seed) -> seconds: one ggpo online step on `problems`."""
    from pipeline.core.schemas import TRAIN_POOL, write_parquet
    from pipeline.core.store import model_path
    from pipeline.models.engines import SamplingParams
    from pipeline.models.engines.hf import TransformersEngine
    from pipeline.models.runtime import make_runtime
    from pipeline.tasks.grading import grade_many
    from pipeline.training.loop import TrainContext, load_pool, new_state, run_updates
    from stages.rollout import prompt_table, rollout_table

    rc, tc, path = cfg.rollout, cfg.train, model_path(base)
    rt = make_runtime(tc)
    st = new_state(cfg, path, path, rt)
    engine = TransformersEngine(path, rc.batch_prompts, cfg.model.threads, dtype=rc.dtype)
    tok = engine.tokenizer

    def step(problems, seed: int) -> float:
        t0 = time.perf_counter()
        engine.load_weights(list(st.model.named_parameters()))
        prompts = prompt_table(problems, tok, cfg.task.prompt)
        params = SamplingParams(M, rc.temperature, rc.top_p, rc.max_new_tokens, seed)
        rows = rollout_table(prompts, engine.generate(prompts["prompt"], params), params, engine)
        graded = grade_many(rows["response_text"], [(prompts["answer"][g],) for g in rows["group"]],
                            cfg.verify.timeout_s, cfg.verify.workers)
        rows["reward"], rows["status"] = [g[0] for g in graded], [g[1] for g in graded]
        write_parquet({k: rows[k] for k in TRAIN_POOL.names}, TRAIN_POOL, folder / "pool.parquet")
        pool = load_pool(folder / "pool.parquet", M, tc.needs_behavior_logprobs())
        every = list(range(len(problems)))
        run_updates(st, TrainContext(cfg, pool, rt, tok.pad_token_id, groups_of=lambda u: every,
                                     step_groups_of=lambda u: every, desc="ggpo step"), st.update + 1)
        return time.perf_counter() - t0
    return step


def trl_trainer(cfg, base, problems, folder: Path, steps: int, callback):
    """GRPOTrainer on the preset's base model with the same geometry, `callback` attached."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.core.store import model_path
    from pipeline.models.hf import load_model, load_tokenizer
    from pipeline.tasks import catalog
    from pipeline.tasks.grading import grade_many

    path = model_path(base)

    def reward(completions, answer, **_):      # ggpo's grader (countdown's: in this thread)
        return [g.reward for g in grade_many(completions, [(a,) for a in answer], cfg.verify.timeout_s, workers=1)]
    data = Dataset.from_dict({"prompt": [catalog.format_prompt(p.problem, cfg.task.prompt) for p in problems],
                              "answer": [p.answer for p in problems]})
    args = GRPOConfig(output_dir=str(folder), per_device_train_batch_size=PROMPTS_PER_STEP * M, num_generations=M,
                      steps_per_generation=1, gradient_accumulation_steps=1, max_completion_length=cfg.rollout.max_new_tokens,
                      temperature=cfg.rollout.temperature, beta=cfg.train.beta, learning_rate=cfg.train.lr,
                      max_steps=steps, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                      dataloader_num_workers=0, seed=cfg.seed, shuffle_dataset=False, bf16=False)
    return GRPOTrainer(model=load_model(path), reward_funcs=[reward], args=args, train_dataset=data,
                       processing_class=load_tokenizer(path), callbacks=[callback])


def measure(preset: str, steps: int) -> dict:
    import torch
    from transformers import TrainerCallback

    from pipeline.core.config import load_config
    from pipeline.tasks import catalog
    from stages import base_model as base_stage

    cfg = load_config(preset, ["train.method=ggpo", f"train.groups_per_update={PROMPTS_PER_STEP}",
                               "train.updates_per_step=1"])
    base = base_stage.run(cfg)
    torch.set_num_threads(cfg.model.threads)
    problems = catalog.splits(cfg.task)["train"][:PROMPTS_PER_STEP * steps]
    trl_s: list[float] = []
    ggpo_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="ggpo-trl-") as tmp:
        step = ggpo_stepper(cfg, base, Path(tmp))

        class Interleave(TrainerCallback):
            """After each TRL step, one ggpo step on the same prompts; TRL's time excludes it."""
            mark = 0.0

            def on_step_begin(self, args, state, control, **kw):
                self.mark = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                trl_s.append(time.perf_counter() - self.mark)
                k = state.global_step - 1
                ggpo_s.append(step(problems[k * PROMPTS_PER_STEP:(k + 1) * PROMPTS_PER_STEP], seed=k))
                print(f"step {k}: TRL {trl_s[-1]:.2f} s, ggpo {ggpo_s[-1]:.2f} s", flush=True)
        trl_trainer(cfg, base, problems, Path(tmp) / "trl", steps, Interleave()).train()
    trl_med, ggpo_med = statistics.median(trl_s[1:]), statistics.median(ggpo_s[1:])
    return {"preset": preset, "steps": steps, "completions_per_step": PROMPTS_PER_STEP * M,
            "trl_s_per_step": trl_med, "ggpo_s_per_step": ggpo_med, "ratio_ggpo_over_trl": ggpo_med / trl_med,
            "trl_s": [round(x, 3) for x in trl_s], "ggpo_s": [round(x, 3) for x in ggpo_s]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-regime")
    ap.add_argument("--steps", type=int, default=6, help="steps of each (the first is not counted)")
    args = ap.parse_args(argv)
    result = measure(args.preset, max(2, args.steps))
    print(json.dumps(result))
    print(f"ggpo / TRL per step: {result['ratio_ggpo_over_trl']:.2f}x (target <= 0.85)")
    return result


if __name__ == "__main__":
    main()
