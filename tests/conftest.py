"""Shared fixtures. Tests never touch the user's state: the cache, the state folder and
the service ports are private to the test session (free ports, so the suite passes while
a user's `ggpo up` holds 4200 and 5000)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SESSION = Path(tempfile.mkdtemp(prefix="ggpo-tests-"))
os.environ["GGPO_CACHE"] = str(_SESSION / "cache")
os.environ["GGPO_HOME"] = str(_SESSION / "home")
os.environ["GGPO_PREFECT_PORT"] = str(free_port())
os.environ["GGPO_MLFLOW_PORT"] = str(free_port())
for var in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
    os.environ.pop(var, None)


def sigkill_after_checkpoint(argv: list[str], ckpt_dir: Path, first: int, stop: int):
    """Start `argv` (a `ggpo stage` command) and SIGKILL it as soon as `ckpt_dir` holds a
    checkpoint of an update in [first, stop); returns the killed process."""
    import signal
    import subprocess
    import time

    from pipeline.training import checkpoint
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        state = checkpoint.load(ckpt_dir) if (ckpt_dir / checkpoint.NAME).exists() else None
        if state and first <= state["update"] < stop:
            proc.send_signal(signal.SIGKILL)
            break
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.02)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return proc


INTERRUPT_SET = ["train.updates=60", "train.checkpoint_every=5", "experiment.methods=[grpo]"]


def interrupt_offline_run(env: dict, seed: int, extra: list[str], deployment: bool = False):
    """`ggpo run offline --preset smoke` (60 updates of grpo), SIGINT at a random moment of
    its training (a seeded delay after the first checkpoint), then the same command again:
    (interrupted process, its stderr, the checkpoint it left, the rerun). `extra`: --set
    options that give each test its own training run; deployment: through ggpo/offline."""
    import random
    import signal
    import subprocess
    import time

    from pipeline.core.config import load_config
    from pipeline.core.store import Store
    from pipeline.dag import graph
    from pipeline.training import checkpoint
    sets = INTERRUPT_SET + extra
    argv = [str(BIN / "ggpo"), "run", "offline", "--preset", "smoke"] + [a for x in sets for a in ("--set", x)]
    argv += ["--deployment"] if deployment else []
    cfg = load_config("smoke", sets + ["train.method=grpo"])
    folder = Store().folder("train", graph.expected_key("train", cfg))
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600       # a safety net for a hung run, not a verdict
    while time.monotonic() < deadline and proc.poll() is None:
        if (folder / "checkpoints" / checkpoint.NAME).exists():
            break
        time.sleep(0.05)
    time.sleep(random.Random(seed).uniform(0.0, 2.0))
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    state = checkpoint.load(folder / "checkpoints")
    rerun = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return proc, err, state, rerun


def assert_interrupted_cleanly(proc, err: str, state: dict | None, rerun) -> None:
    """Exit 130, one `ggpo:` line (the last), no traceback, a checkpoint; the rerun resumes."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 130, err[-3000:]
    assert [ln for ln in lines if ln.startswith("ggpo:")] == [lines[-1]], err[-3000:]
    assert lines[-1].startswith("ggpo: interrupted (") and lines[-1].endswith("); rerun resumes"), lines[-1]
    assert "Traceback" not in err
    assert state is not None and 1 <= state["update"] < 60
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming after update {state['update']}" in rerun.stderr + rerun.stdout



def write_qwen3_layout(source: Path, folder: Path) -> Path:
    """A copy of the HF model folder `source` (a tied model) laid out like Qwen3-1.7B's
    checkpoint: config.json ties the embeddings, yet `lm_head.weight` is stored (a copy of
    the embedding), and the weights lie in two shards listed in model.safetensors.index.json."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    assert json.loads((source / "config.json").read_text())["tie_word_embeddings"] is True
    folder.mkdir(parents=True)
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy(f, folder / f.name)
    state = {}
    for f in sorted(source.glob("*.safetensors")):
        state |= load_file(f)
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"].clone())
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(folder / fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": {k: fname for fname, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


@pytest.fixture(autouse=True)
def no_stop_request_left_behind():
    """A stop request is process-wide (pipeline/core/interrupt.py): a test that signals and then
    fails must not leave it set, or every later stage in this process stops at once."""
    yield
    from pipeline.core import interrupt
    interrupt.reset()

@pytest.fixture(scope="session")
def smoke_cfg():
    from pipeline.core.config import load_config
    return load_config("smoke")


@pytest.fixture(scope="session")
def base_manifest(smoke_cfg):
    """The built-in tiny model (same key as the tiny preset's); built once per session."""
    from stages import base_model
    return base_model.run(smoke_cfg)


@pytest.fixture(scope="session")
def pool(smoke_cfg, base_manifest):
    """(rollout, verify, filter) manifests of the smoke preset, in the session cache."""
    from stages import filter as filt, rollout, verify
    roll = rollout.run(smoke_cfg, {"base": base_manifest})
    ver = verify.run(smoke_cfg, {"rollout": roll})
    return roll, ver, filt.run(smoke_cfg, {"rollout": roll, "verify": ver})


@pytest.fixture(scope="session")
def logit_scale(base_manifest, pool):
    """(largest |logit| of the tiny model on the smoke pool's sequences, its hidden size):
    the scale and terms of its log-probs' rounding tolerance (tests/tolerance.py)."""
    import polars as pl
    import torch

    from pipeline.models.hf import load_model
    from pipeline.training.policy import make_batch
    from stages.base_model import model_path
    model = load_model(model_path(base_manifest)).eval()
    rows = pl.read_parquet(pool[2].path("train_pool"), columns=["prompt_token_ids", "response_token_ids"])
    batch = make_batch(rows["prompt_token_ids"].to_list(), rows["response_token_ids"].to_list(), 0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return float(logits.abs().max()), model.config.hidden_size


@pytest.fixture
def store(tmp_path):
    from pipeline.core.store import Store
    return Store(tmp_path / "cache")


# ---- a user's shell with servers of its own (the bad-day tests kill them)

def api(base: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(f"{base}{path}", method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture
def shell(tmp_path, base_manifest):
    """A user's shell with its own servers (free ports) and the session's cache (the base
    model built once)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env |= {"GGPO_HOME": str(tmp_path / "home"), "GGPO_PREFECT_PORT": str(free_port()),
            "GGPO_MLFLOW_PORT": str(free_port())}
    up = subprocess.run([str(BIN / "ggpo"), "up"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    yield env
    subprocess.run([str(BIN / "ggpo"), "down"], cwd=REPO, env=env, capture_output=True, timeout=120)


def state(env: dict) -> dict:
    return json.loads((Path(env["GGPO_HOME"]) / "services.json").read_text())


def prefect_dies_mid_training(shell: dict, sets: list[str], deployment: bool = False):
    """`ggpo run offline --preset smoke` with `sets` (one grpo training, seed 12), as
    `python -m pipeline.cli` from this checkout: SIGTERM to the Prefect server's process
    group (as a crash or a redeploy would) once the training's first checkpoint exists;
    returns the running command's process (tests/test_bad_day_prefect.py, test_serve_outage.py)."""
    import signal
    import time

    from pipeline.core.config import load_config
    from pipeline.core.store import Store
    from pipeline.dag import graph
    cfg = load_config("smoke", sets + ["train.method=grpo", "seed=12"])
    ckpt = Store().folder("train", graph.expected_key("train", cfg)) / "checkpoints"
    argv = [sys.executable, "-m", "pipeline.cli", "run", "offline", "--preset", "smoke"]
    argv += [a for s in sets for a in ("--set", s)] + (["--deployment"] if deployment else [])
    proc = subprocess.Popen(argv, cwd=REPO, env=shell, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900           # a safety net for a hung run, not a verdict
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()
    os.killpg(state(shell)["pids"]["prefect"], signal.SIGTERM)     # the server, mid-training
    return proc
