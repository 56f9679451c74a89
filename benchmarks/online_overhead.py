"""Per-round overhead of the online loop, before and after the resident cell, side by side.

Overhead is everything a round costs beyond sampling, grading and its N updates: for the
per-round stages (before, git revision --before) a model save and a state save per round,
a policy and AdamW reload, an engine built from the saved folder; for the resident cell
(this checkout) the in-memory weight sync, the round's record and the amortized rolling
checkpoint. Heavy bytes: weights and optimizer state written per round (.safetensors, .pt;
the base model excluded).

Each (model, N, code) runs in its own process on its own cache, all from the same base
model (built once, copied), one method, no evaluation, no Prefect or MLflow (the loop
itself: both versions log the same per round). Per round: the mean over rounds 1 .. R-2
(round 0 includes start-up; the last round's end-of-run writes are shown apart), the
resident cell's rolling checkpoint amortized over its interval. Models: the built-in
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

# runs inside either checkout (its own pipeline/ and stages/ on sys.path); prints per round r
# its wall time (end of round r-1 to end of round r), its work and, for the resident cell,
# the seconds its rolling checkpoint took in that round (0 in most rounds)
DRIVER = r'''
import json, sys, time
from pathlib import Path
import polars as pl
try:                                    # this layout
    from pipeline.core.config import load_config
    from pipeline.core.store import Store
    from pipeline.dag import graph
except ImportError:                     # a checkout from before pipeline/ had sub-packages (--before)
    from pipeline import dag as graph
    from pipeline.config import load_config
    from pipeline.store import Store
a = json.loads(sys.argv[1])
cfg = load_config(a["preset"], a["overrides"])
store = Store(a["cache"])
base = store.load("base", graph.expected_key("base", cfg))
assert base is not None, "the base model was not copied in: its key differs between the checkouts"
rounds, ends, ckpt, every = cfg.train.updates // cfg.train.updates_per_step, [], {}, 0
if Path("stages/online_cell.py").exists():      # this checkout's (the resident cell)
    from stages import online_cell
    save = online_cell.save_cell_checkpoint

    def timed_save(cell, r, st):
        t0 = time.perf_counter()
        save(cell, r, st)
        ckpt[r] = time.perf_counter() - t0
    online_cell.save_cell_checkpoint = timed_save
    every = cfg.online.checkpoint_rounds(cfg.train)
    online_cell.run_cell(cfg, store, base, on_round=lambda r, pool, trained: ends.append(time.perf_counter()))
else:                                           # per-round stages: the flow's calls
    prev = None
    for r in range(rounds):
        c = cfg.updated({"online.round": r})
        pool = graph.run("online_pool", c, {"policy": prev or base}, store)
        prev = graph.run("online_train", c, {"base": base, "pool": pool} | ({"state": prev} if prev else {}), store)
        ends.append(time.perf_counter())
import stages.online_pool
assert stages.online_pool.__file__.startswith(str(Path.cwd())), stages.online_pool.__file__
per_round = []
for r in range(1, rounds):
    keys = graph.online_keys(cfg, r)
    pool, trained = store.load("online_pool", keys["online_pool"]), store.load("online_train", keys["online_train"])
    per_round.append({"wall": ends[r] - ends[r - 1], "sampling": pool.summary["generate_seconds"],
                      "grading": pool.summary["grade_seconds"],
                      "updates": float(pl.read_parquet(trained.path("metrics"))["seconds"].sum()),
                      "checkpoint": ckpt.get(r, 0.0)})
heavy = sum(p.stat().st_size for p in Path(a["cache"]).rglob("*") if p.is_file() and p.suffix in (".safetensors", ".pt")
            and not p.relative_to(a["cache"]).parts[0].startswith("base-"))
from safetensors.torch import load_file
params = sum(t.numel() for t in load_file(str(Path(base.folder) / "model" / "model.safetensors")).values())
print("RESULT " + json.dumps({"rounds": per_round, "every": every, "heavy": heavy, "params": params,
                              "checkpoint_each": (sum(ckpt.values()) / len(ckpt)) if ckpt else 0.0}))
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


def build_base(preset: str, overrides: dict) -> Path:
    """pi_0 for this model size, built once with this checkout in the project's cache (a later
    run of this benchmark reuses it); its folder."""
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    sys.path.insert(0, str(REPO))
    from pipeline.core.config import load_config
    from pipeline.core.store import Store
    from pipeline.dag import graph
    cfg = load_config(preset, overrides)
    return Path(graph.run("base", cfg, {}, Store()).folder)


def steady(r: dict) -> dict:
    """Per-round means over the steady rounds (1 .. R-2: round 0 includes start-up, the last
    the end-of-run writes), the resident cell's checkpoint amortized over its interval; and
    the last round's extra overhead (paid once)."""
    rows, last = r["rounds"][:-1], r["rounds"][-1]
    mean = {k: sum(x[k] for x in rows) / len(rows) for k in rows[0]}
    work = mean["sampling"] + mean["grading"] + mean["updates"]
    over = mean["wall"] - work - mean["checkpoint"] + (r["checkpoint_each"] / r["every"] if r["every"] else 0.0)
    end = last["wall"] - last["sampling"] - last["grading"] - last["updates"] - over
    return mean | {"work": work, "overhead": over, "wall": work + over, "end": end}


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
    ap.add_argument("--rounds", type=int, default=5, help="rounds per run (the first and last not in the mean)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ggpo-overhead-"))
    os.environ.setdefault("GGPO_HOME", str(tmp / "home"))
    trees = {"before": checkout(args.before, tmp / "before"), "after": REPO}
    print(f"{'model':6s} {'params':>7s} {'N':>3s} {'code':7s} {'round s':>8s} {'sample':>7s} {'grade':>6s} "
          f"{'updates':>8s} {'overhead':>9s} {'share':>6s} {'end s':>6s} {'heavy MB':>9s}")
    for model in args.models:
        for n in args.n:
            overrides = MODELS[model] | {"train.method": args.method, "train.updates_per_step": n,
                                         "train.updates": n * args.rounds, "train.eval_every": None}
            base = build_base(args.preset, overrides)
            for code, tree in trees.items():
                r = run(tree, args.preset, overrides, base, tmp / f"{model}-n{n}-{code}")
                m = steady(r)
                print(f"{model:6s} {r['params'] / 1e6:6.1f}M {n:3d} {code:7s} {m['wall']:8.2f} {m['sampling']:7.2f} "
                      f"{m['grading']:6.2f} {m['updates']:8.2f} {m['overhead']:9.3f} {100 * m['overhead'] / m['wall']:5.1f}% "
                      f"{m['end']:6.2f} {r['heavy'] / 2**20:9.1f}", flush=True)
                if r["every"]:
                    print(f"{'':6s} after: a checkpoint takes {r['checkpoint_each']:.2f}s "
                          f"({r['checkpoint_each'] * 1e9 / r['params']:.1f}s per 1e9 parameters), one every "
                          f"{r['every']} round(s), amortized above", flush=True)
    print(f"rounds 1..{args.rounds - 2} timed (round 0 has the start-up); end s: what the last round adds once "
          f"(the final checkpoint and policy); heavy MB: weights and optimizer state on disk after "
          f"{args.rounds} rounds (before: grows with every round; after: two rolling checkpoints and the final "
          f"policy at most)")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
