"""The vLLM engine: shard/merge logic, explicit sampling params and the missing-vLLM error
on CPU; a real generation under the `gpu` marker (needs vLLM, CUDA and a local HF folder in
GGPO_TEST_MODEL, since the built-in tiny model may be too small for vLLM's kernels)."""
from __future__ import annotations

import importlib.util
import math
import os
from types import SimpleNamespace

import pytest
import torch

from pipeline.core.config import ConfigError
from pipeline.models.engines import Completion, SamplingParams, make_engine, vllm_engine as ve

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_shard_ranges_tile_in_order_with_uneven_sizes():
    assert ve.shard_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert ve.shard_ranges(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert ve.shard_ranges(5, 1) == [(0, 5)]
    for n, k in [(1, 1), (7, 2), (64, 8), (65, 8), (3, 5)]:
        r = ve.shard_ranges(n, k)
        assert r[0][0] == 0 and r[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(r, r[1:]))          # contiguous
        sizes = [e - s for s, e in r]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_more_shards_than_prompts_gives_one_prompt_per_shard():
    assert ve.shard_ranges(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert ve.shard_ranges(0, 4) == []
    with pytest.raises(ValueError):
        ve.shard_ranges(4, 0)


def test_merge_shards_restores_prompt_order():
    n = 11
    ranges = ve.shard_ranges(n, 4)
    # each shard's result as a worker would return it: one entry per prompt of its range
    results = [[f"p{i}" for i in range(s, e)] for s, e in ranges]
    assert ve.merge_shards(ranges, results, n) == [f"p{i}" for i in range(n)]
    # shards finishing in any order still land in place (results are matched by range)
    assert ve.merge_shards(ranges[::-1], results[::-1], n) == [f"p{i}" for i in range(n)]


def test_merge_shards_rejects_a_short_shard():
    ranges = ve.shard_ranges(6, 2)
    with pytest.raises(ValueError, match="shard 1 .* returned 2 results, expected 3"):
        ve.merge_shards(ranges, [["a", "b", "c"], ["d", "e"]], 6)


def test_prompt_seeds_depend_on_global_index_not_on_sharding():
    seeds = [ve.prompt_seed(42, i) for i in range(100)]
    assert len(set(seeds)) == 100                         # no two prompts share a stream
    assert all(0 <= s < 2**62 for s in seeds)             # room for vLLM's seed + sample index
    assert ve.prompt_seed(42, 7) == seeds[7] and ve.prompt_seed(43, 7) != seeds[7]


def test_sampling_kwargs_are_fully_explicit():
    """Every field explicit; the stop ids of both engines; flat log-probs of the sampled token
    only, and none at all for evaluation (logprobs=False)."""
    params = SamplingParams(n=8, temperature=0.7, top_p=1.0, max_new_tokens=3072, seed=5)
    kw = ve.vllm_sampling_kwargs(params, seed=99, stop_ids=[2, 151645])
    assert kw == {"n": 8, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                  "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                  "max_tokens": 3072, "seed": 99, "stop_token_ids": [2, 151645], "logprobs": 0,
                  "flat_logprobs": True, "detokenize": False}
    evaluation = SamplingParams(n=8, temperature=0.7, top_p=1.0, max_new_tokens=3072, seed=5, logprobs=False)
    assert ve.vllm_sampling_kwargs(evaluation, 99, [2])["logprobs"] is None


def test_data_parallel_resolution():
    assert ve.resolve_data_parallel("auto", 1, 8) == 8
    assert ve.resolve_data_parallel("auto", 2, 8) == 4
    assert ve.resolve_data_parallel("auto", 4, 2) == 1       # at least one engine
    assert ve.resolve_data_parallel(3, 1, 8) == 3
    assert ve.visible_gpus(2, "4,6") == ["4", "6"]
    assert ve.visible_gpus(3, None) == ["0", "1", "2"]


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _output(ids, lps, finish="length"):
    # the shape of a vllm CompletionOutput with logprobs=0: one {token_id: Logprob} per step
    steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids, lps)]
    return SimpleNamespace(index=0, token_ids=ids, logprobs=steps, finish_reason=finish)


def _flat_output(ids, lps, finish="length"):
    # the shape of vllm.logprobs.FlatLogprobs (flat_logprobs=True): per position t the entries
    # start_indices[t]..end_indices[t]-1, the sampled token first; here a second-ranked one too
    flat = SimpleNamespace(start_indices=[], end_indices=[], token_ids=[], logprobs=[])
    for t, lp in zip(ids, lps):
        flat.start_indices.append(len(flat.token_ids))
        flat.token_ids += [t, t + 1000]
        flat.logprobs += [lp, lp - 5.0]
        flat.end_indices.append(len(flat.token_ids))
    return SimpleNamespace(index=0, token_ids=ids, logprobs=flat, finish_reason=finish)


@pytest.mark.parametrize("shape", [_output, _flat_output], ids=["nested", "flat"])
def test_completion_reads_the_sampled_token_logprob(shape):
    c = ve.completion_from_output(shape([5, 9, 2], [-0.5, -1.25, -3.0], "stop"), 0, _Tok())
    assert c == Completion(token_ids=[5, 9, 2], logprobs=[-0.5, -1.25, -3.0], finish_reason="stop", text="5 9 2")
    bare = SimpleNamespace(index=0, token_ids=[5, 9], logprobs=None, finish_reason="length")
    assert ve.completion_from_output(bare, 0, _Tok(), with_logprobs=False).logprobs == []


def test_a_flat_position_whose_first_entry_is_not_the_sampled_token_raises():
    out = _flat_output([5, 9, 2], [-0.5, -1.0, -1.0])
    out.logprobs.token_ids[2] = 77          # position 1 starts at entry 2
    with pytest.raises(ve.VLLMOutputError, match="prompt 3, sample 0, token position 1 "):
        ve.completion_from_output(out, 3, _Tok())


@pytest.mark.parametrize("bad", [math.nan, -math.inf, None])
def test_a_bad_logprob_raises_naming_prompt_and_position(bad):
    out = _output([5, 9, 2], [-0.5, -1.0, -1.0])
    out.logprobs[1] = {} if bad is None else {9: SimpleNamespace(logprob=bad)}
    with pytest.raises(ve.VLLMOutputError, match="prompt 17, sample 0, token position 1 "):
        ve.completion_from_output(out, 17, _Tok())


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_vllm_missing_is_one_clear_config_error(tmp_path):
    with pytest.raises(ConfigError) as exc:
        make_engine("vllm", str(tmp_path), 64, 1)
    assert str(exc.value) == ("rollout.engine=vllm needs vLLM: pip install -e '.[gpu]' on a CUDA machine, "
                              "or use rollout.engine=transformers")



@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_vllm_without_cuda_is_a_clear_config_error(tmp_path, monkeypatch):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")    # importable, so the CUDA check is reached
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm needs a CUDA GPU .* use rollout.engine=transformers"):
        make_engine("vllm", str(tmp_path), 64, 1)

def _gpu_ready() -> bool:
    if not HAS_VLLM:
        return False
    import torch
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not (_gpu_ready() and os.environ.get("GGPO_TEST_MODEL")),
                    reason="needs vLLM, CUDA and GGPO_TEST_MODEL=<local HF model folder>")
def test_vllm_generates_with_finite_logprobs():
    from pipeline.core.config import load_config
    rc = load_config("tiny", {"rollout.engine": "vllm", "rollout.data_parallel": 1,
                              "rollout.gpu_memory_utilization": 0.5}).rollout
    engine = make_engine("vllm", os.environ["GGPO_TEST_MODEL"], 64, 1, rollout_cfg=rc)
    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=3)
    prompts = ["1 + 1 =", "The capital of France is", "def f(x):"]
    outs = engine.generate(prompts, params)
    assert len(outs) == 3 and all(len(g) == 4 for g in outs)
    for group in outs:
        for c in group:
            assert 1 <= len(c.token_ids) <= 16 and len(c.logprobs) == len(c.token_ids)
            assert all(math.isfinite(x) and x <= 0 for x in c.logprobs)
            assert c.finish_reason in ("stop", "length")
    # per-prompt seeds: the same call again gives the same tokens
    again = engine.generate(prompts, params)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in outs]
    assert engine.tokenizer(prompts[0])["input_ids"]


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_a_failing_shard_process_is_reported_with_its_gpus(tmp_path):
    """The real spawn/pipe path: each shard process starts, cannot build its engine (no
    vLLM here) and the parent raises naming the shard, its GPUs and the child's error."""
    from pipeline.models.tiny_model import build_tokenizer
    build_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match=r"(?s)vLLM shard 0 on CUDA_VISIBLE_DEVICES=3 failed.*No module named 'vllm'"):
        ve.VLLMEngine(str(tmp_path), data_parallel=2, gpu_ids=["3", "5"])


# A stand-in `vllm` package for the shard processes only (vLLM cannot run on this machine):
# it answers like vLLM's LLM.generate, with tokens that reveal which prompt, which seed and
# which CUDA_VISIBLE_DEVICES produced them, and samples in scrambled order.
FAKE_VLLM = '''
import os
from types import SimpleNamespace as NS

class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)

class LLM:
    def __init__(self, model, **kw):
        assert kw["logprobs_mode"] == "processed_logprobs" and kw["generation_config"] == "vllm"

    def generate(self, requests, sps, use_tqdm=True):
        gpu = int(os.environ["CUDA_VISIBLE_DEVICES"])
        out = []
        for req, sp in zip(requests, sps):
            toks = lambda j: [len(req["prompt_token_ids"]), (sp.seed + j) % 97, gpu]
            samples = [NS(index=j, token_ids=toks(j), finish_reason="length",
                          logprobs=[{t: NS(logprob=-1.5)} for t in toks(j)]) for j in range(sp.n)]
            out.append(NS(outputs=samples[::-1]))
        return out
'''


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_sharded_engine_merges_in_prompt_order_and_stops_its_processes(tmp_path, monkeypatch):
    from pipeline.models.tiny_model import build_tokenizer
    model = tmp_path / "model"
    build_tokenizer().save_pretrained(model)
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.syspath_prepend(str(tmp_path))        # spawned children inherit sys.path
    engine = ve.VLLMEngine(str(model), data_parallel=2, gpu_ids=["3", "5"], seed=1)
    procs = [p for p, _, _ in engine._workers]
    try:
        prompts = ["a", "bb", "ccc", "dddd", "eeeee"]
        params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=11)
        outs = engine.generate(prompts, params)
        lens = [len(engine.tokenizer(p)["input_ids"]) for p in prompts]
        gpus = [3, 3, 3, 5, 5]                        # shards (0..2) and (3..4)
        assert [[c.token_ids for c in g] for g in outs] == [
            [[lens[i], (ve.prompt_seed(11, i) + j) % 97, gpus[i]] for j in range(2)] for i in range(5)]
        assert outs[0][0].logprobs == [-1.5, -1.5, -1.5]
        # the same processes serve a second call
        again = engine.generate(prompts[:2], params)
        assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in outs[:1]] + [
            [[lens[1], (ve.prompt_seed(11, 1) + j) % 97, 5] for j in range(2)]]
    finally:
        engine.close()
    assert not any(p.is_alive() for p in procs)
    assert engine.stop_ids == [engine.tokenizer.eos_token_id]
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(prompts, params)


def test_a_resident_sampler_is_one_engine_on_the_learners_gpu(tmp_path, monkeypatch):
    """An online cell's sampler on an 8-GPU host with rollout.data_parallel=auto: one engine
    in this process (it sleeps while the learner trains), not 8 shard engines in processes
    that never sleep on the GPUs the learner trains on. Rollout and evaluation stages still
    shard over every GPU."""
    import torch

    import pipeline.models.engines as engines
    import pipeline.models.runtime as runtime
    from pipeline.core.config import load_config
    made = []
    monkeypatch.setattr(engines, "check_vllm", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)     # a CUDA host (else: vLLM's CPU build)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(runtime, "free_device_fraction", lambda: 0.95)
    monkeypatch.setattr(ve, "VLLMEngine", lambda path, **kw: made.append(kw) or kw)
    rc = load_config("smoke", ["rollout.data_parallel=auto"]).rollout
    make_engine("vllm", str(tmp_path), rollout_cfg=rc, resident=True)
    make_engine("vllm", str(tmp_path), rollout_cfg=rc.model_copy(update={"data_parallel": 4}), resident=True)
    make_engine("vllm", str(tmp_path), rollout_cfg=rc)
    assert [(kw["data_parallel"], kw["resident"]) for kw in made] == [(1, True), (1, True), (8, False)]


# --------------------------------------------------------------------------- weight syncs (fakes)

def _tiny_folder(folder) -> str:
    """The built-in tiny model, untrained (tied embeddings; lm_head.weight not stored)."""
    from pipeline.core.config import ModelConfig
    from pipeline.models.tiny_model import build_model, build_tokenizer, save
    tok = build_tokenizer()
    save(build_model(ModelConfig(), len(tok)), tok, folder)
    return str(folder)


class SyncRecorder:
    """vLLM's LLM as VLLMEngine.load_weights drives it in this process: what a sync sends,
    by either route (the CUDA IPC session, whose handles the test makes the tensors
    themselves; the worker's reload_weights from a folder, read here as the worker would)."""

    def __init__(self):
        self.calls, self.sent = [], {}

    def init_weight_transfer_engine(self, request):
        self.calls.append("init_weight_transfer_engine")

    def start_weight_update(self):
        self.calls.append("start_weight_update")

    def update_weights(self, request):
        info = request["update_info"]
        self.calls.append("update_weights")
        self.sent = {n: next(iter(h.values())) for n, h in zip(info["names"], info["ipc_handles"])}

    def finish_weight_update(self):
        self.calls.append("finish_weight_update")

    def collective_rpc(self, method, kwargs=None):
        from safetensors.torch import load_file
        self.calls.append(method)
        self.sent = load_file(os.path.join(kwargs["weights_path"], "model.safetensors"))

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return True


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_qwen3_layout_checkpoint_syncs_with_its_tied_head(tmp_path, monkeypatch, device):
    """Finding 2.1: Qwen3-1.7B ties its head to the embedding yet stores `lm_head.weight`;
    the learner's named_parameters() omit it. The sync sends what the checkpoint holds, the
    head being the learner's embedding, by both routes (CUDA IPC; the CPU build's reload
    from a file), then resets the prefix cache. The real engine: tests/test_vllm_real.py."""
    from pathlib import Path

    from pipeline.models.hf import load_model

    from conftest import write_qwen3_layout

    folder = write_qwen3_layout(Path(_tiny_folder(tmp_path / "tiny")), tmp_path / "qwen3-layout")
    assert "lm_head.weight" in ve.checkpoint_shapes(str(folder))       # stored, as in Qwen3-1.7B
    monkeypatch.setattr(ve, "build_llm", lambda path, kwargs: SyncRecorder())
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")      # restored after the test
    engine = ve.VLLMEngine(str(folder), seed=1, resident=True, **({"device": device} if device == "cpu" else {}))
    engine.ipc_handle = lambda t: t
    learner = load_model(str(folder))
    with torch.no_grad():
        learner.model.embed_tokens.weight.mul_(1.5)
    named = list(learner.named_parameters())
    assert "lm_head.weight" not in dict(named)
    engine.load_weights(named)
    llm = engine.llm
    assert engine.llm.calls[-1] == "reset_prefix_cache"
    assert ("reload_weights" in llm.calls) == (device == "cpu")
    assert {n: tuple(t.shape) for n, t in llm.sent.items()} == ve.checkpoint_shapes(str(folder))
    assert torch.equal(llm.sent["lm_head.weight"], learner.model.embed_tokens.weight.detach())
    assert all(torch.equal(llm.sent[n], p.detach()) for n, p in named)


def test_a_tied_model_whose_checkpoint_omits_the_head_is_sent_the_head_too(tmp_path, monkeypatch):
    """The built-in tiny model's checkpoint omits the tied head; vLLM's CPU reload keeps a
    head it is not sent (the probe in tests/test_vllm_real.py), so it is sent anyway."""
    from pipeline.models.hf import load_model
    folder = _tiny_folder(tmp_path / "tiny")
    assert "lm_head.weight" not in ve.checkpoint_shapes(folder)
    monkeypatch.setattr(ve, "build_llm", lambda path, kwargs: SyncRecorder())
    engine = ve.VLLMEngine(folder, seed=1, resident=True, device="cpu")
    learner = load_model(folder)
    engine.load_weights(list(learner.named_parameters()))
    assert set(engine.llm.sent) == set(ve.checkpoint_shapes(folder)) | {"lm_head.weight"}
    assert engine.llm.calls == ["reload_weights", "reset_prefix_cache"]
    # an untied model gets no head it does not have
    emb = [("model.embed_tokens.weight", torch.zeros(2))]
    assert ve.with_tied_head(emb, tied=False) == emb


def test_an_engine_of_the_cpu_build_runs_eager_in_fp32_with_an_explicit_kv_cache(tmp_path, monkeypatch):
    """vLLM's CPU build: dtype auto = float32, eager, CPU_KV_CACHE_BYTES of KV cache (its
    gpu_memory_utilization would reserve that share of the machine's memory), no sleep mode
    or CUDA weight transfer for a resident engine; one engine per process (tp 1)."""
    from pipeline.core.config import load_config
    folder = _tiny_folder(tmp_path / "tiny")
    made = []
    monkeypatch.setattr(ve, "build_llm", lambda path, kwargs: made.append(kwargs) or SyncRecorder())
    rc = load_config("smoke", {"rollout.engine": "vllm"}).rollout
    engine = ve.cpu_engine(folder, rc, seed=3, resident=True)
    assert engine.device == "cpu" and engine.llm is not None and len(made) == 1
    assert {k: v for k, v in made[0].items() if k != "seed"} == {
        "tensor_parallel_size": 1, "dtype": "float32", "enforce_eager": True,
        "kv_cache_memory_bytes": ve.CPU_KV_CACHE_BYTES}
    engine.sleep()
    assert engine.llm.calls == []
    assert ve.cpu_engine(folder, rc, seed=3, dtype="bfloat16").engine_kwargs["dtype"] == "bfloat16"
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size=2: vLLM on the CPU"):
        ve.cpu_engine(folder, rc.model_copy(update={"tensor_parallel_size": 2}), seed=3)
    with pytest.raises(ConfigError, match="data_parallel must be >= 1"):
        ve.cpu_engine(folder, rc.model_copy(update={"data_parallel": 0}), seed=3)


# The shard processes' stand-in (FAKE_VLLM) with a prefix cache: a prompt's state is kept
# with the version of the weights it was computed with; reload_weights makes new weights,
# reset_prefix_cache empties the cache. Each sample ends with the version its prompt state
# came from, so a stale state shows in the tokens.
FAKE_VLLM_PREFIX_CACHE = FAKE_VLLM + '''
_Base = LLM


class LLM(_Base):
    def __init__(self, model, **kw):
        super().__init__(model, **kw)
        self.version, self.cache = 0, {}

    def collective_rpc(self, method, kwargs=None):
        assert method == "reload_weights"
        assert os.path.exists(os.path.join(kwargs["weights_path"], "model.safetensors"))
        self.version += 1

    def reset_prefix_cache(self):
        self.cache.clear()
        return True

    def generate(self, requests, sps, use_tqdm=True):
        out = super().generate(requests, sps, use_tqdm)
        for req, o in zip(requests, out):
            state = self.cache.setdefault(tuple(req["prompt_token_ids"]), self.version)
            for s in o.outputs:
                s.token_ids = s.token_ids + [state]
                s.logprobs = s.logprobs + [{state: NS(logprob=-1.5)}]
        return out
'''


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_shard_processes_reset_their_prefix_cache_after_a_sync(tmp_path, monkeypatch):
    """Finding 2.4: a sync reloads the weights in every shard process; the prompt states
    those cached before it came from the old weights and must not serve the next round."""
    from pipeline.models.hf import load_model
    folder = _tiny_folder(tmp_path / "tiny")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM_PREFIX_CACHE)
    monkeypatch.syspath_prepend(str(tmp_path))        # spawned children inherit sys.path
    engine = ve.VLLMEngine(folder, data_parallel=2, gpu_ids=["3", "5"], seed=1, resident=True)
    try:
        prompts = ["a", "bb", "ccc", "dddd"]
        params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=11)
        assert {c.token_ids[-1] for g in engine.generate(prompts, params) for c in g} == {0}
        engine.load_weights(list(load_model(folder).named_parameters()))
        assert {c.token_ids[-1] for g in engine.generate(prompts, params) for c in g} == {1}
    finally:
        engine.close()
