"""A flow command timed twice, alternated: in two checkouts, or in one with two settings (#26, #35).

Each repetition runs `ggpo run online --preset tiny-regime` with the ladder's grid (16 cells,
one seed) from an empty cache, first the "old" side, then the new (this checkout), each timed
with wall and CPU time (its children included). Alternating keeps slow drifts of the
machine's load out of the ratio; run it with nothing else running. It prints each run, the
ratio new / old of the medians and, with `--cells`, cells per hour.

    .venv/bin/python benchmarks/ladder_side_by_side.py --old ../ggpo-f1fbc09 [--reps 1]

`--old` is a checkout with its environment built (git worktree add ../ggpo-f1fbc09 f1fbc09,
then `make install` there, or a link to this checkout's .venv: each side runs with its own
checkout first on PYTHONPATH). Without it both sides run this checkout and `--old-set` says
what the old side ran differently (a schedule the new preset changed), e.g. the corrections
table's two cuts (evaluation at the end only, the round drift every 4th round) on a subset
of its cells:

    .venv/bin/python benchmarks/ladder_side_by_side.py --command run corrections --preset corrections \
        --set 'experiment.methods=["grpo_tis","cispo","ggpo","m2po"]' --set 'experiment.seeds=[42]' \
        --old-set train.eval_every=64 --old-set online.drift_every=1 --cells 20

`--old-env NAME=VALUE` sets a variable on the old side only: the reproducible kernel mode
against the processor's own kernels on the corrections table's one-seed run (#44),

    .venv/bin/python benchmarks/ladder_side_by_side.py --command run corrections --preset corrections \
        --set 'experiment.seeds=[42]' --old-env GGPO_KERNELS=native --cells 60 --reps 2

Odd repetitions run the new side first. Caches and state folders are temporary and removed
afterwards.
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


def run_once(checkout: Path, argv: list[str], extra_env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the run and its children) of one command from an empty cache;
    `extra_env` is added to the command's environment (one side's GGPO_KERNELS, say)."""
    with tempfile.TemporaryDirectory(prefix="ggpo-ladder-") as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
        # the checkout's own code first: an environment installed editable from another
        # checkout (a linked .venv) would otherwise import that checkout's packages
        env |= {"GGPO_CACHE": f"{tmp}/cache", "GGPO_HOME": f"{tmp}/home", "PYTHONPATH": str(checkout)}
        env |= extra_env or {}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        res = subprocess.run([str(checkout / ".venv" / "bin" / "ggpo"), *argv], cwd=checkout, env=env,
                             capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if res.returncode != 0:
            raise RuntimeError(f"`ggpo {' '.join(argv)}` failed in {checkout} (exit {res.returncode}):\n"
                               f"{res.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def sides(args: argparse.Namespace) -> list[tuple[str, Path, list[str]]]:
    """(name, checkout, argv) of the old and the new side, old first."""
    argv = [*args.command, *(a for s in args.set for a in ("--set", s))]
    if args.preset:
        argv[2:2] = ["--preset", args.preset]
    old = [*argv, *(a for s in args.old_set for a in ("--set", s))]
    return [("old", (args.old or REPO).resolve(), old), ("new", REPO, argv)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, help="the other checkout (with its .venv); default: this one")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--command", nargs="+", default=["run", "online"], help="the ggpo command (default: run online)")
    ap.add_argument("--preset", default="tiny-regime")
    ap.add_argument("--set", action="append", default=None, help="KEY=VALUE for both sides (default: the ladder's grid)")
    ap.add_argument("--old-set", action="append", default=[], help="KEY=VALUE for the old side only")
    ap.add_argument("--old-env", action="append", default=[],
                    help="NAME=VALUE in the old side's environment only, e.g. GGPO_KERNELS=native")
    ap.add_argument("--cells", type=int, help="cells the command runs: also print cells per hour")
    args = ap.parse_args()
    if args.set is None:
        args.set = ['experiment.grid={"train.updates_per_step": [1, 4, 16, 64]}']
    if args.old is None and not args.old_set and not args.old_env:
        ap.error("without --old, --old-set or --old-env says what the old side runs differently")
    old_env = dict(kv.split("=", 1) for kv in args.old_env)
    runs: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for rep in range(args.reps):
        # odd repetitions run the new side first, so a drift of the machine's load over the
        # run weighs on both sides alike
        order = sides(args) if rep % 2 == 0 else sides(args)[::-1]
        for name, checkout, argv in order:
            wall, cpu = run_once(checkout, argv, old_env if name == "old" else None)
            runs[name].append((wall, cpu))
            print(f"rep {rep} {name}: {wall:.0f} s wall, {cpu:.0f} s CPU", flush=True)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
    print(f"new / old: wall {med['new'][0] / med['old'][0]:.3f}x, CPU {med['new'][1] / med['old'][1]:.3f}x "
          f"(medians over {args.reps} repetition(s))")
    if args.cells:
        rate = {k: args.cells * 3600 / w for k, (w, _) in med.items()}
        print(f"cells per hour: old {rate['old']:.0f}, new {rate['new']:.0f} ({rate['new'] / rate['old']:.3f}x)")


if __name__ == "__main__":
    main()
