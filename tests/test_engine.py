"""The transformers engine: behavior log-probs equal a teacher-forced recompute."""
import pytest
import torch

from pipeline.models.engines import SamplingParams
from pipeline.models.engines.hf import TransformersEngine
from pipeline.training.policy import make_batch, token_logprobs
from stages.base_model import model_path

from tolerance import assert_close, rounding_tol

PROMPTS = ["Q:123\nA:", "Q:98765\nA:", "Q:4\nA:", "Q:3141592\nA:"]


def recompute(engine, prompts, outs, temperature):
    flat = [(p, c) for p, group in zip(prompts, outs) for c in group]
    batch = make_batch([engine.tokenizer(p)["input_ids"] for p, _ in flat], [c.token_ids for _, c in flat],
                       engine.tokenizer.pad_token_id)
    with torch.no_grad():
        lp, _ = token_logprobs(engine.model, batch, temperature)
    recorded = torch.zeros_like(lp)
    for i, (_, c) in enumerate(flat):
        recorded[i, :len(c.logprobs)] = torch.tensor(c.logprobs)
    return lp, recorded, batch.mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_teacher_forced(base_manifest, temperature, logit_scale):
    engine = TransformersEngine(model_path(base_manifest), batch_prompts=3)   # several batches, mixed padding
    outs = engine.generate(PROMPTS, SamplingParams(6, temperature, 1.0, 20, seed=3))
    assert [len(g) for g in outs] == [6] * len(PROMPTS)
    lp, recorded, mask = recompute(engine, PROMPTS, outs, temperature)
    assert mask.sum() > 50
    # two fp32 computations of each log-prob (KV-cached sampling, full teacher forcing)
    z, hidden = logit_scale
    assert_close(lp, recorded, torch.float32, z / temperature, hidden, "engine vs teacher-forced", computations=2)
    for c in (c for g in outs for c in g):
        assert c.finish_reason in ("stop", "length") and len(c.token_ids) == len(c.logprobs)
        assert (c.token_ids[-1] == engine.tokenizer.eos_token_id) == (c.finish_reason == "stop")


def test_stop_ids_include_the_generation_config_eos_list(base_manifest, tmp_path):
    """A model whose generation_config.json lists a second EOS (as Qwen's does): the
    transformers engine stops on it too, the ids vLLM is given (engines/base.py)."""
    import json
    import shutil

    from pipeline.models.engines import stop_token_ids
    folder = tmp_path / "model"
    shutil.copytree(model_path(base_manifest), folder)
    engine = TransformersEngine(str(folder))
    brace = engine.tokenizer("}")["input_ids"][-1]      # ends every boxed answer, just before EOS
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, brace]}))
    assert stop_token_ids(str(folder), engine.tokenizer) == sorted({2, brace})
    plain = engine.generate(PROMPTS, SamplingParams(4, 1.0, 1.0, 20, seed=5))
    stopping = TransformersEngine(str(folder)).generate(PROMPTS, SamplingParams(4, 1.0, 1.0, 20, seed=5))
    for a, b in zip((c for g in plain for c in g), (c for g in stopping for c in g)):
        cut = a.token_ids.index(brace) + 1 if brace in a.token_ids else len(a.token_ids)
        assert b.token_ids == a.token_ids[:cut]                     # the same draw, cut at the new stop
        assert b.finish_reason == ("stop" if b.token_ids[-1] in (2, brace) else "length")
    assert any(brace in a.token_ids[:-1] for g in plain for a in g)   # the case occurs


def test_engine_is_seeded(base_manifest):
    engine = TransformersEngine(model_path(base_manifest))
    a = engine.generate(PROMPTS, SamplingParams(4, 1.0, 1.0, 20, seed=5))
    b = engine.generate(PROMPTS, SamplingParams(4, 1.0, 1.0, 20, seed=5))
    c = engine.generate(PROMPTS, SamplingParams(4, 1.0, 1.0, 20, seed=6))
    ids = lambda outs: [x.token_ids for g in outs for x in g]
    assert ids(a) == ids(b) and ids(a) != ids(c)


def test_top_p_keeps_sampling_inside_nucleus(base_manifest):
    engine = TransformersEngine(model_path(base_manifest))
    outs = engine.generate(PROMPTS, SamplingParams(4, 1.0, 0.05, 20, seed=1))
    greedy = engine.generate(PROMPTS, SamplingParams(1, 0.0, 1.0, 20, seed=1))
    # a nucleus this small holds only the argmax token: sampling equals greedy decoding
    assert all(c.token_ids == g[0].token_ids for group, g in zip(outs, greedy) for c in group)


def test_generation_computes_logits_only_at_the_last_position(base_manifest):
    """The prefill's LM head runs on one position per row, not on every prompt position
    ([B, L, V] logits at Qwen3's vocabulary are gigabytes); every step after it too."""
    engine = TransformersEngine(model_path(base_manifest), batch_prompts=4)
    shapes = []
    hook = engine.model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: shapes.append(tuple(out.shape)))
    try:
        outs = engine.generate(PROMPTS, SamplingParams(2, 1.0, 1.0, 6, seed=3))
    finally:
        hook.remove()
    width = max(len(engine.tokenizer(p)["input_ids"]) for p in PROMPTS)
    assert width > 1 and len(shapes) >= 2
    # the prefill on one row per prompt (hf.shared_prefill), every step after it on every row
    assert shapes[0][:2] == (len(PROMPTS), 1), shapes
    assert all(s[:2] == (2 * len(PROMPTS), 1) for s in shapes[1:]), shapes
    assert all(len(c.token_ids) == len(c.logprobs) > 0 for g in outs for c in g)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lean", [True, False])
def test_shared_prefill_changes_no_bit(base_manifest, dtype, lean):
    """A prompt's prefill computed once for its n samples (hf.shared_prefill) gives every
    token and log-prob, bit for bit, of the prefill of all n rows: in the reproducible mode each
    row's forward is a function of that row alone (ggpo's GEMM, per-row norms and attention)."""
    engine = TransformersEngine(model_path(base_manifest), batch_prompts=4, dtype=dtype)
    engine.lean = lean
    params = SamplingParams(8, 1.0, 1.0, 20, seed=5)
    shared = engine.generate(PROMPTS, params)
    engine.share_prefill = False
    every = engine.generate(PROMPTS, params)
    assert [(c.token_ids, c.logprobs) for g in shared for c in g] == [(c.token_ids, c.logprobs) for g in every for c in g]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_finished_rows_leaving_the_batch_change_no_draw(base_manifest, monkeypatch, dtype):
    """Rows leave the batch once they stop (engines/hf._worth_shrinking); each row draws the
    tokens it draws when every row stays to the end (the pre-#26 loop): the noise is drawn for
    every original row. The log-probs are the same computation at another batch size, which
    CPU kernels may round differently: a few ulps of the weights' dtype on logits of size ~10."""
    from pipeline.models.engines import hf
    engine = TransformersEngine(model_path(base_manifest), batch_prompts=4, dtype=dtype)
    params = SamplingParams(8, 1.0, 1.0, 20, seed=11)
    shrinking = engine.generate(PROMPTS, params)
    monkeypatch.setattr(hf, "_worth_shrinking", lambda done: False)
    kept = engine.generate(PROMPTS, params)
    pairs = [(a, b) for ga, gb in zip(shrinking, kept) for a, b in zip(ga, gb)]
    assert all(a.token_ids == b.token_ids and a.finish_reason == b.finish_reason for a, b in pairs)
    assert len({len(b.token_ids) for _, b in pairs}) > 1      # rows did finish at different steps
    tol = 4 * 10 * torch.finfo(hf.weights_dtype(dtype, engine.device)).eps
    assert max(abs(x - y) for a, b in pairs for x, y in zip(a.logprobs, b.logprobs)) <= tol


def _step_side_by_side(model, prompts: list[str], tok, steps: int, shrink_at: int, room: int = 64) -> int:
    """transformers' forward and the lean decode step fed the same tokens (drawn from the
    former's logits), their logits compared bit for bit at every step; at step `shrink_at` the
    batch keeps every other row; the lean cache starts `room` columns past the prompt (a small
    one makes it grow). Returns the number of steps compared."""
    every_other = {shrink_at: lambda attn: torch.arange(0, attn.shape[0], 2)}
    _side_by_side(model, _ids(tok, prompts), tok.pad_token_id, steps, every_other, room)
    return steps


def test_models_load_without_hub_kernels(base_manifest, monkeypatch):
    """transformers >= 5.25 kernelizes every model it loads from the hub's kernels when the
    `kernels` package is installed (its own dependency). ggpo's loads keep the torch modules
    (the arithmetic numerics.py pins, the forward the lean decode step copies), here with the
    environment allowing hub kernels explicitly."""
    from pipeline.models.hf import load_model
    monkeypatch.setenv("USE_HUB_KERNELS", "YES")
    model = load_model(model_path(base_manifest))
    assert not getattr(model, "use_kernels", False)
    assert not getattr(model, "_kernels_mode", None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lean_decode_step_equals_transformers_forward_bit_for_bit(base_manifest, dtype):
    """engines/decode.LeanQwen3 copies transformers' Qwen3 forward for decoding: its logits are
    transformers' to the bit, with padded rows (a mask) and without (none), before and after
    the batch shrinks, so a seeded draw is the same whichever forward runs it."""
    from pipeline.models.engines.decode import lean_supported
    engine = TransformersEngine(model_path(base_manifest), dtype=dtype)
    assert lean_supported(engine.model)
    tok = engine.tokenizer
    assert len({len(tok(p)["input_ids"]) for p in PROMPTS}) > 1        # padded rows
    same_width = ["Q:12\nA:", "Q:34\nA:", "Q:56\nA:", "Q:78\nA:"]
    assert len({len(tok(p)["input_ids"]) for p in same_width}) == 1    # no padding: no mask
    for prompts in (PROMPTS * 4, same_width * 4):
        assert _step_side_by_side(engine.model, prompts, tok, steps=12, shrink_at=4) == 12
        assert _step_side_by_side(engine.model, prompts, tok, steps=12, shrink_at=4, room=2) == 12   # the cache grows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_decode_step_equals_transformers_forward_with_grouped_query_heads(base_manifest, dtype):
    """Qwen3 models past the tiny one share key/value heads between query heads (Qwen3-1.7B: 16
    query heads, 8 key/value heads), which transformers' SDPA function handles its own way for
    one query (pack_gqa); the lean step calls that function, so the logits still match bit for bit."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipeline.models.engines.decode import lean_supported
    tok = TransformersEngine(model_path(base_manifest)).tokenizer
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, pad_token_id=tok.pad_token_id)
    model = Qwen3ForCausalLM(config).to(dtype).eval()
    assert lean_supported(model) and model.model.layers[0].self_attn.num_key_value_groups == 2
    assert _step_side_by_side(model, PROMPTS * 4, tok, steps=10, shrink_at=3) == 10


def test_lean_sampler_draws_what_transformers_forward_draws(base_manifest):
    """The sampler with the lean decode step (the default) gives the same completions, token ids
    and log-probs exactly, as with transformers' forward; a model it does not copy (eager
    attention here) keeps transformers' forward."""
    from pipeline.models.engines.decode import HFForward, LeanQwen3, lean_supported, sampler_forward
    lean = TransformersEngine(model_path(base_manifest), batch_prompts=3, dtype="bfloat16")
    plain = TransformersEngine(model_path(base_manifest), batch_prompts=3, dtype="bfloat16", lean=False)
    for seed in (1, 2):
        params = SamplingParams(8, 1.0, 1.0, 20, seed=seed)
        a, b = lean.generate(PROMPTS, params), plain.generate(PROMPTS, params)
        rows = [(x, y) for ga, gb in zip(a, b) for x, y in zip(ga, gb)]
        assert all(x.token_ids == y.token_ids and x.logprobs == y.logprobs for x, y in rows)
        assert len({len(x.token_ids) for x, _ in rows}) > 1       # rows finished at different steps
    assert lean.lean and lean.lean_checked          # its first draw checked the lean step, and kept it
    assert isinstance(sampler_forward(lean.model, 30), LeanQwen3)
    plain.model.set_attn_implementation("eager")
    assert not lean_supported(plain.model) and isinstance(sampler_forward(plain.model, 30), HFForward)


def test_a_lean_step_that_differs_is_dropped_and_the_draw_is_transformers(base_manifest, monkeypatch, caplog):
    """Each engine's first decode step runs both forwards: a lean step whose logits differ (here
    by one ulp at one entry, as another transformers release or a GPU kernel might) is dropped
    with one warning, and the draws are transformers' forward's, token for token."""
    from pipeline.models.engines import decode
    plain = TransformersEngine(model_path(base_manifest), batch_prompts=3, dtype="bfloat16", lean=False)
    engine = TransformersEngine(model_path(base_manifest), batch_prompts=3, dtype="bfloat16")
    step = decode.LeanQwen3._step

    def off_by_one_ulp(self, *args):
        logits = step(self, *args)
        logits[0, 0] = torch.nextafter(logits[0, 0], torch.tensor(float("inf"), dtype=logits.dtype))
        return logits
    monkeypatch.setattr(decode.LeanQwen3, "_step", off_by_one_ulp)
    params = SamplingParams(8, 1.0, 1.0, 20, seed=4)
    with caplog.at_level("WARNING", logger="ggpo"):
        a = engine.generate(PROMPTS, params)
    assert not engine.lean and not engine.lean_checked
    assert sum("lean decode step's logits differ" in r.getMessage() for r in caplog.records) == 1
    b = plain.generate(PROMPTS, params)
    assert [x.token_ids for g in a for x in g] == [y.token_ids for g in b for y in g]
    assert [x.logprobs for g in a for x in g] == [y.logprobs for g in b for y in g]


# --- padding, non-finite logits, the lean step's checks (#37) ---------------------------------

def _side_by_side(model, ids: list[list[int]], pad_id: int, steps: int, shrinks: dict, room: int = 64,
                  check: bool = False, verified: set | None = None):
    """transformers' forward and the lean decode step fed the same tokens (drawn from the
    former's logits), their logits compared bit for bit at every step; at step t in `shrinks`
    the batch keeps the rows shrinks[t](attention mask) gives; returns the lean forward (its
    checks, its state)."""
    from pipeline.models.engines.decode import HFForward, LeanQwen3
    from pipeline.models.engines.hf import left_padded
    step_ids, attn, pos = left_padded(ids, pad_id, steps)
    width = step_ids.shape[1]
    hf, lean = HFForward(model), LeanQwen3(model, width + steps, room, check=check, verified=verified)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for t in range(steps):
            a, b = hf(step_ids, attn[:, :width + t], pos), lean(step_ids, attn[:, :width + t], pos)
            assert torch.equal(a, b), f"step {t}: max |diff| {(a - b).abs().max()}"
            step_ids = torch.multinomial(a.float().softmax(-1), 1, generator=gen)
            pos = pos[:, -1:] + 1
            if t in shrinks:
                keep = shrinks[t](attn)
                hf.select(keep)
                lean.select(keep)
                attn, step_ids, pos = attn[keep], step_ids[keep], pos[keep]
    return lean


def _ids(tok, prompts: list[str]) -> list[list[int]]:
    return [tok(p)["input_ids"] for p in prompts]


def _unpadded_rows(attn: torch.Tensor) -> torch.Tensor:
    return attn[:, 0].nonzero().squeeze(1)      # the rows of the longest prompt: no left padding


def _every_other(attn: torch.Tensor) -> torch.Tensor:
    return torch.arange(0, attn.shape[0], 2)


def test_lean_checks_cover_both_paths_shrinks_and_growths(base_manifest):
    """The lean step checks every attention layout it meets (masked and unmasked path, before and
    after a shrink, before and after its buffers grow) against contiguous copies, as transformers
    passes them, plus its first step against transformers' whole forward; here all agree, and its
    logits are transformers' to the bit at every step. A second draw skips what the first proved.
    Cost: two 12-step draws of 16 rows on the tiny model, ~1 s."""
    engine = TransformersEngine(model_path(base_manifest))
    tok = engine.tokenizer
    ids = _ids(tok, PROMPTS * 4)
    assert len(set(map(len, ids))) > 1                              # padded: the masked path first
    verified: set = set()
    lean = _side_by_side(engine.model, ids, tok.pad_token_id, 12, {3: _unpadded_rows, 6: _every_other}, room=2,
                         check=True, verified=verified)
    checks = lean.checks
    assert all(c["equal"] for c in checks) and lean.equal and not lean.contiguous
    assert [c["check"] for c in checks].count("forward") == 1
    attention = [c for c in checks if c["check"] == "attention"]
    assert {c["path"] for c in attention} == {"masked", "unmasked"}
    assert len({c["rows"] for c in attention}) >= 3                 # before and after each shrink
    width = max(map(len, ids))
    assert {c["columns"] for c in attention} == {width + 2, width + 12}     # before and after the buffers grew
    assert verified == {(c["path"], c["rows"], c["columns"]) for c in attention}
    again = _side_by_side(engine.model, ids, tok.pad_token_id, 12, {3: _unpadded_rows, 6: _every_other}, room=2,
                          verified=verified)
    assert again.checks == []                                       # every layout was proven already


def test_a_layout_whose_strided_views_differ_gets_contiguous_copies(base_manifest, monkeypatch):
    """Where the attention kernel gives other bits on the lean cache's strided views than on
    contiguous tensors (as a GPU kernel might; here one ulp at one entry), the check sees it,
    that step and every later one pass contiguous copies as transformers does, and the logits
    stay transformers' bit for bit. Cost: one 10-step draw, ~1 s."""
    from pipeline.models.engines import decode
    engine = TransformersEngine(model_path(base_manifest))
    tok = engine.tokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def strided_differs(module, q, k, v, mask, **kw):
        out, w = sdpa_attention_forward(module, q, k, v, mask, **kw)
        if not k.is_contiguous():
            out = out.clone()
            out.view(-1)[0] = torch.nextafter(out.view(-1)[0], torch.tensor(float("inf"), dtype=out.dtype))
        return out, w
    real_init = decode.LeanQwen3.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        self.attention = strided_differs
    monkeypatch.setattr(decode.LeanQwen3, "__init__", init)
    lean = _side_by_side(engine.model, _ids(tok, PROMPTS * 2), tok.pad_token_id, 10, {4: _every_other})
    assert lean.contiguous and lean.checks[0]["equal"] is False
    assert len(lean.checks) == 1            # once the copies are passed, nothing is left to check


def test_a_lean_step_that_falls_back_frees_its_buffers(base_manifest, monkeypatch):
    """After the first-step check finds a difference, the lean cache is dropped at once (not kept
    and copied at every shrink beside transformers' cache): no reference to its tensors is left,
    and the draw goes on with transformers' forward. Cost: a 6-step draw, < 1 s."""
    import gc
    import weakref

    from pipeline.models.engines import decode
    engine = TransformersEngine(model_path(base_manifest))
    tok = engine.tokenizer
    step = decode.LeanQwen3._step

    def off_by_one_ulp(self, *args):
        logits = step(self, *args)
        logits[0, 0] = torch.nextafter(logits[0, 0], torch.tensor(float("inf"), dtype=logits.dtype))
        return logits
    monkeypatch.setattr(decode.LeanQwen3, "_step", off_by_one_ulp)
    from pipeline.models.engines.hf import left_padded
    ids, attn, pos = left_padded(_ids(tok, PROMPTS * 2), tok.pad_token_id, 6)
    width = ids.shape[1]
    hf, lean = decode.HFForward(engine.model), decode.LeanQwen3(engine.model, width + 6, check=True)
    with torch.inference_mode():
        lean(ids, attn[:, :width], pos)
        buffers = [weakref.ref(t) for t in lean.keys + lean.values]
        assert buffers
        hf(ids, attn[:, :width], pos)
        step_ids, pos = torch.full((ids.shape[0], 1), 7), pos[:, -1:] + 1
        for t in range(1, 6):
            assert torch.equal(lean(step_ids, attn[:, :width + t], pos), hf(step_ids, attn[:, :width + t], pos))
            if t == 2:
                keep = _every_other(attn)
                lean.select(keep)
                hf.select(keep)
                attn, step_ids, pos = attn[keep], step_ids[keep], pos[keep]
            pos = pos + 1
    gc.collect()
    assert lean.equal is False and lean.keys == [] and lean.values == []
    assert all(ref() is None for ref in buffers), "the lean key/value buffers are still referenced"
    assert [c["check"] for c in lean.checks] == ["attention", "forward"]      # the first step's two checks
    assert lean.checks[-1] == {"check": "forward", "step": 1, "path": "masked", "rows": 8, "columns": width + 6,
                               "equal": False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_token_prompt_gives_finite_logits_and_real_rows_as_before(base_manifest, dtype, monkeypatch):
    """Left padding to the longest prompt when the shortest is one token: every pad query has
    only pad keys. The prefill's mask lets a pad query attend to itself (decode.prefill_mask), so
    no query reaches SDPA without a key (some GPU kernels give NaN there, and a NaN pad key
    reaches real rows through P @ V): every logit is finite, each real position's logits are
    bit for bit what transformers' own mask gives (today's draws), the decode steps after it
    too, and each row equals its unpadded computation within rounding. A kernel made to give
    NaN for a query without keys shows what the mask prevents. Cost: a few forwards, < 1 s."""
    from pipeline.models.engines import decode
    from pipeline.models.engines.hf import left_padded
    from pipeline.models.hf import load_model
    model = load_model(model_path(base_manifest), dtype).eval()
    tok = TransformersEngine(model_path(base_manifest)).tokenizer
    ids = _ids(tok, ["Q:3141592\nA:", "x", "Q:4\nA:"])
    assert min(map(len, ids)) == 1 and max(map(len, ids)) > 4
    inp, attn, pos = left_padded(ids, tok.pad_token_id, 4)
    width, real = inp.shape[1], attn[:, :inp.shape[1]].bool()
    with torch.inference_mode():
        theirs = model(input_ids=inp, attention_mask=attn[:, :width], position_ids=pos).logits
        ours = model(input_ids=inp, attention_mask=decode.prefill_mask(attn[:, :width]), position_ids=pos).logits
        alone = [model(input_ids=torch.tensor([x]), position_ids=torch.arange(len(x))[None]).logits[0] for x in ids]
    assert torch.isfinite(ours).all()
    assert torch.equal(ours[real], theirs[real])
    scale = max(float(a.abs().max()) for a in alone)
    tol = 2 * rounding_tol(dtype, scale, model.config.hidden_size)
    for row, x in enumerate(alone):
        assert (ours[row, width - len(x):].double() - x.double()).abs().max() <= tol, row
    # the decode steps after it: the real rows' logits as with transformers' own prefill mask
    today, fixed = decode.HFForward(model), decode.HFForward(model)
    today.pad_safe = False
    lean = decode.LeanQwen3(model, width + 4)
    step, p = inp, pos
    with torch.inference_mode():
        for t in range(4):
            a, b, c = today(step, attn[:, :width + t], p), fixed(step, attn[:, :width + t], p), lean(step, attn[:, :width + t], p)
            assert torch.equal(a, b) and torch.equal(a, c), t
            step, p = a.argmax(-1, keepdim=True), p[:, -1:] + 1
    # a kernel that gives NaN to a query without keys: transformers' own mask lets NaN reach the
    # real rows' logits; the prefill mask never hands the kernel such a query
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    keyless = []

    def nan_without_keys(q, k, v, attn_mask=None, **kw):
        out = real_sdpa(q, k, v, attn_mask=attn_mask, **kw)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            none = ~attn_mask.any(-1, keepdim=True)                  # [b, 1, q, 1]
            keyless.append(int(none.sum()))
            out = out.masked_fill(none, float("nan"))
        return out
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", nan_without_keys)
    with torch.inference_mode():
        broken = decode.HFForward(model)
        broken.pad_safe = False
        assert not torch.isfinite(broken(inp, attn[:, :width], pos)).all()
        keyless.clear()
        assert torch.isfinite(decode.HFForward(model)(inp, attn[:, :width], pos)).all()
    assert keyless and not any(keyless)


def test_the_sampler_refuses_a_non_finite_logit(base_manifest, monkeypatch):
    """A NaN logit (a broken kernel, a diverged model) stops the draw at once with one line naming
    where it is; nothing is sampled from it or returned. Cost: a 3-step draw, < 1 s."""
    from pipeline.models.engines import decode
    from pipeline.models.engines.base import NonFiniteLogits
    engine = TransformersEngine(model_path(base_manifest), batch_prompts=4, lean=False)
    call = decode.HFForward.__call__
    calls = []

    def nan_at_third_step(self, *args):
        logits = call(self, *args)
        calls.append(1)
        if len(calls) == 3:
            logits[1, 7] = float("nan")
        return logits
    monkeypatch.setattr(decode.HFForward, "__call__", nan_at_third_step)
    with pytest.raises(NonFiniteLogits) as err:
        engine.generate(PROMPTS, SamplingParams(1, 1.0, 1.0, 10, seed=0))
    msg = str(err.value)
    assert "\n" not in msg and "not finite at new token 2" in msg and "batch row 1, token id 7: nan" in msg, msg
    assert len(calls) == 3                                          # refused at once
