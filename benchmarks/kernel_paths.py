"""Which CPU kernel paths this machine takes, and whether they move the bits (run on demand).

    .venv/bin/python benchmarks/kernel_paths.py [--preset tiny-regime] [--paths]

Why: ggpo's runs are deterministic for one set of kernels (the same config and seed give the
same pool and weights, run after run, under any load), but torch's CPU kernels are picked
per processor: ATen's vector width (`ATEN_CPU_CAPABILITY`: AVX2, AVX512, ...) and MKL's
code path (`MKL_CBWR`) change the order of a sum, so a processor that picks other kernels
trains other bits from the same seed, and every pool, model and table after it differs.
And a bfloat16 matmul (the testbed's sampler dtype) is fast only where the processor has
bf16 instructions: on an AVX2-only CPU torch falls back to a slow loop.

The preset's model architecture, initialized from its seed (nothing built or downloaded),
runs a float32 forward and backward and a bfloat16 forward on seeded token ids, one thread;
this prints the processor's kernel capability, the sha256 of each result, and the time of
a bfloat16 Linear over a float32 one at the sampler's shape (median of alternated pairs).
With --paths it reruns itself under other kernel choices (ATen's plain kernels, MKL's
compatible path) and says which results moved: if they move here, they move between
processors that pick different kernels by default. Two machines agree when this prints the
same hashes on both.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a plain script

import torch  # noqa: E402

# another kernel choice each, set before torch loads (ATen and MKL read them once)
PATHS = {"aten_default": {"ATEN_CPU_CAPABILITY": "default"}, "mkl_compatible": {"MKL_CBWR": "COMPATIBLE"}}


def digest(t: torch.Tensor) -> str:
    """16 hex of the sha256 the shared pools hash sampler weights with (dtype, shape, bytes)."""
    from stages.online_pool import weights_sha256

    return weights_sha256([("", t)])[:16]


def model_hashes(cfg) -> dict[str, str]:
    """sha256 (16 hex) of float32 logits and gradients and of bfloat16 logits, [8, 32] ids."""
    from pipeline.models.tiny_model import build_model, build_tokenizer

    vocab = len(build_tokenizer())
    model = build_model(cfg.model, vocab)
    ids = torch.randint(0, vocab, (8, 32), generator=torch.Generator().manual_seed(0))
    logits = model(ids).logits
    logits.log_softmax(-1).mean().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    with torch.no_grad():
        model.to(torch.bfloat16)  # type: ignore[arg-type]   # nn.Module.to; transformers' stub wraps it
        bf16_logits = model(ids).logits
    return {"fp32_logits": digest(logits), "fp32_grads": digest(grads), "bf16_logits": digest(bf16_logits)}


def linear_ratio(cfg, reps: int = 5, calls: int = 200) -> float:
    """Median over alternated pairs of (bfloat16 Linear time) / (float32 Linear time) at the
    tiny model's MLP shape over the sampler's batch (group size rows times 8 prompts)."""
    rows = 8 * cfg.rollout.group_size
    layer = torch.nn.Linear(cfg.model.hidden_size, cfg.model.intermediate_size, bias=False)
    x = torch.randn(rows, cfg.model.hidden_size)
    pairs = {dtype: (copy.deepcopy(layer).to(dtype), x.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}

    def seconds(dtype: torch.dtype) -> float:
        lin, inp = pairs[dtype]
        with torch.no_grad():
            lin(inp)
            t0 = time.perf_counter()
            for _ in range(calls):
                lin(inp)
        return time.perf_counter() - t0

    return statistics.median(seconds(torch.bfloat16) / seconds(torch.float32) for _ in range(reps))


def here(cfg) -> dict:
    return {"capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "hashes": model_hashes(cfg), "bf16_over_fp32_linear": round(linear_ratio(cfg), 2)}


def other_paths(preset: str, mine: dict) -> dict[str, list[str]]:
    """For each kernel choice in PATHS: the results whose bits moved against this process's."""
    moved = {}
    for name, env in PATHS.items():
        out = subprocess.run([sys.executable, __file__, "--preset", preset, "--hashes-only"], env=os.environ | env,
                             capture_output=True, text=True, check=True).stdout
        theirs = json.loads(out.strip().splitlines()[-1])
        moved[name] = [k for k, v in mine["hashes"].items() if theirs[k] != v]
    return moved


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-regime")
    ap.add_argument("--paths", action="store_true", help="rerun under other kernel choices and say what moved")
    ap.add_argument("--hashes-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from pipeline.core.config import load_config

    cfg = load_config(args.preset, [])
    if args.hashes_only:
        print(json.dumps(model_hashes(cfg)))
        return {}
    result = here(cfg)
    print(f"kernels: {result['capability']} (torch {result['torch']}); a bfloat16 Linear takes "
          f"{result['bf16_over_fp32_linear']}x a float32 one here", flush=True)
    print("hashes:", " ".join(f"{k}={v}" for k, v in result["hashes"].items()), flush=True)
    if args.paths:
        result["moved"] = other_paths(args.preset, result)
        for name, moved in result["moved"].items():
            print(f"under {name} ({' '.join(f'{k}={v}' for k, v in PATHS[name].items())}): "
                  f"{', '.join(moved) if moved else 'nothing'} moved", flush=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
