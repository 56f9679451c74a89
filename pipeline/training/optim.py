"""AdamW whose step is the same bits on every x86 processor in the reproducible kernel mode.

torch's AdamW divides by sqrt(v_t) / sqrt(1 - beta2^t) + eps, and torch's fp32 `sqrt` on the
CPU (ATen's AVX2 kernel) is not the correctly rounded square root: measured on this project's
Sapphire Rapids machine, 15.7 % of 100,000 values differ from it by an ulp, and under qemu's
Haswell and EPYC-Rome models another ~1 % of the parameters ended an ulp apart after one step
(an approximate reciprocal square root refined by Newton steps gives the processor's own
bits). So in the reproducible mode (pipeline/core/kernels.py) the fp32 CPU parameters' step
is torch's single-tensor AdamW formula with one change: sqrt(v_t) is computed in float64 and
rounded once to float32, which is the correctly rounded fp32 square root (53 >= 2 * 24 + 2
bits), the same on every processor. Everything else (decoupled weight decay, lerp, addcmul,
addcdiv, the bias corrections in Python floats) is torch's, in torch's order:

    p   <- p * (1 - lr * wd)
    m   <- lerp(m, g, 1 - beta1);   v <- v * beta2 + (1 - beta2) g^2
    p   <- p - lr / (1 - beta1^t) * m / (sqrt(v) / (1 - beta2^t)^0.5 + eps)

Its state (`step` as a float32 tensor, `exp_avg`, `exp_avg_sq`) and param groups are torch's
AdamW's, so checkpoints load either way. Any other case (CUDA, fp64 or bf16 parameters,
`GGPO_KERNELS=native`, amsgrad, maximize) is torch's own step.
"""
from __future__ import annotations

import torch

from pipeline.core import kernels


def exact_sqrt(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of a float32 tensor, as float32."""
    return t.double().sqrt_().float()


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW with a reproducible fp32 CPU step (module docstring)."""

    def _reproducible(self) -> bool:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        simple = all(not g.get("amsgrad") and not g.get("maximize") and not g.get("capturable")
                     for g in self.param_groups)
        return simple and bool(params) and kernels.applies(*params, *(p.grad for p in params))

    @torch.no_grad()
    def step(self, closure=None):
        if not self._reproducible():
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        step = float(state["step"].item())
        g, exp_avg, exp_avg_sq = p.grad, state["exp_avg"], state["exp_avg_sq"]
        p.mul_(1 - lr * wd)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        denom = (exact_sqrt(exp_avg_sq) / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
