"""`rollout.dtype`: a bf16 sampler against the fp32 trainer gives a real behavior-learner gap
on CPU (spec 9's K3 diagnostic), while the default (auto = fp32 on CPU) gives none and keeps
the smoke/tiny pool unchanged."""
import polars as pl
import pytest
import torch

from pipeline.core.config import load_config
from pipeline.core.store import Store
from pipeline.models.engines import make_engine
from pipeline.models.engines.hf import weights_dtype
from stages import filter as filt, rollout, train, verify
from stages.base_model import model_path

from tolerance import rounding_tol

TRAIN_N1 = ["train.method=grpo_tis", "train.updates=1", "train.updates_per_step=1"]


@pytest.fixture(scope="module")
def bf16_pool(tmp_path_factory, base_manifest):
    """(rollout, verify, filter) manifests of the smoke preset sampled with bf16 weights."""
    store = Store(tmp_path_factory.mktemp("bf16"))
    cfg = load_config("smoke", ["rollout.dtype=bfloat16"])
    roll = rollout.run(cfg, {"base": base_manifest}, store=store)
    ver = verify.run(cfg, {"rollout": roll}, store=store)
    return roll, ver, filt.run(cfg, {"rollout": roll, "verify": ver}, store=store), store


def test_auto_is_fp32_on_cpu_and_bf16_on_gpu(base_manifest):
    assert load_config("smoke").rollout.dtype == "auto"
    assert weights_dtype("auto", torch.device("cpu")) == torch.float32
    assert weights_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert weights_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="rollout.dtype 'float16'"):
        weights_dtype("float16", torch.device("cpu"))
    cfg = load_config("smoke", ["rollout.dtype=bfloat16"])
    engine = make_engine("transformers", model_path(base_manifest), rollout_cfg=cfg.rollout, device="cpu")
    # on the CPU a bf16 sampler is emulated (pipeline/models/numerics.py): fp32 tensors holding
    # bf16 values, so every parameter survives a round trip through bf16 unchanged
    assert engine.dtype == torch.bfloat16 and engine.model.ggpo_bf16_emulated
    for name, p in engine.model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, p.to(torch.bfloat16).float()), name
    engine = make_engine("transformers", model_path(base_manifest), rollout_cfg=cfg.rollout, device="cpu",
                         dtype="auto")        # an explicit override wins over the rollout section
    assert next(engine.model.parameters()).dtype == torch.float32


def test_bf16_sampler_shows_a_mismatch_the_fp32_default_does_not(pool, bf16_pool, logit_scale):
    fp32, bf16 = pool[0].summary, bf16_pool[0].summary
    print(f"\nrollout mismatch_k3: fp32 {fp32['mismatch_k3']:.3e}, bf16 {bf16['mismatch_k3']:.3e}; "
          f"ratio outside [0.9, 1.1]: fp32 {fp32['mismatch_ratio_outside_0.9_1.1']:.4f}, "
          f"bf16 {bf16['mismatch_ratio_outside_0.9_1.1']:.4f}")
    assert pool[0].key != bf16_pool[0].key            # a bf16 pool is its own artifact
    # fp32 sampler vs fp32 trainer: two fp32 computations of each log-prob (tests/tolerance.py);
    # K3 ~ (log rho)^2 / 2. bf16 weights round 2^16 times coarser: far outside that
    k3_fp32 = (2 * rounding_tol(torch.float32, *logit_scale)) ** 2 / 2
    assert fp32["mismatch_k3"] <= k3_fp32
    assert bf16["mismatch_k3"] > 100 * k3_fp32
    assert bf16["mismatch_k3"] > 100 * max(fp32["mismatch_k3"], 1e-12)
    assert bf16["mismatch_abs_log_ratio"] > 100 * max(fp32["mismatch_abs_log_ratio"], 1e-12)


def test_trainer_logs_the_bf16_gap_at_n1(tmp_path, base_manifest, pool, bf16_pool, logit_scale):
    """N = 1: the first update's policy is pi_0 in fp32, so its K3 against the behavior
    log-probs is the engine-trainer mismatch alone: ~0 for fp32 sampling, > 0 for bf16."""
    cfg = load_config("smoke", TRAIN_N1)
    m32 = train.run(cfg, {"base": base_manifest, "pool": pool[2]}, store=Store(tmp_path / "fp32"))
    cfg16 = load_config("smoke", TRAIN_N1 + ["rollout.dtype=bfloat16"])
    m16 = train.run(cfg16, {"base": base_manifest, "pool": bf16_pool[2]}, store=bf16_pool[3])
    k32 = pl.read_parquet(m32.path("metrics")).filter(pl.col("update") == 1)["k3_mismatch"].item()
    k16 = pl.read_parquet(m16.path("metrics")).filter(pl.col("update") == 1)["k3_mismatch"].item()
    print(f"\ntrain k3_mismatch at update 1 (N = 1): fp32 pool {k32:.3e}, bf16 pool {k16:.3e}")
    k3_fp32 = (2 * rounding_tol(torch.float32, *logit_scale)) ** 2 / 2
    assert 0 <= k32 <= k3_fp32          # K3 is computed in float64: never below 0
    assert k16 > 100 * k3_fp32
    assert k16 > 100 * max(k32, 1e-12)
