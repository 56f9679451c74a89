"""What the drift diagnostic costs a round of the online loop, side by side in one run (on
demand, not a test).

    .venv/bin/python benchmarks/drift_cost.py [--preset smoke-online] [--pairs 2] [--set k=v ...]

The drift forward (pipeline/training/drift.py: one no-grad forward of one update's worth of
groups at each measured round's end, called from stages/online_train.py) against the round
it ends: the same online cell (one method, no evaluation) run in pairs, alternately with
online.drift_every = 1 (every round measured) and with the drift off for all rounds but
the first and the last (drift_every = the number of rounds), each run on a fresh cache holding only the
base model (every round sampled and trained; the keys are the same, drift_every is not in
them), after one warm-up cell that is not counted. Prints, per run, the mean round wall time and, for drift_every = 1, the mean
seconds of the drift forward per round, and:

- `forward/round`: the drift forward's seconds over its round's wall seconds (its rounds
  only), measured inside the drift_every = 1 runs;
- `wall ratio`: the wall time of the drift_every = 1 cells over the drift-off cells (the
  same rounds, paired runs): what always-on costs the whole cell; on a loaded machine the
  runs' own spread hides a few percent, so forward/round is the figure to quote.

Times are as slow as the machine was: quote the ratios, measured side by side.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from pipeline.core.config import load_config
from pipeline.core.store import Store
from pipeline.dag import graph
from stages import base_model, online_cell, online_train

DEFAULTS = {"experiment.methods": "[grpo]", "train.method": "grpo", "train.eval_every": "null"}   # --set overrides


def timed(fn, into: list[float]):
    """`fn`, appending each call's seconds to `into`."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)
    return wrapper


class Timed:
    """Seconds of every round (online_cell.one_round) and drift forward (online_train's
    round_drift) while installed; the functions are module globals, called by name."""

    def __init__(self) -> None:
        self.rounds: list[float] = []
        self.drift: list[float] = []
        self._round, self._drift = online_cell.one_round, online_train.round_drift

    def __enter__(self) -> Timed:
        online_cell.one_round = timed(self._round, self.rounds)
        online_train.round_drift = timed(self._drift, self.drift)
        return self

    def __exit__(self, *exc) -> None:
        online_cell.one_round, online_train.round_drift = self._round, self._drift


def run(cfg, base, work: Path) -> tuple[float, Timed]:
    """One cell on a fresh cache holding only the base model: (wall seconds, its timings)."""
    cache = work / f"cache-{time.monotonic_ns()}"
    shutil.copytree(base.folder, cache / Path(base.folder).name)
    with Timed() as timed:
        t0 = time.perf_counter()
        online_cell.run_cell(cfg, Store(cache), base)
        wall = time.perf_counter() - t0
    shutil.rmtree(cache, ignore_errors=True)
    return wall, timed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="smoke-online")
    ap.add_argument("--pairs", type=int, default=2, help="(drift_every = 1, drift off) runs, alternated")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    args = ap.parse_args(argv)
    cfg = load_config(args.preset, [f"{k}={v}" for k, v in DEFAULTS.items()] + args.set)
    rounds = cfg.train.updates // cfg.train.updates_per_step
    every, off = cfg.updated({"online.drift_every": 1}), cfg.updated({"online.drift_every": rounds})
    assert graph.cell_key(every) == graph.cell_key(off)
    with tempfile.TemporaryDirectory(prefix="ggpo-drift-cost-") as tmp:
        work = Path(tmp)
        base = base_model.run(cfg, store=Store(work / "base"))
        run(off, base, work)        # a warm-up cell, not counted: the first run pays the imports and caches
        walls: dict[str, list[float]] = {"every": [], "off": []}
        shares, forwards, round_s = [], [], []
        for pair in range(args.pairs):
            for name, c in (("every", every), ("off", off)) if pair % 2 == 0 else (("off", off), ("every", every)):
                wall, timed = run(c, base, work)
                walls[name].append(wall)
                print(f"pair {pair} drift_every={c.online.drift_every}: {wall:.1f} s, {len(timed.rounds)} rounds of "
                      f"{statistics.mean(timed.rounds):.2f} s, {len(timed.drift)} drift forward(s) of "
                      f"{statistics.mean(timed.drift):.3f} s", flush=True)
                if name == "every":
                    shares += [d / r for d, r in zip(timed.drift, timed.rounds)]
                    forwards += timed.drift
                    round_s += timed.rounds
    print(f"\n{args.preset} ({rounds} rounds of N = {cfg.train.updates_per_step} updates, G_mb = "
          f"{cfg.train.groups_per_update}, m = {cfg.rollout.group_size}), {args.pairs} pair(s):")
    print(f"  drift forward {statistics.mean(forwards):.3f} s per round, a round {statistics.mean(round_s):.2f} s")
    print(f"  forward/round: {statistics.mean(shares):.4f} (min {min(shares):.4f}, max {max(shares):.4f})")
    print(f"  wall ratio (drift_every=1 / drift off): {sum(walls['every']) / sum(walls['off']):.4f}")


if __name__ == "__main__":
    main()
