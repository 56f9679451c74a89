"""Peak resident memory of one training update with Qwen3's vocabulary (run on demand).

    .venv/bin/python benchmarks/train_memory.py [--groups 32] [--response-tokens 512]

One update of `--groups` groups x 8 responses x `--response-tokens` tokens (GGPO, with the
reference forward) on CPU, for a randomly initialised Qwen3 with the real vocabulary
(151,936) and a small body (the vocabulary, not the body, is what the old path could not
hold). Each configuration runs in a fresh subprocess and reports its peak RSS (VmHWM):
- after: the chunked LM head (`train.logprob_impl=chunked`) with token-budget micro-batches;
- before: the full-logits path with 8 groups per micro-batch (the old defaults), measured
  at response lengths that fit this machine and extrapolated linearly in tokens to the
  requested length (its [B, T, V] tensors grow linearly), since the real size does not fit.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

VOCAB = 151_936


def child(args) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipeline.core.config import load_config
    from pipeline.models.runtime import make_runtime
    from pipeline.training.loop import Pool, TrainContext, TrainState, run_update
    from pipeline.training.reference import ReferenceCache
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    conf = Qwen3Config(vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=args.hidden // 2, intermediate_size=2 * args.hidden,
                       max_position_embeddings=args.response_tokens + 64, tie_word_embeddings=True)
    model, reference = Qwen3ForCausalLM(conf), Qwen3ForCausalLM(conf)
    reference.load_state_dict(model.state_dict())
    reference.requires_grad_(False)
    m, g = 8, args.groups
    gen = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, VOCAB, (n,), generator=gen).tolist()   # noqa: E731
    responses = [[ids(args.response_tokens) for _ in range(m)] for _ in range(g)]
    pool = Pool(group_ids=list(range(g)), prompt_ids=[ids(32) for _ in range(g)], responses=responses,
                lp_beh=[[[-12.0] * args.response_tokens for _ in range(m)] for _ in range(g)],
                rewards=torch.tensor([[1.0, 0.0] * (m // 2)] * g, dtype=torch.float64), group_size=m)
    cfg = load_config("tiny", ["train.method=ggpo", f"train.groups_per_update={g}", "train.device=cpu",
                               f"train.logprob_impl={args.impl}"] + args.set)
    start = time.perf_counter()
    st = TrainState(model, reference, torch.optim.AdamW(model.parameters()), ref_cache=ReferenceCache(enabled=False))
    row = run_update(st, TrainContext(cfg, pool, make_runtime(cfg.train), 0), list(range(g)))
    seconds = time.perf_counter() - start
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
    print(json.dumps({"peak_rss_gb": hwm / 1024 ** 2, "seconds": seconds, "loss": row["loss"],
                      "tokens": row["tokens"]}))


def measure(impl: str, groups: int, tokens: int, extra: list[str], a) -> dict:
    argv = [sys.executable, __file__, "--child", "--impl", impl, "--groups", str(groups),
            "--response-tokens", str(tokens), "--hidden", str(a.hidden), "--threads", str(a.threads)]
    for item in extra:
        argv += ["--set", item]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["killed"])[-1], "returncode": done.returncode}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--impl", default="chunked")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--response-tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=int, default=8192, help="train.micro_batch_tokens for the after run")
    ap.add_argument("--before-tokens", default="16,32,64", help="response lengths measured for the old path")
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args()
    if a.child:
        return child(a)
    print(f"one GGPO update: {a.groups} groups x 8 responses x {a.response_tokens} response tokens, "
          f"V = {VOCAB:,}, hidden {a.hidden}, CPU")
    after = measure("chunked", a.groups, a.response_tokens,
                    [f"train.micro_batch_tokens={a.budget}", "train.logprob_chunk_tokens=1024"], a)
    print(f"after  (chunked LM head, micro_batch_tokens={a.budget}): {after}")
    points = []
    for t in map(int, a.before_tokens.split(",")):
        r = measure("full", a.groups, t, ["train.micro_batch_groups=8"], a)
        print(f"before (full logits, 8 groups/micro-batch), {t:4d} response tokens: {r}")
        if "peak_rss_gb" in r:
            points.append((t, r["peak_rss_gb"]))
    if len(points) >= 2:
        (t0, m0), (t1, m1) = points[-2], points[-1]
        slope = (m1 - m0) / (t1 - t0)
        est = m1 + slope * (a.response_tokens - t1)
        print(f"before, extrapolated to {a.response_tokens} response tokens: {est:.1f} GB "
              f"({slope * 1024:.2f} GB per 1k response tokens)")
        if "peak_rss_gb" in after:
            print(f"ratio before/after: {est / after['peak_rss_gb']:.1f}x")


if __name__ == "__main__":
    main()
