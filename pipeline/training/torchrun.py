"""torchrun for the train stage: `launch` (in the stage's process) starts

    torchrun --nproc-per-node N --nnodes K --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        -m pipeline.training.torchrun --config C --base B --pool P --folder F

and `main` is what every rank runs: it joins the process group (distributed.init) and runs
the single-process loop (loop.train), whose distributed behaviour lives in distributed.py.
Any rank's failure makes torchrun exit non-zero; `launch` then raises a one-line
TrainingError (DiskFull, with the rank's own line, when a rank ran out of space: the CLI's
exit 2 and "free space, then rerun"), so `run_stage` writes no manifest, and a rerun resumes
from the last complete checkpoint (a DCP folder is published only whole, checkpoint.py). The parent reads the metrics rows back from that final checkpoint.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.core.config import PipelineConfig
from pipeline.core.errors import DiskFull, TrainingError
from pipeline.models.hf import load_tokenizer
from pipeline.services.servers import free_port
from pipeline.training import checkpoint
from pipeline.training.distributed import finish, init
from pipeline.training.loop import load_pool, train


def torchrun_argv(tc, rank_args: list[str], module: str = "pipeline.training.torchrun") -> list[str]:
    """The torchrun command for train.nproc / nnodes / rdzv_endpoint; every rank runs `module`."""
    endpoint = tc.rdzv_endpoint if tc.nnodes > 1 else f"127.0.0.1:{free_port()}"
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tc.nproc),
            "--nnodes", str(tc.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--max-restarts", "0", "-m", module, *rank_args]


def launch(cfg, base_path: str, pool_path: Path, folder: Path) -> list[dict]:
    """Runs the training under torchrun and returns the metrics rows (from the final
    checkpoint). Any rank failing: one-line TrainingError, nothing committed."""
    tc = cfg.train
    with tempfile.TemporaryDirectory(prefix="ggpo-torchrun-") as tmp:
        conf = Path(tmp) / "config.json"
        conf.write_text(cfg.model_dump_json())
        argv = torchrun_argv(tc, ["--config", str(conf), "--base", str(base_path),
                                  "--pool", str(pool_path), "--folder", str(folder)])
        env = os.environ | {"OMP_NUM_THREADS": str(cfg.model.threads)}
        proc = subprocess.run(argv, cwd=Path(__file__).resolve().parents[2], env=env,
                              stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        last, full = last_error(proc.stderr), disk_full_line(proc.stderr)
        sys.stderr.write(proc.stderr[-4000:])
        if full:
            raise DiskFull(f"{full} (torchrun, {tc.nproc} x {tc.nnodes} ranks)")
        raise TrainingError(f"train: torchrun ({tc.nproc} x {tc.nnodes} ranks) exited {proc.returncode}"
                            f"{': ' + last if last else ''}; checkpoints kept in {folder / 'checkpoints'}, "
                            "rerun the same command to resume")
    state = checkpoint.load(folder / "checkpoints")
    if state is None or state["update"] != tc.updates:
        raise TrainingError(f"train: torchrun exited 0 but {folder / 'checkpoints'} holds no final checkpoint")
    return state["metrics"]


def disk_full_line(stderr: str) -> str:
    """A rank's DiskFull message ("disk full: checkpointing into <path> needs about ..."),
    the first one any rank printed; "" when no rank ran out of space that way."""
    for line in stderr.splitlines():
        _, sep, message = line.partition("DiskFull: ")
        if sep and message.startswith("disk full:"):
            return message.strip()[:500]
    return ""


def last_error(stderr: str) -> str:
    """The most telling line of a failed torchrun: a rank's exception ("[rank0]: XError: ..."),
    else any exception line, else its exit code."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for prefer in (lambda ln: ln.startswith("[rank") and "Error" in ln,
                   lambda ln: ("Error:" in ln or "Error " in ln.split(":")[0]) and "ChildFailedError" not in ln,
                   lambda ln: "exitcode" in ln):
        found = [ln for ln in lines if prefer(ln)]
        if found:
            return found[-1][:300]
    return ""


def rank_setup(module: str, names: tuple[str, ...], argv: list[str] | None):
    """One rank's start: its arguments (each required), the config, torch threads, the
    process group joined (distributed.init); rank 0 logs, the others show no progress."""
    ap = argparse.ArgumentParser(prog=f"python -m {module}")
    for name in names:
        ap.add_argument(name, required=True)
    args = ap.parse_args(argv)
    cfg = PipelineConfig.model_validate(json.loads(Path(args.config).read_text()))
    torch.set_num_threads(cfg.model.threads)
    d = init(cfg.train.device)
    if d.is_main:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    else:
        os.environ["GGPO_PROGRESS"] = "0"      # one progress display: rank 0's
    return args, cfg, d


def main(argv: list[str] | None = None) -> None:
    """One rank: the single-process loop with the rank context set up first."""
    args, cfg, d = rank_setup("pipeline.training.torchrun", ("--config", "--base", "--pool", "--folder"), argv)
    try:
        pool = load_pool(Path(args.pool), cfg.rollout.group_size, cfg.train)
        train(cfg, pool, args.base, load_tokenizer(args.base), Path(args.folder))
    except BaseException:
        dist.destroy_process_group()
        raise
    finish(d)


if __name__ == "__main__":
    main()
