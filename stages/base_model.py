"""Stage `base`: the base policy pi_0.

Reads `model`, `task`. Writes `model/` (an HF folder) and `sft.parquet` (warm-up log).
With `model.name_or_path` set, the stage only records that path (an HF folder or hub id)
and writes nothing else. Otherwise it builds the built-in tiny Qwen3 and warms it up by
supervised learning on fresh task problems (never eval problems): token cross-entropy on
the target response and <eos> after the prompt (`\\boxed{answer}`; for
countdown_work:W a search trace, catalog.sft_targets), AdamW, linear warm-up then cosine decay. Every
`sft_check_every` steps it samples `check_samples` answers (T = 1) for `check_prompts`
training prompts and stops once the sampled accuracy reaches `target_accuracy`: the model
is then uncertain rather than wrong (greedy above sampled), which is the room RL needs
(docs/measurements.md, The tiny model). The SFT target is a correct response (for countdown a random
one of many per problem, catalog.sft_stream, so the warm-up teaches variety). The summary
reports, for the check prompts with GROUP_CHECK = 8 samples each at T = 1, what RL will see:
mean@8, the share of mixed groups, and the mean number of distinct correct responses per
group with a success (`check_mean_at_8`, `check_mixed_fraction`, `check_distinct_correct`),
with the mean response length in tokens (`check_mean_length`) and the distinct boxed
answers among a group's correct responses (`check_distinct_boxed`: a search trace's text
differs almost always, its answer less often). Check samples may take
catalog.response_budget tokens (24, or a search trace's budget).
Deterministic on CPU for a given config.
"""
from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import torch

from pipeline.core import interrupt
from pipeline.core.config import ModelConfig, PipelineConfig
from pipeline.core.errors import ParseError
from pipeline.core.schemas import write_parquet
from pipeline.core.seeding import derive_seed
from pipeline.core.store import Manifest, Store, model_path  # noqa: F401 - also imported from here (tests, scripts)
from pipeline.dag.spec import Built, StageSpec, run_stage
from pipeline.models.engines import SamplingParams
from pipeline.models.engines.hf import TransformersEngine
from pipeline.models.tiny_model import build_model, build_tokenizer, save
from pipeline.services.progress import Progress
from pipeline.tasks import catalog, countdown
from pipeline.tasks.grading import grade_many, warm_up
from pipeline.training import optim
from pipeline.training.policy import make_batch, token_logprobs

GROUP_CHECK = 8      # samples per check prompt for the final group statistics (mean@8)
SFT_LOG = pa.schema([("step", pa.int32()), ("loss", pa.float64()), ("lr", pa.float64()),
                     ("sampled_accuracy", pa.float64())])


def lr_at(step: int, cfg: ModelConfig) -> float:
    if step < cfg.sft_warmup:
        return cfg.sft_lr * (step + 1) / cfg.sft_warmup
    progress = min(1.0, (step - cfg.sft_warmup) / max(1, cfg.sft_decay_steps - cfg.sft_warmup))
    return cfg.sft_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def sample_groups(engine, problems: list[tuple[str, str]], n: int, temperature: float,
                  seed: int, max_new_tokens: int = 24) -> list[list[tuple[str, float]]]:
    """n graded samples per problem: one list of (response text, reward) per problem."""
    prompts = [catalog.format_prompt(problem) for problem, _ in problems]
    outs = engine.generate(prompts, SamplingParams(n, temperature, 1.0, max_new_tokens, seed, logprobs=False))
    texts = [c.text for group in outs for c in group]
    answers = [(answer,) for (_, answer), group in zip(problems, outs) for _ in group]
    rewards = iter(g[0] for g in grade_many(texts, answers, 5.0, workers=1))
    return [[(c.text, next(rewards)) for c in group] for group in outs]


def accuracy(engine, problems: list[tuple[str, str]], n: int, temperature: float, seed: int,
             max_new_tokens: int = 24) -> float:
    rewards = [r for group in sample_groups(engine, problems, n, temperature, seed, max_new_tokens)
               for _, r in group]
    return sum(rewards) / len(rewards)


def boxed(text: str) -> str | None:
    """The last box's content (None without one or for a box that never closes)."""
    try:
        return countdown.last_box(text)
    except ParseError:
        return None


def group_stats(groups: list[list[tuple[str, float]]], tok=None) -> dict[str, float]:
    """What RL will see of the base policy (issue #17): mean@m, the share of mixed groups
    (0 < successes < m: the ones training keeps) and the mean number of distinct correct
    responses in a group with a success (1 on a task with one right string)."""
    m = len(groups[0])
    wins = [[text for text, r in group if r > 0.5] for group in groups]
    solved = [w for w in wins if w]
    out = {f"check_mean_at_{m}": sum(map(len, wins)) / (m * len(groups)),
           "check_mixed_fraction": sum(0 < len(w) < m for w in wins) / len(groups),
           "check_distinct_correct": sum(len(set(w)) for w in solved) / len(solved) if solved else 0.0,
           "check_distinct_boxed": sum(len({boxed(t) for t in w}) for w in solved) / len(solved) if solved else 0.0}
    if tok is not None:     # without the end token: the tiny tokenizer's tokens are characters
        texts = [text for group in groups for text, _ in group]
        out["check_mean_length"] = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts) / len(texts)
    return out


def sft_step(model, opt, tok, batch: list[tuple[str, str]], lr: float) -> float:
    prompt_ids = [tok(catalog.format_prompt(p))["input_ids"] for p, _ in batch]
    target_ids = [tok(target)["input_ids"] + [tok.eos_token_id] for _, target in batch]
    b = make_batch(prompt_ids, target_ids, tok.pad_token_id)
    lp, _ = token_logprobs(model, b)
    loss = -(lp * b.mask).sum() / b.mask.sum()
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def warm_up_tiny(cfg: PipelineConfig, folder: Path) -> tuple[dict, dict]:
    mc = cfg.model
    torch.set_num_threads(mc.threads)
    warm_up()
    eval_problems = {p.problem for p in catalog.splits(cfg.task)["eval"]}
    check = catalog.sample_problems(cfg.task, "sft-check", mc.check_prompts, eval_problems)
    stream = catalog.sft_targets(cfg.task, eval_problems)
    budget = catalog.response_budget(cfg.task)
    tok = build_tokenizer()
    model = build_model(mc, len(tok))
    opt = optim.AdamW(model.parameters(), lr=mc.sft_lr, betas=(0.9, 0.99), weight_decay=0.0)   # pipeline/training/optim.py
    # the tiny model's warm-up stays on the CPU on every machine: the base is the same everywhere
    engine = TransformersEngine.from_model(model, tok, [tok.eos_token_id])
    log: dict[str, list[float]] = {"step": [], "loss": [], "lr": [], "sampled_accuracy": []}
    acc, step = 0.0, 0
    # the count is an upper bound: warm-up stops once the sampled accuracy reaches the target
    with Progress("base: warm-up (stops at the target accuracy)", total=mc.sft_max_steps, unit="step") as bar:
        for step in range(1, mc.sft_max_steps + 1):
            interrupt.check(f"base warm-up at step {step - 1} (it starts over)")
            model.train()
            loss = sft_step(model, opt, tok, [next(stream) for _ in range(mc.sft_batch_size)], lr_at(step - 1, mc))
            acc = float("nan")
            if step % mc.sft_check_every == 0 or step == mc.sft_max_steps:
                acc = accuracy(engine, check, mc.check_samples, 1.0, derive_seed(mc.init_seed, f"sft/check{step}"),
                               budget)
                bar.set_postfix(sampled_accuracy=f"{acc:.2f}", target=mc.target_accuracy)
            for k, v in zip(log, (step, loss, lr_at(step - 1, mc), acc)):
                log[k].append(v)
            bar.update(1, loss=f"{loss:.3f}")
            if acc >= mc.target_accuracy:
                break
    greedy = accuracy(engine, check, 1, 0.0, 0, budget)
    groups = group_stats(sample_groups(engine, check, GROUP_CHECK, 1.0, derive_seed(mc.init_seed, "sft/groups"),
                                       budget), tok)
    tmp = folder / "model.tmp"
    save(model, tok, tmp)
    tmp.rename(folder / "model")
    rows = write_parquet(log, SFT_LOG, folder / "sft.parquet")
    summary = {"sft_steps": step,     # the model: files["weights"] (model_path), no absolute path
               "check_sampled_accuracy": acc, "check_greedy_accuracy": greedy,
               "parameters": sum(p.numel() for p in model.parameters()), **groups}
    return {"sft_log": ("sft.parquet", rows), "weights": ("model/model.safetensors", None),
            "model_config": ("model/config.json", None), "tokenizer": ("model/tokenizer.json", None)}, summary


def build(cfg: PipelineConfig, inputs: dict[str, Manifest], folder: Path) -> Built:
    if cfg.model.name_or_path:
        return Built(files={}, summary={"model_path": cfg.model.name_or_path, "built_in": False})
    files, summary = warm_up_tiny(cfg, folder)
    return Built(files=files, summary=summary | {"built_in": True})


# not task.n_train: pools of any size share one base model
SPEC = StageSpec(name="base", numerics=True, version=2, build=build, reads=(
    "model", "task.name", "task.difficulty", "task.split_seed", "task.n_eval"))


def run(config: PipelineConfig, inputs: dict[str, Manifest] | None = None,
        store: Store | None = None, force: bool = False) -> Manifest:
    return run_stage(SPEC, config, inputs or {}, store, force)
