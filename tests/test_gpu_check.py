"""benchmarks/gpu_check.py runs on the GPU machine's bare image: torch and transformers,
plus pydantic and polars (which the device kit carries), nothing else of this project's
stack. Here every other package is made unimportable (a stub that raises), and the check's
CPU smoke run must import and finish every section."""
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
