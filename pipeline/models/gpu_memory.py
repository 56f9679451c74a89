"""How much of a GPU an online cell's vLLM sampler may take beside its resident learner.

The sampler and the learner share a GPU and take turns: the sampler samples a round, sleeps
(level 2: weights and KV cache handed back), the learner trains N updates, the sampler wakes
into what the learner left. vLLM sizes itself once, at its start (round 0), to
`gpu_memory_utilization` x the GPU: weights, activation workspace and KV cache, the KV cache
being whatever the share leaves (vllm/v1/worker/gpu_worker.py, determine_available_memory),
and wakes into the same bytes every round. At round 0 the learner holds only its weights and
its reference: AdamW creates its moments at the first step, gradients and activations come
with the first update. A share measured from the free memory then (the old rule) gave vLLM
~119 GiB of an H200, and after round 0's updates it woke into ~21 GiB: out of memory.

So the share is planned from the learner's footprint, computed here from the model's shape
and the training config, not measured, and only where the two really coexist. vLLM is
awake while it samples and asleep while the learner trains; between the last update and
the wake the learner's gradients are freed (zero_grad(set_to_none)), its activations and
the head's blocks are gone, and `release_device_memory` hands the allocator's cached
blocks back. So:

    wake      = weights + AdamW moments + reference (+ the gathered full weights under
                torchrun: rank 0 holds them while the sampler wakes and samples; one
                process shares its own parameters, no copy)
    train     = weights + gradients + AdamW moments + reference + FSDP buffers
                + activations at the token budget + the chunked LM head's blocks
    step      = weights + gradients + AdamW moments + reference + one more copy of the
                weights (the foreach AdamW's temporaries)
    peak      = max(train, step, wake)          (vLLM asleep, except at wake)
    reserve   = RESERVE_BYTES + RESERVE_SHARE x peak   (CUDA contexts, vLLM's memory while
                asleep; allocator fragmentation: what release_device_memory cannot return)
    sampler   = GPU - wake - reserve            (awake: beside the learner at wake)
    share     = sampler / GPU                   -> vLLM's gpu_memory_utilization
and the training peak must fit beside the sleeping sampler: peak + reserve <= GPU.

Under FSDP (train.nproc > 1) weights, gradients and moments are sharded over the ranks; the
reference is replicated; the root's parameters (embeddings) stay unsharded through forward
and backward, and two decoder layers are unsharded at a time (the one computing and the
one prefetched). Activations are per rank (each rank runs micro-batches of the same budget).

Why a share and not vLLM's `kv_cache_memory_bytes`: that option fixes the KV cache alone
("does not respect gpu_memory_utilization"), and vLLM still refuses to start unless
`gpu_memory_utilization` x GPU is free (Worker.init_device), so it would need the share
anyway plus our own estimate of vLLM's weights, activation workspace and CUDA graphs. With
the share vLLM measures those itself and gives the KV cache the rest.

Activation bytes per token and decoder layer (bf16 autocast, fp32 residual stream; what
autograd saves for backward, as transformers' Qwen3 / Llama layers compute):
    fp32: 8 H (the two RMSNorms' inputs and normalized outputs, the two residual sums)
          + 2 (q + kv) (the q/k RMSNorms upcast)
    bf16: 3 H (the inputs autocast casts for q/k/v, o and gate/up) + 3 (q + 2 kv) (the
          projections, rotated q/k, attention's saved q/k/v) + q (attention's output)
          + 4 I (gate, up, the activation and the product)
with q = heads x head_dim, kv = kv_heads x head_dim, I the MLP width: ~180 KB at Qwen3-1.7B.
With gradient checkpointing each layer keeps only its fp32 input (4 H) and one layer is
recomputed at a time, its activations and their gradients (2 x the above) alive together.
All of it is an estimate; its figures are printed when a cell starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

GiB = 2 ** 30
RESERVE_BYTES = 4 * GiB         # two CUDA contexts, NCCL, vLLM asleep (context, CUDA graphs)
RESERVE_SHARE = 0.05            # of the learner's footprint: allocator fragmentation
PROMPT_TOKENS = 512             # a prompt's tokens, where only micro_batch_groups bounds a micro-batch
MIN_SHARE = 0.1                 # below this the sampler has no room for its weights and a KV cache


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a causal LM: unique parameters (tied weights once), those the
    reference keeps in bf16 (runtime.autocast_parameters), and the layer geometry."""
    params: int
    autocast_params: int
    embedding_params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, model) -> "ModelShape":
        """From an HF causal LM (on any device, the meta device too)."""
        from pipeline.models.runtime import autocast_parameters
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(params=sum(p.numel() for p in model.parameters()),
                   autocast_params=sum(p.numel() for p in autocast_parameters(model)),
                   embedding_params=model.get_input_embeddings().weight.numel(),
                   layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                   kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads, head_dim=head_dim,
                   intermediate=c.intermediate_size, vocab=c.vocab_size)

    def activation_bytes_per_token(self) -> int:
        """One decoder layer's saved activations per token (module docstring)."""
        q, kv, h = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden
        return 4 * (8 * h + 2 * (q + kv)) + 2 * (3 * h + 3 * (q + 2 * kv) + q + 4 * self.intermediate)


@dataclass(frozen=True)
class LearnerSetup:
    """How the learner holds the model on the sampler's GPU (from TrainConfig / Runtime)."""
    tokens: int                          # a micro-batch's tokens (the token budget)
    gradient_checkpointing: bool
    world: int = 1                       # FSDP ranks sharing weights, gradients and moments
    autocast: bool = True                # bf16 autocast over fp32 master weights
    reference_on_gpu: bool = True        # train.reference_device=same
    fsdp_bf16: bool = False              # train.fsdp_param_dtype=bfloat16 under FSDP
    chunk_tokens: int = 1024             # train.logprob_chunk_tokens


@dataclass(frozen=True)
class SamplerMemory:
    gpu_bytes: int
    parts: dict[str, int] = field(hash=False)      # the learner's footprint, by part (bytes)
    wake_bytes: int                 # what the learner holds while the sampler is awake
    peak_bytes: int                 # its training peak, while the sampler sleeps
    reserve_bytes: int
    sampler_bytes: int

    @property
    def gpu_memory_utilization(self) -> float:
        return self.sampler_bytes / self.gpu_bytes

    def describe(self) -> str:
        held = ", ".join(f"{k} {self.parts[k] / GiB:.1f}" for k in WAKE_PARTS if self.parts.get(k))
        rest = ", ".join(f"{k} {v / GiB:.1f}" for k, v in self.parts.items() if k not in WAKE_PARTS)
        return (f"GPU {self.gpu_bytes / GiB:.1f} GiB: learner holds {self.wake_bytes / GiB:.1f} GiB when the "
                f"sampler wakes ({held}), {self.peak_bytes / GiB:.1f} GiB at its training peak while the sampler "
                f"sleeps (besides: {rest}), reserve {self.reserve_bytes / GiB:.1f}, sampler "
                f"{self.sampler_bytes / GiB:.1f} GiB (gpu_memory_utilization {self.gpu_memory_utilization:.3f})")


# what the learner still holds when the sampler wakes: gradients, activations, the head's
# blocks and FSDP's unsharded buffers are freed by then (module docstring)
WAKE_PARTS = ("weights", "adamw", "reference", "sync_gather")


def learner_parts(shape: ModelShape, setup: LearnerSetup) -> dict[str, int]:
    """The learner's bytes on the sampler's GPU, by part (module docstring)."""
    p, w = shape.params, setup.world
    parts = {"weights": 4 * p // w, "gradients": 4 * p // w, "adamw": 8 * p // w}
    if not setup.reference_on_gpu:
        parts["reference"] = 0
    elif not setup.autocast:
        parts["reference"] = 4 * p
    elif setup.fsdp_bf16:
        parts["reference"] = 2 * p
    else:       # bf16 linear weights, fp32 embeddings, norms and head (runtime.prepare_reference)
        parts["reference"] = 2 * shape.autocast_params + 4 * (p - shape.autocast_params)
    if w > 1:   # unsharded while computing: the root (embeddings) throughout, two layers at a time; with gradients
        layer = (p - shape.embedding_params) // shape.layers
        unit = 2 if setup.fsdp_bf16 else 4
        parts["fsdp_buffers"] = unit * shape.embedding_params + 4 * shape.embedding_params + 2 * 2 * unit * layer
    per_layer = shape.activation_bytes_per_token() * setup.tokens
    if setup.gradient_checkpointing:
        parts["activations"] = shape.layers * 4 * shape.hidden * setup.tokens + 2 * per_layer
    else:
        parts["activations"] = shape.layers * per_layer
    v, h = shape.vocab, shape.hidden
    # chunked head: its hidden rows and their gradient, a chunk's logits and softmax, the head
    # weight's bf16 copy and its fp32 gradient accumulator (pipeline/training/lm_head.py)
    parts["lm_head"] = 2 * 4 * setup.tokens * h + 2 * 4 * setup.chunk_tokens * v + 2 * v * h + 4 * v * h
    if w > 1:
        parts["sync_gather"] = 4 * p       # rank 0: the full fp32 weights while the sampler wakes
    return parts


def plan_sampler_memory(shape: ModelShape, setup: LearnerSetup, gpu_bytes: int) -> SamplerMemory:
    """The sampler's share of a `gpu_bytes` GPU beside the learner (module docstring): what
    the learner holds at wake decides it; the training peak only has to fit beside the
    sleeping sampler. Raises ValueError, naming the parts, when the peak does not fit or
    the learner leaves the sampler under MIN_SHARE."""
    parts = learner_parts(shape, setup)
    wake = sum(parts.get(k, 0) for k in WAKE_PARTS)
    train = (parts["weights"] + parts["adamw"] + parts["reference"] + parts["gradients"]
             + parts.get("fsdp_buffers", 0) + parts["activations"] + parts["lm_head"])
    step = parts["weights"] + parts["adamw"] + parts["reference"] + parts["gradients"] + parts["weights"]
    peak = max(train, step, wake)
    reserve = RESERVE_BYTES + int(RESERVE_SHARE * peak)
    plan = SamplerMemory(gpu_bytes=gpu_bytes, parts=parts, wake_bytes=wake, peak_bytes=peak,
                         reserve_bytes=reserve, sampler_bytes=gpu_bytes - wake - reserve)
    if peak + reserve > gpu_bytes:
        raise ValueError(f"the learner's training peak {peak / GiB:.1f} GiB and the reserve "
                         f"{reserve / GiB:.1f} GiB do not fit the GPU's {gpu_bytes / GiB:.1f} ({plan.describe()})")
    if plan.gpu_memory_utilization < MIN_SHARE:
        raise ValueError(f"the learner leaves the sampler {max(plan.sampler_bytes, 0) / GiB:.1f} GiB of the GPU's "
                         f"{gpu_bytes / GiB:.1f} ({plan.describe()})")
    return plan


def micro_batch_tokens(tc, rollout) -> int:
    """The tokens of the largest micro-batch: train.micro_batch_tokens, or micro_batch_groups
    groups of m responses at the full budget after a PROMPT_TOKENS prompt; never less than
    one such group (a group is never split)."""
    group = rollout.group_size * (rollout.max_new_tokens + PROMPT_TOKENS)
    budget = tc.micro_batch_tokens if tc.micro_batch_tokens is not None else tc.micro_batch_groups * group
    return max(budget, group)


def learner_setup(cfg, rt, world: int) -> LearnerSetup:
    """The LearnerSetup of a PipelineConfig's training under Runtime `rt` over `world` ranks."""
    return LearnerSetup(tokens=micro_batch_tokens(cfg.train, cfg.rollout), world=world,
                        gradient_checkpointing=rt.gradient_checkpointing, autocast=rt.autocast_dtype is not None,
                        reference_on_gpu=rt.reference_device.type == "cuda", fsdp_bf16=rt.bf16_parameters,
                        chunk_tokens=rt.chunk_tokens)
