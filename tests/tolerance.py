"""The one rule for float tolerances in tests.

A float result is compared with an exact reference (the same computation in float64) and
may differ from it by the rounding error its dtype can make on a quantity of its size:

    tol(dtype, scale, terms) = SAFETY * eps(dtype) * scale * (ceil(log2(terms)) + 1)

- eps: the dtype's machine epsilon (torch.finfo: 1.2e-7 for fp32, 7.8e-3 for bf16);
- scale: the magnitude of the values the quantity is built from (the largest logit for a
  log-prob, the largest gradient entry for a gradient);
- terms: the length of the longest sum inside it (a dot product over the hidden size, a
  logsumexp over the vocabulary). A pairwise (tree) sum of n terms is off by at most
  eps * ceil(log2 n) times the sum of its terms' sizes (Higham, Accuracy and Stability of
  Numerical Algorithms, 2nd ed., section 4.2, eq. 4.6); the + 1 is the last operation's
  own rounding. Vectorized and blocked kernels (MKL, OpenBLAS, ARM's, cuBLAS) sum in trees
  of short runs;
- SAFETY = 8: room for the few chained operations of one quantity and for the kernels of
  another processor (MKL, OpenBLAS, ARM), which change summation order and fusion but
  not this bound.

Two float computations of the same exact value (two summation orders) may differ by
twice the tolerance. A test never tunes a tolerance to one machine: it names its scale
and terms, so the bound holds on any x86-64 or ARM processor, loaded or not.
"""
from __future__ import annotations

import math

import torch

SAFETY = 8.0


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def rounding_tol(dtype: torch.dtype, scale: float, terms: int = 1) -> float:
    """How far a `dtype` result of size `scale`, with sums of up to `terms` terms inside,
    may lie from its exact value."""
    return SAFETY * eps(dtype) * abs(scale) * (math.ceil(math.log2(max(terms, 1))) + 1)


def max_err(actual, exact) -> float:
    a = torch.as_tensor(actual, dtype=torch.float64)
    e = torch.as_tensor(exact, dtype=torch.float64)
    return float((a - e).abs().max()) if a.numel() else 0.0


def assert_close(actual, exact, dtype: torch.dtype, scale: float, terms: int = 1, what: str = "",
                 computations: int = 1) -> float:
    """|actual - exact| <= computations * tol(dtype, scale, terms), elementwise; returns the
    error. computations = 2 when `exact` is itself a `dtype` computation (another order)."""
    err, tol = max_err(actual, exact), computations * rounding_tol(dtype, scale, terms)
    assert err <= tol, f"{what}: max abs error {err:.3g} > tolerance {tol:.3g} ({dtype}, scale {scale:.3g}, terms {terms})"
    return err


def adam_weight_tol(dtype: torch.dtype, grad_scale: float, terms: int, lr: float, updates: int,
                    adam_eps: float = 1e-8) -> float:
    """How far the weights of two AdamW runs may drift apart when their gradients differ
    only by rounding. Adam's step g / (|g| + eps) moves by at most lr * dg / eps for a
    gradient change dg (its derivative eps / (|g| + eps)^2 peaks at 1 / eps where g ~ 0),
    so after `updates` steps the weights differ by at most updates * lr * dg / eps, with
    dg = 2 * rounding_tol(dtype, grad_scale, terms). In fp32 this exceeds Adam's own step
    (lr) by orders of magnitude: weights of fp32 runs cannot be compared elementwise,
    which is why such checks train in float64 (train.dtype=float64)."""
    return updates * lr * 2 * rounding_tol(dtype, grad_scale, terms) / adam_eps


TRAINING_COLUMNS = ("loss", "grad_norm", "k3_mismatch", "entropy", "kl_ref_k3", "ess")


def assert_same_training(metrics_a, weights_a: dict, metrics_b, weights_b: dict, lr: float,
                         dtype: torch.dtype = torch.float64) -> None:
    """Two training runs of one config that differ only in how the work was split
    (micro-batches, LM-head chunks, ranks): per update the same metrics within rounding
    (scale: the value, or 1 for values below it; terms: the update's tokens), and the same
    weights within adam_weight_tol. Meant for float64 runs (train.dtype=float64)."""
    tokens = int(max(metrics_a["tokens"]))
    for col in TRAINING_COLUMNS:
        a, b = metrics_a[col].to_list(), metrics_b[col].to_list()
        assert [x is None for x in a] == [y is None for y in b], col
        for x, y in zip(a, b):
            if x is not None:
                assert_close(y, x, dtype, max(abs(x), 1.0), tokens, what=col, computations=2)
    tol = adam_weight_tol(dtype, max(max(metrics_a["grad_norm"]), 1.0), tokens, lr, len(metrics_a["update"]))
    assert sorted(weights_a) == sorted(weights_b)
    worst = max(max_err(weights_a[k], weights_b[k]) for k in weights_a)
    assert worst <= tol, f"weights differ by {worst:.3g} > {tol:.3g}"
