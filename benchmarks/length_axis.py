"""The length axis (issue #34): each preset's base and one online update, side by side.

For each preset (default: tiny-regime, then the countdown_work presets) in one process:
- the base stage from an empty cache (a temporary store, or `--cache`): its warm-up seconds,
  wall and this process's CPU, and steps, and its check statistics (stages/base_model.py);
- the base on the eval split, `m` = rollout.group_size samples a problem at T = 1 within
  eval.max_new_tokens: mean response length (tokens, without the end token), mean@m, the
  share of mixed groups, distinct correct responses and distinct boxed answers per group
  with a success (base_model.group_stats), and the share of responses cut at the budget;
- one online update: a cell (`--method`, GGPO by default) at each N of `--n` (train.updates_per_step) over `--rounds`
  rounds in a fresh store (stages/online_cell.run_cell); per update, the median round's
  seconds, wall and CPU (rounds after the first, which carries the start-up) over N. The presets' cells
  alternate within each repetition, so load on the machine falls on all of them alike; the
  ratio to the first preset is printed per repetition and as the median.

    .venv/bin/python benchmarks/length_axis.py [--presets tiny-regime tiny-regime-long]
        [--n 1 16] [--rounds 4] [--reps 2] [--eval-problems 200]

A preset's base is built once in the temporary store; nothing is written to GGPO_CACHE.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from pipeline.core.config import PipelineConfig, load_config
from pipeline.core.seeding import derive_seed
from pipeline.core.store import Store, model_path
from pipeline.models.engines.hf import TransformersEngine
from pipeline.models.hf import load_tokenizer
from pipeline.tasks import catalog
from stages import base_model as base_stage
from stages.online_cell import run_cell


def base_on_eval(cfg: PipelineConfig, base, problems: int) -> dict:
    """The base's statistics on the first `problems` eval problems (module doc)."""
    path = model_path(base)
    tok = load_tokenizer(path)
    engine = TransformersEngine(path, threads=cfg.model.threads, dtype="float32")
    rows = [(p.problem, p.answer) for p in catalog.splits(cfg.task)["eval"][:problems]]
    groups = base_stage.sample_groups(engine, rows, cfg.rollout.group_size, 1.0,
                                      derive_seed(cfg.seed, "length-axis/eval"), cfg.eval.max_new_tokens)
    stats = base_stage.group_stats(groups, tok)
    texts = [t for g in groups for t, _ in g]
    cut = sum(len(tok(t, add_special_tokens=False)["input_ids"]) >= cfg.eval.max_new_tokens for t in texts)
    return {k.replace("check_", "eval_"): v for k, v in stats.items()} | {"eval_cut_at_budget": cut / len(texts)}


def update_seconds(cfg: PipelineConfig, base, n: int, rounds: int, method: str) -> tuple[float, float]:
    """(wall, CPU) seconds per update of a `method` cell at N = n: the median round after the
    first, over n. CPU time is this process's (one torch thread, grading in-process): on a
    loaded machine it moves far less than the wall time."""
    cell = cfg.model_copy(deep=True)
    cell.train.method, cell.train.updates_per_step = method, n
    cell.train.updates = cell.train.eval_every = cell.train.checkpoint_every = rounds * n
    stamps = [(time.perf_counter(), time.process_time())]
    with tempfile.TemporaryDirectory(prefix="ggpo-length-axis-") as tmp:
        run_cell(cell, Store(tmp), base, on_round=lambda *_: stamps.append((time.perf_counter(), time.process_time())))
    if len(stamps) < 3:     # a stall (online.on_stall) in round 0 leaves no round to time
        raise SystemExit(f"{cfg.task.name} {method} N={n}: the cell stopped before round 1; try --method grpo_tis")
    wall = [b[0] - a[0] for a, b in zip(stamps[1:], stamps[2:])]
    cpu = [b[1] - a[1] for a, b in zip(stamps[1:], stamps[2:])]
    return statistics.median(wall) / n, statistics.median(cpu) / n


def measure(presets: list[str], sets: list[str], ns: list[int], rounds: int, reps: int, problems: int,
            cache: str | None, method: str = "ggpo") -> dict:
    torch.set_num_threads(1)
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="ggpo-length-axis-cache-") as tmp:
        store, bases = Store(cache or tmp), {}
        for preset in presets:
            cfg = load_config(preset, sets)
            start, cpu = time.perf_counter(), time.process_time()
            bases[preset] = base_stage.run(cfg, store=store)
            warm, warm_cpu = time.perf_counter() - start, time.process_time() - cpu
            s = bases[preset].summary
            out[preset] = {"task": cfg.task.name, "max_new_tokens": cfg.rollout.max_new_tokens,
                           "warm_up_s": round(warm, 1), "warm_up_cpu_s": round(warm_cpu, 1),
                           "cached": bases[preset].cache_hit, "sft_steps": s["sft_steps"],
                           **{k: s[k] for k in s if k.startswith("check_")},
                           **(base_on_eval(cfg, bases[preset], problems) if problems else {})}
            print(json.dumps({preset: out[preset]}), flush=True)
        for n in ns:
            per: dict[str, list[tuple[float, float]]] = {p: [] for p in presets}
            for rep in range(reps):
                for preset in presets:
                    per[preset].append(update_seconds(load_config(preset, sets), bases[preset], n, rounds, method))
                first = per[presets[0]][-1]
                print(f"N={n} rep {rep}: " + ", ".join(
                    f"{p} {1000 * per[p][-1][0]:.0f} ms/update wall ({per[p][-1][0] / first[0]:.2f}x), "
                    f"{1000 * per[p][-1][1]:.0f} ms CPU ({per[p][-1][1] / first[1]:.2f}x)" for p in presets), flush=True)
            for preset in presets:
                for i, kind in enumerate(("wall", "cpu")):
                    ratios = [a[i] / b[i] for a, b in zip(per[preset], per[presets[0]])]
                    out[preset][f"update_{kind}_ms_n{n}"] = round(1000 * statistics.median(x[i] for x in per[preset]), 1)
                    out[preset][f"update_{kind}_ratio_n{n}"] = round(statistics.median(ratios), 2)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny-regime", "tiny-regime-long-w4", "tiny-regime-long"])
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a config override for every preset")
    ap.add_argument("--n", dest="ns", type=int, nargs="+", default=[1, 16], help="updates per round (N)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per cell (the first is not counted)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--method", default="ggpo", help="the cells' train.method (GGPO stalls at N = 16 with "
                    "tiny-regime's lr: time grpo_tis there)")
    ap.add_argument("--eval-problems", type=int, default=200, help="0: no eval-split statistics")
    ap.add_argument("--cache", default=None, help="a store folder to build the bases in (and find them); "
                    "default: a temporary one, so every warm-up runs")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (round 0 carries the start-up and is not counted)")
    result = measure(args.presets, args.sets, args.ns, args.rounds, args.reps, args.eval_problems, args.cache, args.method)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
