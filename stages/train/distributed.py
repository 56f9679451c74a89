"""Data-parallel, sharded training under torchrun: the same loop on every rank.

Launch. With `train.nproc > 1` (or `train.nnodes > 1`) the train stage's build calls
`launch`, which runs

    torchrun --nproc-per-node N --nnodes K --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        -m stages.train.distributed --config C --base B --pool P --folder F

(one node: a free port on 127.0.0.1). Every rank (`main`) loads the pool and the base
model, joins the process group (nccl on CUDA, each rank on cuda:LOCAL_RANK; gloo on the
CPU) and runs `loop.train`, the single-process loop; the distributed behaviour lives in the
functions it calls, which ask `current()` for the rank context:

- the policy is FSDP2-sharded (`shard_policy`: `fully_shard` per decoder layer, then the
  root), with `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` when the runtime
  computes in bf16 (fp32 master weights and optimizer state stay sharded), none in fp32; on
  the CPU an explicit `init_device_mesh("cpu", ...)` mesh (pytorch#132471). Gradients are
  SUMMED over ranks, not averaged: each rank's loss is already divided by the update's
  global token count T_tot. The reference policy is frozen and replicated (every rank holds
  it whole, bf16 on CUDA); a refresh copies the gathered full policy into it;
- an update's groups are split into contiguous shards of whole groups (`shards`), every
  rank runs the same number of micro-batches (`lockstep`: FSDP's all-gathers are
  collectives, so a rank with fewer pads with a zero-weight micro-batch), and the metrics
  row is combined over ranks (`combine`): sums added, the ESS block's sequence log ratios
  concatenated in rank order, so loss, K3, ESS, ... are those of the single-process run
  up to float reduction order. T_tot and the sequence count come from the whole update's
  groups, which every rank knows (the pool and the seeded group order are on every rank);
- the step anchor lp_old: each rank computes its shard of the step's groups, then the
  shards are gathered, so every rank (and the checkpoint) holds the whole step's anchor;
- grad-norm clipping is global: `clip_grad_norm_` on FSDP's DTensor gradients reduces the
  norm over the mesh;
- checkpoints go through torch.distributed.checkpoint (checkpoint.py), the final `model/`
  and snapshots are written by rank 0 from the gathered full state dict.

Any rank's failure makes torchrun exit non-zero; `launch` then raises a one-line
TrainingError, so `run_stage` writes no manifest, and a rerun resumes from the last
complete checkpoint. The parent reads the metrics rows back from that final checkpoint.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

# test hook: "RANK:UPDATE" makes that rank die (os._exit(9)) right after the checkpoint of
# that update, as a killed worker would
KILL_ENV = "GGPO_TEST_KILL_RANK_AFTER"


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    mesh: object            # torch.distributed.device_mesh.DeviceMesh, 1-D over all ranks

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shards(self, items: list) -> list[list]:
        """Contiguous shards of `items`, one per rank, sizes differing by at most one."""
        base, extra = divmod(len(items), self.world)
        out, start = [], 0
        for r in range(self.world):
            end = start + base + (1 if r < extra else 0)
            out.append(list(items[start:end]))
            start = end
        return out

    def lockstep(self, chunks_by_rank: list[list[list[int]]]) -> list[tuple[list[int], bool]]:
        """This rank's micro-batches flagged real, padded with (filler, False) up to the
        largest rank's count: every rank then runs the same number of FSDP forwards."""
        mine = chunks_by_rank[self.rank]
        most = max(len(c) for c in chunks_by_rank)
        filler = min((c for cs in chunks_by_rank for c in cs), key=len)
        return [(c, True) for c in mine] + [(filler, False)] * (most - len(mine))

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()


_CURRENT: Dist | None = None


def current() -> Dist | None:
    """The rank context when this process is a rank of an initialized process group
    (`init` ran, or a caller set up torch.distributed itself), else None."""
    global _CURRENT
    if _CURRENT is None and dist.is_available() and dist.is_initialized():
        _CURRENT = _context(dist.get_backend() == "nccl")
    return _CURRENT


def _context(cuda: bool) -> Dist:
    from torch.distributed.device_mesh import init_device_mesh
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    return Dist(rank, world, local, device, init_device_mesh(device.type, (world,)))


def init(device_setting: str) -> Dist:
    """Join torchrun's process group: nccl on CUDA (this rank on cuda:LOCAL_RANK), gloo on
    the CPU. `device_setting` is train.device (auto | cpu | cuda)."""
    global _CURRENT
    from pipeline.runtime import resolve_device
    cuda = resolve_device(device_setting).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    _CURRENT = _context(cuda)
    return _CURRENT


def shard_policy(model, autocast_dtype: torch.dtype | None):
    """FSDP2 over the current mesh: each decoder layer, then the root (which keeps the
    embeddings, final norm and, tied or not, the LM head). The log-prob entry point
    `ggpo_token_logprobs` is registered as an FSDP forward method, because the chunked
    path calls the decoder body and then reads the head weight itself: the root's
    all-gather must be around both."""
    d = current()
    if d is None:
        return model
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from stages.train.policy import token_logprobs
    mp = (MixedPrecisionPolicy(param_dtype=autocast_dtype, reduce_dtype=torch.float32)
          if autocast_dtype is not None else MixedPrecisionPolicy())
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for layer in body.layers:
        fully_shard(layer, mesh=d.mesh, mp_policy=mp)
    fully_shard(model, mesh=d.mesh, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # losses are / global T_tot already: the ranks' gradients add, never average
            # (a plain SUM collective: gloo has no PREMUL_SUM/AVG)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    model.ggpo_token_logprobs = types.MethodType(token_logprobs, model)
    register_fsdp_forward_method(model, "ggpo_token_logprobs")
    return model


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def policy_state(model, rank0_only: bool = False) -> dict:
    """The policy's full state dict (plain tensors): for an FSDP model gathered over the
    ranks (a collective: every rank calls it); with rank0_only, on the CPU of rank 0 only
    (other ranks get {})."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))


def save_sharded_policy(model, tokenizer, tmp: Path, final: Path) -> None:
    """`final` as an HF folder of the gathered full weights, written by rank 0 (temp name,
    then rename); every rank calls it (the gather is a collective)."""
    d = current()
    full = policy_state(model, rank0_only=True)
    if d.is_main:
        if getattr(model.config, "tie_word_embeddings", False):   # as save_pretrained drops them
            for key in getattr(model, "_tied_weights_keys", None) or ():
                full.pop(key, None)
        model.save_pretrained(tmp, state_dict=full)
        tokenizer.save_pretrained(tmp)
        # the class FSDP2 made is "FSDP<Name>": the folder must name the model's own class
        config = json.loads((tmp / "config.json").read_text())
        config["architectures"] = [type(model).__bases__[-1].__name__]   # (FSDPModule, cls)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        import shutil
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    d.barrier()


# row entries that are maxima over the update's tokens, not sums
MAXIMA = ("max_abs_log_ratio",)


def combine(parts: list[dict]) -> dict:
    """Ranks' partial update rows -> one: numbers added in rank order (MAXIMA: the largest),
    lists concatenated, None where no rank had a value."""
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            if isinstance(v, list):
                out[k] = out.get(k, []) + v
            elif v is not None and k in MAXIMA:
                out[k] = max(out.get(k) or v, v)
            elif v is not None:
                out[k] = (out.get(k) or 0) + v
            else:
                out.setdefault(k, None)
    return out


def after_checkpoint(update: int) -> None:
    """The test hook of KILL_ENV: this rank dies as if killed (no cleanup, exit 9)."""
    spec = os.environ.get(KILL_ENV)
    d = current()
    if spec and d is not None:
        rank, at = map(int, spec.split(":"))
        if d.rank == rank and update == at:
            os._exit(9)


def wanted(tc) -> bool:
    """Does this train config ask for torchrun (several ranks or nodes)?"""
    return tc.nproc > 1 or tc.nnodes > 1


def torchrun_argv(tc, rank_args: list[str]) -> list[str]:
    """The torchrun command for train.nproc / nnodes / rdzv_endpoint."""
    from pipeline.services import free_port
    endpoint = tc.rdzv_endpoint if tc.nnodes > 1 else f"127.0.0.1:{free_port()}"
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tc.nproc),
            "--nnodes", str(tc.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--max-restarts", "0", "-m", "stages.train.distributed", *rank_args]


def launch(cfg, base_path: str, pool_path: Path, folder: Path) -> list[dict]:
    """Runs the training under torchrun and returns the metrics rows (from the final
    checkpoint). Any rank failing: one-line TrainingError, nothing committed."""
    from stages.train import checkpoint
    from stages.train.loop import TrainingError
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
        last = _last_error(proc.stderr)
        sys.stderr.write(proc.stderr[-4000:])
        raise TrainingError(f"train: torchrun ({tc.nproc} x {tc.nnodes} ranks) exited {proc.returncode}"
                            f"{': ' + last if last else ''}; checkpoints kept in {folder / 'checkpoints'}, "
                            "rerun the same command to resume")
    state = checkpoint.load(folder / "checkpoints")
    if state is None or state["update"] != tc.updates:
        raise TrainingError(f"train: torchrun exited 0 but {folder / 'checkpoints'} holds no final checkpoint")
    return state["metrics"]


def _last_error(stderr: str) -> str:
    """The most telling line of a failed torchrun: a rank's exception, else its exit code."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error:" in ln or "Error " in ln.split(":")[0]:
            return ln[:300]
    for ln in reversed(lines):
        if "exitcode" in ln:
            return ln[:300]
    return ""


def main(argv: list[str] | None = None) -> None:
    """One rank: the single-process loop with the rank context set up first."""
    ap = argparse.ArgumentParser(prog="python -m stages.train.distributed")
    for name in ("--config", "--base", "--pool", "--folder"):
        ap.add_argument(name, required=True)
    args = ap.parse_args(argv)
    from pipeline.config import PipelineConfig
    from pipeline.hf import load_tokenizer
    from stages.train.loop import load_pool, train
    cfg = PipelineConfig.model_validate(json.loads(Path(args.config).read_text()))
    torch.set_num_threads(cfg.model.threads)
    d = init(cfg.train.device)
    if not d.is_main:
        os.environ["GGPO_PROGRESS"] = "0"      # one progress display: rank 0's
    if d.is_main:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        pool = load_pool(Path(args.pool), cfg.rollout.group_size, cfg.train.needs_behavior_logprobs())
        train(cfg, pool, args.base, load_tokenizer(args.base), Path(args.folder))
        d.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
