"""One-shot GPU check at Qwen3-1.7B scale, with nothing from the internet (run on demand).

    .venv/bin/python benchmarks/gpu_check.py [--out figures.json]    # one H200: about 5-8 min
    .venv/bin/python benchmarks/gpu_check.py --quick                 # CPU smoke run, about 1 min
    (on a GPU box the device kit's one command, `bash .whl/gpu-run.sh`, runs it)

Builds a randomly initialised model with Qwen3-1.7B's architecture (28 layers, hidden 2048,
16 heads / 8 KV heads of 128, MLP 6144, vocab 151,936, tied embeddings) and a small BPE
tokenizer trained here on generated text, saves both as an HF folder in a temp directory,
then reports, each section on its own so one failure does not hide the others (nor the
figures a section had before it failed):

  (a) train: one optimizer update at the preset geometry (32 groups x 8 responses, method
      GGPO, bf16 autocast, gradient checkpointing, the preset's micro-batch token budget)
      with 1,024- and 3,072-token responses of random token ids after short prompts, in
      both layouts, padded rows and packed rows (train.packing=on: flash-attn's varlen
      kernels when installed, else flex attention), each timed after an untimed update on
      the same pool (flex attention compiles for each new shape): seconds, response tokens/s, peak GPU
      memory and MFU = model FLOPs / seconds / 989e12 (H200 dense bf16 peak), with
      model FLOPs = 6 N T + 6 L H d sum_i l_i^2 over the real tokens only: N parameters,
      T prompt + response tokens, and per sequence i of l_i tokens the causal attention's
      QK^T and AV products (2 l_i^2 H d a layer forward, times 3 with backward; L layers,
      H heads of d). Padding does no useful work, so the packed layout's gain shows as MFU.
      The reference forward and checkpoint recompute count as overhead.
  (b) the transformers engine's generation tokens/s (64 prompts x 256 new tokens), with the
      lean decode step against transformers' forward: the time ratio, and whether every
      token drawn is the same (it must be: the logits are equal bit for bit). Stop ids that
      fire (every stop_every-th token id) make rows finish, so the batch shrinks (and, past
      64 new tokens, the lean cache grows); two draws, padded prompts (the masked path) and
      one prompt repeated (the unmasked path). Reported: `lean` (still on after the draws),
      `lean_checked` (its first-step check passed) and `lean_checks` (every check the lean
      step ran: forward or attention layout, path, rows, buffer columns, equal).
  (c) vLLM's generation tokens/s through the project's VLLMEngine, or "vllm: not installed".
  (d) attention kernels: a short generation and a padded update (8 groups x 8 responses of
      1,024 tokens) under the project's SDPA choice (pipeline/models/runtime.py
      attention_backends: flash > memory-efficient > math), under each SDPA backend alone, and
      under torch's own choice (cuDNN first on an H200 with CUDA 13): seconds, tokens/s, and
      which SDPA kernels ran (the aten ops a profiled forward called). A backend that cannot
      run a shape (flash takes no padding mask) reports its error.

Refuses a box it cannot use, in one line and exit status 2, before building anything: no
CUDA device (a CPU build of torch, no NVIDIA driver, or a driver older than the torch
wheel's CUDA needs: DRIVER_FOR_CUDA; CUDA 13, torch 2.14.0 from PyPI and vLLM 0.33, needs
driver >= 580). --quick runs the miniature on whatever device there is.

Uses from the project: pipeline.models.runtime.make_runtime (Runtime.prepare / prepare_reference;
its SDPA_BACKENDS and ATTENTION_DEVICES for (d)), pipeline.models.hf.load_model,
pipeline.training.loop.Pool and run_update(..., runtime=rt), pipeline.models.engines.hf.TransformersEngine,
pipeline.models.engines.vllm_engine.VLLMEngine, pipeline.core.config.load_config, pipeline.models.tiny_model.save.
All figures go to stdout, and as JSON to --out when given.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import random
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a plain script

import torch  # noqa: E402

PEAK_FLOPS = 989e12     # H200 SXM dense bf16
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]

FULL = dict(layers=28, hidden=2048, heads=16, kv_heads=8, head_dim=128, intermediate=6144,
            vocab=151_936, tok_vocab=8_000, groups=32, group_size=8, prompt_len=32,
            lengths=[1024, 3072], gen_prompts=64, gen_tokens=256, vllm_prompts=128, vllm_n=8,
            vllm_tokens=512, stop_every=32, kernel_groups=8, kernel_length=1024, kernel_prompts=32,
            kernel_tokens=32)
QUICK = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
             vocab=512, tok_vocab=300, groups=2, group_size=8, prompt_len=8,
             lengths=[64], gen_prompts=4, gen_tokens=16, vllm_prompts=4, vllm_n=2, vllm_tokens=16,
             stop_every=16, kernel_groups=1, kernel_length=16, kernel_prompts=4, kernel_tokens=8)
# the NVIDIA driver a wheel built for each CUDA major version needs (CUDA's minor-version
# compatibility floors: 13.x >= 580, 12.x >= 525.60.13, 11.x >= 450.80.02)
DRIVER_FOR_CUDA = {13: (580,), 12: (525, 60, 13), 11: (450, 80, 2)}
INSTALL = ("install torch 2.14.0 from PyPI (built for CUDA 13.0; vLLM 0.33 from `pip install 'ggpo[gpu]'` needs "
           "the same) on a machine with an NVIDIA GPU and driver >= 580, or run --quick for the CPU smoke run")


def section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def environment() -> dict:
    import transformers
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        import vllm
        env["vllm"] = vllm.__version__
    except Exception:   # not installed, or installed but broken: reported, not fatal
        env["vllm"] = None
    for k, v in env.items():
        print(f"{k:13s} {v}")
    return env


def corpus(n_lines: int, seed: int = 0) -> list[str]:
    """Generated text for the tokenizer: arithmetic, words and code-like lines."""
    rng = random.Random(seed)
    words = ["the", "sum", "of", "and", "is", "let", "find", "value", "prove", "that", "number",
             "answer", "boxed", "step", "therefore", "def", "return", "if", "for", "in", "x", "y"]
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, 9999), rng.randint(0, 9999)
        lines.append(f"{' '.join(rng.choices(words, k=rng.randint(3, 12)))} {a} + {b} = {a + b}.")
    return lines


def build_tokenizer(vocab_size: int):
    """A byte-level BPE trained here (specials first: pad 0, bos 1, eos 2, unk 3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(corpus(20_000), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


def build_model(g: dict, device: torch.device):
    """Qwen3-1.7B's architecture (or the --quick miniature), random init, fp32, on `device`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    # the ignore: transformers 5 still takes the legacy rope_theta (into rope_parameters); 4.x knows only that name
    config = Qwen3Config(  # type: ignore[call-arg]
        vocab_size=g["vocab"], hidden_size=g["hidden"], num_hidden_layers=g["layers"],
        num_attention_heads=g["heads"], num_key_value_heads=g["kv_heads"], head_dim=g["head_dim"],
        intermediate_size=g["intermediate"], tie_word_embeddings=True, max_position_embeddings=40_960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):      # initialise on the GPU: seconds instead of a minute on CPU
        model = Qwen3ForCausalLM(config)
    return model


def make_pool(g: dict, length: int, seed: int, ragged: bool = False):
    """A pool of random token ids: `groups` groups x `group_size` responses of `length`
    tokens (ragged: of length/2 to length tokens, so a padded batch has padding), mixed 0/1
    rewards per group, behaviour log-probs near a uniform model's."""
    from pipeline.training.loop import Pool
    rng = random.Random(seed)
    m, n, top = g["group_size"], g["groups"], g["vocab"] - 1
    lp = -float(torch.log(torch.tensor(float(g["vocab"]))))
    rewards = torch.zeros(n, m, dtype=torch.float64)
    for j in range(n):
        rewards[j, rng.sample(range(m), rng.randint(1, m - 1))] = 1.0
    sizes = [[rng.randint(length // 2, length) if ragged else length for _ in range(m)] for _ in range(n)]
    return Pool(group_ids=list(range(n)),
                prompt_ids=[[rng.randint(4, top) for _ in range(g["prompt_len"])] for _ in range(n)],
                responses=[[[rng.randint(4, top) for _ in range(k)] for k in row] for row in sizes],
                lp_beh=[[[lp] * k for k in row] for row in sizes],
                rewards=rewards, group_size=m)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def model_flops(pool, groups: list[int], n_params: int, g: dict) -> float:
    """6 N T + 6 L H d sum_i l_i^2 over real tokens (module docstring)."""
    seqs = [len(pool.prompt_ids[j]) + len(r) for j in groups for r in pool.responses[j]]
    return 6 * n_params * sum(seqs) + 6 * g["layers"] * g["heads"] * g["head_dim"] * sum(s * s for s in seqs)


def one_update(model, reference, opt, pool, cfg, rt, n_params: int, g: dict) -> dict:
    """run_update + optimizer step, timed; the figures of one update."""
    from pipeline.training.loop import TrainContext, TrainState, run_update
    from pipeline.training.reference import ReferenceCache
    if rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    groups = list(range(len(pool.group_ids)))
    sync(rt.device)
    t0 = time.perf_counter()
    row = run_update(TrainState(model, reference, opt, ref_cache=ReferenceCache(enabled=False)),
                     TrainContext(cfg, pool, rt, 0), groups)
    sync(rt.device)
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(rt.device)
    seconds = time.perf_counter() - t0
    all_tokens = sum(len(pool.prompt_ids[j]) + len(r) for j in groups for r in pool.responses[j])
    out = {"response_tokens": row["tokens"], "all_tokens": all_tokens, "seconds": round(seconds, 3),
           "fwd_bwd_seconds": round(t1 - t0, 3), "step_seconds": round(seconds - (t1 - t0), 3),
           "tokens_per_s": round(row["tokens"] / seconds, 1),
           "mfu": round(model_flops(pool, groups, n_params, g) / seconds / PEAK_FLOPS, 4),
           "loss": row["loss"], "grad_norm": row["grad_norm"]}
    if rt.device.type == "cuda":
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def train_section(model, g: dict, args, out: dict | None = None) -> dict:
    """(a): one timed update per layout and response length, each after an untimed update
    on the same pool (the same shapes: kernels, allocator, optimizer state, and flex
    attention's compile for these shapes are outside the timing). Figures go into `out` as
    they come, so a failure later keeps them; an update that fails is recorded with its
    error and the next still runs."""
    import copy

    from pipeline.core.config import load_config
    from pipeline.models.runtime import make_runtime
    result = out if out is not None else {}
    result |= {"micro_batch_tokens": args.micro_batch_tokens, "updates": []}
    for packing in ("off", "on"):
        cfg = load_config("tiny", {
            "train.method": "ggpo", "train.groups_per_update": g["groups"], "rollout.group_size": g["group_size"],
            "rollout.temperature": 1.0, "train.micro_batch_tokens": args.micro_batch_tokens,
            "train.gradient_checkpointing": True, "train.device": "auto", "train.dtype": "auto",
            "train.packing": packing})
        rt = make_runtime(cfg.train)
        layout = f"packed ({rt.attn_implementation})" if rt.packed else "padded"
        print(f"runtime: device {rt.device}, autocast {rt.autocast_dtype}, checkpointing {rt.gradient_checkpointing}, "
              f"micro_batch_tokens {cfg.train.micro_batch_tokens}, logprob {rt.logprob_impl}/{rt.chunk_tokens}, {layout}")
        reference = rt.prepare_reference(copy.deepcopy(model))
        policy = rt.prepare(copy.deepcopy(model))
        policy.train()
        n_params = sum(p.numel() for p in policy.parameters())
        result["params"] = n_params
        opt = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr, betas=cfg.train.adam_betas)
        try:
            one_update(policy, reference, opt, make_pool(g | {"groups": 2}, 64, seed=1), cfg, rt, n_params, g)
        except Exception as exc:         # a layout that cannot run here: said, the other still runs
            result["updates"].append({"layout": layout, "error": f"{type(exc).__name__}: {exc}"[:500]})
            print(json.dumps(result["updates"][-1]))
            continue
        for length in g["lengths"]:
            r = {"layout": layout, "response_length": length}
            pool = make_pool(g, length, seed=length)
            try:
                one_update(policy, reference, opt, pool, cfg, rt, n_params, g)        # warm-up at this shape
                r |= one_update(policy, reference, opt, pool, cfg, rt, n_params, g)
            except Exception as exc:     # out of memory, a kernel that cannot run: said, the others still run
                oom = isinstance(exc, torch.OutOfMemoryError)
                r["error"] = f"out of memory: {str(exc)[:300]}" if oom else f"{type(exc).__name__}: {exc}"[:500]
                opt.zero_grad(set_to_none=True)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            print(json.dumps(r))
            result["updates"].append(r)
        del policy, reference, opt
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"params {result.get('params', 0) / 1e9:.3f} B")
    return result


def stop_ids(g: dict, eos: int) -> list[int]:
    """Stop ids that fire on a random model: every stop_every-th token id (a near-uniform
    draw stops a row with chance ~1/stop_every a step), so rows finish at different steps."""
    return sorted({eos, *range(4, g["vocab"], g["stop_every"])})


def transformers_section(folder: Path, g: dict, device: torch.device, threads: int) -> dict:
    """(b): TransformersEngine generation on the model folder, the lean decode step against
    transformers' forward, with rows that stop (the batch shrinks) on two draws: prompts of
    several lengths (padded: the masked path) and one prompt repeated (the unmasked path)."""
    from pipeline.models.engines import SamplingParams
    from pipeline.models.engines.hf import TransformersEngine
    kwargs = {"batch_prompts": g["gen_prompts"], "threads": threads, "device": str(device)}
    t0 = time.perf_counter()
    engine = TransformersEngine(str(folder), **kwargs)
    load_s = time.perf_counter() - t0
    engine.stop_ids = stop_ids(g, engine.tokenizer.eos_token_id)
    draws = {"padded": corpus(g["gen_prompts"], seed=7), "unpadded": corpus(1, seed=9) * g["gen_prompts"]}
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_new_tokens=g["gen_tokens"], seed=0)
    timed: dict = {}
    for lean in (False, True):      # transformers' forward, then the lean decode step (engines/decode.py)
        engine.lean = lean
        for name, prompts in draws.items():
            sync(device)
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            sync(device)
            timed[lean, name] = (time.perf_counter() - t0, [c.token_ids for grp in outs for c in grp])
    secs = sum(timed[True, name][0] for name in draws)
    ids = [timed[True, name][1] for name in draws]
    tokens = sum(len(x) for draw in ids for x in draw)
    lengths = [len(x) for x in ids[0]]
    r = {"device": kwargs["device"], "prompts": g["gen_prompts"], "draws": list(draws), "max_new_tokens": g["gen_tokens"],
         "tokens": tokens, "rows_stopped": sum(n < g["gen_tokens"] for draw in ids for n in map(len, draw)),
         "shortest_row": min(lengths), "load_seconds": round(load_s, 2), "seconds": round(secs, 2),
         "tokens_per_s": round(tokens / secs, 1),
         "lean_over_transformers_seconds": round(secs / sum(timed[False, name][0] for name in draws), 3),
         "lean_draws_the_same_tokens": ids == [timed[False, name][1] for name in draws],
         "lean": engine.lean, "lean_checked": engine.lean_checked,
         "lean_paths_checked": sorted({c["path"] for c in engine.lean_checks}),
         "lean_checks": engine.lean_checks}
    print(json.dumps(r))
    return r


def vllm_section(folder: Path, g: dict) -> dict:
    """(c): the project's VLLMEngine (one engine, this GPU) on the model folder."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        print(f"vllm: not installed ({type(exc).__name__})")
        return {"skipped": "vllm: not installed"}
    from pipeline.models.engines import SamplingParams
    from pipeline.models.engines.vllm_engine import VLLMEngine
    t0 = time.perf_counter()
    engine = VLLMEngine(str(folder), gpu_memory_utilization=0.6)
    init_s = time.perf_counter() - t0
    try:
        prompts = corpus(g["vllm_prompts"], seed=8)
        params = SamplingParams(n=g["vllm_n"], temperature=1.0, top_p=1.0, max_new_tokens=g["vllm_tokens"], seed=0)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        secs = time.perf_counter() - t0
    finally:
        engine.close()
    tokens = sum(len(c.token_ids) for grp in outs for c in grp)
    lps = [x for grp in outs for c in grp for x in c.logprobs]
    r = {"prompts": len(prompts), "n": g["vllm_n"], "max_new_tokens": g["vllm_tokens"], "tokens": tokens,
         "init_seconds": round(init_s, 1), "seconds": round(secs, 2), "tokens_per_s": round(tokens / secs, 1),
         "mean_logprob": round(sum(lps) / len(lps), 3)}
    print(json.dumps(r))
    return r


# (d): the SDPA choices timed; None: the project's own (runtime.SDPA_BACKENDS), (): torch's own
KERNEL_CHOICES: dict[str, tuple[str, ...] | None] = {
    "project": None, "flash": ("FLASH_ATTENTION",), "efficient": ("EFFICIENT_ATTENTION",), "math": ("MATH",),
    "cudnn": ("CUDNN_ATTENTION",), "torch default": ()}
# an SDPA aten op's name -> the backend it is (CPU's flash op is _scaled_dot_product_flash_attention_for_cpu)
KERNEL_TAGS = (("cudnn", "cudnn"), ("flash", "flash"), ("efficient", "efficient"), ("math", "_math"))


@contextlib.contextmanager
def sdpa_choice(backends: tuple[str, ...] | None, device: torch.device):
    """Every forward of the project on `device` under `backends` (None: the project's choice;
    (): none, torch decides), through runtime.attention_backends' two settings."""
    from pipeline.models import runtime
    saved = runtime.SDPA_BACKENDS, runtime.ATTENTION_DEVICES
    runtime.ATTENTION_DEVICES = () if backends == () else (device.type,)
    runtime.SDPA_BACKENDS = backends or runtime.SDPA_BACKENDS
    try:
        yield
    finally:
        runtime.SDPA_BACKENDS, runtime.ATTENTION_DEVICES = saved


def kernels_ran(fn) -> list[str]:
    """The SDPA backends whose aten ops `fn()` called (a CPU-side profile: the ops, not their time)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.key for e in prof.key_averages() if "dot_product" in e.key or "attention_forward" in e.key]
    return sorted({kind for name in names for kind, tag in KERNEL_TAGS if tag in name})


def reference_forward(reference, batch, rt) -> None:
    """One no-grad forward of the trainer's log-prob path (the kernels a padded update calls)."""
    from pipeline.training.loop import policy_logprobs
    with torch.no_grad():
        policy_logprobs(reference, batch, rt, 1.0)


def kernels_section(folder: Path, g: dict, device: torch.device, args, out: dict) -> dict:
    """(d): under each SDPA choice, one generation and one padded update (after an untimed
    one at the same shapes), and the SDPA kernels each ran (module docstring); the model
    loaded from the folder (fp32, as the trainer's)."""
    import copy

    from pipeline.core.config import load_config
    from pipeline.models.engines import SamplingParams
    from pipeline.models.engines.hf import TransformersEngine
    from pipeline.models.hf import load_model
    from pipeline.models.runtime import make_runtime
    from pipeline.training.policy import make_batch
    cfg = load_config("tiny", {
        "train.method": "ggpo", "train.groups_per_update": g["kernel_groups"], "rollout.group_size": g["group_size"],
        "rollout.temperature": 1.0, "train.micro_batch_tokens": args.micro_batch_tokens,
        "train.gradient_checkpointing": True, "train.device": "auto", "train.dtype": "auto", "train.packing": "off"})
    rt = make_runtime(cfg.train)
    model = load_model(str(folder))
    reference, policy = rt.prepare_reference(copy.deepcopy(model)), rt.prepare(model)
    policy.train()
    n_params = sum(p.numel() for p in policy.parameters())
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr, betas=cfg.train.adam_betas)
    engine = TransformersEngine(str(folder), batch_prompts=g["kernel_prompts"], threads=args.threads, device=str(device))
    prompts = corpus(g["kernel_prompts"], seed=11)
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_new_tokens=g["kernel_tokens"], seed=0)
    pool = make_pool(g | {"groups": g["kernel_groups"]}, g["kernel_length"], seed=5, ragged=True)
    probe = make_batch(pool.prompt_ids[:1] * 2, pool.responses[0][:2], 0)     # two rows, padded
    out |= {"updates_response_tokens": sum(len(r) for grp in pool.responses for r in grp), "choices": []}
    for name, backends in KERNEL_CHOICES.items():
        row: dict = {"choice": name, "backends": list(backends) if backends is not None else "project"}
        engine.lean_checked, engine.lean_layouts, engine.lean = False, set(), True     # the lean step checks itself anew
        with sdpa_choice(backends, device):
            try:
                row["generation_kernels"] = kernels_ran(lambda: engine.generate(prompts[:2], params))
                row["update_kernels"] = kernels_ran(lambda: reference_forward(reference, probe, rt))
                sync(device)
                t0 = time.perf_counter()
                outs = engine.generate(prompts, params)
                sync(device)
                gen_s, tokens = time.perf_counter() - t0, sum(len(c.token_ids) for grp in outs for c in grp)
                row |= {"generation_seconds": round(gen_s, 3), "generation_tokens_per_s": round(tokens / gen_s, 1),
                        "lean": engine.lean}
                one_update(policy, reference, opt, pool, cfg, rt, n_params, g)        # untimed, same shapes
                row["update"] = one_update(policy, reference, opt, pool, cfg, rt, n_params, g)
            except Exception as exc:     # a backend that cannot run these shapes: said, the others still run
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                opt.zero_grad(set_to_none=True)
        print(json.dumps(row))
        out["choices"].append(row)
    return out


def model_section(g: dict, device: torch.device, folder: Path, built: dict) -> dict:
    """The model and tokenizer, saved as an HF folder (the generation sections load it)."""
    from pipeline.models.tiny_model import save
    t0 = time.perf_counter()
    tok = build_tokenizer(g["tok_vocab"])
    built["model"] = build_model(g, device)
    save(built["model"], tok, folder)
    print(f"built and saved {folder} in {time.perf_counter() - t0:.1f} s "
          f"(tokenizer vocab {len(tok)}, model vocab {g['vocab']})")
    return {"seconds": round(time.perf_counter() - t0, 1), "tokenizer_vocab": len(tok)}


def guarded(name: str, results: dict, fn, *a, **kw) -> None:
    """Runs one section; a failure is printed and recorded beside the figures the section had
    already put into kw["out"] (if it takes one), and the next section still runs."""
    section(name)
    t0 = time.perf_counter()
    results[name] = kw.get("out", {})
    try:
        results[name] = fn(*a, **kw)
    except Exception as exc:
        traceback.print_exc()
        results[name]["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    print(f"({name}: {time.perf_counter() - t0:.1f} s)")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def driver_version() -> str | None:
    """The NVIDIA driver's version ("580.65.06"): nvidia-smi's, else the kernel module's
    (/proc/driver/nvidia/version); None where there is no driver."""
    import shutil
    import subprocess
    if shutil.which("nvidia-smi"):
        try:
            res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=60)
            if res.returncode == 0 and res.stdout.strip():
                return res.stdout.split()[0]
        except (OSError, subprocess.SubprocessError):
            pass        # the kernel module's file below says it too
    try:
        found = re.search(r"\b(\d{3,}\.\d+(?:\.\d+)?)\b", Path("/proc/driver/nvidia/version").read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def driver_problem(cuda: str | None, driver: str | None) -> str | None:
    """Why a torch built for CUDA `cuda` ("13.0") cannot run on NVIDIA driver `driver`
    ("575.57.08"); None when it can, or when either is unknown."""
    if not cuda or not driver:
        return None
    need = DRIVER_FOR_CUDA.get(int(cuda.split(".")[0]))
    have = tuple(int(x) for x in re.findall(r"\d+", driver))
    if need is None or have >= need:
        return None
    return f"NVIDIA driver {driver} is older than this torch's CUDA {cuda} needs (>= {'.'.join(map(str, need))})"


def refusal(quick: bool) -> str | None:
    """The one line saying why this box cannot run the full-size check (None: it can). The
    full geometry never runs on a CPU (it would build and train a 1.7B model there). A driver
    older than the wheel's CUDA refuses only where torch sees no GPU: where torch runs anyway
    (CUDA's forward-compatibility package) it is said and the check goes on."""
    if quick:
        return None
    driver = driver_version()
    old = driver_problem(torch.version.cuda, driver)
    if torch.cuda.is_available():
        if old:
            print(f"gpu_check: warning: {old}; torch runs on it here, vLLM's CUDA 13 libraries may not", flush=True)
        return None
    if old:
        return f"gpu_check: no usable CUDA device: {old}: update the NVIDIA driver to >= 580, or {INSTALL}"
    if torch.version.cuda is None:
        why = f"this torch {torch.__version__} is a CPU build"
    else:
        why = f"torch {torch.__version__} sees no GPU (NVIDIA driver: {driver or 'none found'})"
    return f"gpu_check: no CUDA device ({why}); the full-size check needs one: {INSTALL}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="miniature model, CPU-sized (smoke run)")
    ap.add_argument("--out", help="also write the figures as JSON here")
    ap.add_argument("--micro-batch-tokens", type=int, default=32768, help="train.micro_batch_tokens (preset: 32768)")
    ap.add_argument("--threads", type=int, default=4, help="torch threads for CPU work")
    ap.add_argument("--skip", action="append", default=[], choices=["train", "transformers", "vllm", "kernels"])
    args = ap.parse_args()
    problem = refusal(args.quick)
    if problem:
        print(problem, file=sys.stderr)
        sys.exit(2)
    g = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    results: dict = {"quick": args.quick, "geometry": g}
    guarded("environment", results, environment)
    with tempfile.TemporaryDirectory(prefix="ggpo-gpu-check-") as tmp:
        folder = Path(tmp) / "model"
        built: dict = {}
        guarded("model", results, model_section, g, device, folder, built)
        model = built.pop("model", None)
        missing = {"error": "skipped: no model (see the section model)"}
        if "train" not in args.skip:
            guarded("train", results, train_section, model, g, args, out={}) if model is not None \
                else results.update(train=missing)
        del model
        # (d) last: the figures the device kit's time limit must not cut come first
        for name, fn, extra in (("transformers", transformers_section, (device, args.threads)), ("vllm", vllm_section, ()),
                                ("kernels", kernels_section, (device, args))):
            if name not in args.skip:
                if (folder / "config.json").exists():
                    guarded(name, results, fn, folder, g, *extra, **({"out": {}} if name == "kernels" else {}))
                else:
                    results[name] = missing
    results["total_seconds"] = round(time.perf_counter() - start, 1)
    section("summary")
    print(json.dumps(results, indent=1, default=str))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
