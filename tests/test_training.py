"""Training robustness: SIGKILL and resume, non-finite updates, bad pools and configs."""
import subprocess

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from pipeline.core.config import ConfigError, load_config
from pipeline.core.errors import NonFiniteUpdate, TrainingError
from pipeline.core.store import MANIFEST, Store
from pipeline.dag import graph
from pipeline.training import checkpoint, loop
from stages import train

from conftest import BIN, REPO, sigkill_after_checkpoint
from tolerance import rounding_tol

KILL_CFG = ["train.updates=12", "train.checkpoint_every=2", "train.method=grpo_tis", "train.updates_per_step=3"]


def test_sigkill_then_rerun_resumes_bit_exact(tmp_path, base_manifest, pool):
    """`ggpo stage train` is SIGKILLed after a checkpoint; the same command resumes and
    ends with the uninterrupted run's weights, bit for bit (GRPO+TIS: lp_old resumes too)."""
    cfg = load_config("smoke", KILL_CFG)
    argv = [str(BIN / "ggpo"), "stage", "train", "--preset", "smoke", "--no-track"]
    for item in KILL_CFG:
        argv += ["--set", item]
    folder = Store().folder("train", graph.expected_key("train", cfg))
    sigkill_after_checkpoint(argv, folder / "checkpoints", 2, 12)
    assert not (folder / MANIFEST).exists()
    resumed = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after update" in resumed.stderr
    straight = train.run(cfg, {"base": base_manifest, "pool": pool[2]}, store=Store(tmp_path))
    done = Store().load("train", straight.key)
    wa, wb = load_file(straight.path("weights")), load_file(done.path("weights"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    metrics = pl.read_parquet(done.path("metrics"))
    assert metrics["update"].to_list() == list(range(1, 13))
    assert metrics.drop("seconds").equals(pl.read_parquet(straight.path("metrics")).drop("seconds"))


def test_non_finite_update_stops_with_update_and_method(tmp_path, base_manifest, pool, monkeypatch):
    real, calls = loop.get_loss, []

    def poisoned(method):
        fn = real(method)

        def wrapped(inp, cfg):
            calls.append(1)
            loss, metrics = fn(inp, cfg)
            return (loss * float("nan") if len(calls) > 8 else loss), metrics   # from update 5 on
        return wrapped
    monkeypatch.setattr(loop, "get_loss", poisoned)
    cfg = load_config("smoke", ["train.method=agro", "train.micro_batch_groups=4", "train.updates=6"])  # 2 per update
    store = Store(tmp_path)
    with pytest.raises(NonFiniteUpdate, match=r"update 5 \(method agro\): non-finite"):
        train.run(cfg, {"base": base_manifest, "pool": pool[2]}, store=store)
    state = checkpoint.load(store.folder("train", graph.expected_key("train", cfg)) / "checkpoints")
    assert state["update"] == 4 and all(torch.isfinite(v).all() for v in state["model"].values())


def test_pool_without_behavior_logprobs(tmp_path, pool):
    df = pl.read_parquet(pool[2].path("train_pool"))
    broken = df.with_columns(pl.when(pl.int_range(pl.len()) == 3).then(None)
                             .otherwise(pl.col("behavior_logprobs")).alias("behavior_logprobs"))
    path = tmp_path / "pool.parquet"
    broken.write_parquet(path)
    for method in ("grpo_tis", "grpo"):       # importance weights; the behavior anchor
        with pytest.raises(TrainingError, match=rf"pool\.parquet: column behavior_logprobs is empty in row \(group \d+, "
                                                rf"sample 3\) and 0 more, but train.method={method} \(.*\) reads it$"):
            loop.load_pool(path, 8, load_config("smoke", [f"train.method={method}"]).train)
    for sets in (["train.method=ggpo"], ["train.method=agro"], ["train.method=grpo", "train.anchor=old"]):
        loaded = loop.load_pool(path, 8, load_config("smoke", sets).train)     # never read them
        assert loaded.lp_beh is None and not loaded.has_behavior              # and never get zeros
        with pytest.raises(TrainingError, match="no behavior log-probs"):
            loaded.behavior(0)
    assert load_config("smoke", ["train.method=grpo_tis"]).train.needs_behavior_logprobs()
    assert not load_config("smoke", ["train.method=ggpo"]).train.needs_behavior_logprobs()


@pytest.mark.parametrize("bad, needle", [
    (["train.method=ppo"], "method"),
    (["train.beta=-0.1"], "beta"),
    (["train.method=ggpo", "train.beta=0"], "beta must be > 0 for ggpo"),
    (["train.t_ref=0"], "t_ref"),
    (["train.method=agro", "train.ggpo_clip_delta=0.05"], "ggpo_clip_delta applies to method 'ggpo'"),
])
def test_bad_training_config_fails_before_training(bad, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("smoke", bad)


def test_reference_refresh_defaults_and_schedule(tmp_path, base_manifest, pool, logit_scale):
    assert [load_config("tiny", [f"train.method={m}"]).train.refresh_every() for m in ("grpo", "grpo_tis", "agro", "ggpo")] \
        == [None, None, 160, 160]
    cfg = load_config("smoke", ["train.method=ggpo", "train.t_ref=2", "train.lr=1e-4"])   # ell well above rounding
    m = train.run(cfg, {"base": base_manifest, "pool": pool[2]}, store=Store(tmp_path))
    metrics = pl.read_parquet(m.path("metrics"))
    assert metrics["ref_refreshed"].to_list() == [False, True, False, True]
    # right after a refresh the reference equals the learner, so the next update's ell (a sum
    # over a response's tokens of two fp32 computations of one log-prob) is rounding only
    tol = metrics["response_length"][2] * 2 * rounding_tol(torch.float32, *logit_scale)
    assert abs(metrics["mean_ell"][2]) <= tol < abs(metrics["mean_ell"][1])
