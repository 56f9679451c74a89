"""Stage `evaluate`: mean@n, pass@K and per-benchmark scores of a policy (spec section 10).

Reads `seed`, `task`, `eval`, `verify`; input `model` (a base or train manifest;
`eval.target` picks which one `ggpo stage evaluate` uses, `eval.update` a training
snapshot). Problems: the task's held-out eval split, or the benchmarks `eval.benchmarks`
from `eval.data_dir` (the first `eval.limit` of each). Each problem gets `eval.n_samples`
answers, generated in chunks of `batch_prompts` prompts with the streams
(seed, "eval/sample/<chunk>"), the same for every model, and graded like the verify stage
(any reference answer may match). Writes `eval.parquet` (one row per sample: benchmark,
problem id, sample index, reward, status, length) and `eval_report.md` / `.csv`
(per benchmark: problems, mean@n, pass@K; and the problem-weighted average). The prompt
template is recorded in the summary.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import polars as pl

from pipeline.core.config import PipelineConfig
from pipeline.core.metrics import pass_at_k, problem_weighted_average
from pipeline.core.schemas import EVAL_SAMPLES, write_parquet
from pipeline.core.seeding import derive_seed
from pipeline.core.store import Manifest, Store, model_path
from pipeline.dag.spec import Built, StageSpec, run_stage
from pipeline.models.engines import SamplingParams, make_engine
from pipeline.services import progress
from pipeline.tasks import benchmarks, catalog
from pipeline.tasks.grading import grade_many, summary as grading_summary

AVG = "avg"   # the problem-weighted average row of the per-benchmark table


def eval_problems(cfg: PipelineConfig) -> list[benchmarks.BenchProblem]:
    ec = cfg.eval
    if not ec.benchmarks:
        return [benchmarks.BenchProblem(p.id, "task", p.problem, (p.answer,))
                for p in catalog.splits(cfg.task)["eval"][:ec.limit]]
    return [p for name in ec.benchmarks for p in benchmarks.load(name, ec.data_dir)[:ec.limit]]


def prompt_builder(cfg: PipelineConfig, tokenizer) -> tuple[str, Callable[[str], str]]:
    """(description of the template, problem -> prompt text) for eval.prompt (catalog.prompt_builder)."""
    kind = cfg.eval.prompt
    if kind == "auto":
        kind = "chat" if cfg.eval.benchmarks else "task"
    return catalog.prompt_builder(kind, tokenizer)


def generate(engine, prompts: list[str], cfg: PipelineConfig, desc: str = "evaluate") -> tuple[list, float]:
    """All completions, chunk by chunk with progress; (completions per prompt, seconds)."""
    ec, out, start = cfg.eval, [], time.perf_counter()
    with progress.Progress(f"{desc}: generate", total=len(prompts), unit="prompt") as bar:
        for i in range(0, len(prompts), ec.batch_prompts):
            params = SamplingParams(ec.n_samples, ec.temperature, ec.top_p, ec.max_new_tokens,
                                    derive_seed(cfg.seed, f"eval/sample/{i // ec.batch_prompts}"), logprobs=False)
            out += progress.generate(engine, prompts[i:i + ec.batch_prompts], params, bar)
    return out, time.perf_counter() - start


def benchmark_table(samples: pl.DataFrame, n: int, ks: list[int]) -> pl.DataFrame:
    """Per benchmark: problems, mean@n, pass@K for K <= n; then a problem-weighted row."""
    per_problem = samples.group_by(["benchmark", "prompt_id"], maintain_order=True).agg(
        (pl.col("reward") > 0.5).sum().alias("c"))
    rows = []
    for (bench,), group in per_problem.group_by("benchmark", maintain_order=True):
        c = group["c"].to_list()
        rows.append({"benchmark": bench, "problems": len(c), f"mean_at_{n}": sum(c) / (n * len(c)),
                     **{f"pass_at_{k}": sum(pass_at_k(n, x, k) for x in c) / len(c) for k in ks}})
    sizes = {r["benchmark"]: r["problems"] for r in rows}
    avg = {"benchmark": AVG, "problems": sum(sizes.values())}
    for col in [f"mean_at_{n}"] + [f"pass_at_{k}" for k in ks]:
        avg[col] = problem_weighted_average({r["benchmark"]: r[col] for r in rows}, sizes)
    return pl.DataFrame(rows + ([avg] if len(rows) > 1 else []))


TRAINED = ("train", "online_policy")      # stages whose model has an update count


def progress_name(cfg: PipelineConfig, model: Manifest) -> str:
    """'evaluate base seed 1' or 'evaluate grpo seed 1 update 8': which of a flow's many
    evaluations a progress line belongs to."""
    if model.stage not in TRAINED:
        return f"evaluate {model.stage} seed {cfg.seed}"
    return f"evaluate {cfg.train.method} seed {cfg.seed} update {cfg.eval.update or model.summary['updates']}"


def build(cfg: PipelineConfig, inputs: dict[str, Manifest], folder: Path) -> Built:
    ec = cfg.eval
    problems = eval_problems(cfg)
    engine = make_engine(cfg.rollout.engine, model_path(inputs["model"], ec.update), ec.batch_prompts, cfg.model.threads,
                         rollout_cfg=cfg.rollout, device=cfg.train.device, seed=cfg.seed,
                         dtype="auto")   # evaluation never samples at rollout.dtype (not in its key)
    template, to_prompt = prompt_builder(cfg, engine.tokenizer)
    desc = progress_name(cfg, inputs["model"])
    outs, gen_seconds = generate(engine, [to_prompt(p.problem) for p in problems], cfg, desc)
    getattr(engine, "close", lambda: None)()      # a vLLM engine hands its GPUs back
    flat = [(p, i, c) for p, group in zip(problems, outs) for i, c in enumerate(group)]
    start = time.perf_counter()
    with progress.Progress(f"{desc}: grade", total=len(flat), unit="response") as bar:
        graded = grade_many([c.text for _, _, c in flat], [p.answers for p, _, _ in flat], cfg.verify.timeout_s,
                            cfg.verify.workers, progress=bar.update, retry_timeout_s=cfg.verify.retry_timeout_s)
    grade_seconds = time.perf_counter() - start
    table = {"benchmark": [p.benchmark for p, _, _ in flat], "prompt_id": [p.id for p, _, _ in flat],
             "sample": [i for _, i, _ in flat], "reward": [g[0] for g in graded], "status": [g[1] for g in graded],
             "response_length": [len(c.token_ids) for _, _, c in flat], "response_text": [c.text for _, _, c in flat]}
    rows = write_parquet(table, EVAL_SAMPLES, folder / "eval.parquet")
    n, ks = ec.n_samples, [k for k in ec.pass_k if k <= ec.n_samples]
    scores = benchmark_table(pl.DataFrame(table), n, ks)
    scores.write_csv(folder / "eval_report.csv")
    (folder / "eval_report.md").write_text(markdown(scores, template))
    overall = scores.row(-1, named=True)
    return Built(files={"samples": ("eval.parquet", rows), "report_md": ("eval_report.md", None),
                        "report_csv": ("eval_report.csv", scores.height)}, summary={
        "model": inputs["model"].stage, "model_key": inputs["model"].key, "problems": len(problems),
        "update": (ec.update or inputs["model"].summary["updates"]) if inputs["model"].stage in TRAINED else 0,
        "n_samples": n, f"mean_at_{n}": overall[f"mean_at_{n}"],
        **{f"pass_at_{k}": overall[f"pass_at_{k}"] for k in ks},
        **{f"{r['benchmark']}/mean_at_{n}": r[f"mean_at_{n}"] for r in scores.iter_rows(named=True)
           if r["benchmark"] != AVG and len(scores) > 1},
        **{k: v for k, v in grading_summary(graded).items() if k in ("grading_retries", "grading_timeouts")},
        **({} if ec.benchmarks else catalog.file_report(cfg.task)),
        "prompt_template": template, "generation_samples_per_second": rows / gen_seconds,
        "grading_samples_per_second": rows / grade_seconds})


def markdown(scores: pl.DataFrame, template: str) -> str:
    cols = [c for c in scores.columns if c != "benchmark"]
    lines = ["| benchmark | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in scores.iter_rows(named=True):
        lines.append(f"| {r['benchmark']} | " + " | ".join(
            str(r[c]) if c == "problems" else f"{100 * r[c]:.2f}" for c in cols) + " |")
    return f"Prompt: {template}\n\n" + "\n".join(lines) + "\n"


def content_key(cfg: PipelineConfig) -> dict[str, str]:
    """sha256 of the benchmark files this evaluation reads, so editing one in place
    re-evaluates (the task file, when task.name is a path, enters every task reader's key)."""
    return benchmarks.content_key(cfg.eval.benchmarks, cfg.eval.data_dir)


SPEC = StageSpec(name="evaluate", numerics=True, version=3, reads=("seed", "task", "eval", "verify"), build=build,
                 extra_key=content_key)


def run(config: PipelineConfig, inputs: dict[str, Manifest], store: Store | None = None,
        force: bool = False) -> Manifest:
    return run_stage(SPEC, config, inputs, store, force)
