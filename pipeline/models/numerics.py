"""How a model computes on the CPU: ggpo's reproducible Linear layers, and a bfloat16 sampler
emulated in float32.

`prepare(model)` makes every nn.Linear of a model a `ReproducibleLinear`: the same module
(parameters, state dict, isinstance), whose forward runs ggpo's product
(pipeline/core/gemm.py) where it applies (the reproducible mode, fp32 CPU tensors) and
F.linear everywhere else (CUDA, bf16, fp64, `GGPO_KERNELS=native`). Every model the pipeline
loads or builds goes through it (pipeline/models/hf.py, tiny_model.py).

`emulate_bf16(model)`: the sampler of `rollout.dtype = "bfloat16"` on the CPU. The testbed
samples in bf16 on purpose: a GPU stack's sampler runs in bf16 while its trainer runs in fp32,
and that mismatch is what off-policy corrections correct. A CPU with bf16 instructions has
fast bf16 kernels, one without (AVX2 only) a slow fallback (a bf16 Linear 8-14x a fp32 one),
and each processor's bf16 kernels round differently. So on the CPU the bf16 model is emulated:
fp32 tensors holding bf16 values, fp32 kernels (the pinned ones), and a rounding to bf16
(round to nearest even, `round_bf16_`) wherever a bf16 model stores a tensor:

- every parameter, rounded once (and again after every weight sync, `round_parameters_`);
- the output of every Linear layer, activation function, RMSNorm, and the rotary cos/sin;
- the inputs of the attention output projection and of the MLP's down projection (the
  attention's output and the gate * up product, which a bf16 model stores in bf16);
- the residual stream where a decoder layer reads it (the input of each input and
  post-attention RMSNorm, and of the final norm), rounded in place, so the residual that the
  next addition reads is the rounded one, as in a bf16 model.

Each operation computes in fp32 from bf16 inputs and rounds its output once, as a GPU's bf16
kernels do (a bf16 matmul accumulates in fp32). What differs from a native bf16 forward: the
elementwise steps inside a module keep fp32 between them (RoPE's q*cos + rotate(q)*sin, the
RMSNorm's weight product, the softmax inside attention), each rounding once at the module's
output where a bf16 kernel may round more often. Measured on the tiny-regime base model
(benchmarks/kernel_paths.py --sampler): the token log-prob mismatch to the fp32 trainer,
mean |lp_train - lp_sampler|, is 2.87e-3 emulated against 2.94e-3 with native bf16 kernels
(weights alone rounded: 6.7e-4, a quarter of the real mismatch). docs/math.md section 15.
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.core import kernels


class ReproducibleLinear(nn.Linear):
    """nn.Linear whose forward is ggpo's reproducible product where it applies (module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


def prepare(model):
    """`model` with every plain nn.Linear turned into a ReproducibleLinear, in place (the
    class only: parameters, hooks and state dict stay). Returns the model."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = ReproducibleLinear
    return model


def round_bf16_(t: torch.Tensor) -> torch.Tensor:
    """t (fp32) rounded to the nearest bf16 value (ties to even), in place; returns t."""
    return t.copy_(t.to(torch.bfloat16))


@torch.no_grad()
def round_parameters_(model) -> None:
    """Every parameter's values rounded to bf16, in place (fp32 storage)."""
    for param in model.parameters():
        round_bf16_(param)      # not param.data: the write must move the parameter's version (gemm.py)


def _round_output(module, args, output):
    if isinstance(output, tuple):
        return tuple(round_bf16_(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in output)
    return round_bf16_(output)


def _round_input(module, args):
    round_bf16_(args[0])        # in place: the caller's tensor (the residual stream) is the rounded one
    return None


def _role(name: str, module) -> tuple[bool, bool]:
    """(round the input, round the output) of a module of an HF causal LM, by its name."""
    leaf = name.rsplit(".", 1)[-1]
    norm_in = leaf in ("input_layernorm", "post_attention_layernorm") or name.endswith("model.norm")
    is_norm = "norm" in leaf
    is_act = leaf == "act_fn" or type(module).__name__.endswith("Activation")
    out = isinstance(module, nn.Linear) or is_norm or is_act or leaf == "rotary_emb"
    return norm_in or leaf in ("o_proj", "down_proj"), out


def emulate_bf16(model):
    """The fp32 `model` as the bf16 sampler of the module docstring, in place: its parameters
    rounded, hooks rounding what a bf16 model stores. For inference only (the hooks round in
    place). Returns the model; `model.ggpo_bf16_emulated` is set."""
    if getattr(model, "ggpo_bf16_emulated", False):
        return model
    round_parameters_(model)
    for name, module in model.named_modules():
        round_in, round_out = _role(name, module)
        if round_in:
            module.register_forward_pre_hook(_round_input)
        if round_out:
            module.register_forward_hook(_round_output)
    model.ggpo_bf16_emulated = True
    return model
