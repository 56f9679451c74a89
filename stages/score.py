"""Stage `score`: behavior log-probs for an imported pool that has none, from a named model.

Reads `rollout.group_size`, `rollout.temperature` (log-probs under softmax(logits / T), the
engines' convention), `train.device`, `train.dtype`, `train.logprob_impl` (the trainer's
precision and log-prob path); the model `pool.score_model` (a local HF folder) enters the
key by content (the sha256 of its files), not by path. Input `pool` (a pool_import
artifact). Writes `train_pool.parquet` (TRAIN_POOL): the input pool with every response's
teacher-forced log-probs under that model as its `behavior_logprobs`, `logprobs_mode`
"scored by <model>, not sampled" and the temperature used. The summary carries the
input's counts and says the same under `behavior_logprobs`, so the train stage, MLflow and
anyone reading the manifest can tell these from sampled log-probs: they are the scoring
model's probabilities of text someone else sampled, which GRPO+TIS and behavior-anchored
GRPO then treat as pi_beh.

The log-probs are computed by the trainer's own code (pipeline.training.loop step_anchor: the
same micro-batches, runtime and LM head as a step start's lp_old), so scoring with the
base model gives what the trainer computes for pi_0. The scoring model must tokenize as
the pool's base model did (the vocabularies are compared).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import polars as pl
import torch

from pipeline.core.config import PipelineConfig
from pipeline.core.errors import ConfigError
from pipeline.core.schemas import TRAIN_POOL, write_parquet
from pipeline.core.store import Manifest, Store, canonical_json, sha256_cached
from pipeline.dag.spec import Built, StageSpec, run_stage
from pipeline.models.hf import load_model, load_tokenizer
from pipeline.models.runtime import make_runtime
from pipeline.training.loop import TrainContext, check_token_ids, load_pool, step_anchor
from stages.pool_import import vocab_sha256


def scored_by(cfg: PipelineConfig) -> str:
    return f"scored by {cfg.pool.score_model}, not sampled"


def model_folder(cfg: PipelineConfig) -> Path:
    """pool.score_model as a local HF folder, or a ConfigError (one line)."""
    folder = Path(cfg.pool.score_model or "").expanduser()
    if not cfg.pool.score_model or not (folder / "config.json").is_file():
        raise ConfigError(f"pool.score_model={cfg.pool.score_model}: not a local Hugging Face model folder (no "
                          "config.json); give the folder of the model to score with (`ggpo stage score --model PATH`)")
    return folder


def build(cfg: PipelineConfig, inputs: dict[str, Manifest], folder: Path) -> Built:
    torch.set_num_threads(cfg.model.threads)
    source, path = inputs["pool"], str(model_folder(cfg))
    tok = load_tokenizer(path)
    if vocab_sha256(tok) != source.summary.get("tokenizer_vocab_sha256"):
        raise ConfigError(f"pool.score_model={cfg.pool.score_model}: its tokenizer is not the one the pool was "
                          "tokenized with (the base model's); score with a model of the same tokenizer")
    pool_path, m = source.path("train_pool"), cfg.rollout.group_size
    pool = load_pool(pool_path, m)
    rt = make_runtime(cfg.train)
    model = rt.prepare(load_model(path)).eval()
    check_token_ids(pool, model.config.vocab_size, f"pool.score_model={cfg.pool.score_model}")
    lp = step_anchor(model, TrainContext(cfg, pool, rt, tok.pad_token_id), list(range(len(pool.group_ids))))
    rows = [lp[j][i, :len(r)].tolist() for j in range(len(pool.group_ids)) for i, r in enumerate(pool.responses[j])]
    df = pl.read_parquet(pool_path).sort(["group", "sample"]).with_columns(
        pl.Series("behavior_logprobs", rows, dtype=pl.List(pl.Float32)),
        pl.lit(scored_by(cfg)).alias("logprobs_mode"), pl.lit(cfg.rollout.temperature).alias("temperature"))
    n = write_parquet(df.to_arrow(), TRAIN_POOL, folder / "train_pool.parquet")
    return Built(files={"train_pool": ("train_pool.parquet", n)},
                 summary=source.summary | {"behavior_logprobs": scored_by(cfg), "scored_by": cfg.pool.score_model,
                                           "scored_pool_key": source.key, "scoring_temperature": cfg.rollout.temperature})


def content_key(cfg: PipelineConfig) -> dict[str, str]:
    """sha256 over the scoring model's files (each hashed once per process)."""
    folder = model_folder(cfg)
    files = {p.name: sha256_cached(p) for p in sorted(folder.iterdir()) if p.is_file()}
    return {"score_model": hashlib.sha256(canonical_json(files).encode()).hexdigest()}


SPEC = StageSpec(name="score", numerics=True, version=1, build=build, extra_key=content_key, reads=(
    "rollout.group_size", "rollout.temperature", "train.device", "train.dtype", "train.logprob_impl"))


def run(config: PipelineConfig, inputs: dict[str, Manifest], store: Store | None = None,
        force: bool = False) -> Manifest:
    return run_stage(SPEC, config, inputs, store, force)
