"""Typed configuration: one pydantic model per stage, presets as TOML files.

A run's config is `defaults <- preset file <- --set overrides`. Each stage declares the
sections it reads; only those sections enter its cache key, so changing `train.lr`
reruns training and evaluation but reuses the pool. Defaults are the paper's where the
paper gives one (docs/math.md lists them); the tiny preset scales the geometry down
for a 2-core CPU. What each training method needs is pipeline/core/methods.py.
"""
from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.core import methods
from pipeline.core.errors import BENCHMARKS, ConfigError

PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def check_known(setting: str, given, known: tuple[str, ...]) -> None:
    """A ValueError naming the names in `given` that are not `known`."""
    unknown = [x for x in given if x not in known]
    if unknown:
        raise ValueError(f"{setting}: unknown {unknown}; known: {', '.join(known)}")


class TaskConfig(Section):
    """The prompt set: a built-in task family, or a Parquet/JSONL file with problem, answer."""
    name: str = "digit_sort"          # digit_sort | arithmetic | countdown | countdown_work:W | path to .parquet/.jsonl
    difficulty: int = Field(1, ge=1, le=5)
    n_train: int = Field(512, ge=1)
    n_eval: int = Field(200, ge=1)
    split_seed: int = 0               # fixes the data itself; independent of the run seed
    # training prompt: task = the built-in "Q: ..\nA:" format (what the tiny model learned);
    # plain = a step-by-step instruction ending in "\boxed{}" (real base models)
    prompt: Literal["task", "plain"] = "task"


class ModelConfig(Section):
    """The base policy pi_0: an HF folder / hub id, or the built-in tiny model (None)."""
    name_or_path: str | None = None
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 512
    init_seed: int = 0
    # supervised warm-up of the tiny model: stop once sampled accuracy reaches the target
    sft_lr: float = 3e-3
    sft_batch_size: int = 128
    sft_warmup: int = 50
    sft_decay_steps: int = 800        # cosine horizon; warm-up usually stops well before it
    sft_max_steps: int = 400
    sft_check_every: int = 25
    target_accuracy: float = 0.35     # sampled accuracy (T=1) at which warm-up stops
    check_prompts: int = 64
    check_samples: int = 4
    threads: int = 1                  # torch threads; 1 is fastest and deterministic here


class RolloutConfig(Section):
    group_size: int = Field(8, ge=2)  # m
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(16, ge=1)
    batch_prompts: int = Field(64, ge=1)
    engine: Literal["transformers", "vllm"] = "transformers"     # "hf" is accepted for transformers
    # the engine's weights: auto = fp32 on CPU, bf16 on CUDA (vLLM: auto = bf16). Log-probs are
    # always fp32 from the logits; bfloat16 against the fp32 trainer gives a real behavior-learner
    # gap (training-inference mismatch) that a CPU can show
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # vLLM only: engines over prompt shards, one per visible GPU ("auto") or this many;
    # each engine spans tensor_parallel_size GPUs
    data_parallel: int | Literal["auto"] = "auto"
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    # responses whose trainer log-probs are recomputed to measure engine-trainer mismatch
    mismatch_sample: int = Field(64, ge=0)

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_alias(cls, value):
        return "transformers" if value == "hf" else value     # one name in keys and summaries


class VerifyConfig(Section):
    """Grading limits are CPU seconds per response, so a verdict does not depend on load
    (pipeline/tasks/grading.py). A response over `timeout_s` is graded once more, in fresh
    workers, with `retry_timeout_s` (None: 5 x timeout_s) before `timeout` is final."""
    timeout_s: float = Field(2.0, gt=0)   # per response
    retry_timeout_s: float | None = Field(None, gt=0)
    workers: int = Field(0, ge=0)         # 0 = one per core


class FilterConfig(Section):
    keep: Literal["mixed"] = "mixed"      # 0 < successes < m (spec 8.2)


# the off-policy corrections' options (TrainConfig): each in a stage's key only when set away
# from its default (PipelineConfig.slice), so the keys cached before they existed stay valid;
# each applies only to the methods whose Method.options name it (TrainConfig's validator)
CORRECTION_OPTIONS = ("is_threshold_low", "is_threshold_high", "geo_mask_low", "geo_mask_high", "opsm_delta",
                      "cispo_eps_clip_low", "cispo_eps_clip_high", "gspo_eps_low", "gspo_eps_high", "m2_threshold",
                      "behave_imp_weight_cap", "dppo_mask_low", "dppo_mask_high", "dppo_kl_tau", "sapo_tau_pos",
                      "sapo_tau_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
                      "dppo_kl_delta_low", "dppo_kl_delta_high", "dppo_kl_clip_c", "gmpo_eps_low", "gmpo_eps_high",
                      "opmd_tau", "opmd_baseline")


class TrainConfig(Section):
    method: str = "grpo"      # a name in pipeline/core/methods.py's METHODS (plugins included)
    updates: int = Field(400, ge=1)
    groups_per_update: int = Field(32, ge=1)   # G_mb
    updates_per_step: int = Field(8, ge=1)     # N
    lr: float = Field(1e-6, gt=0)
    adam_betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    beta: float = Field(0.01, ge=0)
    tis_cap: float = Field(2.0, gt=0)                  # C, spec section 3
    ggpo_clip_delta: float | None = Field(None, gt=0)  # spec 5.5 variant; None = off
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float = 3.0
    eps_adv: float = 1e-6
    aggregation: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    anchor: Literal["behavior", "old"] = "behavior"   # spec 13 item 4
    # options of the off-policy corrections (pipeline/training/corrections.py; docs/math.md,
    # "Off-policy corrections"), named and defaulted as their source framework's option. Each
    # is read only by the methods whose Method.options name it, and at its default it is
    # left out of every cache key (CORRECTION_OPTIONS), so adding one moved no key
    is_threshold_low: float = Field(0.5, gt=0)       # icepop: keep pi_old/mu in [low, high] (OpenRLHF)
    is_threshold_high: float = Field(5.0, gt=0)
    geo_mask_low: float = Field(0.99, gt=0)          # geo_mask: keep a response whose geometric-mean
    geo_mask_high: float = Field(1.01, gt=0)         #   pi_old/mu is in [low, high] (SkyRL)
    opsm_delta: float = 1e-4                         # opsm: drop A < 0 responses past this mean log(mu/pi) (slime)
    cispo_eps_clip_low: float = Field(1.0, ge=0)     # cispo: sg(clip(r, 1 - low, 1 + high)) (SkyRL, ScaleRL)
    cispo_eps_clip_high: float = Field(4.0, ge=0)
    gspo_eps_low: float = Field(3e-4, ge=0)          # gspo: clip of the sequence ratio (verl's GSPO recipe)
    gspo_eps_high: float = Field(4e-4, ge=0)
    m2_threshold: float = Field(0.04, gt=0)          # m2po: second-moment bound (AReaL gsm8k_m2po example)
    behave_imp_weight_cap: float = Field(5.0, gt=0)  # decoupled_ppo, m2po: drop tokens with pi_old/mu above (AReaL)
    dppo_mask_low: float = Field(0.2, ge=0)          # dppo_tv: probability-difference trust region (prime-rl)
    dppo_mask_high: float = Field(0.2, ge=0)
    dppo_kl_tau: float = Field(1e-3, ge=0)           # dppo_tv: + kl_tau (log pi/mu)^2 a token (prime-rl)
    sapo_tau_pos: float = Field(1.0, gt=0)           # sapo: gate temperature where A > 0, else tau_neg (verl, TRL)
    sapo_tau_neg: float = Field(1.05, gt=0)
    vespo_k_pos: float = Field(2.0, ge=0)            # vespo: phi(W) = W^k exp(lambda (1 - W)), (k, lambda) by
    vespo_lambda_pos: float = Field(3.0, gt=0)       #   the sign of A: pos where A >= 0 (TRL)
    vespo_k_neg: float = Field(3.0, ge=0)
    vespo_lambda_neg: float = Field(2.0, gt=0)
    dppo_kl_delta_low: float = Field(0.2, ge=0)      # dppo_kl: binary-KL trust region (verl's clip_ratio_low/high)
    dppo_kl_delta_high: float = Field(0.2, ge=0)
    dppo_kl_clip_c: float = Field(3.0, gt=0)         # dppo_kl: sg(min(pi/pi_old, C)) (verl's actor clip_ratio_c)
    gmpo_eps_low: float = Field(0.4, ge=0)           # gmpo: token log-ratio clip [-low, high] (TRL, verl's GMPO example)
    gmpo_eps_high: float = Field(0.4, ge=0)
    opmd_tau: float = Field(1.0, gt=0)               # opmd: baseline temperature and the 1/(1 + tau) (Trinity-RFT)
    opmd_baseline: Literal["logavgexp", "mean"] = "logavgexp"   # opmd: tau log-mean-exp or the mean (Trinity's default)
    # reference refresh every t_ref updates; "fixed" = never; "default" = the method's
    # default_t_ref (pipeline/core/methods.py: GRPO and GRPO+TIS fixed, AGRO and GGPO 160)
    t_ref: int | Literal["fixed", "default"] = "default"
    micro_batch_groups: int = Field(8, ge=1)
    # token budget per micro-batch (prompt + response tokens, padded); whole groups are
    # packed longest first. None = micro_batch_groups groups per micro-batch
    micro_batch_tokens: int | None = Field(None, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"       # auto: cuda when available
    # auto: bf16 autocast on cuda, fp32 on cpu; float64: exact arithmetic for checks (tests
    # compare two training paths in it, where fp32 rounding through AdamW would blur them)
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    reference_device: Literal["same", "cpu"] = "same"     # "cpu" keeps the reference off the GPU
    gradient_checkpointing: bool = False                 # non-reentrant
    logprob_chunk_tokens: int = Field(1024, ge=1)         # LM-head chunk (tokens) for log-probs
    # chunked: hidden states -> LM head per chunk, never a [tokens, vocab] tensor (policy.py);
    # full: the plain logits path, kept as the reference implementation for parity checks
    logprob_impl: Literal["chunked", "full"] = "chunked"
    # padding-free micro-batches (policy.make_batch): auto = on CUDA (flash-attn's varlen kernels
    # when installed, else flex attention), on the CPU padded rows in length buckets (policy.Buckets);
    # on = packed on the CPU too (sdpa with a block-diagonal mask: correct, for checks, not
    # faster there); off = one padded batch per micro-batch
    packing: Literal["auto", "on", "off"] = "auto"
    reference_cache: bool = True     # reference log-probs once per group per reference window
    # the step anchor (lp_old) of a micro-batch that the step's first update also runs, exactly
    # as batched, read from that update's own forward (same weights, same input: the same bits
    # on the CPU, a test checks it) instead of a second forward; false computes it apart
    anchor_reuse: bool = True
    checkpoint_every: int = Field(10, ge=1)
    diagnostics_block: int = Field(8, ge=1)     # updates per sequence-ESS block (spec 9)
    eval_every: int | None = None               # also snapshot the policy every this many updates
    # data-parallel training (pipeline/training/distributed.py): nproc ranks per node under torchrun,
    # FSDP2-sharded; nnodes > 1 needs rdzv_endpoint ("host:port" of node 0, the same on every
    # node). Placement, not content: never in a cache key (KEY_EXCLUDE)
    nproc: int = Field(1, ge=1)
    nnodes: int = Field(1, ge=1)
    rdzv_endpoint: str | None = None
    # parameters under FSDP (pipeline/training/distributed.py): float32 + bf16 autocast, as one
    # process computes; bfloat16 = FSDP's bf16 parameters (less traffic, bf16 residual stream)
    fsdp_param_dtype: Literal["float32", "bfloat16"] = "float32"

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        methods.get(value)          # ValueError: "train.method: unknown 'x'; known: ..."
        return value

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        entry = self.method_entry()
        if entry.needs_beta and self.beta <= 0:
            raise ValueError(f"train.beta must be > 0 for {self.method} (it divides by beta), got {self.beta}")
        if isinstance(self.t_ref, int) and self.t_ref < 1:
            raise ValueError(f"train.t_ref must be >= 1, 'fixed' or 'default', got {self.t_ref}")
        if self.ggpo_clip_delta is not None and not entry.clip_delta:
            clipped = [m.name for m in methods.METHODS.values() if m.clip_delta]
            raise ValueError(f"train.ggpo_clip_delta applies to method {' or '.join(map(repr, clipped))} only")
        if self.aggregation != "token-mean" and not entry.honors_aggregation:
            honoring = [m.name for m in methods.METHODS.values() if m.honors_aggregation]
            raise ValueError(f"train.aggregation={self.aggregation!r}: {self.method} computes token-mean only and "
                             f"would ignore it; methods that honor it: {', '.join(honoring)}")
        self._check_correction_options(entry)
        return self

    def _check_correction_options(self, entry: methods.Method) -> None:
        """A correction option away from its default only for a method that reads it; bands ordered."""
        for name in CORRECTION_OPTIONS:
            if getattr(self, name) != TrainConfig.model_fields[name].default and name not in entry.options:
                readers = [m.name for m in methods.METHODS.values() if name in m.options]
                raise ValueError(f"train.{name} applies to method {' or '.join(map(repr, readers))} only, "
                                 f"not {self.method!r}")
        for band in ("is_threshold", "geo_mask"):
            low, high = getattr(self, f"{band}_low"), getattr(self, f"{band}_high")
            if not low < high:
                raise ValueError(f"train.{band}_low must be < train.{band}_high, got {low} and {high}")

    def method_entry(self) -> methods.Method:
        """The record of `method` (pipeline/core/methods.py)."""
        return methods.get(self.method)

    def refresh_every(self) -> int | None:
        """Updates between reference refreshes; None = fixed reference."""
        if self.t_ref == "default":
            return self.method_entry().default_t_ref
        return None if self.t_ref == "fixed" else self.t_ref

    def needs_step_anchor(self) -> bool:
        """lp_old at step starts (the method's record, train.anchor, train.ggpo_clip_delta)."""
        return self.method_entry().needs_step_anchor(self.anchor, self.ggpo_clip_delta)

    def snapshot_updates(self) -> list[int]:
        """Updates after which the policy is saved for evaluation (not the final one)."""
        return list(range(self.eval_every, self.updates, self.eval_every)) if self.eval_every else []

    def online_eval_points(self) -> list[tuple[int, int | None, int]]:
        """Where the online flow evaluates: (round, eval.update, update) for every
        eval_every point and the end (the round that contains the update; the cell keeps
        an online_policy there)."""
        n = self.updates_per_step
        return [(-(-at // n) - 1, None if at % n == 0 else at, at) for at in self.snapshot_updates() + [self.updates]]

    def online_eval_updates(self, rounds_done: int) -> list[int]:
        """The updates a cell that finished `rounds_done` rounds has policies for: its
        evaluation points inside them and, when it stopped early (online.on_stall), the
        update it stopped at."""
        points = [at for r, _, at in self.online_eval_points() if r < rounds_done]
        stop = rounds_done * self.updates_per_step
        return points + ([stop] if 0 < stop < self.updates and stop not in points else [])

    def needs_behavior_logprobs(self) -> bool:
        """Behavior log-probs (the method's record and train.anchor)."""
        return self.method_entry().needs_behavior(self.anchor)


class ExperimentConfig(Section):
    """What the flow compares: every method trains on each seed's pool (spec 8.4), at
    every point of `grid` (pipeline/core/grid.py expands and validates the cells)."""
    # which flow the preset's experiment is (ggpo report reads that flow's artifacts);
    # corrections: the online cells and, per seed, every method on the fixed offline pool
    flow: Literal["offline", "online", "corrections"] = "offline"
    # method names, or names defined in `variants`; "all" is every registered method, plugins
    # included (methods.names(), in the table's order), with any variants named beside it after
    methods: list[str] = ["grpo"]
    seeds: list[int] = [42]
    # stage builds at once (2 cells side by side: 1.06x one alone in threads, 1.21x in worker
    # processes on this 2-core machine, benchmarks/runner_parallelism.py). Results do not
    # depend on it. Use 1 on a single GPU.
    parallel: int = Field(2, ge=1)
    # config fields to sweep, every combination a cell: {"train.lr": [1e-5, 1e-4]}
    grid: dict[str, list[Any]] = {}
    # named method entries: {"ggpo_clip": {"train.method": "ggpo", "train.ggpo_clip_delta": 0.05}}
    variants: dict[str, dict[str, Any]] = {}
    # where stage tasks run (pipeline/dag/placement.py): threads of the flow process;
    # `parallel` worker processes of this machine (no shared interpreter lock: a small model's
    # Python-bound steps run side by side; benchmarks/runner_parallelism.py); or Ray
    # workers, each task asking for its GPUs/CPUs. Results do not depend on it
    task_runner: Literal["threads", "processes", "ray"] = "threads"
    # Ray cluster: "host:port" (the head's GCS port), "ray://host:10001" (Ray Client),
    # "auto" (the cluster `ray start` runs on this machine) or "local" (a private Ray
    # instance for this flow run). None: $RAY_ADDRESS, else "local"
    ray_address: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "ExperimentConfig":
        names = methods.names()
        self.methods = expand_all(self.methods, names, self.variants)
        known = list(names) + [v for v in self.variants if v not in names]
        unknown = [m for m in self.methods if m not in known]
        if unknown:
            raise ValueError(f"experiment.methods: unknown {unknown}; known: {', '.join(known)} "
                             f"(define others in experiment.variants)")
        clash = [v for v in self.variants if v in names]
        if clash:
            raise ValueError(f"experiment.variants: {clash} are method names; name the variant otherwise")
        for field, values in self.grid.items():
            if field == "seed" or field.split(".")[0] == "experiment" or field in FLOW_FIELDS:
                raise ValueError(f"experiment.grid: '{field}' is set by the flow; use experiment.seeds, "
                                 f"experiment.methods or experiment.variants instead")
            if not values or len(set(map(repr, values))) != len(values):
                raise ValueError(f"experiment.grid['{field}']: give a non-empty list of distinct values, got {values}")
        return self


ALL_METHODS = "all"      # experiment.methods entry: every registered method


def expand_all(entries: list[str], names: tuple[str, ...], variants: dict[str, Any]) -> list[str]:
    """experiment.methods with "all" replaced by every registered method (`names`), the
    variants named beside it kept after them in their order. Refused where it is ambiguous:
    a method or variant named "all", or a method named beside "all" (it is in it already:
    which place does it take?)."""
    if ALL_METHODS not in entries:
        return entries
    if ALL_METHODS in names or ALL_METHODS in variants:
        raise ValueError(f"experiment.methods: '{ALL_METHODS}' is also the name of a "
                         f"{'method' if ALL_METHODS in names else 'variant'}; name it otherwise")
    if entries.count(ALL_METHODS) > 1:
        raise ValueError(f"experiment.methods: '{ALL_METHODS}' given {entries.count(ALL_METHODS)} times; give it once")
    beside = [m for m in entries if m != ALL_METHODS]
    twice = [m for m in beside if m in names]
    if twice:
        raise ValueError(f"experiment.methods: {twice} named beside '{ALL_METHODS}', which holds "
                         f"every registered method already ({', '.join(names)}); give '{ALL_METHODS}' and variant "
                         f"names, or the methods one by one")
    return list(names) + beside


# what each flow stage sets itself
FLOW_FIELDS = ("train.method", "eval.target", "eval.update", "online.round")


# the fields an imported pool's source can hold (pipeline/tasks/pool_source.py); `pool.map` renames them
POOL_FIELDS = ("problem", "answer", "response", "responses", "reward", "rewards", "behavior_logprobs",
               "group", "id")


class PoolConfig(Section):
    """A pool you already have (stages/pool_import.py): completions with a correctness flag,
    in place of rollout -> verify -> filter. `source` is a Parquet or JSONL file, a folder
    saved by `datasets` (`save_to_disk`), or a dataset id read through `datasets` (`split`).
    Its content enters the key (file bytes, or the dataset's fingerprint), not its path."""
    source: str | None = None
    split: str | None = None          # dataset ids and saved dataset folders only; None = "train"
    # our field -> the source's column: {"problem": "question", "responses": "generations"}
    map: dict[str, str] = {}
    trust_rewards: bool = False       # keep given rewards instead of grading every response
    # task: the task's template (task.prompt), as the rollout stage; chat: the model's chat
    # template with the plain instruction, the one eval.prompt=chat uses
    prompt: Literal["task", "chat"] = "task"
    # a local HF folder whose teacher-forced log-probs become the behavior log-probs
    # (stages/score.py) of a pool that has none; the train stage then reads the scored pool
    score_model: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "PoolConfig":
        check_known("pool.map", self.map, POOL_FIELDS)
        if (self.score_model or self.split) and not self.source:
            raise ValueError("pool.score_model and pool.split apply to an imported pool: set pool.source too")
        return self


class OnlineConfig(Section):
    """The online loop (spec 8.1-8.3, flows/online.py): each round syncs the sampler to the
    learner, draws prompt batches from the seeded loader until N * G_mb mixed-reward groups
    exist, then takes N = train.updates_per_step updates on them."""
    # which round `ggpo stage online_pool|online_train` reads from the cache (0-based; a cell
    # builds them). Never in a key: a round's place in the chain is its inputs' keys
    round: int = Field(0, ge=0)
    # prompts per draw; None = N * G_mb (spec 8.2 [choice])
    draw_prompts: int | None = Field(None, ge=1)
    # draws per round before the round fails: a prompt set that cannot fill a round (all
    # solved, none solved) stops with the counts, never loops forever. Not in a key
    max_draws: int = Field(16, ge=1)
    # stop a round's draws early once the draws left cannot fill it even at its mixed-group
    # rate's upper bound at this level (stages/online_pool.py `cannot_fill`; docs/math.md 8.2).
    # None = always draw online.max_draws (a collapsed policy then costs 16 draws of N * G_mb
    # prompts before its stall). Not in a key: a round that fills is the same
    stall_alpha: float | None = Field(1e-4, gt=0, lt=1)
    # a round (after the first) that cannot fill its pool, because the policy now solves or
    # fails (nearly) every prompt: "stop" ends the cell there and evaluates its policy as
    # the cell's final (the report shows the update it stopped at: a collapse is a result of
    # the comparison, not a reason to lose the other cells); "error" fails the cell. Round 0
    # (pi_0) always fails: then the task does not fit the model. Not in a key
    on_stall: Literal["stop", "error"] = "stop"
    # a bound on each round's learner-to-behavior drift at its end (`round_drift`: token mean
    # |log ratio| of the learner after the round's N updates against the round's behavior
    # log-probs, pipeline/training/drift.py); None = no guard. A round above it: on_drift "warn"
    # logs one line and goes on; "stop" ends the cell after that round, as on_stall does (its
    # policy there is the cell's final, the report marks the stop). Not in a key
    max_round_drift: float | None = Field(None, gt=0)
    on_drift: Literal["warn", "stop"] = "warn"
    # measure round_drift (one no-grad forward of a seeded sample, pipeline/training/drift.py)
    # at rounds 0, k, 2k, ... and the last (k = drift_every); the others' drift is missing (None,
    # never 0) and max_round_drift checks only measured rounds. 4: the forward is 4.2% of a round
    # at N = 2, 7.9% at N = 1 (benchmarks/drift_cost.py, smoke-online), ~1-2% at k = 4; the
    # testbed presets measure every round (their reports are about it). Not in a key
    drift_every: int = Field(4, ge=1)
    # share pools between rounds whose sampler weights (sha256), base model, round start and
    # pool settings are equal: the later one copies the earlier one's files instead of
    # sampling (stages/online_pool.py "Shared pools"; bit-identical cells, e.g. the corrections
    # table's). Costs a sha256 of the weights per round (the tiny model: ~2 ms; 3.4 GB at
    # Qwen3-1.7B: seconds), so off by default. Not in a key: a shared pool is the same bytes
    share_pools: bool = False

    # rounds between an online cell's rolling checkpoints (the last 2 are kept, and one at the
    # end); "auto": every ceil(16 / N) rounds, about one per 16 updates: at the paper's scale
    # (Qwen3-1.7B, G_mb 32, m 8, ~1.6 k-token responses on one H200) an update with its share
    # of sampling is ~55 s, so about one checkpoint per 15 minutes. Not in any key
    checkpoint_every: int | Literal["auto"] = "auto"

    def per_draw(self, tc: "TrainConfig") -> int:
        return self.draw_prompts or tc.updates_per_step * tc.groups_per_update

    def checkpoint_rounds(self, tc: "TrainConfig") -> int:
        return self.checkpoint_every if isinstance(self.checkpoint_every, int) else max(1, -(-16 // tc.updates_per_step))


class EvalConfig(Section):
    # which model `ggpo stage evaluate` scores: the offline run, pi_0, or an online cell's
    # policy after update eval.update (its evaluation points: train.eval_every and the end)
    target: Literal["train", "base", "online"] = "train"
    update: int | None = None                    # a training snapshot (train.eval_every); None = final
    # empty: the task's own eval split; else benchmark names read from data_dir
    # (math500, aime24, aime25, olympiadbench, minerva_math, math_train)
    benchmarks: list[str] = []
    data_dir: str = "data/benchmarks"           # the shipped benchmarks (data/benchmarks/README.md), a folder, or hub
    # task: the task's own "Q:..\nA:" format; plain: a step-by-step \boxed{} instruction;
    # chat: the model's chat template (plain when it has none); auto: task for the task's
    # split, chat for benchmarks
    prompt: Literal["auto", "task", "plain", "chat"] = "auto"
    pass_k: list[int] = [1, 4, 8, 16, 32]        # pass@K reported for K <= n_samples
    n_samples: int = Field(8, ge=1)     # mean@n
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    batch_prompts: int = 64
    limit: int | None = None


    @model_validator(mode="after")
    def _check(self) -> "EvalConfig":
        check_known("eval.benchmarks", self.benchmarks, BENCHMARKS)
        return self


class PipelineConfig(Section):
    seed: int = 42
    task: TaskConfig = TaskConfig()
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    verify: VerifyConfig = VerifyConfig()
    filter: FilterConfig = FilterConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    online: OnlineConfig = OnlineConfig()
    pool: PoolConfig = PoolConfig()
    experiment: ExperimentConfig = ExperimentConfig()

    def updated(self, overrides: dict[str, Any]) -> "PipelineConfig":
        """A validated copy with dotted overrides applied ({"seed": 7, "train.method": "ggpo"})."""
        tree = self.model_dump(mode="json")
        for key, value in overrides.items():
            _set_dotted(tree, key, value)
        return PipelineConfig.model_validate(tree)

    def slice(self, fields: tuple[str, ...], drop: tuple[str, ...] = ()) -> dict[str, Any]:
        """The config fields a stage reads ("train" or "task.name"), as JSON-able data:
        its cache-key part; `drop`: dotted fields left out (not the stage's content)."""
        dumped = self.model_dump(mode="json")
        for dotted in KEY_EXCLUDE + tuple(drop):
            section, leaf = dotted.split(".")
            dumped[section].pop(leaf, None)
        for leaf in CORRECTION_OPTIONS:      # key-neutral at their default: no existing key moved
            if dumped["train"].get(leaf) == TrainConfig.model_fields[leaf].default:
                dumped["train"].pop(leaf)
        out: dict[str, Any] = {}
        for dotted in fields:
            src, dst, *_ = dumped, out
            *parents, leaf = dotted.split(".")
            for part in parents:
                src, dst = src[part], dst.setdefault(part, {})
            dst[leaf] = src[leaf]
        return out


# Placement, not content: fields that say where or how a stage runs, not what it computes
# (nproc=2 and packed micro-batches give nproc=1's padded result up to float reduction
# order; the reference cache and the anchor's reuse give it exactly). Never in a key or a manifest's config, so
# existing keys stay and a run can resume under another placement.
KEY_EXCLUDE = ("train.nproc", "train.nnodes", "train.rdzv_endpoint", "train.packing", "train.reference_cache",
               "train.anchor_reuse")


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def parse_value(raw: str) -> Any:
    """`--set` values: JSON when it parses (1e-5, true, [1,2]), else a bare list or string."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        pass
    if raw.startswith("[") and raw.endswith("]"):
        return [parse_value(x.strip()) for x in raw[1:-1].split(",") if x.strip()]
    return raw


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """["train.lr=1e-5", ...] -> {"train.lr": 1e-5, ...}."""
    pairs = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got '{item}'")
        k, v = item.split("=", 1)
        pairs[k.strip()] = parse_value(v.strip())
    return pairs


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: '{part}' is not a section")
    node[leaf] = value


def load_config(preset: str = "tiny", overrides: dict[str, Any] | list[str] | None = None) -> PipelineConfig:
    """defaults <- preset <- overrides ({"train.lr": 1e-5} or ["train.lr=1e-5"])."""
    path = PRESET_DIR / f"{preset}.toml"
    if not path.exists():
        raise ConfigError(f"unknown preset '{preset}'; known: {', '.join(preset_names())}")
    tree = tomllib.loads(path.read_text())
    items = overrides or {}
    if isinstance(items, list):
        items = parse_overrides(items)
    for key, value in items.items():
        _set_dotted(tree, key, value)
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(f"invalid config (preset '{preset}'):\n{exc}") from None
