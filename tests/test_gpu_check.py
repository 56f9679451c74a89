"""benchmarks/gpu_check.py runs on the GPU machine's bare image: torch and transformers,
plus pydantic and polars (which the device kit carries), nothing else of this project's
stack. Here every other package is made unimportable (a stub that raises), and the check's
CPU smoke run must import and finish every section. The full-size run refuses a machine
without CUDA in one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

# what the H200 image lacks and the kit does not carry (KINDS.md): none may be needed
ABSENT = ("prefect", "mlflow", "math_verify", "latex2sympy2_extended", "datasets", "ray", "vllm", "s3fs", "moto")


def test_gpu_check_runs_with_torch_transformers_pydantic_polars_only(tmp_path):
    stubs = tmp_path / "stubs"
    for name in ABSENT:
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(f"raise ImportError('{name} is not on the GPU image')\n")
    out = tmp_path / "figures.json"
    env = os.environ | {"PYTHONPATH": str(stubs)}
    res = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--quick", "--skip", "vllm", "--out", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    figures = json.loads(out.read_text())
    for section in ("environment", "model", "train", "transformers"):
        assert "error" not in figures[section], (section, figures[section])
    layouts = [u["layout"] for u in figures["train"]["updates"]]
    assert layouts == ["padded", "packed (sdpa)"], layouts
    assert all(u["mfu"] >= 0 and u["tokens_per_s"] > 0 for u in figures["train"]["updates"])
    gen = figures["transformers"]          # (b): stop ids that fire, the lean step's checks reported
    assert gen["lean_draws_the_same_tokens"] and gen["lean"] and gen["lean_checked"] and gen["rows_stopped"] > 0
    assert gen["lean_paths_checked"] == ["masked", "unmasked"]
    assert all(c["equal"] for c in gen["lean_checks"]) and {c["check"] for c in gen["lean_checks"]} == {"forward", "attention"}
    choices = {c["choice"]: c for c in figures["kernels"]["choices"]}     # (d): per SDPA choice
    assert set(choices) == {"project", "flash", "efficient", "math", "cudnn", "torch default"}
    for name, kernels in (("project", ["flash"]), ("math", ["math"]), ("torch default", ["flash"])):   # the CPU's kernels
        c = choices[name]
        assert c["generation_kernels"] == c["update_kernels"] == kernels, c
        assert c["generation_tokens_per_s"] > 0 and c["update"]["tokens_per_s"] > 0, c
    assert "No viable backend" in choices["cudnn"]["error"]            # a backend this machine lacks: said


def test_gpu_check_refuses_a_box_without_cuda_in_one_line():
    """Without --quick on a machine without CUDA the check stops before building anything:
    one line saying why and what to install, exit status 2. Cost: one torch import, ~5 s."""
    import torch
    if torch.cuda.is_available():
        import pytest
        pytest.skip("this machine has CUDA: the full check would run")
    res = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--skip", "vllm"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, (res.returncode, lines)
    assert lines[0].startswith("gpu_check: no CUDA device (this torch ") and "driver >= 580" in lines[0], lines[0]
    assert "--quick" in lines[0]


def test_driver_requirement_of_the_wheels_cuda(monkeypatch, capsys):
    """torch 2.14.0 from PyPI (+cu130) and vLLM 0.33 (cu13 libraries) need driver >= 580; a
    cu12 wheel needs >= 525.60.13. Unknown versions (no driver, a CPU build) are no verdict. An
    old driver refuses the run where torch sees no GPU, and is only said where torch runs on it.
    Cost: < 1 s."""
    import torch
    gc = _gpu_check()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(gc, "driver_version", lambda: "575.57.08")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = gc.refusal(quick=False)
    assert line.startswith("gpu_check: no usable CUDA device: NVIDIA driver 575.57.08 is older") and "\n" not in line
    assert gc.refusal(quick=True) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gc.refusal(quick=False) is None and "warning: NVIDIA driver 575.57.08" in capsys.readouterr().out
    monkeypatch.setattr(gc, "driver_version", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "sees no GPU (NVIDIA driver: none found)" in gc.refusal(quick=False)
    assert gc.driver_problem("13.0", "580.65.06") is None and gc.driver_problem("13.0", "590.1") is None
    assert "575.57.08 is older than this torch's CUDA 13.0 needs (>= 580)" in gc.driver_problem("13.0", "575.57.08")
    assert gc.driver_problem("12.8", "525.60.13") is None
    assert "(>= 525.60.13)" in gc.driver_problem("12.8", "525.60.11")
    assert gc.driver_problem(None, "470.1") is None and gc.driver_problem("13.0", None) is None


def _gpu_check():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_timed_update_follows_an_untimed_one_at_its_shape_and_a_failure_keeps_the_rest(monkeypatch):
    """Every (layout, response length) is timed after an update on the very same pool (flex
    attention compiles anew for each shape: a first update there would time the compile);
    an update that fails is recorded and the others keep their figures, and a section that
    dies midway keeps the figures it had."""
    import argparse

    import torch
    gc = _gpu_check()
    g = gc.QUICK | {"lengths": [8, 12], "groups": 2}
    calls = []

    def one_update(model, reference, opt, pool, cfg, rt, n_params, g_):
        length = len(pool.responses[0][0])
        calls.append((rt.packed, length, id(pool)))
        if rt.packed and length == 12 and sum(c[:2] == (True, 12) for c in calls) == 2:
            raise RuntimeError("a kernel that cannot run at this shape")
        return {"seconds": 1.0, "tokens_per_s": 1.0, "mfu": 0.0}
    monkeypatch.setattr(gc, "one_update", one_update)
    torch.set_num_threads(1)
    model = gc.build_model(g, torch.device("cpu"))
    args = argparse.Namespace(micro_batch_tokens=64)
    out = gc.train_section(model, g, args)
    timed = calls       # every update, in order
    for packed in (False, True):
        for length in g["lengths"]:
            mine = [i for i, c in enumerate(timed) if c[:2] == (packed, length)]
            assert len(mine) == 2 and mine[1] == mine[0] + 1 and timed[mine[0]][2] == timed[mine[1]][2]
    rows = {(u["layout"].split(" ")[0], u["response_length"]): u for u in out["updates"]}
    assert set(rows) == {("padded", 8), ("padded", 12), ("packed", 8), ("packed", 12)}
    assert "a kernel that cannot run" in rows[("packed", 12)]["error"]
    assert all("error" not in r and r["seconds"] == 1.0 for k, r in rows.items() if k != ("packed", 12))

    def dies(model, g_, args_, out):          # a section that fails after its first figures
        out["updates"] = [{"layout": "padded", "seconds": 1.0}]
        raise RuntimeError("the GPU went away")
    results = {}
    gc.guarded("train", results, dies, model, g, args, out={})
    assert results["train"]["updates"] == [{"layout": "padded", "seconds": 1.0}]
    assert "the GPU went away" in results["train"]["error"]
