"""The reproducible kernel mode's parts: ggpo's fp32 product (pipeline/core/gemm.c) computes
each output as one fixed chain of fused multiply-adds, whatever the vector width, strides
or packing; its autograd matches float64; the mode's dispatch serves fp32 CPU tensors only;
and the bf16-emulating sampler holds bf16 values where a bf16 model stores them, with a
sampler-trainer mismatch of a native bf16 model's size."""
from __future__ import annotations

import copy

import pytest
import torch

from pipeline.core import gemm, kernels
from pipeline.core.config import load_config
from pipeline.models import numerics
from pipeline.models.tiny_model import build_model, build_tokenizer

from tolerance import rounding_tol

pytestmark = pytest.mark.skipif(gemm.unavailable() is not None, reason=f"ggpo's product: {gemm.unavailable()}")


def fma_chain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The contract, computed independently: c = fma(a[:, k], b[k], c) for k = 0..K-1, each
    step exact in float64 (a product of two fp32 values has 48 significant bits) and rounded
    once to float32."""
    c = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    for k in range(a.shape[1]):
        c = (a[:, k, None].double() * b[None, k].double() + c.double()).float()
    return c


def operands(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)


@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 300, 37), (13, 64, 129), (6, 257, 32)])
def test_each_output_is_the_contracts_chain_of_fmas(shape):
    a, b = operands(*shape)
    assert torch.equal(gemm.mm(a, b), fma_chain(a, b))     # bit for bit, across the K blocking (256)


def test_vector_width_strides_and_packing_move_no_bit(monkeypatch):
    a, b = operands(70, 384, 130, seed=1)
    wide = gemm.mm(a, b)
    monkeypatch.setenv(gemm.WIDTH_ENV, "256")
    assert gemm.width() == 256
    assert torch.equal(gemm.mm(a, b), wide)                              # AVX2's tile
    assert torch.equal(gemm.mm(a.t().contiguous().t(), b.t().contiguous().t()), wide)   # column-major views
    monkeypatch.delenv(gemm.WIDTH_ENV)
    weight = b.t().contiguous()                                          # [N, K], as nn.Linear holds it
    with torch.inference_mode():
        packed = gemm.mm_weight_t(a, weight)
        assert torch.equal(packed, wide)
    with torch.no_grad():
        weight.mul_(2)          # new values: the packed copy must follow (the version counter)
    with torch.inference_mode():
        assert torch.equal(gemm.mm_weight_t(a, weight), gemm.mm(a, weight.t()))


def test_linear_and_matmul_match_float64_in_value_and_gradient():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 96, generator=g, requires_grad=True)
    w = torch.randn(24, 96, generator=g, requires_grad=True)
    bias = torch.randn(24, generator=g, requires_grad=True)
    up = torch.randn(40, 24, generator=g)
    y = kernels.linear(x, w, bias)
    (y * up).sum().backward()
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, bias))
    y64 = torch.nn.functional.linear(x64, w64, b64)
    (y64 * up.double()).sum().backward()
    for ours, ref, terms in ((y, y64, 96), (x.grad, x64.grad, 24), (w.grad, w64.grad, 40), (bias.grad, b64.grad, 40)):
        assert ours is not None and ref is not None
        tol = rounding_tol(torch.float32, float(ref.detach().abs().max()), terms)
        assert (ours.double() - ref).abs().max().item() <= tol
    a = torch.randn(9, 33, generator=g, requires_grad=True)
    b = torch.randn(33, 5, generator=g, requires_grad=True)
    kernels.matmul(a, b).sum().backward()
    assert a.grad is not None and torch.equal(a.grad, gemm.mm(torch.ones(9, 5), b.detach().t()))


def test_the_mode_serves_fp32_cpu_tensors_only():
    assert kernels.state().mode == "reproducible" and kernels.reproducible(), kernels.state().line()
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    assert kernels.applies(x, w)
    assert not kernels.applies(x.double(), w.double()) and not kernels.applies(x.bfloat16(), w.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not kernels.applies(x, w)
    assert torch.equal(kernels.linear(x.double(), w.double()), torch.nn.functional.linear(x.double(), w.double()))
    assert kernels.fingerprint() == f"reproducible-{kernels.VERSION}"


def test_a_mistyped_mode_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "fast")
    with pytest.raises(ValueError, match="GGPO_KERNELS='fast': expected one of reproducible, native"):
        kernels.mode()


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config("tiny-regime", [])
    tokenizer = build_tokenizer()
    model = build_model(cfg.model, len(tokenizer)).eval()
    ids = torch.randint(4, len(tokenizer), (8, 24), generator=torch.Generator().manual_seed(3))
    return model, ids


@pytest.mark.parametrize("emulated", [False, True])
def test_a_weight_sync_in_place_reaches_the_packed_weights(tiny, emulated):
    """The sampler's forwards keep each weight packed while its version stays: an engine's
    in-place sync (load_weights) must move it, or the synced engine samples the old policy
    (CI on 0ff8029: the online cells resumed to other weights). The synced engine's logits
    equal those of an engine built on the new weights, bit for bit."""
    from pipeline.models.engines.hf import TransformersEngine
    model, ids = tiny
    old, new = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    fresh = copy.deepcopy(new)
    if emulated:
        old, fresh = numerics.emulate_bf16(old), numerics.emulate_bf16(fresh)
    engine = TransformersEngine.from_model(old, build_tokenizer(), [])
    with torch.inference_mode():
        before = engine.model(ids).logits
    engine.load_weights([(n, p.detach()) for n, p in new.named_parameters()])
    with torch.inference_mode():
        synced, want = engine.model(ids).logits, fresh(ids).logits
    assert not torch.equal(before, want)
    assert torch.equal(synced, want)


def test_prepared_linear_layers_keep_their_state_and_compute_nn_linear(tiny):
    model, ids = tiny
    assert all(type(m) is not torch.nn.Linear for m in model.modules())
    layer = model.model.layers[0].mlp.up_proj
    assert isinstance(layer, numerics.ReproducibleLinear) and isinstance(layer, torch.nn.Linear)
    x = torch.randn(5, layer.in_features)
    ref = torch.nn.functional.linear(x.double(), layer.weight.double())
    tol = rounding_tol(torch.float32, float(ref.abs().max()), layer.in_features)
    assert (layer(x).double() - ref).abs().max().item() <= tol


def test_the_emulated_sampler_stores_bf16_values_with_a_native_bf16_sized_mismatch(tiny):
    model, ids = tiny
    emulated = numerics.emulate_bf16(copy.deepcopy(model))
    seen: list[torch.Tensor] = []
    hook = emulated.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.extend([a[0], out]))
    with torch.inference_mode():
        lp32 = model(ids).logits.log_softmax(-1)
        lp_emu = emulated(ids).logits.log_softmax(-1)
        lp_bf16 = copy.deepcopy(model).to(torch.bfloat16)(ids).logits.float().log_softmax(-1)
    hook.remove()
    for t in [*emulated.parameters(), *seen]:
        assert t.dtype == torch.float32 and torch.equal(t, t.to(torch.bfloat16).float())
    emu_gap, bf16_gap = (lp_emu - lp32).abs().mean().item(), (lp_bf16 - lp32).abs().mean().item()
    print(f"\nmean |lp - lp_fp32|: emulated {emu_gap:.3e}, native bf16 {bf16_gap:.3e}")
    # the mismatch is bf16's rounding, not a tenth or ten times it (measured 2.87e-3 vs 2.94e-3)
    assert 0.5 * bf16_gap <= emu_gap <= 2 * bf16_gap


def test_the_reproducible_adamw_is_torchs_but_for_an_exact_square_root():
    """pipeline/training/optim.py: the same state layout as torch's AdamW, its step within fp32
    rounding of a float64 AdamW, and bit for bit torch's wherever torch's fp32 sqrt is the
    correctly rounded one (elsewhere it is an ulp off on this processor and maybe not on another)."""
    from pipeline.training.optim import AdamW, exact_sqrt

    g = torch.Generator().manual_seed(4)
    start = [torch.randn(300, generator=g), torch.randn(7, 11, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) * 1e-3 for t in start] for _ in range(3)]

    def run(cls, dtype):
        params = [t.clone().to(dtype).requires_grad_() for t in start]
        opt = cls(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
        for step in grads:
            for p, gr in zip(params, step):
                p.grad = gr.to(dtype)
            opt.step()
        return [p.detach() for p in params], opt
    ours, opt = run(AdamW, torch.float32)
    ref, _ = run(torch.optim.AdamW, torch.float64)
    for a, b in zip(ours, ref):
        assert (a.double() - b).abs().max().item() <= rounding_tol(torch.float32, float(b.abs().max()), 8)
    assert set(opt.state[opt.param_groups[0]["params"][0]]) == {"step", "exp_avg", "exp_avg_sq"}
    theirs, topt = run(torch.optim.AdamW, torch.float32)
    torch.optim.AdamW(opt.param_groups[0]["params"]).load_state_dict(opt.state_dict())   # checkpoints load either way
    # one step from equal states: equal wherever torch's sqrt is exact
    params = [t.clone().requires_grad_() for t in start]
    ours1, theirs1 = AdamW(params, lr=1e-2), torch.optim.AdamW([t.clone().requires_grad_() for t in start], lr=1e-2)
    for opt_, ps in ((ours1, params), (theirs1, theirs1.param_groups[0]["params"])):
        for p, gr in zip(ps, grads[0]):
            p.grad = gr.clone()
        opt_.step()
    for a, b, p in zip(params, theirs1.param_groups[0]["params"], params):
        v = ours1.state[p]["exp_avg_sq"]
        exact = v.sqrt() == exact_sqrt(v)
        assert torch.equal(a.detach()[exact], b.detach()[exact])
