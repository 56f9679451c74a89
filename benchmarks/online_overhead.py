"""Per-round overhead of the online loop, before and after the resident cell, side by side.

Overhead is everything a round costs beyond sampling, grading and its N updates: for the
per-round stages (before, git revision --before) a model save and a state save per round,
a policy and AdamW reload, an engine built from the saved folder; for the resident cell
(this checkout) the in-memory weight sync, the round's record and the amortized rolling
checkpoint. Heavy bytes: weights and optimizer state written per round (.safetensors, .pt;
the base model excluded).

Each (model, N, code) runs in its own process on its own cache, all from the same base
model (built once, copied), one method, no evaluation, no Prefect or MLflow (the loop
itself: both versions log the same per round). Round 0 is not timed (it includes start-up);
per round = (end of the last round - end of round 0) / (rounds - 1). Models: the built-in
tiny model (tiny-online preset) and a ~50 M-parameter one (hidden 512, 12 layers,
intermediate 2048; G_mb = 4 so a CPU round stays short).

    .venv/bin/python benchmarks/online_overhead.py [--before 842e479] [--n 1 8] [--models tiny 50m]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    "tiny": {},
    # a short warm-up (mixed groups are all a round needs): 120 steps or 20 % sampled accuracy
    "50m": {"model.hidden_size": 512, "model.num_layers": 12, "model.num_heads": 8, "model.intermediate_size": 2048,
            "train.groups_per_update": 4, "model.sft_batch_size": 32, "model.sft_max_steps": 120,
            "model.target_accuracy": 0.2, "model.sft_check_every": 20},
}

# runs inside either checkout (its own pipeline/ and stages/ on sys.path)
DRIVER = r'''
import json, sys, time
from pathlib import Path
from pipeline import dag
from pipeline.config import load_config
from pipeline.store import Store
a = json.loads(sys.argv[1])
cfg = load_config(a["preset"], a["overrides"])
store = Store(a["cache"])
base = store.load("base", dag.expected_key("base", cfg))
assert base is not None, "the base model was not copied in: its key differs between the checkouts"
rounds, ends, counts = cfg.train.updates // cfg.train.updates_per_step, [], {}
if Path("stages/online_cell.py").exists():      # this checkout's (stages/ may be a namespace package)
    from stages.online_cell import run_cell
    counts = run_cell(cfg, store, base, on_round=lambda r, pool, trained: ends.append(time.perf_counter()))
else:
    prev = None
    for r in range(rounds):
        c = cfg.updated({"online.round": r})
        pool = dag.run("online_pool", c, {"policy": prev or base}, store)
        prev = dag.run("online_train", c, {"base": base, "pool": pool} | ({"state": prev} if prev else {}), store)
        ends.append(time.perf_counter())
import polars as pl
work = {"sampling": 0.0, "grading": 0.0, "updates": 0.0}
for r in range(1, rounds):
    keys = dag.online_keys(cfg, r)
    pool, trained = store.load("online_pool", keys["online_pool"]), store.load("online_train", keys["online_train"])
    work["sampling"] += pool.summary["generate_seconds"]
    work["grading"] += pool.summary["grade_seconds"]
    work["updates"] += float(pl.read_parquet(trained.path("metrics"))["seconds"].sum())
heavy = sum(p.stat().st_size for p in Path(a["cache"]).rglob("*") if p.is_file() and p.suffix in (".safetensors", ".pt")
            and not p.relative_to(a["cache"]).parts[0].startswith("base-"))
n = rounds - 1
import stages.online_pool
assert stages.online_pool.__file__.startswith(str(Path.cwd())), stages.online_pool.__file__
print("RESULT " + json.dumps({"wall": (ends[-1] - ends[0]) / n, **{k: v / n for k, v in work.items()},
                              "heavy": heavy, "rounds": rounds,
                              "sync": counts.get("sync_seconds", 0.0) / max(1, counts.get("rounds_sampled", 1)),
                              "checkpoints": counts.get("checkpoints_written", 0),
                              "checkpoint_s": counts.get("checkpoint_seconds", 0.0),
                              "params": sum(t.numel() for t in __import__("safetensors.torch").torch.load_file(
                                  str(Path(base.folder) / "model" / "model.safetensors")).values())}))
'''


def checkout(rev: str, into: Path) -> Path:
    """The tree of `rev` (git archive, no worktree registered)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=REPO, check=True, capture_output=True).stdout
    tar = into.with_suffix(".tar")
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into


def build_base(preset: str, overrides: dict, cache: Path) -> Path:
    """pi_0 for this model size, built once with this checkout; its folder."""
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    sys.path.insert(0, str(REPO))
    from pipeline import dag
    from pipeline.config import load_config
    from pipeline.store import Store
    cfg = load_config(preset, overrides)
    return Path(dag.run("base", cfg, {}, Store(cache)).folder)


def run(tree: Path, preset: str, overrides: dict, base: Path, cache: Path) -> dict:
    cache.mkdir(parents=True)
    shutil.copytree(base, cache / base.name)
    env = os.environ | {"PYTHONPATH": str(tree), "GGPO_PROGRESS": "0", "GGPO_CACHE": str(cache)}
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps({"preset": preset, "overrides": overrides,
                                                                    "cache": str(cache)})],
                          cwd=tree, env=env, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{tree.name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="842e479", help="the revision with per-round stages")
    ap.add_argument("--preset", default="tiny-online")
    ap.add_argument("--method", default="ggpo")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=4, help="rounds per run (round 0 not timed)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ggpo-overhead-"))
    os.environ.setdefault("GGPO_HOME", str(tmp / "home"))
    trees = {"before": checkout(args.before, tmp / "before"), "after": REPO}
    print(f"{'model':6s} {'params':>8s} {'N':>3s} {'code':7s} {'round s':>8s} {'sample':>7s} {'grade':>7s} "
          f"{'updates':>8s} {'overhead':>9s} {'share':>6s} {'sync s':>7s} {'heavy MB':>9s}")
    for model in args.models:
        for n in args.n:
            overrides = MODELS[model] | {"train.method": args.method, "train.updates_per_step": n,
                                         "train.updates": n * args.rounds, "train.eval_every": None}
            base = build_base(args.preset, overrides, tmp / "bases")
            for code, tree in trees.items():
                r = run(tree, args.preset, overrides, base, tmp / f"{model}-n{n}-{code}")
                work = r["sampling"] + r["grading"] + r["updates"]
                over = r["wall"] - work
                print(f"{model:6s} {r['params'] / 1e6:7.1f}M {n:3d} {code:7s} {r['wall']:8.2f} {r['sampling']:7.2f} "
                      f"{r['grading']:7.2f} {r['updates']:8.2f} {over:9.3f} {100 * over / r['wall']:5.1f}% "
                      f"{r['sync']:7.3f} {r['heavy'] / 2**20:9.1f}", flush=True)
                if code == "after" and r["checkpoints"]:
                    per = r["checkpoint_s"] / r["checkpoints"]
                    print(f"{'':6s} after: {r['checkpoints']} checkpoint(s), {per:.2f}s each, {r['sync'] * 1e9 / r['params']:.2f}s "
                          f"per 1e9 parameters to sync", flush=True)
    print(f"heavy MB: weights and optimizer state on disk after {args.rounds} rounds (before: grows with every "
          f"round; after: two rolling checkpoints and the final policy at most)")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
