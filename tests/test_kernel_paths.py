"""benchmarks/kernel_paths.py: its hashes repeat under one kernel choice, and its rerun under
another choice reports only what really moved (here: the machine's own choice, so nothing)."""
from __future__ import annotations

import importlib.util

import torch

from pipeline.core.config import load_config

from conftest import REPO


def load_script():
    spec = importlib.util.spec_from_file_location("kernel_paths", REPO / "benchmarks" / "kernel_paths.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_same_kernels_give_the_same_hashes_in_process_and_in_a_child(monkeypatch):
    kp = load_script()
    cfg = load_config("tiny-regime", [])
    first, again = kp.model_hashes(cfg), kp.model_hashes(cfg)
    assert first == again and set(first) == {"fp32_logits", "fp32_grads", "bf16_logits"}
    assert all(len(v) == 16 for v in first.values())
    # the machine's own capability named explicitly: the child takes the same kernels
    own = torch.backends.cpu.get_cpu_capability().lower()
    monkeypatch.setattr(kp, "PATHS", {"own": {"ATEN_CPU_CAPABILITY": own}})
    assert kp.other_paths("tiny-regime", {"hashes": first}) == {"own": []}


def test_a_result_that_differs_is_named(monkeypatch):
    kp = load_script()
    mine = {"hashes": dict.fromkeys(("fp32_logits", "fp32_grads", "bf16_logits"), "0" * 16)}
    monkeypatch.setattr(kp, "PATHS", {"own": {}})
    assert kp.other_paths("tiny-regime", mine) == {"own": ["fp32_logits", "fp32_grads", "bf16_logits"]}
