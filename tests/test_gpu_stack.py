"""The GPU stack resolves to one coherent set: `make install GPU=1` installs the torch the
Makefile pins, then the project with its `gpu` extra; pip must keep that torch and find a
transformers inside vLLM's range. Checked with pip's resolver against the package index
(`pip install --dry-run --report`, nothing downloaded beyond metadata)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from conftest import REPO


def makefile_gpu_torch() -> str:
    return re.search(r"^GPU_TORCH_SPEC := (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)


def test_the_gpu_extra_resolves_with_the_pinned_torch(tmp_path):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    gpu = project["optional-dependencies"]["gpu"]
    assert gpu == ["vllm==0.33.*"]
    torch_pin = makefile_gpu_torch()
    report = tmp_path / "report.json"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                          "--report", str(report), torch_pin, *project["dependencies"], *gpu],
                         capture_output=True, text=True, timeout=900)
    if res.returncode != 0 and ("NewConnectionError" in res.stderr or "Network is unreachable" in res.stderr):
        pytest.skip("the package index is not reachable from here")
    assert res.returncode == 0, res.stderr[-3000:]
    found = {i["metadata"]["name"].lower(): i["metadata"] for i in json.loads(report.read_text())["install"]}
    vllm, torch, transformers = found["vllm"], found["torch"], found["transformers"]
    assert Version(vllm["version"]).release[:2] == (0, 33)
    assert f"torch=={torch['version']}" == torch_pin                     # pip kept the Makefile's torch
    needs = {Requirement(r).name.lower(): Requirement(r) for r in vllm.get("requires_dist", [])
             if "extra ==" not in r}
    assert needs["torch"].specifier.contains(torch["version"])
    assert needs["transformers"].specifier.contains(transformers["version"])
    assert Requirement(next(d for d in project["dependencies"] if d.startswith("transformers"))
                       ).specifier.contains(transformers["version"])
    # the project's Python floor is vLLM's
    floor = min(s.version for s in Requirement("x" + vllm["requires_python"]).specifier if s.operator == ">=")
    assert project["requires-python"] == f">={floor}"
