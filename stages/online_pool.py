"""Stage `online_pool`: one round's training groups under the synced sampler (spec 8.1-8.3).

Built only inside an online cell (stages/online_cell.py), by its resident engine, whose
weights the cell has just synced to the learner's (Algorithm 1 line 3); a cached pool is
the cell's log, which a resumed cell replays without sampling it again. Input `policy`:
pi_0 (the `base` stage) for round 0, else the previous round's `online_train` artifact,
whose summary carries the prompt cursor and the cumulative counts (the policy itself is
the cell's learner, not a file). Reads `seed`, `task`,
`rollout`, `verify.timeout_s`, `train.groups_per_update`, `train.updates_per_step`, `online.draw_prompts`.

Algorithm (spec 8.1 inner loop, 8.2 refill):

    C <- []
    while |C| < N * G_mb:                      at most online.max_draws draws, else an error
                                               (earlier when the draws left cannot fill C:
                                               online.stall_alpha, `cannot_fill`; [ours])
        next draw_prompts prompts of the seeded loader (spec 8.3: positions cursor.. of the
        per-epoch permutations of (seed, "online/prompt-order", epoch))
        m responses each under pi_beh with lp_beh; grade; append the mixed groups, in order
    C <- first N * G_mb groups of C            surplus discarded; the cursor moves past them

Sampling uses the stream (seed, "online/sample/round<r>/draw<d>"), the loader a stream of
its own: every method of a seed sees the same prompt sequence. Writes `pool.parquet`
(TRAIN_POOL rows of the kept groups; `group` = position in C, so update j of the round
takes groups j*G_mb .. (j+1)*G_mb - 1) and `draws.parquet` (one row per drawn prompt: draw,
loader position, prompt id, successes, mixed, kept). The summary counts prompts drawn and
responses generated, discarded groups and refill draws included (paper Figure 2), for this
round and cumulatively.

Shared pools (online.share_pools, off by default; the corrections preset's): a round's pool is
a function of the sampler's weights, the base model the engine was built from, the round's
start (index, update, cursor, counts) and the settings in this stage's key, not of which cell
or method produced the weights. With sharing on, a cell keys the round by those
(`pool_content_key`); when an earlier round in this store had the same content key, the
build copies that pool's files (`copy_pool`, the bytes sampling would write again: the draw
is deterministic) instead of sampling. Cells whose policies are bit-identical share their
pools this way (the corrections table's IcePop, M2PO and decoupled PPO online, whose rules
masked nothing, are GRPO+TIS's rounds; CISPO, GSPO and TOPR at N = 1 one another's). The
artifact keeps its own key and its own `policy` input, so nothing downstream changes; its
summary names the source (`shared_from`) and has no sampling seconds.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import torch

from pipeline.core.config import PipelineConfig
from pipeline.core.errors import RefillError, TrainingError
from pipeline.core.schemas import TRAIN_POOL, typed_table, write_parquet
from pipeline.core.seeding import derive_seed, permutation
from pipeline.core.store import Manifest, Store, write_text_atomic
from pipeline.dag.spec import Built, StageSpec, key_for
from pipeline.models.engines import SamplingParams
from pipeline.services import progress
from pipeline.tasks import catalog
from pipeline.tasks.grading import grade_many
from stages.online_round import RoundStart
from stages.rollout import prompt_table, rollout_table

DRAWS = pa.schema([("draw", pa.int32()), ("position", pa.int64()), ("prompt_id", pa.string()),
                   ("successes", pa.int32()), ("mixed", pa.bool_()), ("kept", pa.bool_())])


@dataclass
class Refill:
    kept: list[Any]          # payloads of the first `need` mixed groups, in draw order
    draws: int               # prompt batches drawn
    prompts: int             # prompts drawn (= groups generated)
    responses: int           # responses generated, dropped groups and the surplus included
    mixed: int               # mixed groups found (>= need; the surplus is discarded)


def is_mixed(rewards: list[float]) -> bool:
    """Spec 8.2: keep a group iff max r > min r."""
    return max(rewards) > min(rewards)


def poisson_upper(k: int, alpha: float) -> float:
    """The rate lam with P(Poisson(lam) <= k) = alpha: an upper bound on a count's mean that
    is exceeded with probability at most alpha (a binomial count's bound is tighter, so this
    one is conservative for it)."""
    def log_cdf(lam: float) -> float:
        terms = [i * math.log(lam) - lam - math.lgamma(i + 1) for i in range(k + 1)]
        top = max(terms)
        return top + math.log(sum(math.exp(t - top) for t in terms))
    lo, hi = max(k, 1e-9), k + 10.0 * math.sqrt(k + 1) - math.log(alpha) + 10.0
    for _ in range(100):     # bisection: the CDF falls as lam grows
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if log_cdf(mid) > math.log(alpha) else (lo, mid)
    return hi


def cannot_fill(found: int, prompts: int, remaining_prompts: int, need: int, alpha: float) -> bool:
    """True when the draws left cannot fill the round unless its mixed-group rate is above
    its upper bound at level alpha: found + rate_hi * remaining < need, rate_hi =
    poisson_upper(found, alpha) / prompts. A collapsed policy (0 mixed groups in the first
    draw of 512 prompts at N = 64) is then known after 1 draw, not 16; the prompts are a
    seeded permutation and the policy is fixed within a round, so the rate does not drift."""
    if found >= need or prompts == 0:
        return False
    return found + poisson_upper(found, alpha) / prompts * remaining_prompts < need


def collect_mixed(draw: Callable[[int], list[tuple[Any, list[float]]]], need: int, max_draws: int,
                  what: str = "round", stall_alpha: float | None = None) -> Refill:
    """Draw batches `draw(0), draw(1), ...` of (payload, rewards) groups until `need` mixed
    groups exist; keep the first `need`. Raises RefillError after `max_draws` draws, or
    earlier once `cannot_fill` at level `stall_alpha` (None: never early). A round that
    fills is the same either way: the early stop only shortens a round that fails."""
    kept: list[Any] = []
    prompts = responses = 0
    for d in range(max_draws):
        batch = draw(d)
        prompts += len(batch)
        responses += sum(len(r) for _, r in batch)
        kept += [payload for payload, rewards in batch if is_mixed(rewards)]
        if len(kept) >= need:
            return Refill(kept[:need], d + 1, prompts, responses, len(kept))
        left = (max_draws - d - 1) * len(batch)
        if stall_alpha is not None and left and cannot_fill(len(kept), prompts, left, need, stall_alpha):
            raise RefillError(f"{what}: found {len(kept)} mixed-reward groups from {prompts} prompts ({responses} "
                              f"responses, {d + 1} of online.max_draws = {max_draws} draws), and the draws left "
                              f"cannot reach train.updates_per_step x train.groups_per_update = {need} (at "
                              f"online.stall_alpha = {stall_alpha:g}); {HINT}")
    raise RefillError(f"{what}: found {len(kept)} mixed-reward groups from {prompts} prompts ({responses} "
                      f"responses, {max_draws} draws) but needs train.updates_per_step x "
                      f"train.groups_per_update = {need}; {HINT}")


HINT = ("the prompt set is (nearly) all solved or all failed by this policy: use another task or difficulty, "
        "or raise online.max_draws")


@lru_cache(maxsize=16)
def _epoch(n_prompts: int, seed: int, epoch: int) -> tuple[int, ...]:
    return tuple(permutation(n_prompts, seed, "online/prompt-order", epoch))


def loader_positions(start: int, n: int, n_prompts: int, seed: int) -> list[int]:
    """Dataset indices at loader positions start .. start+n-1 (spec 8.3): epoch e is the
    permutation of (seed, "online/prompt-order", e); the order depends only on (seed, epoch)."""
    return [_epoch(n_prompts, seed, pos // n_prompts)[pos % n_prompts] for pos in range(start, start + n)]


@dataclass
class Sampler:
    """What an online cell hands its round's pool build: the resident engine, synced to the
    round's policy. The build leaves the pool's table here (`table`: TRAIN_POOL, cast as
    written) so training takes it in memory while the artifact holds the same rows.
    `content`, `store`: the round's content key and the store whose index it is looked up
    in (online.share_pools; None: always sample). `engine` is None only when the cell found
    the round's pool shared before syncing one."""
    engine: Any
    table: pa.Table | None = None
    content: str | None = None
    store: Store | None = None


SHARED = ".pool-content"    # in the store's root: one small file per content key, holding a pool's key


def weights_sha256(weights: list[tuple[str, torch.Tensor]]) -> str:
    """sha256 of named tensors (names, dtypes, shapes, bytes), in name order."""
    h = hashlib.sha256()
    for name, tensor in sorted(weights, key=lambda nt: nt[0]):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())     # bf16 has no numpy type: its bytes
    return h.hexdigest()


def pool_content_key(cfg: PipelineConfig, base_key: str, start: RoundStart, weights: str) -> str:
    """What a round's pool is a function of: this stage's key with its `policy` input (which
    cell's chain, which round) replaced by the sampler's weights (`weights`: their sha256),
    the base model the engine was built from (tokenizer, config) and the round's start."""
    start_sha = hashlib.sha256(json.dumps(dataclasses.asdict(start), sort_keys=True).encode()).hexdigest()
    return key_for(SPEC, cfg, {"base": base_key, "start": start_sha, "weights": weights})


def shared_pool(store: Store, content: str) -> Manifest | None:
    """The intact pool built earlier under this content key, or None (none, gone or damaged:
    then the round samples)."""
    try:
        key = (store.root / SHARED / content).read_text().strip()
    except FileNotFoundError:
        return None
    source = store.load("online_pool", key)
    return source if source is not None and not store.check(source) else None


def remember_pool(store: Store, content: str, key: str) -> None:
    """Index the pool `key` under its content key (atomically: never half written)."""
    (store.root / SHARED).mkdir(exist_ok=True)
    write_text_atomic(store.root / SHARED / content, key)


def copy_pool(source: Manifest, folder: Path) -> Built:
    """This round's files copied from `source`, whose round had the same content key: the
    bytes sampling would write again. No sampling seconds; `shared_from` names the source."""
    files = {}
    for name in ("train_pool", "draws"):
        entry = source.files[name]
        shutil.copyfile(source.path(name), folder / entry.path)
        files[name] = (entry.path, entry.rows)
    summary = source.summary | {"generate_seconds": 0.0, "grade_seconds": 0.0, "grading_retries": 0,
                                "grading_timeouts": 0, "shared_from": source.key}
    return Built(files=files, summary=summary)


def build(cfg: PipelineConfig, inputs: dict[str, Manifest], folder: Path, ctx: Sampler) -> Built:
    """The round's pool from the cell's engine (synced to this round's policy by the cell)."""
    if ctx.content is not None and ctx.store is not None and (source := shared_pool(ctx.store, ctx.content)):
        return copy_pool(source, folder)
    if ctx.engine is None:
        raise TrainingError(f"online_pool: the shared pool of content key {(ctx.content or '')[:16]} went away while the round "
                            "was being built, and no engine was synced for it; rerun the cell (it samples the round)")
    rc, tc, at, engine = cfg.rollout, cfg.train, RoundStart.after(inputs["policy"]), ctx.engine
    r, need, per_draw = at.round, tc.updates_per_step * tc.groups_per_update, cfg.online.per_draw(cfg.train)
    problems = catalog.splits(cfg.task)["train"]
    drawn: list[dict] = []      # one entry per drawn prompt, for draws.parquet
    seconds = {"generate": 0.0, "grade": 0.0}   # the round's work, for the overhead figure
    retries = [0, 0]                            # responses graded twice, final timeouts

    def draw(d: int) -> list[tuple[Any, list[float]]]:
        start = at.prompt_cursor + d * per_draw
        picked = [problems[i] for i in loader_positions(start, per_draw, len(problems), cfg.seed)]
        prompts = prompt_table(picked, engine.tokenizer, cfg.task.prompt)
        params = SamplingParams(rc.group_size, rc.temperature, rc.top_p, rc.max_new_tokens,
                                derive_seed(cfg.seed, f"online/sample/round{r}/draw{d}"))
        t0 = time.perf_counter()
        with progress.Progress(f"round {r} draw {d}: sample", total=len(picked), unit="prompt") as bar:
            outs = progress.generate(engine, prompts["prompt"], params, bar)
        rows = rollout_table(prompts, outs, params, engine)
        t1 = time.perf_counter()
        graded = grade_many(rows["response_text"], [(prompts["answer"][g],) for g in rows["group"]],
                            cfg.verify.timeout_s, cfg.verify.workers, retry_timeout_s=cfg.verify.retry_timeout_s)
        retries[0] += sum(g.retried for g in graded)
        retries[1] += sum(g.status == "timeout" for g in graded)
        seconds["generate"] += t1 - t0
        seconds["grade"] += time.perf_counter() - t1
        rows["reward"], rows["status"] = [g[0] for g in graded], [g[1] for g in graded]
        m, groups = rc.group_size, []
        for g in range(len(picked)):
            group = {k: v[g * m:(g + 1) * m] for k, v in rows.items()}
            drawn.append({"draw": d, "position": start + g, "prompt_id": prompts["prompt_id"][g],
                          "successes": int(sum(x > 0.5 for x in group["reward"])),
                          "mixed": is_mixed(group["reward"]), "kept": False})
            groups.append(((len(drawn) - 1, group), group["reward"]))
        return groups

    refill = collect_mixed(draw, need, cfg.online.max_draws, f"online round {r} (seed {cfg.seed})",
                           cfg.online.stall_alpha)
    table: dict[str, list] = {name: [] for name in TRAIN_POOL.names}
    for position, (index, group) in enumerate(refill.kept):
        drawn[index]["kept"] = True
        for k in TRAIN_POOL.names:
            table[k] += [position] * rc.group_size if k == "group" else group[k]
    ctx.table = typed_table(table, TRAIN_POOL)      # training takes it in memory; the file holds the same
    n = write_parquet(ctx.table, TRAIN_POOL, folder / "pool.parquet")
    n_draws = write_parquet({k: [x[k] for x in drawn] for k in DRAWS.names}, DRAWS, folder / "draws.parquet")
    return Built(files={"train_pool": ("pool.parquet", n), "draws": ("draws.parquet", n_draws)}, summary={
        "round": r, "start_update": at.update, "draws": refill.draws, "prompts_drawn": refill.prompts,
        "responses_generated": refill.responses, "groups_mixed": refill.mixed, "groups_kept": len(refill.kept),
        "groups_discarded": refill.prompts - len(refill.kept),
        "prompt_cursor_start": at.prompt_cursor, "prompt_cursor": at.prompt_cursor + refill.prompts,
        "cumulative_prompts": at.cumulative_prompts + refill.prompts,
        "cumulative_responses": at.cumulative_responses + refill.responses,
        "pool_mean_reward": sum(table["reward"]) / max(n, 1), "engine": engine.name,
        "generate_seconds": seconds["generate"], "grade_seconds": seconds["grade"],
        "grading_retries": retries[0], "grading_timeouts": retries[1], **catalog.file_report(cfg.task)})




# version 2 (online_pool 4): the transformers sampler drops finished rows (#26); the same tokens,
# but fp32 log-probs computed at another batch size may differ in their last bits
SPEC = StageSpec(name="online_pool", numerics=True, version=4,
                 reads=("seed", "task", "rollout", "verify.timeout_s", "verify.retry_timeout_s",
                        "train.groups_per_update", "train.updates_per_step",
                        "online.draw_prompts"), build=build,
                 context=Sampler, without_context="an online round's pool is sampled by its cell's resident engine: "
                 "run the cell (`ggpo stage online` or `ggpo run online`), which builds or replays every round")
