"""One online step of TRL's GRPOTrainer against ggpo's, side by side in one run, like with like.

The same geometry on the tiny model of the preset (tiny-regime: countdown): 32 prompts x m = 8
completions = 256 per step, up to `rollout.max_new_tokens` new tokens at temperature 1, then
one optimizer step on all 256 (the reference forward for beta = 0.01); generation and
training both counted. The runs interleave: TRL trains, and after each of its steps a
callback runs one ggpo step (the same 32 prompts), timed apart, so load on the machine
falls on both alike.

Like with like (each side set explicitly, and printed with the result, `settings`):
- gradient checkpointing off on both (GRPOConfig's default is on; ggpo's is off);
- the same micro-batching: `--micro-batch-rows` rows (default 64 = 8 groups) per forward and
  backward, gradients accumulated over 256 / rows micro-batches into one optimizer step
  (TRL: per_device_train_batch_size and gradient_accumulation_steps, one generation per
  optimizer step; ggpo: train.micro_batch_groups, train.packing=off: one padded batch per
  micro-batch, as TRL pads, not ggpo's CPU length buckets);
- fp32 everywhere: the trainer (TRL bf16=False, ggpo train.dtype=float32) and the sampler
  (TRL generates with the training model; ggpo rollout.dtype=float32, where tiny-regime
  samples in bf16);
- the same optimizer: AdamW at the preset's lr, betas train.adam_betas, weight decay
  train.weight_decay, eps 1e-8, gradient clip train.grad_clip, a constant lr schedule (TRL's
  default is linear decay) with no warm-up.
What still differs is each library's own: the loss (GGPO against TRL's default GRPO loss;
both one forward of policy and reference per row), TRL's generate() against ggpo's sampler,
and ggpo's grading and pool round trip.

ggpo's step is its library's: the resident transformers sampler (synced to the learner),
countdown's in-thread grading, the pool written and read back as an online round's is, and
one update of pipeline/training/loop (GGPO's loss). TRL's is GRPOTrainer.train's own step.
TRL is not a dependency of the project: install it where you run this
(`pip install trl==1.16`; it leaves torch and transformers as they are).

    .venv/bin/python benchmarks/trl_compare.py [--steps 6] [--preset tiny-regime] [--micro-batch-rows 64]

Prints the median seconds per step of each (the first step of each skipped: start-up), the
ratio ggpo / TRL, and the settings both ran with.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS_PER_STEP = 32


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
    m = rc.group_size
    rt = make_runtime(tc)
    st = new_state(cfg, path, path, rt)
    engine = TransformersEngine(path, rc.batch_prompts, cfg.model.threads, dtype=rc.dtype)
    tok = engine.tokenizer

    def step(problems, seed: int) -> float:
        t0 = time.perf_counter()
        engine.load_weights(list(st.model.named_parameters()))
        prompts = prompt_table(problems, tok, cfg.task.prompt)
        params = SamplingParams(m, rc.temperature, rc.top_p, rc.max_new_tokens, seed)
        rows = rollout_table(prompts, engine.generate(prompts["prompt"], params), params, engine)
        graded = grade_many(rows["response_text"], [(prompts["answer"][g],) for g in rows["group"]],
                            cfg.verify.timeout_s, cfg.verify.workers)
        rows["reward"], rows["status"] = [g[0] for g in graded], [g[1] for g in graded]
        write_parquet({k: rows[k] for k in TRAIN_POOL.names}, TRAIN_POOL, folder / "pool.parquet")
        pool = load_pool(folder / "pool.parquet", m, tc.needs_behavior_logprobs())
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
    args = GRPOConfig(output_dir=str(folder), report_to=[], save_strategy="no", use_cpu=True, logging_steps=1,
                      dataloader_num_workers=0, seed=cfg.seed, shuffle_dataset=False, max_steps=steps,
                      **trl_settings(cfg))
    return GRPOTrainer(model=load_model(path), reward_funcs=[reward], args=args, train_dataset=data,
                       processing_class=load_tokenizer(path), callbacks=[callback])


def ggpo_overrides(micro_batch_rows: int, m: int) -> list[str]:
    """The ggpo side of the like-with-like settings (module doc)."""
    return ["train.method=ggpo", f"train.groups_per_update={PROMPTS_PER_STEP}", "train.updates_per_step=1",
            f"train.micro_batch_groups={micro_batch_rows // m}", "train.packing=off",
            "train.gradient_checkpointing=false", "train.dtype=float32", "rollout.dtype=float32"]


def trl_settings(cfg) -> dict:
    """GRPOConfig's arguments that must match ggpo's config (module doc)."""
    tc, m = cfg.train, cfg.rollout.group_size
    rows = tc.micro_batch_groups * m
    return {"per_device_train_batch_size": rows, "gradient_accumulation_steps": PROMPTS_PER_STEP * m // rows,
            "num_generations": m, "max_completion_length": cfg.rollout.max_new_tokens,
            "temperature": cfg.rollout.temperature, "beta": tc.beta, "learning_rate": tc.lr,
            "lr_scheduler_type": "constant", "warmup_steps": 0, "adam_beta1": tc.adam_betas[0],
            "adam_beta2": tc.adam_betas[1], "adam_epsilon": 1e-8, "weight_decay": tc.weight_decay,
            "max_grad_norm": tc.grad_clip, "gradient_checkpointing": False, "bf16": False}


def settings(cfg) -> dict:
    """What both sides ran with, printed beside the result."""
    tc, m = cfg.train, cfg.rollout.group_size
    return {"completions_per_step": PROMPTS_PER_STEP * m, "micro_batch_rows": tc.micro_batch_groups * m,
            "micro_batches_per_step": PROMPTS_PER_STEP // tc.micro_batch_groups,
            "gradient_checkpointing": tc.gradient_checkpointing, "train_dtype": tc.dtype,
            "sampler_dtype": cfg.rollout.dtype, "ggpo_packing": tc.packing, "lr": tc.lr,
            "lr_schedule": "constant", "adam_betas": list(tc.adam_betas), "weight_decay": tc.weight_decay,
            "grad_clip": tc.grad_clip, "beta": tc.beta, "max_new_tokens": cfg.rollout.max_new_tokens,
            "temperature": cfg.rollout.temperature, "torch_threads": cfg.model.threads}


def measure(preset: str, steps: int, micro_batch_rows: int = 64) -> dict:
    import torch
    from transformers import TrainerCallback

    from pipeline.core.config import load_config
    from pipeline.tasks import catalog
    from stages import base_model as base_stage

    m = load_config(preset).rollout.group_size
    if micro_batch_rows % m or (PROMPTS_PER_STEP * m) % micro_batch_rows:
        raise SystemExit(f"--micro-batch-rows must be a multiple of m = {m} dividing {PROMPTS_PER_STEP * m}")
    cfg = load_config(preset, ggpo_overrides(micro_batch_rows, m))
    base = base_stage.run(cfg)
    torch.set_num_threads(cfg.model.threads)
    problems = catalog.splits(cfg.task)["train"][:PROMPTS_PER_STEP * steps]
    trl_s: list[float] = []
    ggpo_s: list[float] = []
    checkpointing: list[bool] = []
    with tempfile.TemporaryDirectory(prefix="ggpo-trl-") as tmp:
        step = ggpo_stepper(cfg, base, Path(tmp))

        class Interleave(TrainerCallback):
            """After each TRL step, one ggpo step on the same prompts; TRL's time excludes it."""
            mark = 0.0

            def on_step_begin(self, args, state, control, **kw):
                self.mark = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                trl_s.append(time.perf_counter() - self.mark)
                model = kw.get("model")       # checkpointing as TRL really trained (must be off)
                checkpointing.append(bool(getattr(model, "is_activation_checkpointing",
                                                  getattr(model, "is_gradient_checkpointing", False))))
                k = state.global_step - 1
                ggpo_s.append(step(problems[k * PROMPTS_PER_STEP:(k + 1) * PROMPTS_PER_STEP], seed=k))
                print(f"step {k}: TRL {trl_s[-1]:.2f} s, ggpo {ggpo_s[-1]:.2f} s", flush=True)
        trl_trainer(cfg, base, problems, Path(tmp) / "trl", steps, Interleave()).train()
    trl_med, ggpo_med = statistics.median(trl_s[1:]), statistics.median(ggpo_s[1:])
    if any(checkpointing):
        raise SystemExit("TRL's model trained with activation checkpointing on: not like with like")
    return {"preset": preset, "steps": steps, "settings": settings(cfg),
            "trl_s_per_step": trl_med, "ggpo_s_per_step": ggpo_med, "ratio_ggpo_over_trl": ggpo_med / trl_med,
            "trl_s": [round(x, 3) for x in trl_s], "ggpo_s": [round(x, 3) for x in ggpo_s]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-regime")
    ap.add_argument("--steps", type=int, default=6, help="steps of each (the first is not counted)")
    ap.add_argument("--micro-batch-rows", type=int, default=64,
                    help="rows per forward/backward on both sides (a multiple of m dividing 256)")
    args = ap.parse_args(argv)
    result = measure(args.preset, max(2, args.steps), args.micro_batch_rows)
    print(json.dumps(result))
    print("settings (both sides): " + ", ".join(f"{k}={v}" for k, v in result["settings"].items()))
    print(f"ggpo / TRL per step: {result['ratio_ggpo_over_trl']:.2f}x ({result['ggpo_s_per_step']:.2f} s "
          f"against {result['trl_s_per_step']:.2f} s, medians of {len(result['trl_s']) - 1} steps)")
    return result


if __name__ == "__main__":
    main()
