"""The real-model training path, checked on CPU: token-budget micro-batches give the same
update, the ratio guard keeps extreme behavior log-probs finite, the chunked log-probs equal
the full-logits ones inside the trainer, and bad GPU settings fail before any work."""
import json
import math

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from pipeline.core.config import ConfigError, load_config
from pipeline.core.errors import TrainingError
from pipeline.core.store import Store
from pipeline.dag.preflight import preflight
from pipeline.models.runtime import make_runtime
from pipeline.training import loop
from pipeline.training.losses import LossInputs, get_loss
from pipeline.training.packing import pack_groups, split_by_count
from stages import train

from tolerance import assert_same_training, rounding_tol

# --- packing -----------------------------------------------------------------------

def test_pack_groups_keeps_groups_whole_and_under_budget():
    widths = {0: 10, 1: 40, 2: 25, 3: 40, 4: 5, 5: 90}
    groups = [3, 0, 5, 1, 4, 2]
    batches = pack_groups(groups, widths, rows_per_group=2, budget=170)
    assert sorted(g for b in batches for g in b) == sorted(groups)        # each group exactly once
    assert batches[0] == [5]                                              # longest first
    for b in batches:
        cost = len(b) * 2 * max(widths[g] for g in b)
        assert cost <= 170 or len(b) == 1
    assert [widths[b[0]] for b in batches] == sorted((widths[b[0]] for b in batches), reverse=True)
    assert pack_groups(groups, widths, 2, budget=10) == [[5], [3], [1], [2], [0], [4]]   # one group each
    assert pack_groups(groups, widths, 2, budget=10**6) == [[5, 3, 1, 2, 0, 4]]
    assert split_by_count(groups, 4) == [[3, 0, 5, 1], [4, 2]]
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack_groups(groups, widths, 2, budget=0)


SPLITS = [["train.micro_batch_groups=8"], ["train.micro_batch_groups=3"],
          ["train.micro_batch_tokens=300"], ["train.micro_batch_tokens=1000"], ["train.micro_batch_tokens=100000"]]


@pytest.mark.parametrize("method", ["grpo_tis", "ggpo"])
def test_token_budgets_give_the_same_update(tmp_path, base_manifest, pool, method):
    """Three token budgets and two group-count splits, trained in float64: the same metrics
    per update and the same weights after two updates, within rounding (tests/tolerance.py)."""
    runs = []
    for i, split in enumerate(SPLITS):
        cfg = load_config("smoke", [f"train.method={method}", "train.updates=2", "train.updates_per_step=2",
                                    "train.dtype=float64"] + split)
        m = train.run(cfg, {"base": base_manifest, "pool": pool[2]}, store=Store(tmp_path / str(i)))
        runs.append((pl.read_parquet(m.path("metrics")), load_file(m.path("weights"))))
    metrics0, weights0 = runs[0]
    for metrics, weights in runs[1:]:
        assert_same_training(metrics0, weights0, metrics, weights, lr=cfg.train.lr)
    assert metrics0["grad_norm"][0] > 0


def test_token_budget_bounds_micro_batches(pool):
    cfg = load_config("smoke", ["train.micro_batch_tokens=300"])
    p = loop.load_pool(pool[2].path("train_pool"), 8)
    groups = list(range(len(p.group_ids)))
    batches = loop.micro_batches(p, groups, cfg.train)
    widths = [max(len(p.prompt_ids[g]) + max(map(len, p.responses[g])) for g in b) for b in batches]
    assert sorted(g for b in batches for g in b) == groups
    assert all(len(b) * 8 * w <= 300 or len(b) == 1 for b, w in zip(batches, widths))
    assert len(batches) > 1


# --- the ratio guard -----------------------------------------------------------------

def _extreme_inputs(lp_beh_value: float) -> LossInputs:
    torch.manual_seed(0)
    shape = (2, 4, 5)
    lp = (-torch.rand(shape) * 2).requires_grad_(True)
    lp_beh = lp.detach() - 0.1
    lp_beh[0, 1, 2] = lp_beh_value          # one token the engine found (nearly) impossible
    return LossInputs(lp=lp, lp_beh=lp_beh, lp_ref=lp.detach() + 0.05, mask=torch.ones(shape),
                      rewards=torch.tensor([[1.0, 0, 0, 1], [0, 1, 0, 0]]), t_tot=40.0, n_seq_tot=8,
                      lp_old=lp.detach() + 0.02)


@pytest.mark.parametrize("lp_beh_value", [-100.0, float("-inf")])
@pytest.mark.parametrize("method", ["grpo", "grpo_tis", "agro", "ggpo"])
def test_ratio_guard_keeps_losses_and_gradients_finite(method, lp_beh_value):
    inp = _extreme_inputs(lp_beh_value)
    cfg = load_config("smoke", [f"train.method={method}"]).train
    loss, metrics = get_loss(method)(inp, cfg)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(inp.lp.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


def test_ratio_guard_leaves_ordinary_ratios_alone():
    """Inside +-20 the clamp is the identity: the spec's formula, exactly."""
    inp = _extreme_inputs(-1.0)
    cfg = load_config("smoke", ["train.method=grpo"]).train
    loss, _ = get_loss("grpo")(inp, cfg)
    rho = torch.exp(inp.lp - inp.lp_beh)
    adv = ((inp.rewards - inp.rewards.mean(1, keepdim=True)) / (inp.rewards.std(1, keepdim=True) + 1e-6))[..., None]
    pg = torch.maximum(-adv * rho, -adv * rho.clamp(0.8, 1.2))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * 3.0), pg)
    d = (inp.lp_ref - inp.lp).clamp(-20, 20)
    expected = (pg + 0.01 * (torch.exp(d) - d - 1).clamp(-10, 10)).sum() / 40.0
    assert torch.allclose(loss, expected, atol=1e-7)


def test_pool_with_non_finite_behavior_logprobs(tmp_path, pool):
    df = pl.read_parquet(pool[2].path("train_pool"))

    def poisoned(value):
        return df.with_columns(pl.when(pl.int_range(pl.len()) == 5)
                               .then(pl.col("behavior_logprobs").list.eval(pl.when(pl.int_range(pl.len()) == 1)
                                                                           .then(value).otherwise(pl.element())))
                               .otherwise(pl.col("behavior_logprobs")).alias("behavior_logprobs"))
    path = tmp_path / "pool.parquet"
    poisoned(float("nan")).write_parquet(path)
    with pytest.raises(TrainingError, match=r"pool\.parquet: row \(group \d+, sample 5\) has behavior log-prob nan "
                                                 r"at response token 1"):
        loop.load_pool(path, 8)
    poisoned(float("-inf")).write_parquet(path)
    p = loop.load_pool(path, 8)
    assert p.lp_beh[0][5][1] == loop.LP_BEH_FLOOR


# --- chunked log-probs inside the trainer ----------------------------------------------

def test_chunked_and_full_logprobs_train_alike(tmp_path, base_manifest, pool):
    """The same two GGPO updates (float64) through the chunked LM head and the full-logits path."""
    out = []
    for i, impl in enumerate(["full", "chunked"]):
        cfg = load_config("smoke", ["train.method=ggpo", "train.updates=2", f"train.logprob_impl={impl}",
                                    "train.logprob_chunk_tokens=37", "train.dtype=float64"])
        m = train.run(cfg, {"base": base_manifest, "pool": pool[2]}, store=Store(tmp_path / str(i)))
        out.append((pl.read_parquet(m.path("metrics")), load_file(m.path("weights"))))
    (ma, wa), (mb, wb) = out
    assert_same_training(ma, wa, mb, wb, lr=cfg.train.lr)


# --- runtime and bad settings ----------------------------------------------------------

def test_runtime_on_cpu_is_fp32_and_resolves_auto():
    rt = make_runtime(load_config("smoke").train)
    assert rt.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert rt.autocast_dtype is None and rt.reference_device.type == "cpu"
    rt16 = make_runtime(load_config("smoke", ["train.dtype=bfloat16", "train.device=cpu"]).train)
    assert rt16.autocast_dtype == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"train\.device=cuda .* no CUDA device: use train\.device=auto"):
        preflight(load_config("smoke", ["train.device=cuda"]))


def test_vllm_without_vllm_is_one_clear_error():
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match=r"rollout\.engine=vllm needs vLLM: pip install -e '\.\[gpu\]'"):
        preflight(load_config("smoke", ["rollout.engine=vllm"]))


def test_model_folder_checks(tmp_path, base_manifest):
    from stages.base_model import model_path
    src = model_path(base_manifest)
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    (no_tok / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    with pytest.raises(ConfigError, match=r"model\.name_or_path=.*no_tokenizer: the folder has no tokenizer"):
        preflight(load_config("smoke", [f"model.name_or_path={no_tok}"]))
    with pytest.raises(ConfigError, match=r"rollout\.max_new_tokens=8192 does not fit the model's context of 4096"):
        preflight(load_config("smoke", [f"model.name_or_path={src}", "rollout.max_new_tokens=8192"]))
    preflight(load_config("smoke", [f"model.name_or_path={src}"]))       # a good folder passes


def test_qwen_preset_has_the_paper_geometry():
    cfg = load_config("qwen3-1.7b")
    tc = cfg.train
    assert (cfg.rollout.group_size, tc.groups_per_update, tc.updates_per_step) == (8, 32, 8)
    assert (tc.lr, tc.beta, tc.updates, tc.eval_every) == (1e-6, 0.01, 400, 80)
    assert cfg.rollout.engine == "vllm" and cfg.eval.n_samples == 32 and len(cfg.eval.benchmarks) == 5
    assert cfg.task.name.endswith("math_train.parquet") and cfg.task.prompt == "plain"


def test_pool_records_engine_trainer_mismatch(pool, logit_scale):
    """On CPU the transformers engine and the trainer run one fp32 model with one log-prob
    convention, so the recorded mismatch is fp32 rounding (tests/tolerance.py); a convention
    error would show here."""
    summary, tol = pool[0].summary, 2 * rounding_tol(torch.float32, *logit_scale)
    assert summary["mismatch_responses"] == 64
    assert 0 <= summary["mismatch_k3"] <= tol ** 2 / 2
    assert summary["mismatch_abs_log_ratio"] <= tol
    assert summary["mismatch_ratio_outside_0.9_1.1"] == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA messages")
def test_every_missing_prerequisite_of_a_preset_in_one_list(tmp_path):
    """The paper preset on a CPU machine with a bad model and task path: device, engine,
    model and data are all named at once, not one run each."""
    with pytest.raises(ConfigError) as err:
        preflight(load_config("qwen3-1.7b", ["model.name_or_path=/nonexistent/model",
                                              f"task.name={tmp_path}/none.parquet"]))
    text = str(err.value)
    assert text.startswith("4 prerequisites are missing:"), text
    for needle in ("train.device=cuda but this torch", "rollout.engine=vllm needs vLLM",
                   "model.name_or_path=/nonexistent/model: no such folder", "none.parquet does not exist"):
        assert needle in text, (needle, text)


def test_a_hub_id_that_cannot_be_resolved_is_refused_in_preflight(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")       # as on a machine without internet
    with pytest.raises(ConfigError, match=r"model.name_or_path=Qwen/Qwen3-1.7B-Base: not a local folder, and the "
                                          r"hub id cannot be resolved here"):
        preflight(load_config("smoke", ["model.name_or_path=Qwen/Qwen3-1.7B-Base"]))


def test_top_p_below_one_is_refused_where_behavior_logprobs_matter():
    with pytest.raises(ConfigError, match=r"rollout.top_p=0.9 with train.method=grpo_tis: behavior log-probs"):
        preflight(load_config("smoke", ["rollout.top_p=0.9", "train.method=grpo_tis"]))
    preflight(load_config("smoke", ["rollout.top_p=0.9", "train.method=ggpo"]))     # GGPO reads none


def test_paper_preset_rollout_runs_on_cpu_past_its_training_file(base_manifest):
    """The qwen3-1.7b preset from the shipped data (nothing outside the project), with the tiny model and CPU
    settings: the MATH train file loads, its 2 answerless rows are skipped and counted."""
    import subprocess

    from stages.base_model import model_path

    from conftest import BIN, REPO
    res = subprocess.run([str(BIN / "ggpo"), "stage", "rollout", "--preset", "qwen3-1.7b", "--no-track",
                          "--set", f"model.name_or_path={model_path(base_manifest)}", "--set", "rollout.engine=hf",
                          "--set", "train.device=cpu", "--set", "model.threads=1", "--set", "task.n_train=2",
                          "--set", "rollout.max_new_tokens=8", "--set", "rollout.mismatch_sample=0"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("  summary "))[10:])
    assert (summary["prompts"], summary["task_rows"], summary["task_rows_skipped"]) == (2, 12000, 2)


def test_a_bf16_reference_keeps_fp32_rotary_frequencies_at_long_positions():
    """The bf16 reference casts parameters only: its rotary inv_freq stays fp32, and its
    log-probs up to position 4,096 equal the fp32 policy's under the same autocast. Module.to
    (what the runtime once did) also casts the buffer, and that moves them: the check can fail."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipeline.training.policy import make_batch, token_logprobs
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, intermediate_size=64, max_position_embeddings=8192)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():        # sharp attention, so positions matter (random init is nearly uniform)
        for p in model.parameters():
            p.normal_(0.0, 0.5) if p.dim() > 1 else p.fill_(1.0)
    rt = make_runtime(load_config("smoke", ["train.dtype=bfloat16", "train.device=cpu"]).train)
    import copy
    reference = rt.prepare_reference(copy.deepcopy(model))
    cast_buffers = copy.deepcopy(reference)
    for name, b in cast_buffers.named_buffers():
        if "inv_freq" in name:
            b.data = b.data.to(torch.bfloat16)
    assert all(b.dtype == torch.float32 for n, b in reference.named_buffers() if "inv_freq" in n)
    ids = torch.randint(0, 64, (4096,), generator=torch.Generator().manual_seed(1)).tolist()
    batch = make_batch([ids[:8]], [ids[8:]], pad_id=0)
    with torch.no_grad(), rt.autocast():
        lp = [token_logprobs(m, batch, 1.0)[0][0, 1024:] for m in (reference, model, cast_buffers)]
    assert torch.equal(lp[0], lp[1])
    moved = (lp[2] - lp[1]).abs().mean()
    print(f"\nmean |log-prob change| from casting inv_freq to bf16, positions 1,032-4,095: {moved:.4f}")
    assert moved > 1e-2                                 # the buffer cast moves long-range log-probs


def test_the_reference_computes_what_the_policy_computes_at_update_0_and_after_a_refresh(base_manifest, pool):
    """Under bf16 autocast (here the CPU's) the reference is built (loop.new_state) and
    refreshed (one_update at t_ref) so that its token log-probs equal the fp32 policy's bit
    for bit: the log ratio to the reference is exactly 0 at update 0 and right after each
    refresh, and non-zero between. A reference whose every parameter is bf16 runs its
    residual stream in bf16 and is off by ~1e-2 nat a token (summed over a response, up to
    nats: enough to reorder GGPO's weights among successes)."""
    from pipeline.models.runtime import cast_parameters
    from pipeline.training.pool import batch
    from stages.base_model import model_path
    cfg = load_config("smoke", ["train.dtype=bfloat16", "train.device=cpu", "train.t_ref=2",
                                "train.method=ggpo", "train.lr=1e-3"])
    rt = make_runtime(cfg.train)
    assert rt.autocast_dtype == torch.bfloat16 and rt.param_dtype == torch.float32
    pl_pool = loop.load_pool(pool[2].path("train_pool"), cfg.rollout.group_size, cfg.train.needs_behavior_logprobs())
    groups = list(range(min(4, len(pl_pool.group_ids))))
    st = loop.new_state(cfg, model_path(base_manifest), model_path(base_manifest), rt)
    b = batch(pl_pool, groups, 0, rt.packed)

    def ell(reference) -> torch.Tensor:          # per response: sum_t lp - lp_ref
        with torch.no_grad():
            lp, _ = loop.policy_logprobs(st.model, b, rt, cfg.rollout.temperature)
            ref, _ = loop.policy_logprobs(reference, b, rt, cfg.rollout.temperature, device=rt.reference_device)
        return ((lp - ref) * b.mask).sum(-1)

    assert torch.equal(ell(st.reference), torch.zeros(b.mask.shape[0]))
    assert all(p.dtype == torch.float32 for p in st.model.parameters())
    assert {p.dtype for p in st.reference.parameters()} == {torch.float32, torch.bfloat16}   # Linear weights bf16
    import copy
    all_bf16 = cast_parameters(copy.deepcopy(st.reference), torch.bfloat16)     # the reference as it was
    print(f"\nall-bf16 reference at update 0: |ell| up to {ell(all_bf16).abs().max():.4f} nat")
    assert ell(all_bf16).abs().max() > 0
    for u in range(2):
        loop.one_update(st, loop.TrainContext(cfg, pl_pool, rt, 0), groups)
        if u == 0:
            assert ell(st.reference).abs().max() > 0           # the policy moved, the reference did not
    assert torch.equal(ell(st.reference), torch.zeros(b.mask.shape[0]))     # refreshed after update 2


@pytest.mark.parametrize("temperature", [2.5, 3.0])
def test_temperature_outside_vllms_range_is_refused_in_preflight(temperature):
    with pytest.raises(ConfigError, match=rf"rollout.temperature={temperature}: vLLM accepts temperatures in \[0, 2\]"):
        preflight(load_config("smoke", ["rollout.engine=vllm", f"rollout.temperature={temperature}"]))


def test_fsdp_keeps_fp32_parameters_unless_asked():
    """Under FSDP the default matches one process (fp32 parameters, bf16 autocast); bf16
    parameters only with train.fsdp_param_dtype=bfloat16."""
    from pipeline.training.distributed import mixed_precision
    assert mixed_precision(torch.bfloat16, "float32").param_dtype is None
    assert mixed_precision(torch.bfloat16, "bfloat16").param_dtype == torch.bfloat16
    assert mixed_precision(None, "bfloat16").param_dtype is None
    assert load_config("smoke").train.fsdp_param_dtype == "float32"


# --- padding-free micro-batches, the reference cache, one host sync per update ---------------

def _lm(tied: bool, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64, tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.set_attn_implementation("sdpa")
    return model.to(dtype)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_rows_give_the_padded_logprobs_and_gradients(tied, dtype):
    """Rows of very different lengths, padded [B, L] and packed [1, sum] (position ids
    restarting per row, no mask): the same log-probs and parameter gradients within the
    dtype's rounding (two computations; scale: the largest logit / gradient, terms: the
    longest sum, the vocabulary), for tied and untied heads."""
    from pipeline.training.policy import make_batch, token_logprobs

    from tolerance import assert_close
    model = _lm(tied, dtype)
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(3, 300, (n,), generator=g).tolist()    # noqa: E731
    prompts, responses = [ids(5), ids(9), ids(2)], [ids(40), ids(3), ids(17)]
    out = {}
    for packed in (False, True):
        b = make_batch(prompts, responses, 0, packed=packed)
        lp, _ = token_logprobs(model, b, 0.7, impl="chunked", chunk_tokens=16)
        coef = torch.randn(lp.shape, generator=torch.Generator().manual_seed(4), dtype=dtype) * b.mask
        (lp * coef).sum().backward()
        out[packed] = (lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    (lp_pad, g_pad), (lp_pack, g_pack) = out[False], out[True]
    assert make_batch(prompts, responses, 0, packed=True).input_ids.shape == (1, 5 + 40 + 9 + 3 + 2 + 17)
    with torch.no_grad():
        z = model(input_ids=make_batch(prompts, responses, 0).input_ids).logits.abs().max().item() / 0.7
    assert_close(lp_pack, lp_pad, dtype, z, 32, "log-probs", computations=2)
    scale = max(v.abs().max().item() for v in g_pad.values())
    for name in g_pad:
        assert_close(g_pack[name], g_pad[name], dtype, scale, 300, f"grad {name}", computations=2)


def test_packed_training_equals_padded_training(tmp_path, base_manifest, pool):
    """Two GRPO+TIS updates (float64) with packed micro-batches under a token budget and
    with padded ones: the same metrics and weights within rounding."""
    runs = []
    for i, packing in enumerate(["off", "on"]):
        cfg = load_config("smoke", ["train.method=grpo_tis", "train.updates=2", "train.dtype=float64",
                                    "train.micro_batch_tokens=600", f"train.packing={packing}"])
        m = train.run(cfg, {"base": base_manifest, "pool": pool[2]}, store=Store(tmp_path / str(i)))
        runs.append((pl.read_parquet(m.path("metrics")), load_file(m.path("weights"))))
    assert_same_training(*runs[0], *runs[1], lr=cfg.train.lr)
    assert dag_key_of(cfg, "train.packing=off") == dag_key_of(cfg, "train.packing=on")    # placement, not content


def dag_key_of(cfg, override: str) -> str:
    from pipeline.dag import graph
    return graph.expected_key("train", cfg.updated(dict([override.split("=")])))


def test_the_reference_cache_changes_nothing_and_saves_forwards(tmp_path, base_manifest, pool):
    """GGPO with a refresh every 3 updates over a pool it revisits (36 groups, 8 per update,
    10 updates): cached and uncached reference log-probs give byte-identical weights and
    metrics on CPU; the cache computed each group once per reference window."""
    runs = []
    for i, cached in enumerate(["true", "false"]):
        cfg = load_config("smoke", ["train.method=ggpo", "train.updates=10", "train.t_ref=3",
                                    f"train.reference_cache={cached}"])
        m = train.run(cfg, {"base": base_manifest, "pool": pool[2]}, store=Store(tmp_path / str(i)))
        runs.append(m)
    cached, uncached = runs
    assert cached.files["weights"].sha256 == uncached.files["weights"].sha256
    assert pl.read_parquet(cached.path("metrics")).drop("seconds").equals(
        pl.read_parquet(uncached.path("metrics")).drop("seconds"))
    assert uncached.summary["reference_forwards"] == 80 and uncached.summary["reference_cache_hits"] == 0
    assert cached.summary["reference_cache_hits"] > 0
    assert cached.summary["reference_forwards"] + cached.summary["reference_cache_hits"] == 80


def test_an_update_reads_the_device_once(base_manifest, pool, monkeypatch):
    """Loss, metrics and diagnostics stay tensors until the update ends: the project's code
    converts a tensor to host values once per update (to_host's tolist), whatever the
    micro-batches. (transformers' sdpa mask builder reads a padded batch's attention mask;
    packed batches have none.)"""
    import sys

    from pipeline.training.loop import new_state, run_update
    from pipeline.training.pool import load_pool
    from stages.base_model import model_path
    cfg = load_config("smoke", ["train.method=grpo_tis", "train.micro_batch_groups=3"])
    rt = make_runtime(cfg.train)
    st = new_state(cfg, model_path(base_manifest), model_path(base_manifest), rt)
    p = load_pool(pool[2].path("train_pool"), 8)
    groups = list(range(8))
    ctx = loop.TrainContext(cfg, p, rt, 0)
    st.lp_old = loop.step_anchor(st.model, ctx, groups)
    calls = []

    def ours() -> bool:      # called from the project's own code (pipeline/, stages/)?
        caller = sys._getframe(2).f_code.co_filename
        return "/site-packages/" not in caller and ("/pipeline/" in caller or "/stages/" in caller)
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k:
                            (calls.append(_n) if ours() else None, _o(self, *a, **k))[1])
    row = run_update(st, ctx, groups)
    monkeypatch.undo()
    assert calls == ["tolist"], calls
    assert math.isfinite(row["loss"]) and len(row["seq_log_ratio"]) == 64


def test_auto_packs_on_cuda_with_flex_attention_when_flash_attn_is_absent(monkeypatch):
    """train.packing=auto on a GPU without flash-attn (the pinned stack installs none) packs
    with flex attention instead of silently padding; flash-attn's varlen kernels when present."""
    import importlib.util

    from pipeline.models import runtime
    real = importlib.util.find_spec
    cuda = torch.device("cuda")
    for flash, expected in ((False, (True, "flex_attention")), (True, (True, "flash_attention_2"))):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, flash=flash: (object() if flash else None) if name == "flash_attn"
                            else real(name, *a))
        assert runtime.packing_plan("auto", cuda) == expected
        assert runtime.packing_plan("on", cuda) == expected
        assert runtime.packing_plan("off", cuda) == (False, None)
    assert runtime.packing_plan("auto", torch.device("cpu")) == (False, None)
    assert runtime.packing_plan("on", torch.device("cpu")) == (True, "sdpa")


def test_packed_rows_reach_a_varlen_attention_with_their_boundaries_once():
    """A flash-style varlen attention (registered here: it isolates rows by cu_seq_lens
    alone, as flash_attn_varlen_func does, and gets no mask) receives in every layer the
    boundaries make_batch built on the host, as flash attention's kwargs; with them the
    packed log-probs equal the padded ones within rounding. Without them transformers'
    flash path would rebuild the boundaries from position_ids in each layer (a
    device-to-host read per layer)."""
    from transformers import AttentionInterface

    from pipeline.training.policy import make_batch, token_logprobs

    from tolerance import assert_close
    seen = []

    def varlen(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
        seen.append((cu, longest, attention_mask))
        assert cu is not None and torch.equal(cu, kwargs["cu_seq_lens_k"]) and isinstance(longest, int)
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
        bounds = cu.tolist()
        out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling)
            for a, b in zip(bounds[:-1], bounds[1:])], dim=2)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("ggpo_test_varlen", varlen)
    model = _lm(True, torch.float64)
    g = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(3, 300, (n,), generator=g).tolist()    # noqa: E731
    prompts, responses = [ids(4), ids(7), ids(2)], [ids(30), ids(5), ids(12)]
    padded = make_batch(prompts, responses, 0)
    with torch.no_grad():
        lp_pad, _ = token_logprobs(model, padded, 0.7)
        z = model(input_ids=padded.input_ids).logits.abs().max().item() / 0.7
        model.set_attn_implementation("ggpo_test_varlen")
        packed = make_batch(prompts, responses, 0, packed=True)
        lp_pack, _ = token_logprobs(model, packed, 0.7)
    assert packed.cu_seq_lens.tolist() == [0, 34, 46, 60] and packed.max_length == 34
    assert len(seen) == model.config.num_hidden_layers
    assert all(torch.equal(cu, packed.cu_seq_lens) and n == 34 and mask is None for cu, n, mask in seen)
    assert_close(lp_pack, lp_pad, torch.float64, z, 32, "varlen packed vs padded", computations=2)
