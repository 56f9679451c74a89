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
