"""Data-parallel, sharded training under torchrun: the same loop on every rank.

Launch: torchrun.py (`launch` in the stage's process, `main` on every rank). Every rank
loads the pool and the base model, joins the process group (`init`: nccl on CUDA, each
rank on cuda:LOCAL_RANK; gloo on the CPU) and runs `loop.train`, the single-process loop;
the distributed behaviour lives in the functions it calls, which ask `current()` for the
rank context. This module imports nothing of the loop or the checkpoints:

- the policy is FSDP2-sharded (`shard_policy`: `fully_shard` per decoder layer, then the
  root); on the CPU an explicit `init_device_mesh("cpu", ...)` mesh (pytorch#132471).
  Precision (`train.fsdp_param_dtype`): "float32" (default) keeps fp32 parameters and runs
  the forward under the runtime's bf16 autocast, exactly as one process does, so the
  residual stream and the norms stay fp32; "bfloat16" is FSDP's
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: parameters all-gathered in
  bf16 (half the communication), the residual stream in bf16 too, so results differ from
  one process by more than rounding order. fp32 master weights and optimizer state stay
  sharded either way. Gradients are
  SUMMED over ranks, not averaged: each rank's loss is already divided by the update's
  global token count T_tot. The reference policy is frozen and replicated (every rank holds
  it whole, in the precision runtime.prepare_reference gives it); a refresh copies the
  gathered full policy into it;
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

"""
from __future__ import annotations

import json
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pipeline.models.runtime import resolve_device
from pipeline.training.policy import token_logprobs

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# test hook: "RANK:UPDATE" makes that rank die (os._exit(9)) right after the checkpoint of
# that update, as a killed worker would
KILL_ENV = "GGPO_TEST_KILL_RANK_AFTER"


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh        # 1-D over all ranks

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
    cuda = resolve_device(device_setting).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    _CURRENT = _context(cuda)
    return _CURRENT


def finish(d: Dist) -> None:
    """A rank whose work is done and written: wait for the others, leave the process group
    and exit 0 at once. Why `os._exit`: gloo's worker threads can still be joinable when
    the interpreter finalizes, and their C++ destructors then call std::terminate
    ("terminate called without an active exception", SIGABRT) after every byte was
    written; torchrun reports that as a failed rank (pytorch#179291 describes the race).
    Nothing is left to run at exit: every artifact is already renamed into place."""
    import sys
    d.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def mixed_precision(autocast_dtype: torch.dtype | None, fsdp_param_dtype: str):
    """FSDP's MixedPrecisionPolicy for the runtime's autocast dtype and train.fsdp_param_dtype:
    bf16 parameters only when asked for; otherwise none (fp32, the autocast does the rest)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if autocast_dtype is not None and fsdp_param_dtype == "bfloat16":
        return MixedPrecisionPolicy(param_dtype=autocast_dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_policy(model, autocast_dtype: torch.dtype | None, fsdp_param_dtype: str = "float32"):
    """FSDP2 over the current mesh: each decoder layer, then the root (which keeps the
    embeddings, final norm and, tied or not, the LM head). The log-prob entry point
    `ggpo_token_logprobs` is registered as an FSDP forward method, because the chunked
    path calls the decoder body and then reads the head weight itself: the root's
    all-gather must be around both."""
    d = current()
    if d is None:
        return model
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
    mp = mixed_precision(autocast_dtype, fsdp_param_dtype)
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


def full_parameters_on_main(model) -> list[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every parameter of an FSDP model, on rank 0's device, for a
    sampler sync only rank 0 performs; [] on the other ranks. A collective: every rank
    gathers one parameter at a time, in named_parameters' order (the same on every rank),
    and drops it at once unless it is rank 0, so no other rank ever holds more than one
    full parameter (a full state dict would put the whole fp32 model on every GPU)."""
    d = current()
    out = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
            if d is None or d.is_main:
                out.append((name, full))
            del full
    return out


def save_sharded_policy(model, tokenizer, tmp: Path, final: Path) -> None:
    """`final` as an HF folder of the gathered full weights, written by rank 0 (temp name,
    then rename); every rank calls it (the gather is a collective)."""
    d = current()
    assert d is not None    # a sharded model: this process is a rank
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
