"""Stage `pool_import`: a training pool from completions you already have (no rollout).

Reads `seed`, `task.prompt`, `rollout.group_size`, `rollout.max_new_tokens`, `verify`,
`pool` (its split, map, trust_rewards and prompt; the source enters the key by content:
the file's sha256, or the dataset id with its fingerprint, pipeline/tasks/pool_source.py);
input `base` (the policy's tokenizer). Writes `train_pool.parquet` (schema TRAIN_POOL, what
the filter stage writes, so the train stage reads either) and `provenance.parquet` (schema
POOL_PROVENANCE: each chosen response's source row and position, given and used reward,
truncation, kept).

Steps, each as the trainer and the verify stage would see the data:
1. Groups: the source's groups (pipeline/tasks/pool_source.py validates it). A group with more
   than m = rollout.group_size responses keeps m of them, chosen without replacement by
   the stream (seed, "pool_import/choose/<problem id>") and kept in source order; a group
   with fewer than m is dropped and counted.
2. Tokens: the prompt is the task's template (`task.prompt`), or with `pool.prompt=chat`
   the model's chat template exactly as evaluation builds it (pipeline/tasks/catalog.py
   prompt_builder), tokenized as the rollout stage does; a response is its text's tokens
   plus the tokenizer's EOS (finish "stop"), as an engine records a sample that stopped.
   Given `behavior_logprobs` have one entry per token, EOS included; as many as the text's
   tokens means the sampler stopped without EOS (finish "length"), and so does a text of
   exactly `rollout.max_new_tokens` tokens without log-probs (no room was left for an EOS);
   any other count of log-probs is refused.
   A response longer than `rollout.max_new_tokens` is truncated there and marked (finish
   "length", like an engine's length-capped sample; counted), never refused: long
   reasoning traces are the norm in such data, and refusing them would skew the pool
   toward short answers. Its text is then the decoded kept tokens, which is what is graded.
3. Rewards: with `pool.trust_rewards` the given ones (status "given"); otherwise every
   chosen response is graded like the verify stage (math-verify, `verify.timeout_s`, one
   retry, the same statuses), and where the source gave a reward too the summary counts
   how often the two disagree (correct = reward > 0.5).
4. The mixed-reward filter of the filter stage (stages/filter.py keep_mixed): kept,
   all-correct and all-wrong groups are counted in the summary (and MLflow).

Without behavior log-probs the pool's `behavior_logprobs` are null and the summary says
`behavior_logprobs: none`: GGPO, AGRO and GRPO with train.anchor=old train on it, the
methods that need them are refused (pipeline/training), until `ggpo stage score` records some.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import cast

import polars as pl
import pyarrow as pa

from pipeline.core.config import PipelineConfig
from pipeline.core.errors import PoolError
from pipeline.core.schemas import POOL_PROVENANCE, TRAIN_POOL, write_parquet
from pipeline.core.seeding import py_random
from pipeline.core.store import Manifest, Store, canonical_json, model_path
from pipeline.dag.spec import Built, StageSpec, run_stage
from pipeline.models.hf import load_tokenizer
from pipeline.services import progress
from pipeline.tasks import catalog, pool_source
from pipeline.tasks.grading import grade_many, summary as grading_summary
from stages.filter import keep_mixed

log = logging.getLogger("ggpo")
CHOICE_STREAM = "pool_import/choose"
ENGINE = "import"


def choose(groups: list[pool_source.Group], m: int, seed: int) -> tuple[list[tuple], dict]:
    """[(group, its m responses)] in source order, and the counts (step 1 of the doc)."""
    chosen, small, larger = [], 0, 0
    for g in groups:
        n = len(g.responses)
        if n < m:
            small += 1
            continue
        picks: range | list[int] = range(n)
        if n > m:
            larger += 1
            picks = sorted(py_random(seed, f"{CHOICE_STREAM}/{g.prompt_id}").sample(range(n), m))
        chosen.append((g, [g.responses[k] for k in picks]))
    if not chosen:
        largest = max(len(g.responses) for g in groups)
        raise PoolError(f"pool_import: no group of the source has rollout.group_size={m} responses (the largest "
                        f"has {largest}); lower rollout.group_size")
    return chosen, {"groups_source": len(groups), "groups_smaller_than_m": small, "groups_subsampled": larger,
                    "choice_stream": f"(seed {seed}, {CHOICE_STREAM}/<problem id>)"}


def response_tokens(r: pool_source.Response, ids: list[int], eos: int, max_new: int, source: str,
                    field: str) -> tuple[list[int], list[float] | None, str, bool]:
    """(token ids, behavior log-probs or None, finish reason, truncated) of one response
    (step 2 of the doc)."""
    full, finish = ids + [eos], "stop"
    lps = list(r.logprobs) if r.logprobs is not None else None
    if (lps is not None and len(lps) == len(ids)) or (lps is None and len(ids) == max_new):
        full, finish = ids, "length"           # the sampler stopped at its budget, before an EOS
    elif lps is not None and len(lps) != len(full):
        raise PoolError(f"{source}: {r.where}: field '{field}' has {len(lps)} entries for response {r.index}, which "
                        f"tokenizes to {len(ids)} tokens ({len(full)} with EOS); give one log-prob per response "
                        "token, from this model's tokenizer")
    truncated = len(full) > max_new
    if truncated:
        full, finish = full[:max_new], "length"
        lps = lps[:max_new] if lps is not None else None
    return full, lps, finish, truncated


def tokenize(chosen: list[tuple], tok, to_prompt, cfg: PipelineConfig, source: str) -> tuple[dict, list[bool]]:
    """TRAIN_POOL columns of the chosen responses (reward and status still empty) and, per
    response, whether it was truncated."""
    cols: dict[str, list] = {name: [] for name in TRAIN_POOL.names}
    truncated = []
    max_new, field = cfg.rollout.max_new_tokens, cfg.pool.map.get("behavior_logprobs", "behavior_logprobs")
    prompts = tok([to_prompt(g.problem) for g, _ in chosen])["input_ids"]
    texts = [r.text for _, rs in chosen for r in rs]
    ids_of = iter(tok(texts, add_special_tokens=False)["input_ids"] if texts else [])
    for j, ((g, responses), prompt_ids) in enumerate(zip(chosen, prompts)):
        for i, r in enumerate(responses):
            ids, lps, finish, cut = response_tokens(r, next(ids_of), tok.eos_token_id, max_new, source, field)
            row = {"prompt_id": g.prompt_id, "group": j, "sample": i, "prompt_token_ids": prompt_ids,
                   "response_token_ids": ids, "behavior_logprobs": lps,
                   "response_text": tok.decode(ids, skip_special_tokens=True) if cut else r.text,
                   "response_length": len(ids), "finish_reason": finish, "temperature": None, "top_p": None,
                   "max_new_tokens": max_new, "seed": None, "engine": ENGINE,
                   "logprobs_mode": "given" if lps is not None else None, "reward": None, "status": None}
            for name, value in row.items():
                cols[name].append(value)
            truncated.append(cut)
    return cols, truncated


def rewards(cfg: PipelineConfig, chosen: list[tuple], texts: list[str]) -> tuple[list[float], list[str], dict]:
    """(reward, status) per chosen response and the summary's reward counts (step 3 of the doc)."""
    given = [r.reward for _, rs in chosen for r in rs]
    if cfg.pool.trust_rewards:
        return given, ["given"] * len(given), {"rewards": "given (pool.trust_rewards)"}
    answers = [(g.answer,) for g, rs in chosen for _ in rs]
    with progress.Progress("pool_import: grade", total=len(texts), unit="response") as bar:
        graded = grade_many(texts, answers, cfg.verify.timeout_s, cfg.verify.workers, progress=bar.update,
                            retry_timeout_s=cfg.verify.retry_timeout_s)
    pairs = [(a > 0.5, b[0] > 0.5) for a, b in zip(given, graded) if a is not None]
    disagree = sum(a != b for a, b in pairs)
    if disagree:
        log.warning("pool_import: the given rewards and math-verify disagree on %d of %d responses", disagree, len(pairs))
    counts = {"rewards": "graded (math-verify)", **grading_summary(graded), "rewards_compared": len(pairs),
              "reward_disagreements": disagree, "reward_disagreement_rate": disagree / len(pairs) if pairs else 0.0}
    return [g[0] for g in graded], [g[1] for g in graded], counts


def vocab_sha256(tok) -> str:
    """sha256 of the tokenizer's vocabulary: a scoring model must tokenize as the pool did."""
    return hashlib.sha256(canonical_json(sorted(tok.get_vocab().items())).encode()).hexdigest()


def provenance(chosen: list[tuple], cols: dict, truncated: list[bool], kept: set[int]) -> dict[str, list]:
    flat = [r for _, rs in chosen for r in rs]
    return {"group": cols["group"], "sample": cols["sample"], "prompt_id": cols["prompt_id"],
            "source_row": [r.row for r in flat], "source_index": [r.index for r in flat],
            "given_reward": [r.reward for r in flat], "reward": cols["reward"], "status": cols["status"],
            "truncated": truncated, "kept": [g in kept for g in cols["group"]]}


def build(cfg: PipelineConfig, inputs: dict[str, Manifest], folder: Path) -> Built:
    src = pool_source.load(cfg.pool)
    tok = load_tokenizer(model_path(inputs["base"]))
    template, to_prompt = catalog.prompt_builder("chat" if cfg.pool.prompt == "chat" else cfg.task.prompt, tok)
    chosen, counts = choose(src.groups, cfg.rollout.group_size, cfg.seed)
    cols, truncated = tokenize(chosen, tok, to_prompt, cfg, src.name)
    cols["reward"], cols["status"], reward_counts = rewards(cfg, chosen, cols["response_text"])
    frame = cast(pl.DataFrame, pl.from_arrow(pa.table(cols, schema=TRAIN_POOL)))     # a Table gives a DataFrame
    pool, stats = keep_mixed(frame, cfg.rollout.group_size, "pool_import")
    n = write_parquet(pool.to_arrow(), TRAIN_POOL, folder / "train_pool.parquet")
    trail = provenance(chosen, cols, truncated, set(pool["group"].to_list()))
    n_prov = write_parquet(trail, POOL_PROVENANCE, folder / "provenance.parquet")
    if sum(truncated):
        log.warning("pool_import: %d of %d responses were longer than rollout.max_new_tokens=%d: truncated and "
                    "marked (finish_reason length)", sum(truncated), len(truncated), cfg.rollout.max_new_tokens)
    return Built(files={"train_pool": ("train_pool.parquet", n), "provenance": ("provenance.parquet", n_prov)},
                 summary={"source": str(cfg.pool.source), "source_name": src.name, "source_kind": src.kind,
                          "source_digest": src.digest, "source_rows": src.rows, "source_shape": src.shape,
                          "mapping": canonical_json(cfg.pool.map), "group_size": cfg.rollout.group_size,
                          **counts, "responses_chosen": len(truncated), "responses_truncated": sum(truncated),
                          "truncation": "truncated at rollout.max_new_tokens and marked (finish_reason length)",
                          "groups_identical_responses": src.identical, **reward_counts, **stats,
                          "behavior_logprobs": "given" if src.has_behavior else "none",
                          "prompt_template": template, "tokenizer_vocab_sha256": vocab_sha256(tok)})


def content_key(cfg: PipelineConfig) -> dict[str, str]:
    """The source's content (not its path): its sha256, or the dataset id with its fingerprint."""
    return {"pool_source": pool_source.digest(cfg.pool)}


SPEC = StageSpec(name="pool_import", version=1, build=build, extra_key=content_key, reads=(
    "seed", "task.prompt", "rollout.group_size", "rollout.max_new_tokens", "verify", "pool.split", "pool.map",
    "pool.trust_rewards", "pool.prompt"))


def run(config: PipelineConfig, inputs: dict[str, Manifest], store: Store | None = None,
        force: bool = False) -> Manifest:
    return run_stage(SPEC, config, inputs, store, force)
