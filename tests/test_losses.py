"""Losses and diagnostics against docs/math.md section 12: its golden values (float64)."""
import math

import pytest
import torch

from pipeline.core.config import TrainConfig
from pipeline.training.diagnostics import micro_batch_stats, normalized_ess
from pipeline.training.losses import (
    LossInputs,
    agro_coefficients,
    agro_loss,
    get_loss,
    ggpo_coefficients,
    ggpo_group_loss,
    ggpo_loss,
    group_advantages,
    grpo_loss,
    grpo_tis_loss,
)

LP = [[-0.5, -1.2, -0.3], [-2.0, -0.7], [-0.9, -0.4, -1.1], [-1.5]]
D_OLD = [[0.10, -0.06, 0.00], [0.30, 0.00], [-0.25, 0.02, 0.07], [0.00]]
D_BEH = [[0.02, -0.01, 0.00], [-0.80, 0.03], [0.01, 0.00, -0.02], [0.05]]
D_REF = [[0.20, 0.10, -0.10], [-0.30, 0.20], [0.40, -0.20, 0.10], [-0.60]]


def pad(rows):
    t = torch.zeros(1, 4, 3, dtype=torch.float64)
    for i, r in enumerate(rows):
        t[0, i, :len(r)] = torch.tensor(r, dtype=torch.float64)
    return t


def golden_inputs() -> LossInputs:
    lp = pad(LP).requires_grad_(True)
    old = pad(LP) + pad(D_OLD)
    return LossInputs(lp=lp, lp_beh=old + pad(D_BEH), lp_ref=pad(LP) + pad(D_REF),
                      mask=pad([[1.0] * len(r) for r in LP]), rewards=torch.tensor([[1.0, 0, 1, 0]], dtype=torch.float64),
                      t_tot=9, n_seq_tot=4, lp_old=old)


def grads(inp: LossInputs, loss):
    loss.backward()
    return [inp.lp.grad[0, i, :len(r)].tolist() for i, r in enumerate(LP)]


def assert_rows(got, expected):
    for g, e in zip(got, expected):
        assert g == pytest.approx(e, abs=1e-5)


def test_advantages_ddof1():
    a = group_advantages(torch.tensor([[1.0, 0, 1, 0]], dtype=torch.float64), 1e-6)
    assert a[0].tolist() == pytest.approx([0.866024, -0.866024, 0.866024, -0.866024], abs=1e-5)


def test_grpo_plain_token_mean_golden():
    inp = golden_inputs()
    loss, metrics = grpo_loss(inp, TrainConfig())
    assert loss.item() == pytest.approx(-0.242133, abs=1e-5)
    assert_rows(grads(inp, loss), [[-0.08559, -0.103319, -0.096119], [0.158936, 0.093135],
                                   [-0.000546, -0.094118, -0.091649], [0.092033]])
    assert 0 < metrics["clip_frac"] < 1 and metrics["kl_ref_k3"] > 0


def test_grpo_seq_mean_token_mean_golden():
    inp = golden_inputs()
    loss, _ = grpo_loss(inp, TrainConfig(aggregation="seq-mean-token-mean"))
    assert loss.item() == pytest.approx(0.050483, abs=1e-5)
    assert_rows(grads(inp, loss), [[-0.064192, -0.077489, -0.072089], [0.178803, 0.104777],
                                   [-0.00041, -0.070589, -0.068737], [0.207075]])


def test_micro_batches_sum_to_the_update():
    """Token-mean over the update: splitting groups across micro-batches changes nothing."""
    torch.manual_seed(0)
    G, m, T = 4, 4, 5
    lp = (-torch.rand(G, m, T, dtype=torch.float64)).requires_grad_(True)
    mask = (torch.rand(G, m, T) > 0.2).double()
    base = dict(lp_beh=lp.detach() + 0.05, lp_ref=lp.detach() - 0.1, mask=mask,
                rewards=torch.randint(0, 2, (G, m)).double(), t_tot=float(mask.sum()), n_seq_tot=G * m)
    whole, _ = grpo_loss(LossInputs(lp=lp, **base), TrainConfig())
    parts = sum(grpo_loss(LossInputs(lp=lp[s], **{k: (v[s] if torch.is_tensor(v) else v) for k, v in base.items()}),
                          TrainConfig())[0] for s in (slice(0, 1), slice(1, 4)))
    assert whole.item() == pytest.approx(parts.item(), abs=1e-12)


def test_registry_rejects_unknown_method():
    assert get_loss("grpo") is grpo_loss and get_loss("ggpo") is ggpo_loss
    with pytest.raises(ValueError, match="known: agro, cispo, decoupled_ppo, dppo_kl, dppo_tv, geo_mask, ggpo, gmpo, grpo, grpo_tis, gspo, icepop, m2po, opmd, opsm, plain_is, sapo, tis_seq, topr, vespo"):
        get_loss("ppo")


# ---- 12.5 golden minibatch: the other methods -------------------------------------------

def test_tis_weights_and_loss_golden():
    inp = golden_inputs()
    w = torch.clamp(torch.exp(inp.lp_old - inp.lp_beh), max=2.0)
    assert_rows([w[0, i, :len(r)].tolist() for i, r in enumerate(LP)],
                [[0.980199, 1.01005, 1.0], [2.0, 0.970446], [0.99005, 1.0, 1.020201], [0.951229]])
    loss, metrics = grpo_tis_loss(inp, TrainConfig(method="grpo_tis"))
    assert loss.item() == pytest.approx(-0.245672, abs=1e-5)
    assert_rows(grads(inp, loss), [[-0.08559, -0.103319, -0.096119], [0.000288, 0.093135],
                                   [-0.000546, -0.094118, -0.091649], [0.092033]])
    assert metrics["trunc_frac"] == pytest.approx(1 / 9)


def test_agro_golden():
    inp = golden_inputs()
    loss, _ = agro_loss(inp, TrainConfig(method="agro"))
    assert loss.item() == pytest.approx(0.015378, abs=1e-5)
    a = [0.67, -0.667333, 0.671333, -0.674]
    assert_rows(grads(inp, loss), [[-a[i] / 9] * len(r) for i, r in enumerate(LP)])


def test_ggpo_golden_raw_weights_coefficients_and_loss():
    inp = golden_inputs()
    ell = ((inp.lp - inp.lp_ref) * inp.mask).sum(-1).detach()
    assert ell[0].tolist() == pytest.approx([-0.2, 0.1, -0.3, 0.6], abs=1e-9)
    for beta, raw in [(0.01, 0.496081), (0.1, 0.460813)]:
        assert ggpo_group_loss(inp.rewards - beta * ell, beta).item() == pytest.approx(raw, abs=1e-5)
    w, c_hat = ggpo_coefficients(inp.rewards - 0.01 * ell, 0.01)
    assert w[0].tolist() == pytest.approx([0.475021, 0, 0.524979, 0], abs=1e-5)
    assert c_hat[0].tolist() == pytest.approx([0.519663, -0.57735, 0.635037, -0.57735], abs=1e-5)
    loss, _ = ggpo_loss(inp, TrainConfig(method="ggpo"))
    assert loss.item() == pytest.approx(12.729445, abs=1e-5)
    c = [0.05774, -0.06415, 0.07056, -0.06415]
    assert_rows(grads(inp, loss), [[-c[i]] * len(r) for i, r in enumerate(LP)])


def test_ggpo_clipped_variant_golden():
    inp = golden_inputs()
    loss, _ = ggpo_loss(inp, TrainConfig(method="ggpo", ggpo_clip_delta=0.05))
    assert loss.item() == pytest.approx(0.002502, abs=1e-5)
    assert_rows(grads(inp, loss), [[-0.05774, 0, -0.05774], [0, 0.06415], [0, -0.07056, -0.07056], [0.06415]])


def test_diagnostics_golden():
    inp = golden_inputs()
    stats = micro_batch_stats(inp, 0.01)
    assert stats["k3_mismatch"] == pytest.approx(0.021389, abs=1e-5)
    assert stats["abs_log_ratio"] == pytest.approx(0.12, abs=1e-5)
    assert stats["seq_log_ratio"] == pytest.approx([-0.05, 0.47, 0.17, -0.05], abs=1e-5)
    assert normalized_ess(stats["seq_log_ratio"]) == pytest.approx(0.951367, abs=1e-5)
    assert stats["ell_sum"] / 4 == pytest.approx(0.05, abs=1e-5)
    assert stats["success_ess_sum"] / stats["success_ess_count"] == pytest.approx(0.997510, abs=1e-5)


def test_chi_square_mismatch_golden():
    """chi2_token = sum mask (rho - 1)^2 / T_tot and chi2_seq = sum_i (exp(s_i) - 1)^2 / n_seq,
    against a plain float64 loop over the golden minibatch (and s_i's hand values above)."""
    inp = golden_inputs()
    stats = micro_batch_stats(inp, 0.01)
    lp, beh, mask = (x.double().flatten(0, 1).tolist() for x in (inp.lp, inp.lp_beh, inp.mask))
    token = sum(mk * (math.exp(a - b) - 1.0) ** 2 for ra, rb, rm in zip(lp, beh, mask) for a, b, mk in zip(ra, rb, rm))
    seq = [sum(mk * (a - b) for a, b, mk in zip(ra, rb, rm)) for ra, rb, rm in zip(lp, beh, mask)]
    assert float(stats["chi2_token"]) == pytest.approx(token / inp.t_tot, rel=1e-12)
    assert float(stats["chi2_seq"]) == pytest.approx(sum((math.exp(s) - 1.0) ** 2 for s in seq) / inp.n_seq_tot, rel=1e-12)
    by_hand = sum((math.exp(s) - 1.0) ** 2 for s in (-0.05, 0.47, 0.17, -0.05)) / 4
    assert float(stats["chi2_seq"]) == pytest.approx(by_hand, abs=1e-5)


def test_entropy_golden():
    from types import SimpleNamespace

    from pipeline.training.policy import make_batch, token_logprobs
    probs = torch.tensor([0.7, 0.2, 0.1])
    model = lambda input_ids, **_: SimpleNamespace(logits=probs.log().expand(1, input_ids.shape[1], 3))
    _, entropy = token_logprobs(model, make_batch([[0]], [[1]], 2), with_entropy=True, impl="full")
    assert entropy.item() == pytest.approx(0.801819, abs=1e-5)
    # the chunked LM head: hidden state 1, head weight log p, so the logits are log p again
    head = torch.nn.Linear(1, 3, bias=False)
    head.weight.data = probs.log()[:, None]
    body = lambda input_ids, **_: SimpleNamespace(last_hidden_state=torch.ones(1, input_ids.shape[1], 1))
    chunked = SimpleNamespace(model=body, get_output_embeddings=lambda: head)
    _, entropy = token_logprobs(chunked, make_batch([[0]], [[1]], 2), with_entropy=True, impl="chunked")
    assert entropy.item() == pytest.approx(0.801819, abs=1e-5)


# ---- 12.6 ESS in log space ---------------------------------------------------------------

def test_ess_does_not_overflow():
    log_w = torch.tensor([1000.0, 0, 0, 0])
    assert torch.isnan((log_w.exp().sum() ** 2) / (4 * (log_w.exp() ** 2).sum()))   # the naive form fails
    assert normalized_ess(log_w) == pytest.approx(0.25, abs=1e-12)


# ---- 12.3 Figure 6 coefficient sums (m = 8, binary) --------------------------------------

FIG6 = {  # k: GRPO ddof1, GRPO ddof0, AGRO equal ell, GGPO c_hat beta=1e-4, and the normalized columns
    1: (2.474874, 2.645751, 1.0, 2.645751, 1.0, 1.0, 7.0),
    2: (3.240370, 3.464102, 1.714286, 2.267787, 1.3093, 1.7143, 6.0),
    3: (3.622844, 3.872983, 2.142857, 1.889822, 1.4639, 2.1429, 5.0),
    4: (3.741657, 4.0, 2.285714, 1.511858, 1.5119, 2.2857, 4.0),
    5: (3.622844, 3.872983, 2.142857, 1.133893, 1.4639, 2.1429, 3.0),
    6: (3.240370, 3.464102, 1.714286, 0.755929, 1.3093, 1.7143, 2.0),
    7: (2.474874, 2.645751, 1.0, 0.377964, 1.0, 1.0, 1.0),
}


def correct_sum(coef, k):
    return float(coef[0, :k].sum())


def fig6_row(k, m=8):
    r = torch.tensor([[1.0] * k + [0.0] * (m - k)], dtype=torch.float64)
    grpo1 = correct_sum(group_advantages(r, 1e-6), k)
    grpo0 = correct_sum((r - r.mean()) / (r.std(unbiased=False) + 1e-6), k)
    agro = correct_sum(agro_coefficients(r), k)                  # equal ell: rt = r
    ggpo = correct_sum(ggpo_coefficients(r, 1e-4)[1], k)
    return grpo1, grpo0, agro, ggpo


@pytest.mark.parametrize("k", range(1, 8))
def test_figure6_table(k):
    grpo1, grpo0, agro, ggpo = fig6_row(k)
    g1_7, _, a_7, gg_7 = fig6_row(7)
    expected = FIG6[k]
    assert [grpo1, grpo0, agro, ggpo] == pytest.approx(expected[:4], abs=1e-5)
    assert [grpo1 / g1_7, agro / a_7, ggpo / gg_7] == pytest.approx(expected[4:], abs=1e-4)


@pytest.mark.parametrize("k, by_beta", [(1, {0.01: 2.645751, 0.1: 2.645546, 1.0: 1.572871}),
                                        (4, {0.01: 1.511858, 0.1: 1.511839, 1.0: 1.368456}),
                                        (7, {0.01: 0.377964, 0.1: 0.377963, 1.0: 0.364397})])
def test_figure6_ggpo_finite_beta_unequal_ell(k, by_beta):
    r = torch.tensor([[1.0] * k + [0.0] * (8 - k)], dtype=torch.float64)
    ell = 0.5 * torch.arange(8, dtype=torch.float64)[None]
    for beta, value in by_beta.items():
        assert correct_sum(ggpo_coefficients(r - beta * ell, beta)[1], k) == pytest.approx(value, abs=1e-5)


def test_figure6_agro_unequal_ell_and_limits():
    ell = 0.5 * torch.arange(8, dtype=torch.float64)[None]
    got = [correct_sum(agro_coefficients(torch.tensor([[1.0] * k + [0.0] * (8 - k)], dtype=torch.float64) - 0.01 * ell), k)
           for k in range(1, 8)]
    assert got == pytest.approx([1.02, 1.748571, 2.185714, 2.331429, 2.185714, 1.748571, 1.02], abs=1e-5)
    one = torch.tensor([[1.0] + [0.0] * 7], dtype=torch.float64)
    assert ggpo_coefficients(one, 1e-6)[1][0].tolist() == pytest.approx([2.645751] + [-0.377964] * 7, abs=1e-5)
    for k, value in [(2, 1.133893), (7, 0.053995)]:
        r = torch.tensor([[1.0] * k + [0.0] * (8 - k)], dtype=torch.float64)
        c = ggpo_coefficients(r, 1e-4)[1][0]
        assert c[0].item() == pytest.approx(value, abs=1e-5) and c[-1].item() == pytest.approx(-0.377964, abs=1e-5)


# ---- 12.1 gradient identities on a random toy policy -------------------------------------

def toy(beta, seed=0, G=3, m=8, T=6, V=7):
    """Free logits per (group, response, position); returns (theta, inputs builder, grad log pi_i)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(G, m, T, V, dtype=torch.float64, generator=g).requires_grad_(True)
    ref_logits = torch.randn(G, m, T, V, dtype=torch.float64, generator=g)
    tokens = torch.randint(0, V, (G, m, T), generator=g)
    lengths = torch.randint(1, T + 1, (G, m), generator=g)
    mask = (torch.arange(T)[None, None] < lengths[..., None]).double()
    rewards = torch.randint(0, 2, (G, m), generator=g).double()
    rewards[:, 0], rewards[:, 1] = 1.0, 0.0                    # every group mixed

    def lp_of(logits):
        return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1) * mask

    def inputs(lp_old=None):
        lp = lp_of(theta)
        return LossInputs(lp=lp, lp_beh=lp.detach(), lp_ref=lp_of(ref_logits).detach(), mask=mask, rewards=rewards,
                          t_tot=float(mask.sum()), n_seq_tot=G * m, lp_old=lp_old)

    def grad_log_pi():   # [G, m, *theta.shape]
        seq = lp_of(theta).sum(-1)
        return torch.stack([torch.stack([torch.autograd.grad(seq[gi, i], theta, retain_graph=True)[0]
                                         for i in range(m)]) for gi in range(G)])
    return theta, inputs, grad_log_pi


def grad_of(theta, loss):
    return torch.autograd.grad(loss, theta)[0]


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0])
def test_ggpo_autograd_equals_closed_form_and_surrogates(beta):
    theta, inputs, grad_log_pi = toy(beta)
    cfg = TrainConfig(method="ggpo", beta=beta)
    inp = inputs()
    autograd = grad_of(theta, ggpo_loss(inp, cfg)[0])
    ell, rt = (lambda e: (e, inp.rewards - beta * e))(((inp.lp - inp.lp_ref) * inp.mask).sum(-1).detach())
    w, c_hat = ggpo_coefficients(rt, beta)
    c_raw = beta * (w - 1.0 / 8)
    assert c_raw.sum(1).abs().max() < 1e-15 * 100
    closed = -(c_hat[..., None, None, None, None] * grad_log_pi()).sum((0, 1)) / inp.t_tot
    assert (autograd - closed).abs().max() < 1e-12
    inp = inputs()
    surrogate = ((-c_hat[..., None] * inp.lp) * inp.mask).sum() / inp.t_tot
    assert (grad_of(theta, surrogate) - autograd).abs().max() < 1e-12
    inp = inputs()
    clipped = ggpo_loss(LossInputs(**{**inp.__dict__, "lp_old": inp.lp.detach()}),
                        TrainConfig(method="ggpo", beta=beta, ggpo_clip_delta=0.05))[0]
    assert (grad_of(theta, clipped) - autograd).abs().max() < 1e-12


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0])
def test_agro_gradient_is_the_variance_objective(beta):
    theta, inputs, grad_log_pi = toy(beta, seed=1)
    inp = inputs()
    agro_grad = grad_of(theta, agro_loss(inp, TrainConfig(method="agro", beta=beta))[0])
    inp = inputs()
    ell = ((inp.lp - inp.lp_ref) * inp.mask).sum(-1)
    rt = inp.rewards - beta * ell
    f_agro = rt.var(dim=1, unbiased=True) / (2 * beta)                                  # [G]
    m = 8
    assert (grad_of(theta, (m / inp.t_tot) * f_agro.sum()) - agro_grad).abs().max() < 1e-12
    a = agro_coefficients(rt.detach())
    assert a.sum(1).abs().max() < 1e-13
    inp = inputs()
    rt = inp.rewards - beta * ((inp.lp - inp.lp_ref) * inp.mask).sum(-1)
    f_one = rt[0].var(unbiased=True) / (2 * beta)
    closed = -(a[0, :, None, None, None, None] * grad_log_pi()[0]).sum(0) / m
    assert (grad_of(theta, f_one) - closed).abs().max() < 1e-12
