"""The testbed's staleness ladder timed in two checkouts, alternated (#26).

Each repetition runs `ggpo run online --preset tiny-regime` with the ladder's grid (16 cells,
one seed) from an empty cache, first in the other checkout (`--old`, with its own `.venv`),
then in this one, each timed with wall and CPU time (its children included). Alternating
keeps slow drifts of the machine's load out of the ratio; run it with nothing else running.
It prints each run and the ratio new / old of the medians.

    .venv/bin/python benchmarks/ladder_side_by_side.py --old ../ggpo-f1fbc09 [--reps 1]

`--old` is a checkout with its environment built (git worktree add ../ggpo-f1fbc09 f1fbc09,
then `make install` there). Caches and state folders are temporary and removed afterwards.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LADDER = ["run", "online", "--preset", "tiny-regime", "--set",
          'experiment.grid={"train.updates_per_step": [1, 4, 16, 64]}']


def run_ladder(checkout: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the run and its children) of one ladder from an empty cache."""
    with tempfile.TemporaryDirectory(prefix="ggpo-ladder-") as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
        env |= {"GGPO_CACHE": f"{tmp}/cache", "GGPO_HOME": f"{tmp}/home"}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        res = subprocess.run([str(checkout / ".venv" / "bin" / "ggpo"), *LADDER], cwd=checkout, env=env,
                             capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if res.returncode != 0:
            raise RuntimeError(f"the ladder failed in {checkout} (exit {res.returncode}):\n{res.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True, help="the other checkout (with its .venv)")
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for rep in range(args.reps):
        for name, checkout in (("old", args.old.resolve()), ("new", REPO)):
            wall, cpu = run_ladder(checkout)
            runs[name].append((wall, cpu))
            print(f"rep {rep} {name}: {wall:.0f} s wall, {cpu:.0f} s CPU", flush=True)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
    print(f"new / old: wall {med['new'][0] / med['old'][0]:.3f}x, CPU {med['new'][1] / med['old'][1]:.3f}x "
          f"(medians over {args.reps} repetition(s))")


if __name__ == "__main__":
    main()
