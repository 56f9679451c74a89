"""The testbed's per-update cost against a bare PyTorch loop doing the same arithmetic (#26).

One process, interleaved: each repetition runs a GGPO cell of the preset (`run_cell`, a
fresh store, so every round is sampled, graded, trained and recorded) and then the bare
loop over the same rounds. The bare loop does what the cell's rounds did, with nothing
around it: per round it samples as many prompts as the cell drew (m responses each, a
KV-cache loop in the rollout dtype, stopping when every row has), grades them with
countdown's checker in-process, and takes the round's N updates (policy forward, the
reference forward, GGPO's loss on the round's mixed groups, backward, clip, one AdamW
step). Its draws are its own (same counts and lengths budget, not the same tokens).

Per update: the median over rounds 1 .. R-1 (round 0 carries the cell's start-up, the
learner, sampler and grader built once; a median, as a busy machine stalls single rounds);
printed per repetition and as the ratio cell / bare, which load on the machine moves far
less than either figure.

    .venv/bin/python benchmarks/testbed_cost.py [--preset tiny-regime] [--rounds 6] [--reps 3]
        [--set train.updates_per_step=1 ...]

The preset's base model is built (or found) in the usual cache (GGPO_CACHE).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from pipeline.core.config import PipelineConfig, load_config
from pipeline.core.store import Store, model_path
from pipeline.models.engines.decode import _cache_kwarg
from pipeline.models.hf import load_model, load_tokenizer
from pipeline.tasks import catalog, countdown, grading
from stages import base_model as base_stage
from stages.online_cell import run_cell


def cell_round_seconds(cfg: PipelineConfig, base) -> tuple[list[float], list[int]]:
    """(seconds of each round after the first, prompts drawn in each round) of one cell run
    in a fresh store."""
    stamps, drawn = [time.perf_counter()], []

    def on_round(r, pool, trained):
        stamps.append(time.perf_counter())
        drawn.append(pool.summary["prompts_drawn"])
    with tempfile.TemporaryDirectory(prefix="ggpo-testbed-cost-") as tmp:
        run_cell(cfg, Store(tmp), base, on_round=on_round)
    return [b - a for a, b in zip(stamps[1:], stamps[2:])], drawn


@torch.no_grad()
def bare_sample(model, tok, prompts: list[str], m: int, max_new: int, temperature: float,
                gen: torch.Generator) -> list[list[int]]:
    """m responses per prompt: left-padded prompts, one forward per token over a KV cache."""
    ids = [tok(p)["input_ids"] for p in prompts for _ in range(m)]
    width = max(map(len, ids))
    x = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in ids])
    attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = torch.full((len(ids), max_new), tok.pad_token_id)
    done = torch.zeros(len(ids), dtype=torch.bool)
    past, step = None, 0
    for step in range(max_new):
        res = model(input_ids=x, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                    **{_cache_kwarg(model): past})
        probs = torch.softmax(res.logits[:, -1].float() / temperature, -1)
        nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1).masked_fill(done, tok.pad_token_id)
        out[:, step] = nxt
        done |= nxt == tok.eos_token_id
        if bool(done.all()):
            break
        past, x, pos = res.past_key_values, nxt[:, None], pos[:, -1:] + 1
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
    rows = out[:, :step + 1].tolist()
    return [r[:r.index(tok.eos_token_id) + 1] if tok.eos_token_id in r else r for r in rows]


def token_logprobs(model, prompt_ids: list[list[int]], responses: list[list[int]], pad: int) -> tuple:
    """(log-probs [B, T], mask [B, T]) of the responses under `model`, right-padded rows."""
    rows = [p + r for p, r in zip(prompt_ids, responses)]
    width, t_max = max(map(len, rows)), max(map(len, responses))
    x = torch.full((len(rows), width), pad)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    idx = torch.zeros((len(rows), t_max), dtype=torch.long)
    target = torch.full((len(rows), t_max), pad)
    mask = torch.zeros((len(rows), t_max))
    for b, (p, r) in enumerate(zip(prompt_ids, responses)):
        x[b, :len(p) + len(r)], attn[b, :len(p) + len(r)] = torch.tensor(p + r), 1
        idx[b, :len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        target[b, :len(r)], mask[b, :len(r)] = torch.tensor(r), 1.0
    logits = model(input_ids=x, attention_mask=attn, use_cache=False).logits
    lp = torch.log_softmax(logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1])).float(), -1)
    return lp.gather(2, target[..., None]).squeeze(2) * mask, mask


def bare_update(policy, reference, opt, groups: list[tuple[list[int], list[list[int]], list[float]]],
                pad: int, beta: float) -> None:
    """GGPO's update on `groups` (prompt ids, m responses, m rewards): the success-weighted
    sequence log-likelihood with a K3 penalty to the reference, token-mean."""
    prompts = [p for p, rs, _ in groups for _ in rs]
    responses = [r for _, rs, _ in groups for r in rs]
    rewards = torch.tensor([x for _, _, xs in groups for x in xs])
    lp, mask = token_logprobs(policy, prompts, responses, pad)
    with torch.no_grad():
        ref, _ = token_logprobs(reference, prompts, responses, pad)
    seq = (lp * mask).sum(1)
    weight = torch.softmax(torch.where(rewards > 0.5, seq.detach(), torch.tensor(-1e9)).view(len(groups), -1), -1)
    k3 = (torch.exp(ref - lp) - (ref - lp) - 1) * mask
    loss = -(weight.view(-1) * seq).sum() / mask.sum() + beta * k3.sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    opt.step()


def check(response: str, answer: str) -> float:
    """The reward, in-process: countdown's checker (the testbed's task), else math-verify."""
    if answer.startswith(countdown.PREFIX):
        return countdown.grade(response, answer)[0]
    return grading.grade(response, (answer,), 10.0).reward


def bare_round_seconds(cfg: PipelineConfig, base, drawn: list[int], seed: int) -> list[float]:
    """Seconds of each bare round after the first, drawing `drawn[r]` prompts in round r."""
    tc, rc, path = cfg.train, cfg.rollout, model_path(base)
    tok = load_tokenizer(path)
    policy, reference = load_model(path), load_model(path).eval()
    sampler = load_model(path, torch.bfloat16 if rc.dtype == "bfloat16" else torch.float32).eval()
    opt = torch.optim.AdamW(policy.parameters(), lr=tc.lr, betas=tc.adam_betas, weight_decay=tc.weight_decay)
    problems, gen = catalog.splits(cfg.task)["train"], torch.Generator().manual_seed(seed)
    stamps, cursor, need = [], 0, tc.updates_per_step * tc.groups_per_update
    for count in drawn:
        stamps.append(time.perf_counter())
        sampler.load_state_dict(policy.state_dict())
        picked = [problems[(cursor + i) % len(problems)] for i in range(count)]
        cursor += count
        prompts = [catalog.format_prompt(p.problem, cfg.task.prompt) for p in picked]
        responses = bare_sample(sampler, tok, prompts, rc.group_size, rc.max_new_tokens, rc.temperature, gen)
        groups = []
        for g, p in enumerate(picked):
            rs = responses[g * rc.group_size:(g + 1) * rc.group_size]
            rewards = [check(tok.decode(r, skip_special_tokens=True), p.answer) for r in rs]
            groups.append((tok(prompts[g])["input_ids"], rs, rewards))
        mixed = [x for x in groups if max(x[2]) > min(x[2])] or groups
        mixed = (mixed * need)[:need]             # the round's N x G_mb groups (the cell's are all mixed)
        for j in range(tc.updates_per_step):
            bare_update(policy, reference, opt, mixed[j * tc.groups_per_update:(j + 1) * tc.groups_per_update],
                        tok.pad_token_id, tc.beta)
    stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]


def measure(preset: str, sets: list[str], rounds: int, reps: int) -> dict:
    """Interleaved repetitions; per update milliseconds of the cell and the bare loop, and
    their ratio (medians over repetitions)."""
    probe = load_config(preset, sets)
    n = probe.train.updates_per_step
    cfg = load_config(preset, [*sets, "train.method=ggpo", f"train.updates={rounds * n}",
                               f"train.eval_every={rounds * n}", f"train.checkpoint_every={rounds * n}"])
    base = base_stage.run(cfg)
    torch.set_num_threads(cfg.model.threads)
    cell_ms, bare_ms = [], []
    for rep in range(reps):
        seconds, drawn = cell_round_seconds(cfg, base)
        cell_ms.append(1000 * statistics.median(seconds) / n)
        bare_ms.append(1000 * statistics.median(bare_round_seconds(cfg, base, drawn, seed=rep)) / n)
        print(f"rep {rep}: cell {cell_ms[-1]:.0f} ms/update, bare {bare_ms[-1]:.0f} ms/update, "
              f"ratio {cell_ms[-1] / bare_ms[-1]:.2f} (prompts drawn per round {drawn})", flush=True)
    ratios = [c / b for c, b in zip(cell_ms, bare_ms)]
    return {"preset": preset, "sets": sets, "updates_per_round": n, "rounds": rounds, "reps": reps,
            "cell_ms_per_update": statistics.median(cell_ms), "bare_ms_per_update": statistics.median(bare_ms),
            "ratio": statistics.median(ratios), "ratios": [round(r, 3) for r in ratios]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-regime")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a config override, KEY=VALUE")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per cell run (round 0 is not counted)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (round 0 carries the start-up and is not counted)")
    result = measure(args.preset, args.sets, args.rounds, args.reps)
    print(json.dumps(result))
    print(f"cell / bare loop per update: {result['ratio']:.2f}x (target <= 1.25x)")
    return result


if __name__ == "__main__":
    main()
