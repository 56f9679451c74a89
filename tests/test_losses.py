"""GRPO against the golden minibatch of spec section 12.5 (float64)."""
import pytest
import torch

from pipeline.config import TrainConfig
from stages.train.losses import LossInputs, get_loss, group_advantages, grpo_loss

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
    assert get_loss("grpo") is grpo_loss
    with pytest.raises(ValueError, match="known: grpo"):
        get_loss("ppo")
