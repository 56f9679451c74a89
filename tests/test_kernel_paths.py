"""The golden hashes (tests/data/kernel_golden.json): in the reproducible kernel mode, the
probe of benchmarks/kernel_paths.py (fp32 forward and gradients, the bf16-emulating forward,
one sampled draw, one update of the tiny-regime model) gives the committed bits on this
processor, whatever it is; the machines that run the suite change processor, so this is the
cross-processor check. A kernel variable changed (the fast mode with ATen's plain kernels)
moves them, and the check names what moved and the processor's capability. Under
GGPO_KERNELS=native the probe is only checked run to run."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from pipeline.core import kernels
from pipeline.core.config import load_config

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "kernel_paths.py"


def load_script():
    spec = importlib.util.spec_from_file_location("kernel_paths", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=os.environ | env, capture_output=True, text=True)


def test_the_probe_gives_the_golden_bits_here_and_repeats():
    kp = load_script()
    cfg = load_config("tiny-regime", [])
    first = kp.hashes(cfg)
    assert set(first) == set(kp.RESULTS) and all(len(v) == 16 for v in first.values())
    assert kp.hashes(cfg) == first                      # run to run, in either mode
    if kernels.state().mode == "native":
        pytest.skip("GGPO_KERNELS=native: the processor's own kernels, checked run to run only")
    golden = json.loads(kp.GOLDEN.read_text())
    moved = kp.check(first, golden)
    assert not moved, (f"{', '.join(moved)} moved against {kp.GOLDEN.name} ({golden['kernels']}, torch "
                       f"{golden['torch']}) on this processor ({kp.capability()}): {kernels.state().line()}")


def test_a_changed_kernel_variable_fails_the_check_naming_what_moved_and_the_capability():
    done = child("--check", GGPO_KERNELS="native", ATEN_CPU_CAPABILITY="default")
    assert done.returncode == 1, done.stdout + done.stderr
    message = done.stderr.strip().splitlines()[-1]
    assert "fp32_logits" in message and "update" in message and "moved against kernel_golden.json" in message
    assert "DEFAULT, GGPO_KERNELS=native, native-x86_64-default" in message


def test_the_pins_win_over_a_users_kernel_variable_and_say_so():
    done = child("--check", ATEN_CPU_CAPABILITY="default", MKL_CBWR="AUTO")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"the golden hashes hold here (AVX2, GGPO_KERNELS=reproducible, reproducible-{kernels.VERSION})" in done.stdout
    assert "GGPO_KERNELS=reproducible set ATEN_CPU_CAPABILITY=avx2, MKL_CBWR=COMPATIBLE" in done.stderr


def test_another_kernel_choice_is_reported_as_moved(monkeypatch):
    kp = load_script()
    mine = dict.fromkeys(kp.RESULTS, "0" * 16)
    monkeypatch.setattr(kp, "PATHS", {"same": {}})
    assert kp.other_paths("tiny-regime", mine) == {"same": list(kp.RESULTS)}
