"""Which CPU kernels this machine runs, whether they give the published bits, and what bf16 costs.

    .venv/bin/python benchmarks/kernel_paths.py [--preset tiny-regime] [--paths] [--draws]
    .venv/bin/python benchmarks/kernel_paths.py --check          # against tests/data/kernel_golden.json
    .venv/bin/python benchmarks/kernel_paths.py --write-golden   # after a deliberate numerics change

Why: torch picks its CPU kernels per processor (ATen's vector width, MKL's code branch), and
each choice sums in another order, so the same seed trained other bits on each processor and
the testbed printed other tables. ggpo's reproducible kernel mode (pipeline/core/kernels.py,
the default) pins them and runs its fp32 products through its own GEMM; this probe is its
check. On the preset's model architecture, initialized from its seed (nothing downloaded), one
thread, it hashes (sha256, 16 hex, of dtype, shape and bytes):

    fp32_logits   a float32 forward on seeded token ids [8, 32]
    fp32_grads    the gradients of its mean log-softmax
    bf16_logits   the bf16-emulating sampler's forward (pipeline/models/numerics.py)
    draw          one seeded draw of the rollout engine in the preset's rollout dtype (token ids
                  and log-probs of 4 prompts x group_size, the preset's max_new_tokens)
    update        the parameters after one AdamW step on the chunked LM head's log-probs (the
                  training path's arithmetic: ggpo's product, pipeline/training/optim.py's AdamW)
    shared_update the same step on the trainer's log-probs of 2 groups x 4 rows that share
                  their group's prompt (pipeline/training/shared_prompt.py: the gathers' backward)

--check compares them with tests/data/kernel_golden.json and exits 1 naming what moved and
this processor's capability (tests/test_kernel_paths.py runs it; the machines that run the
suite change processor, so it is the cross-processor check). --paths reruns the probe in
children under other kernel choices and says what moved. --draws times one draw of the
sampler side by side, median of alternated pairs: float32, the bf16-emulating sampler, and a
native bf16 model (torch's bf16 kernels), and a bf16 Linear against a fp32 one.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a plain script

import torch  # noqa: E402

import pipeline  # noqa: E402,F401   # pins the kernels before torch runs anything

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "data" / "kernel_golden.json"
RESULTS = ("fp32_logits", "fp32_grads", "bf16_logits", "draw", "update", "shared_update")
# other kernel choices, each in a child process (set before torch runs anything)
PATHS = {"native": {"GGPO_KERNELS": "native"},
         "native_aten_default": {"GGPO_KERNELS": "native", "ATEN_CPU_CAPABILITY": "default"}}


def digest(*tensors: torch.Tensor) -> str:
    """16 hex of the sha256 the shared pools hash sampler weights with (dtype, shape, bytes)."""
    from stages.online_pool import weights_sha256

    return weights_sha256([(str(i), t) for i, t in enumerate(tensors)])[:16]


def _model(cfg):
    from pipeline.models.tiny_model import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    return build_model(cfg.model, len(tokenizer)), tokenizer


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(4, vocab, (8, 32), generator=torch.Generator().manual_seed(0))


def forward_hashes(cfg) -> dict[str, str]:
    """fp32_logits, fp32_grads, bf16_logits (module docstring)."""
    from pipeline.models.numerics import emulate_bf16

    model, tokenizer = _model(cfg)
    ids = _ids(len(tokenizer))
    logits = model(ids).logits
    logits.log_softmax(-1).mean().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    sampler = emulate_bf16(copy.deepcopy(model).eval())
    with torch.inference_mode():
        bf16_logits = sampler(ids).logits
    return {"fp32_logits": digest(logits), "fp32_grads": digest(grads), "bf16_logits": digest(bf16_logits)}


def update_hash(cfg) -> str:
    """The parameters after one AdamW step on -mean(adv * lp) over the chunked LM head's
    log-probs of seeded ids with seeded advantages."""
    from pipeline.training.lm_head import chunked_logprobs, hidden_for_targets, lm_head_weight
    from pipeline.training.optim import AdamW

    model, tokenizer = _model(cfg)
    ids = _ids(len(tokenizer))
    rows, cols = torch.arange(8).repeat_interleave(31), torch.arange(31).repeat(8)
    hidden = hidden_for_targets(model, ids, None, rows, cols)
    weight, bias = lm_head_weight(model)
    lp, _ = chunked_logprobs(hidden, weight, ids[rows, cols + 1], chunk_tokens=64, bias=bias)
    adv = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    (-(adv * lp).mean()).backward()
    AdamW(model.parameters(), lr=cfg.train.lr).step()     # the training loop's optimizer
    return digest(*[p.detach() for p in model.parameters()])


def shared_update_hash(cfg) -> str:
    """The parameters after one AdamW step on -mean(adv * lp) over policy.token_logprobs of
    seeded rows, 2 prompts x 4 responses (the shared-prompt forward and its backward)."""
    from pipeline.training.optim import AdamW
    from pipeline.training.policy import make_batch, token_logprobs

    model, tokenizer = _model(cfg)
    g = torch.Generator().manual_seed(2)
    rand = lambda n: torch.randint(4, len(tokenizer), (n,), generator=g).tolist()   # noqa: E731
    prompts = [p for p in (rand(11), rand(14)) for _ in range(4)]
    responses = [rand(3 + 5 * i) for i in range(8)]
    batch = make_batch(prompts, responses, tokenizer.pad_token_id)
    lp, _ = token_logprobs(model, batch, cfg.rollout.temperature)
    adv = torch.randn(lp.shape, generator=torch.Generator().manual_seed(3))
    (-(adv * lp * batch.mask).sum() / batch.mask.sum()).backward()
    AdamW(model.parameters(), lr=cfg.train.lr).step()
    return digest(*[p.detach() for p in model.parameters()])


def _engine(cfg, folder: Path, dtype: str):
    from pipeline.models.engines.hf import TransformersEngine
    from pipeline.models.tiny_model import save

    if not (folder / "config.json").exists():
        model, tokenizer = _model(cfg)
        save(model, tokenizer, folder)
    return TransformersEngine(str(folder), threads=1, device="cpu", dtype=dtype)


def _draw(engine, cfg, prompts: list[str]):
    from pipeline.models.engines.base import SamplingParams

    params = SamplingParams(n=cfg.rollout.group_size, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.seed)
    return engine.generate(prompts, params)


PROMPTS = ["12+7=", "3*(4+5)=", "81-27=", "6*7="]


def draw_hash(cfg, folder: Path) -> str:
    groups = _draw(_engine(cfg, folder, cfg.rollout.dtype), cfg, PROMPTS)
    tokens = torch.tensor([t for g in groups for c in g for t in c.token_ids])
    logps = torch.tensor([x for g in groups for c in g for x in c.logprobs], dtype=torch.float64)
    return digest(tokens, logps)


def hashes(cfg) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        return forward_hashes(cfg) | {"draw": draw_hash(cfg, Path(tmp)), "update": update_hash(cfg),
                                      "shared_update": shared_update_hash(cfg)}


def capability() -> str:
    from pipeline.core import kernels

    s = kernels.state()
    return f"{s.capability}, {kernels.ENV}={s.mode}, {kernels.fingerprint()}"


def check(mine: dict[str, str], golden: dict) -> list[str]:
    """The results whose hash differs from the golden file's."""
    return [k for k in RESULTS if golden["hashes"].get(k) != mine.get(k)]


def ratio_of_medians(a, b, reps: int) -> float:
    """median(time a) / median(time b) over `reps` alternated pairs."""
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(reps):
        for f, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
    return statistics.median(ta) / statistics.median(tb)


def linear_ratio(cfg, reps: int = 5, calls: int = 200) -> float:
    """bf16 over fp32 nn.Linear (torch's own kernels) at the MLP shape over the sampler's batch."""
    rows = 8 * cfg.rollout.group_size
    layer = torch.nn.Linear(cfg.model.hidden_size, cfg.model.intermediate_size, bias=False)
    x = torch.randn(rows, cfg.model.hidden_size)
    pairs = {dtype: (copy.deepcopy(layer).to(dtype), x.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}

    def run(dtype):
        lin, inp = pairs[dtype]
        with torch.inference_mode():
            for _ in range(calls):
                lin(inp)
    return ratio_of_medians(lambda: run(torch.bfloat16), lambda: run(torch.float32), reps)


def draw_ratios(cfg, reps: int = 5) -> dict[str, float]:
    """One draw (8 prompts x group_size) of the emulating and of a native bf16 sampler, each
    over a float32 draw, median of alternated pairs."""
    from pipeline.models.engines.hf import TransformersEngine

    prompts = PROMPTS * 2
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = _engine(cfg, Path(tmp), "float32")
        emulated = _engine(cfg, Path(tmp), "bfloat16")
        native = TransformersEngine(tmp, threads=1, device="cpu", model=copy.deepcopy(fp32.model).to(torch.bfloat16))
        for e in (fp32, emulated, native):
            _draw(e, cfg, prompts)      # warm-up (packing, lean forward's check)
        return {"emulated_bf16_over_fp32_draw": round(ratio_of_medians(
                    lambda: _draw(emulated, cfg, prompts), lambda: _draw(fp32, cfg, prompts), reps), 2),
                "native_bf16_over_fp32_draw": round(ratio_of_medians(
                    lambda: _draw(native, cfg, prompts), lambda: _draw(fp32, cfg, prompts), reps), 2),
                "native_bf16_over_fp32_linear": round(linear_ratio(cfg), 2)}


def other_paths(preset: str, mine: dict[str, str]) -> dict[str, list[str]]:
    """For each kernel choice in PATHS: the results whose bits moved against `mine`."""
    moved = {}
    for name, env in PATHS.items():
        out = subprocess.run([sys.executable, __file__, "--preset", preset, "--hashes-only"], env=os.environ | env,
                             capture_output=True, text=True, check=True).stdout
        theirs = json.loads(out.strip().splitlines()[-1])
        moved[name] = [k for k in RESULTS if theirs[k] != mine[k]]
    return moved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-regime")
    ap.add_argument("--check", action="store_true", help="compare with tests/data/kernel_golden.json")
    ap.add_argument("--write-golden", action="store_true", help="write tests/data/kernel_golden.json")
    ap.add_argument("--paths", action="store_true", help="rerun under other kernel choices and say what moved")
    ap.add_argument("--draws", action="store_true", help="time bf16 draws against fp32 ones")
    ap.add_argument("--hashes-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from pipeline.core import kernels
    from pipeline.core.config import load_config

    cfg = load_config(args.preset, [])
    mine = hashes(cfg)
    if args.hashes_only:
        print(json.dumps(mine))
        return 0
    print(f"kernels: {capability()} (torch {torch.__version__})", flush=True)
    print("hashes:", " ".join(f"{k}={v}" for k, v in mine.items()), flush=True)
    if args.write_golden:
        if not kernels.reproducible():
            print(f"kernel_paths: not writing {GOLDEN.name}: {kernels.state().line()}", file=sys.stderr)
            return 1
        golden = {"preset": args.preset, "torch": torch.__version__, "kernels": kernels.fingerprint(), "hashes": mine}
        tmp = GOLDEN.with_suffix(".tmp")
        tmp.write_text(json.dumps(golden, indent=2) + "\n")
        tmp.replace(GOLDEN)
        print(f"wrote {GOLDEN}")
    if args.check:
        golden = json.loads(GOLDEN.read_text())
        moved = check(mine, golden)
        if moved:
            print(f"kernel_paths: {', '.join(moved)} moved against {GOLDEN.name} ({golden['kernels']}, torch "
                  f"{golden['torch']}) on this processor ({capability()}, torch {torch.__version__})", file=sys.stderr)
            return 1
        print(f"the golden hashes hold here ({capability()})")
    if args.paths:
        for name, moved in other_paths(args.preset, mine).items():
            print(f"under {name} ({' '.join(f'{k}={v}' for k, v in PATHS[name].items())}): "
                  f"{', '.join(moved) if moved else 'nothing'} moved", flush=True)
    if args.draws:
        print(json.dumps(draw_ratios(cfg)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
