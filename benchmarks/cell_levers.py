"""Four levers on an online cell's time, measured side by side, with whether they move bits (#45).

    .venv/bin/python benchmarks/cell_levers.py [--preset tiny-regime] [--pools 12] [--reps 3]

On the preset's base model (built, or found, in the usual cache, GGPO_CACHE), one thread, in
the kernel mode the process runs (the reproducible one by default; GGPO_KERNELS=native for the
processor's own kernels):

1. *The reference's log-probs batched per micro-batch.* The trainer computes lp_ref one group
   at a time (pipeline/training/reference.py: so that a cached value is bit for bit a fresh
   one). Here, on --pools pools of 8 groups x group_size responses sampled from the base
   model, one forward per group against one forward of the 8 groups' micro-batch, alternated:
   the median time ratio batched / per group, and how many groups' log-probs (on their real
   tokens) differ in any bit, with the largest difference.
2. *The draw size.* The milliseconds per prompt (group_size responses each) of one sampler
   draw of 8, 24 and 64 prompts (an online round at N = 1 draws 8 prompts at a time, one at
   N = 4 32), medians over --reps.
3. *The prefill shared by a prompt's samples* (engines/hf.shared_prefill, on by default): draws
   of 24 prompts x group_size with the prefill run once per prompt against once per row
   (engine.share_prefill = False), alternated: the median time ratio and whether every token and
   log-prob is the same.

4. *The shared prompt in the no-gradient forwards* (pipeline/training/shared_prompt.py, on by
   default): the reference's per-group forwards of lever 1 with each group's prompt run once
   through the token-wise layers against the plain forward (shared_prompt.ENABLED = False),
   alternated: the median time ratio and whether every log-prob is the same.

5. *The shared prompt in the policy's forward with gradient* (shared_prompt.WITH_GRAD, on by
   default since kernels.VERSION 3: it moves training's bits): one forward and backward of each
   pool's micro-batch, shared against plain, alternated: the median time ratio, whether the
   log-probs are the same (they are: the forward is lever 4's) and the largest relative
   difference of a weight's gradient.

It prints one line per lever and a JSON object; `--only reference,draws,prefill,prompt,grad`
runs some of them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a plain script

import torch  # noqa: E402


def sampled_pools(cfg, engine, problems, n_pools: int, folder: Path) -> list:
    """n_pools pools of 8 groups each, sampled from the base model (seeds 0 ..)."""
    from pipeline.core.schemas import TRAIN_POOL, write_parquet
    from pipeline.models.engines import SamplingParams
    from pipeline.tasks.grading import grade_many
    from pipeline.training.pool import load_pool
    from stages.rollout import prompt_table, rollout_table

    rc, pools = cfg.rollout, []
    for i in range(n_pools):
        prompts = prompt_table(problems[8 * i:8 * i + 8], engine.tokenizer, cfg.task.prompt)
        params = SamplingParams(rc.group_size, rc.temperature, rc.top_p, rc.max_new_tokens, i)
        rows = rollout_table(prompts, engine.generate(prompts["prompt"], params), params, engine)
        graded = grade_many(rows["response_text"], [(prompts["answer"][g],) for g in rows["group"]],
                            cfg.verify.timeout_s, cfg.verify.workers)
        rows["reward"], rows["status"] = [g[0] for g in graded], [g[1] for g in graded]
        path = folder / f"pool-{i}.parquet"
        write_parquet({k: rows[k] for k in TRAIN_POOL.names}, TRAIN_POOL, path)
        pools.append(load_pool(path, rc.group_size, cfg.train))
    return pools


def reference_batching(cfg, reference, pools, pad_id: int, reps: int) -> dict:
    """Lever 1: time ratio batched / per group (median of alternated pairs) and bit differences."""
    from pipeline.models.runtime import make_runtime
    from pipeline.training.loop import group_rows, policy_logprobs
    from pipeline.training.pool import batch
    from pipeline.training.reference import ReferenceCache

    rt = make_runtime(cfg.train)

    def per_group(pool, groups):
        return ReferenceCache(False).get(reference, pool, groups, pad_id, rt, cfg.rollout.temperature, policy_logprobs)

    def batched(pool, groups):
        with torch.no_grad():
            lp, _ = policy_logprobs(reference, batch(pool, groups, pad_id, rt.packed, rt.bucket_overhead), rt,
                                    cfg.rollout.temperature)
        return group_rows(lp, pool, groups)

    ratios, differ, total, largest = [], 0, 0, 0.0
    for rep in range(reps):
        for pool in pools:
            groups = list(range(len(pool.responses)))
            sides, seconds, out = {"per": per_group, "batched": batched}, {}, {}
            for side in (("per", "batched") if rep % 2 == 0 else ("batched", "per")):
                t0 = time.perf_counter()
                out[side] = sides[side](pool, groups)
                seconds[side] = time.perf_counter() - t0
            ratios.append(seconds["batched"] / seconds["per"])
            per, together = out["per"], out["batched"]
            if rep == 0:
                for g, a in zip(groups, per):
                    real = torch.zeros_like(a, dtype=torch.bool)
                    for i, r in enumerate(pool.responses[g]):
                        real[i, :len(r)] = True
                    b = together[g][:, :a.shape[1]]
                    total += 1
                    differ += not torch.equal(a[real], b[real])
                    largest = max(largest, (a[real] - b[real]).abs().max().item())
    return {"batched_over_per_group": round(statistics.median(ratios), 3), "groups": total,
            "groups_with_other_bits": differ, "max_abs_difference": largest}


def alternated(pools, reps: int, run) -> tuple[float, list[dict]]:
    """run(pool, shared) on both sides for every pool and repetition, plain first on even
    repetitions and shared first on odd ones: the median time ratio shared / plain (3 decimals)
    and each pair's outputs {False: plain, True: shared}."""
    ratios, outs = [], []
    for rep in range(reps):
        for pool in pools:
            seconds, out = {}, {}
            for shared in ((False, True) if rep % 2 == 0 else (True, False)):
                t0 = time.perf_counter()
                out[shared] = run(pool, shared)
                seconds[shared] = time.perf_counter() - t0
            ratios.append(seconds[True] / seconds[False])
            outs.append(out)
    return round(statistics.median(ratios), 3), outs


def shared_prompt_forward(cfg, reference, pools, pad_id: int, reps: int) -> dict:
    """Lever 4: time ratio shared / plain of the reference's per-group forwards, and whether
    any log-prob differs in any bit."""
    from pipeline.models.runtime import make_runtime
    from pipeline.training import shared_prompt
    from pipeline.training.loop import policy_logprobs
    from pipeline.training.reference import ReferenceCache

    rt = make_runtime(cfg.train)

    def per_group(pool, shared: bool):
        shared_prompt.ENABLED = shared
        try:
            return ReferenceCache(False).get(reference, pool, list(range(len(pool.responses))), pad_id, rt,
                                             cfg.rollout.temperature, policy_logprobs)
        finally:
            shared_prompt.ENABLED = True

    ratio, outs = alternated(pools, reps, per_group)
    same = all(torch.equal(a, b) for out in outs for a, b in zip(out[False], out[True]))
    return {"shared_over_plain": ratio, "same_logprobs": same}


def shared_prompt_backward(cfg, model, pools, pad_id: int, reps: int) -> dict:
    """Lever 5: time ratio shared / plain of a micro-batch's forward and backward, whether the
    log-probs are the same and the largest relative difference of a weight's gradient."""
    from pipeline.models.runtime import make_runtime
    from pipeline.training import shared_prompt
    from pipeline.training.loop import policy_logprobs
    from pipeline.training.pool import batch

    rt = make_runtime(cfg.train)
    params = [p for p in model.parameters() if p.requires_grad]

    def forward_backward(pool, shared: bool):
        shared_prompt.WITH_GRAD = shared
        try:
            model.zero_grad(set_to_none=True)
            b = batch(pool, list(range(len(pool.responses))), pad_id, rt.packed, rt.bucket_overhead)
            lp, _ = policy_logprobs(model, b, rt, cfg.rollout.temperature, with_entropy=True)
            (lp * b.mask).sum().backward()
            return lp.detach(), [p.grad.clone() for p in params]
        finally:
            shared_prompt.WITH_GRAD = True

    ratio, outs = alternated(pools, reps, forward_backward)
    same = all(torch.equal(out[False][0], out[True][0]) for out in outs)
    largest = max(((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
                  for out in outs for a, b in zip(out[False][1], out[True][1]))
    return {"shared_over_plain": ratio, "same_logprobs": same, "max_rel_grad_difference": largest}


def draw_sizes(cfg, engine, problems, reps: int) -> dict:
    """Lever 2: milliseconds per prompt of one draw of 8, 24 and 64 prompts (medians)."""
    from pipeline.models.engines import SamplingParams
    from pipeline.tasks import catalog

    rc = cfg.rollout
    per_prompt: dict[int, list[float]] = {}
    for rep in range(reps):
        for n in (8, 24, 64):
            prompts = [catalog.format_prompt(p.problem) for p in problems[:n]]
            draws = max(1, 64 // n)
            t0 = time.perf_counter()
            for seed in range(draws):
                engine.generate(prompts, SamplingParams(rc.group_size, rc.temperature, rc.top_p, rc.max_new_tokens,
                                                        seed))
            per_prompt.setdefault(n, []).append((time.perf_counter() - t0) / (draws * n) * 1e3)
    return {f"ms_per_prompt_{n}": round(statistics.median(v), 2) for n, v in per_prompt.items()}


def shared_prefill(cfg, engine, problems, reps: int) -> dict:
    """Lever 3: draw time with the prefill once per prompt / once per row, and equal draws."""
    from pipeline.models.engines import SamplingParams
    from pipeline.tasks import catalog

    rc = cfg.rollout
    seconds: dict[bool, list[float]] = {True: [], False: []}
    same = True
    for rep in range(2 * reps):
        prompts = [catalog.format_prompt(p.problem) for p in problems[24 * rep:24 * rep + 24]]
        params = SamplingParams(rc.group_size, rc.temperature, rc.top_p, rc.max_new_tokens, rep)
        drawn = {}
        for shared in ((True, False) if rep % 2 == 0 else (False, True)):
            engine.share_prefill = shared
            t0 = time.perf_counter()
            drawn[shared] = [(c.token_ids, c.logprobs) for g in engine.generate(prompts, params) for c in g]
            seconds[shared].append(time.perf_counter() - t0)
        same = same and drawn[True] == drawn[False]
    engine.share_prefill = True
    return {"shared_over_every_row": round(statistics.median(seconds[True]) / statistics.median(seconds[False]), 3),
            "same_draws": same}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-regime")
    ap.add_argument("--pools", type=int, default=12)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="reference,draws,prefill,prompt,grad")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    torch.set_num_threads(1)

    from pipeline.core import kernels
    from pipeline.core.config import load_config
    from pipeline.models.engines.hf import TransformersEngine
    from pipeline.models.runtime import make_runtime
    from pipeline.tasks import catalog
    from pipeline.training.loop import new_state
    from stages import base_model as base_stage
    from stages.base_model import model_path

    cfg = load_config(args.preset, [])
    path = model_path(base_stage.run(cfg))
    engine = TransformersEngine(path, threads=1, dtype=cfg.rollout.dtype)
    problems = catalog.splits(cfg.task)["train"]
    st = new_state(cfg, path, path, make_runtime(cfg.train))
    with tempfile.TemporaryDirectory(prefix="ggpo-levers-") as tmp:
        pools = sampled_pools(cfg, engine, problems, args.pools, Path(tmp))
    pad_id = engine.tokenizer.pad_token_id
    result: dict = {"preset": args.preset, "kernels": kernels.state()}
    if "reference" in only:
        ref = result["reference"] = reference_batching(cfg, st.reference, pools, pad_id, args.reps)
        print(f"reference batched per micro-batch / per group: {ref['batched_over_per_group']:.2f}x time; "
              f"{ref['groups_with_other_bits']} of {ref['groups']} groups with other bits "
              f"(max |difference| {ref['max_abs_difference']:.2g})")
    if "draws" in only:
        draws = result["draws"] = draw_sizes(cfg, engine, problems, args.reps)
        print("sampler draw, ms per prompt: " + ", ".join(f"{k.rsplit('_', 1)[1]} prompts {v}" for k, v in draws.items())
              + f" ({draws['ms_per_prompt_8'] / draws['ms_per_prompt_24']:.2f}x from 8 to 24)")
    if "prefill" in only:
        sp = result["shared_prefill"] = shared_prefill(cfg, engine, problems, args.reps)
        print(f"prefill once per prompt / once per row: {sp['shared_over_every_row']:.2f}x draw time, "
              f"same draws: {sp['same_draws']}")
    if "prompt" in only:
        pr = result["shared_prompt"] = shared_prompt_forward(cfg, st.reference, pools, pad_id, args.reps)
        print(f"reference forward, shared prompt / plain: {pr['shared_over_plain']:.2f}x time, "
              f"same log-probs: {pr['same_logprobs']}")
    if "grad" in only:
        gr = result["shared_prompt_grad"] = shared_prompt_backward(cfg, st.model, pools, pad_id, args.reps)
        print(f"policy forward + backward, shared prompt / plain: {gr['shared_over_plain']:.2f}x time, "
              f"same log-probs: {gr['same_logprobs']}, gradients differ by <= {gr['max_rel_grad_difference']:.2g} "
              f"(relative to each weight's largest)")
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    main()
