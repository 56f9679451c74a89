"""The off-policy corrections (pipeline/training/corrections.py) against an independent float64
implementation of each formula in docs/math.md ("Off-policy corrections"), written here as
plain per-token loops: the loss, every token's gradient coefficient d loss / d lp (read
through autograd, as tests/test_losses.py reads the existing losses') and each rule's
clipped / truncated / masked fractions, on responses of unequal lengths (padding), both signs
of advantage, and ratios inside and outside each band. Each case takes well under a second."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.core import methods
from pipeline.core.config import TrainConfig, load_config
from pipeline.core.errors import ConfigError
from pipeline.training import corrections
from pipeline.training.losses import LossInputs, get_loss

from tolerance import assert_close

G, M, T = 2, 4, 5
LENGTHS = [[5, 3, 4, 1], [2, 5, 5, 3]]
REWARDS = [[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]]    # both groups mixed: both signs of A
EXTRA_TOKENS, EXTRA_SEQS = 7.0, 3     # the update holds other micro-batches: T_tot, n_seq are global


def arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """lp in (-2, -0.05); pi/pi_old in about [0.67, 1.5] (PPO's band 0.8-1.2 cut both ways);
    pi_old/mu in about [0.08, 12] (every band here has tokens on both sides); lp_ref near lp."""
    rng = np.random.default_rng(seed)
    lp = rng.uniform(-2.0, -0.05, (G, M, T))
    old = lp - rng.uniform(-0.4, 0.4, (G, M, T))
    beh = old - rng.uniform(-2.5, 2.5, (G, M, T))
    ref = lp + rng.uniform(-0.5, 0.5, (G, M, T))
    mask = np.array([[[1.0 if t < n else 0.0 for t in range(T)] for n in row] for row in LENGTHS])
    return {"lp": lp, "old": old, "beh": beh, "ref": ref, "mask": mask, "rewards": np.array(REWARDS)}


def arrays_for(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    """arrays(seed), with lp_old <= -0.01 for DPPO-KL: its binary KL takes log(1 - pi_old), which
    a token log-prob above 0 (arrays' lp_old reaches +0.35) has no value for."""
    a = arrays(seed)
    if name == "dppo_kl":
        a["old"] = np.minimum(a["old"], -0.01)
    return a


def inputs(a: dict[str, np.ndarray]) -> LossInputs:
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in a.items()}
    return LossInputs(lp=t["lp"].clone().requires_grad_(True), lp_beh=t["beh"], lp_ref=t["ref"], mask=t["mask"],
                      rewards=t["rewards"], t_tot=float(a["mask"].sum()) + EXTRA_TOKENS, n_seq_tot=G * M + EXTRA_SEQS,
                      lp_old=t["old"])


# ---- the reference: per-token loops in float64 --------------------------------------------------

def advantage(a, g: int, i: int, cfg: TrainConfig) -> float:
    r = list(a["rewards"][g])
    mean = sum(r) / len(r)
    sd = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
    return (r[i] - mean) / (sd + cfg.eps_adv)


def ppo(adv: float, x: float, cfg: TrainConfig) -> tuple[float, float, bool]:
    """PPO with dual clip on log ratio x: (value, d value / d x, clipped)."""
    rho = math.exp(x)
    pg1, pg2 = -adv * rho, -adv * min(max(rho, 1 - cfg.eps_low), 1 + cfg.eps_high)
    value, grad = (pg1, -adv * rho) if pg1 >= pg2 else (pg2, 0.0)
    if adv < 0 and value > -adv * cfg.dual_clip:
        value, grad = -adv * cfg.dual_clip, 0.0
    return value, grad, pg2 > pg1


def tokens(a, g: int, i: int) -> range:
    return range(int(a["mask"][g, i].sum()))


def mean_over(a, key_minus: tuple[str, str], g: int, i: int) -> float:
    k1, k2 = key_minus
    ts = tokens(a, g, i)
    return sum(a[k1][g, i, t] - a[k2][g, i, t] for t in ts) / len(ts)


def m2_drops(a, cfg: TrainConfig) -> set[tuple[int, int, int]]:
    """The tokens M2PO drops: the fewest of largest (lp_beh - lp_old)^2 such that the rest's mean
    is below the threshold, all but one when no count does."""
    m2 = sorted(((a["beh"][g, i, t] - a["old"][g, i, t]) ** 2, (g, i, t))
                for g in range(G) for i in range(M) for t in tokens(a, g, i))[::-1]
    n = len(m2)
    k = next((k for k in range(n) if sum(v for v, _ in m2[k:]) / (n - k) < cfg.m2_threshold), n - 1)
    return {where for _, where in m2[:k]}


def opmd_baseline(rewards, cfg: TrainConfig) -> float:
    """b of one group: tau log(mean_j exp(r_j / tau)), or mean_j r_j."""
    if cfg.opmd_baseline == "mean":
        return sum(rewards) / len(rewards)
    return cfg.opmd_tau * math.log(sum(math.exp(x / cfg.opmd_tau) for x in rewards) / len(rewards))


def vespo_phi(a, g: int, i: int, adv: float, cfg: TrainConfig) -> float:
    """VESPO's weight of response (g, i): W^k exp(lambda (1 - W)), W from TRL's clipped sums."""
    lo = math.log(1e-8)
    s = sum(min(max(a["lp"][g, i, t] - a["old"][g, i, t], -20.0), 20.0) +
            min(max(a["old"][g, i, t] - a["beh"][g, i, t], lo), 20.0) for t in tokens(a, g, i))
    w = math.exp(min(max(s, lo), 20.0))
    k, lam = (cfg.vespo_k_pos, cfg.vespo_lambda_pos) if adv >= 0 else (cfg.vespo_k_neg, cfg.vespo_lambda_neg)
    return w ** k * math.exp(lam * (1.0 - w))


def gmpo_clip(adv: float, x: float, cfg: TrainConfig) -> tuple[float, bool]:
    """GMPO's one-sided clip of the log ratio x: (value, clipped)."""
    if adv > 0:
        return min(x, cfg.gmpo_eps_high), x > cfg.gmpo_eps_high
    return max(x, -cfg.gmpo_eps_low), adv < 0 and x < -cfg.gmpo_eps_low


# the corrections without a PPO surrogate (no PPO clip_frac)
NOT_PPO = ("cispo", "gspo", "dppo_tv", "topr", "plain_is", "sapo", "vespo", "dppo_kl", "gmpo", "opmd")


def reference(name: str, a, cfg: TrainConfig):
    """(per-token loss of the correction, its d/d lp, flags {metric: set of tokens or responses})."""
    ell, gam = np.zeros((G, M, T)), np.zeros((G, M, T))
    flags: dict[str, set] = {}
    drops = m2_drops(a, cfg) if name == "m2po" else set()

    def flag(metric, where):
        flags.setdefault(metric, set()).add(where)
    for g in range(G):
        for i in range(M):
            adv = advantage(a, g, i, cfg)
            s_beh = sum(a["old"][g, i, t] - a["beh"][g, i, t] for t in tokens(a, g, i))
            geo = math.exp(mean_over(a, ("old", "beh"), g, i))
            kl = mean_over(a, ("beh", "lp"), g, i)
            gspo_s = math.exp(mean_over(a, ("lp", "old"), g, i))
            phi = vespo_phi(a, g, i, adv, cfg) if name == "vespo" else 0.0
            gm_l = [gmpo_clip(adv, a["lp"][g, i, t] - a["old"][g, i, t], cfg) for t in tokens(a, g, i)]
            gm_r = math.exp(sum(v for v, _ in gm_l) / len(gm_l))
            opmd_a = a["rewards"][g, i] - opmd_baseline(list(a["rewards"][g]), cfg)
            for t in tokens(a, g, i):
                lp, old, beh = a["lp"][g, i, t], a["old"][g, i, t], a["beh"][g, i, t]
                pg, dpg, clipped = ppo(adv, lp - old, cfg)
                w = math.exp(old - beh)
                if clipped and name not in NOT_PPO:
                    flag("clip_frac", (g, i, t))
                if name == "tis_seq":
                    c = min(math.exp(s_beh), cfg.tis_cap)
                    value, grad = c * pg, c * dpg
                    if math.exp(s_beh) > cfg.tis_cap:
                        flag("trunc_frac", (g, i, t))
                        flag("seq_trunc_frac", (g, i))
                elif name == "icepop":
                    keep = cfg.is_threshold_low <= w <= cfg.is_threshold_high
                    value, grad = (w * pg, w * dpg) if keep else (0.0, 0.0)
                    if not keep:
                        flag("mask_frac", (g, i, t))
                elif name == "geo_mask":
                    keep = cfg.geo_mask_low <= geo <= cfg.geo_mask_high
                    value, grad = (pg, dpg) if keep else (0.0, 0.0)
                    if not keep:
                        flag("mask_frac", (g, i, t))
                        flag("seq_mask_frac", (g, i))
                elif name == "opsm":
                    drop = adv < 0 and kl > cfg.opsm_delta
                    value, grad = (0.0, 0.0) if drop else (pg, dpg)
                    if drop:
                        flag("mask_frac", (g, i, t))
                        flag("seq_mask_frac", (g, i))
                elif name == "cispo":
                    r = math.exp(lp - old)
                    rc = min(max(r, 1 - cfg.cispo_eps_clip_low), 1 + cfg.cispo_eps_clip_high)
                    value, grad = -rc * adv * lp, -rc * adv
                    if rc != r:
                        flag("clip_frac", (g, i, t))
                elif name == "gspo":
                    p1, p2 = -adv * gspo_s, -adv * min(max(gspo_s, 1 - cfg.gspo_eps_low), 1 + cfg.gspo_eps_high)
                    value, grad = (p1, -adv * gspo_s) if p1 >= p2 else (p2, 0.0)
                    if p2 > p1:
                        flag("clip_frac", (g, i, t))
                        flag("seq_clip_frac", (g, i))
                elif name in ("decoupled_ppo", "m2po"):
                    over, dropped = w > cfg.behave_imp_weight_cap, (g, i, t) in drops
                    value, grad = (0.0, 0.0) if over or dropped else (w * pg, w * dpg)
                    if over or dropped:
                        flag("mask_frac", (g, i, t))
                    if dropped:
                        flag("m2_mask_frac", (g, i, t))
                elif name == "dppo_tv":
                    rho, diff = math.exp(lp - beh), math.exp(lp) - math.exp(beh)
                    drop = diff > cfg.dppo_mask_high if adv > 0 else diff < -cfg.dppo_mask_low
                    keep = 0.0 if drop else 1.0
                    value = -keep * adv * rho + cfg.dppo_kl_tau * (lp - beh) ** 2
                    grad = -keep * adv * rho + 2 * cfg.dppo_kl_tau * (lp - beh)
                    if drop:
                        flag("mask_frac", (g, i, t))
                elif name == "topr":
                    r = math.exp(lp - old)
                    c = 1.0 if a["rewards"][g, i] > 0 else min(max(r, 0.0), 1.0)
                    value, grad = -c * adv * lp, -c * adv
                    if a["rewards"][g, i] <= 0 and r > 1.0:
                        flag("trunc_frac", (g, i, t))
                elif name == "plain_is":
                    value = grad = -adv * math.exp(lp - beh)
                elif name == "sapo":
                    tau = cfg.sapo_tau_pos if adv > 0 else cfg.sapo_tau_neg
                    r = math.exp(lp - old)
                    sig = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
                    value, grad = -(4.0 / tau) * sig * adv, -4.0 * sig * (1.0 - sig) * r * adv   # d/d lp = r d/d r
                elif name == "vespo":
                    value, grad = -phi * adv * lp, -phi * adv
                elif name == "dppo_kl":
                    p, q, r = math.exp(lp), math.exp(old), math.exp(lp - old)
                    d = q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
                    keep = (d <= cfg.dppo_kl_delta_high or p <= q) if adv > 0 else (d <= cfg.dppo_kl_delta_low or p >= q)
                    c = min(r, cfg.dppo_kl_clip_c) if keep else 0.0
                    value, grad = -adv * c * lp, -adv * c
                    if not keep:
                        flag("mask_frac", (g, i, t))
                    elif r > cfg.dppo_kl_clip_c:
                        flag("trunc_frac", (g, i, t))
                elif name == "gmpo":
                    # each token carries the response's -A R; its weight in the aggregate is the same for
                    # every token of the response, so d L / d lp_t = weight * n * d(-A R)/d lp_t, and
                    # n * dR/d lp_t = R on an unclipped token, 0 on a clipped one
                    value, grad = -adv * gm_r, (0.0 if gm_l[t][1] else -adv * gm_r)
                    if gm_l[t][1]:
                        flag("clip_frac", (g, i, t))
                elif name == "opmd":
                    value, grad = -opmd_a * lp / (1 + cfg.opmd_tau), -opmd_a / (1 + cfg.opmd_tau)
                else:
                    raise AssertionError(name)
                ell[g, i, t], gam[g, i, t] = value, grad
    return ell, gam, flags


def k3(a) -> tuple[np.ndarray, np.ndarray]:
    d = a["ref"] - a["lp"]
    return np.exp(d) - d - 1.0, 1.0 - np.exp(d)


def aggregated(x: np.ndarray, a, how: str, t_tot: float, n_seq: int) -> tuple[float, np.ndarray]:
    """(sum of mask x over the update's denominator, the weight of each token in it)."""
    if how == "token-mean":
        weight = a["mask"] / t_tot
    else:
        weight = a["mask"] / (a["mask"].sum(-1, keepdims=True) * n_seq)
    return float((weight * x).sum()), weight


# ---- the checks ---------------------------------------------------------------------------------

METHOD_CFG = {  # options that put each rule's band inside the test's ratios (the defaults too, below)
    "tis_seq": {}, "icepop": {}, "geo_mask": {"geo_mask_low": 0.7, "geo_mask_high": 1.5},
    "opsm": {"opsm_delta": 0.3}, "cispo": {"cispo_eps_clip_low": 0.2, "cispo_eps_clip_high": 0.2},
    "gspo": {"gspo_eps_low": 0.05, "gspo_eps_high": 0.05}, "m2po": {"m2_threshold": 1.0},
    "dppo_tv": {}, "decoupled_ppo": {}, "topr": {}, "plain_is": {},
    "sapo": {"sapo_tau_pos": 2.0, "sapo_tau_neg": 5.0},
    "vespo": {"vespo_k_pos": 1.0, "vespo_lambda_pos": 0.5, "vespo_k_neg": 0.5, "vespo_lambda_neg": 1.5},
    "dppo_kl": {"dppo_kl_delta_low": 0.05, "dppo_kl_delta_high": 0.05, "dppo_kl_clip_c": 1.2},
    "gmpo": {"gmpo_eps_low": 0.2, "gmpo_eps_high": 0.15}, "opmd": {"opmd_tau": 0.5},
}
# the metric each rule's band shows in, which must be strictly between 0 and 1 with METHOD_CFG
RULE_METRIC = {"tis_seq": "trunc_frac", "icepop": "mask_frac", "geo_mask": "seq_mask_frac", "opsm": "seq_mask_frac",
               "cispo": "clip_frac", "gspo": "seq_clip_frac", "m2po": "m2_mask_frac", "dppo_tv": "mask_frac",
               "decoupled_ppo": "mask_frac", "topr": "trunc_frac", "dppo_kl": "mask_frac", "gmpo": "clip_frac"}
CASES = [(n, o, agg) for n, o in METHOD_CFG.items() for agg in ("token-mean", "seq-mean-token-mean")]
CASES += [(n, {}, "token-mean") for n, o in METHOD_CFG.items() if o]          # the source's defaults
CASES += [("opmd", {"opmd_baseline": "mean", "opmd_tau": 2.0}, "token-mean")]     # Trinity's default baseline


def check(name: str, options: dict, how: str, seed: int = 0) -> dict[str, float]:
    """The loss, its gradient and metrics against the reference; returns the metrics."""
    a = arrays_for(name, seed)
    cfg = TrainConfig(method=name, aggregation=how, **options)
    inp = inputs(a)
    loss, metrics = get_loss(name)(inp, cfg)
    loss.backward()
    ell, gam, flags = reference(name, a, cfg)
    kv, kg = k3(a)
    exact, weight = aggregated(ell + cfg.beta * kv, a, how, inp.t_tot, inp.n_seq_tot)
    n_tok = int(a["mask"].sum())
    assert_close(loss.item(), exact, torch.float64, float(np.abs(weight * (ell + cfg.beta * kv)).sum()), n_tok,
                 what=f"{name} loss")
    coef = weight * (gam + cfg.beta * kg)
    scale = float(np.abs(weight * gam).max() + np.abs(weight * cfg.beta * kg).max())    # its two terms
    assert_close(inp.lp.grad, coef, torch.float64, scale, 2, what=f"{name} d loss / d lp")
    assert not inp.lp.grad[a["mask"] == 0].any()                 # padding gets nothing
    expected = {"pg_loss": aggregated(ell, a, how, inp.t_tot, inp.n_seq_tot)[0],
                "kl_ref_k3": float((a["mask"] * kv).sum()) / inp.t_tot}
    for metric, where in flags.items():
        expected[metric] = len(where) / (inp.n_seq_tot if metric.startswith("seq_") else inp.t_tot)
    got = {k: v.item() for k, v in metrics.items()}
    assert set(got) >= set(expected), (set(expected) - set(got))
    for metric in got:
        assert metrics[metric].dim() == 0 and not metrics[metric].requires_grad
        assert_close(got[metric], expected.get(metric, 0.0), torch.float64, max(1.0, abs(expected.get(metric, 0.0))),
                     n_tok, what=f"{name} {metric}")
    return got


@pytest.mark.parametrize("name, options, how", CASES)
def test_each_correction_equals_its_float64_formula(name, options, how):
    got = check(name, options, how)
    if options and name in RULE_METRIC:      # the inputs cross each rule's band both ways
        assert 0 < got[RULE_METRIC[name]] < 1, (name, got)
    if options and name == "dppo_kl":        # and the cap on the ratio, where the rule keeps a token
        assert 0 < got["trunc_frac"] < 1, got
    if name not in NOT_PPO:
        assert 0 < got["clip_frac"] < 1      # PPO's clip active on some tokens, not all


@pytest.mark.parametrize("seed", [1, 2])
def test_other_draws(seed):
    for name, options in METHOD_CFG.items():
        check(name, options, "token-mean", seed)


@pytest.mark.parametrize("name", [n for n in METHOD_CFG if n != "m2po"])
def test_micro_batches_sum_to_the_update(name):
    """Token-mean over the update: two micro-batches' losses, gradients and metrics add up to the
    whole's (M2PO's mask is taken per micro-batch, as AReaL's is, so it is left out)."""
    a, cfg = arrays_for(name, 3), TrainConfig(method=name, **METHOD_CFG[name])
    whole = inputs(a)
    loss, metrics = get_loss(name)(whole, cfg)
    loss.backward()
    parts = [inputs({k: v[s] for k, v in a.items()}) for s in (slice(0, 1), slice(1, 2))]
    total, sums = 0.0, {}
    for part in parts:
        part.t_tot, part.n_seq_tot = whole.t_tot, whole.n_seq_tot
        piece, m = get_loss(name)(part, cfg)
        piece.backward()
        total += piece.item()
        sums = {k: sums.get(k, 0.0) + v.item() for k, v in m.items()}
    scale = max(1.0, abs(loss.item()))
    assert_close(total, loss.item(), torch.float64, scale, T * M * G, what=name, computations=2)
    assert_close(torch.cat([p.lp.grad for p in parts]), whole.lp.grad, torch.float64,
                 float(whole.lp.grad.abs().max()), 1, computations=2)
    for k, v in metrics.items():
        assert_close(sums[k], v.item(), torch.float64, max(1.0, abs(v.item())), T * M * G, what=k, computations=2)


def test_m2po_mask_drops_the_largest_until_the_mean_is_under_the_threshold():
    m2 = torch.tensor([[[0.5, 0.01, 4.0, 0.02], [0.03, 9.0, 0.0, 0.0]]], dtype=torch.float64)
    mask = torch.tensor([[[1.0, 1, 1, 1], [1, 1, 0, 0]]], dtype=torch.float64)
    keep = corrections.m2po_keep(m2, mask, 0.2)        # drop 9.0 and 4.0: rest mean 0.14 < 0.2
    assert keep.tolist() == [[[True, True, False, True], [True, False, False, False]]]
    keep = corrections.m2po_keep(m2, mask, 1e-9)       # none is enough: all but the smallest go
    assert keep.sum() == 1 and keep[0, 0, 1]


@pytest.mark.parametrize("name, missing", [("tis_seq", "lp_old and lp_beh"), ("cispo", "lp_old"),
                                           ("dppo_tv", "lp_beh"), ("plain_is", "lp_beh"),
                                           ("vespo", "lp_old and lp_beh"), ("sapo", "lp_old"), ("dppo_kl", "lp_old"),
                                           ("gmpo", "lp_old")])
def test_a_missing_anchor_is_one_error_naming_it(name, missing):
    inp = inputs(arrays())
    inp.lp_old, inp.lp_beh = None, None
    with pytest.raises(ValueError, match=f"{name} needs {missing}"):
        get_loss(name)(inp, TrainConfig(method=name))


# ---- the five corrections' defining behaviours -------------------------------------------------

def one_group(lp, old, beh=None, rewards=(1.0, 0.0)) -> LossInputs:
    """G = 1, m = len(rewards) responses of len(lp[i]) tokens each (float64), no padding, lp_ref = lp."""
    lp_t = torch.tensor([lp], dtype=torch.float64)
    return LossInputs(lp=lp_t.clone().requires_grad_(True), lp_ref=lp_t, mask=torch.ones_like(lp_t),
                      lp_beh=torch.tensor([beh if beh is not None else old], dtype=torch.float64),
                      rewards=torch.tensor([list(rewards)], dtype=torch.float64), t_tot=float(lp_t.numel()),
                      n_seq_tot=len(rewards), lp_old=torch.tensor([old], dtype=torch.float64))


def run(name: str, inp: LossInputs, **options) -> tuple[torch.Tensor, dict[str, float]]:
    """(d loss / d lp [m, T], metrics) of `name` at beta = 0."""
    loss, metrics = get_loss(name)(inp, TrainConfig(method=name, beta=0.0, **options))
    loss.backward()
    assert inp.lp.grad is not None
    return inp.lp.grad[0], {k: v.item() for k, v in metrics.items()}


def close(actual, exact, terms: int = 4, what: str = "") -> None:
    """float64 against a closed form, at the scale of the largest exact entry."""
    exact_t = torch.as_tensor(exact, dtype=torch.float64)
    assert_close(actual, exact_t, torch.float64, max(float(exact_t.abs().max()), 1e-300), terms, what=what)


ADV = 0.5 / (math.sqrt(0.5) + 1e-6)          # A of rewards (1, 0): +-0.5 / (std + eps_adv)
LP = [[-1.0, -0.5], [-0.7, -2.0]]


@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (2.0, 10.0)])
def test_sapo_at_r_1_is_the_policy_gradient_whatever_the_temperature(tau_pos, tau_neg):
    """At r = 1 the gate's value is 2 / tau, but its slope is 1 (4 sigmoid'(0)), so every token's
    gradient is -A / T_tot: on-policy REINFORCE, whatever tau."""
    g, metrics = run("sapo", one_group(LP, LP), sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg)
    close(metrics["pg_loss"], (-2 / tau_pos * ADV + 2 / tau_neg * ADV) / 2, what="pg_loss")
    close(g, [[-ADV / 4] * 2, [ADV / 4] * 2], what="gradient")


def test_sapo_gate_is_soft_and_narrows_with_the_temperature():
    """Away from r = 1 the gradient weight r f'(r) = 4 r s (1 - s), s = sigmoid(tau (r - 1)), is
    never 0 (no hard clip) and falls as tau grows: at r = e^0.5, 1.49 at tau 1, 0.010 at tau 10."""
    r = math.exp(0.5)
    weights = []
    for tau in (1.0, 4.0, 10.0):
        g, _ = run("sapo", one_group([[0.5], [0.0]], [[0.0], [0.0]]), sapo_tau_pos=tau)
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        close(g[0, 0], -ADV / 2 * 4 * r * s * (1 - s), what=f"tau {tau}")
        weights.append(-g[0, 0].item() / (ADV / 2))
    assert weights[0] > 1.0 > weights[1] > weights[2] > 0.0, weights


def test_vespo_weight_is_1_at_w_1_and_peaks_at_k_over_lambda():
    cfg = TrainConfig(method="vespo")
    log_w = torch.linspace(math.log(0.05), math.log(20.0), 20001, dtype=torch.float64)[None, :, None]
    for sign, k, lam in ((1.0, cfg.vespo_k_pos, cfg.vespo_lambda_pos), (-1.0, cfg.vespo_k_neg, cfg.vespo_lambda_neg)):
        phi = corrections.vespo_weights(log_w, torch.full_like(log_w, sign), cfg)[0, :, 0]
        peak = math.exp(float(log_w[0, int(phi.argmax()), 0]))
        assert abs(peak / (k / lam) - 1) < 1e-3, (sign, peak)           # 2/3 where A >= 0, 3/2 where A < 0
        at_1 = corrections.vespo_weights(torch.zeros(1, 1, 1, dtype=torch.float64),
                                         torch.full((1, 1, 1), sign, dtype=torch.float64), cfg)
        close(at_1, 1.0, what="phi(1)")
    # through the loss: on-policy (W = 1) it is REINFORCE; off it, W = pi/mu of the whole response
    g, _ = run("vespo", one_group(LP, LP, LP))
    close(g, [[-ADV / 4] * 2, [ADV / 4] * 2], what="W = 1")
    beh = [[-1.0 - math.log(2 / 3), -0.5], [-0.7, -2.0 - math.log(1.5)]]     # W = 2/3 and 3/2: each one's peak
    g, _ = run("vespo", one_group(LP, LP, beh))
    close(g, [[-ADV / 4 * (2 / 3) ** 2 * math.exp(3 * (1 - 2 / 3))] * 2, [ADV / 4 * 1.5 ** 3 * math.exp(2 * (1 - 1.5))] * 2],
          what="W at the peak")


def test_dppo_kl_drops_only_tokens_past_the_bound_in_the_advantages_direction():
    """The trust region bounds a token's move in the direction the advantage pushes it. A > 0: a
    token whose probability fell (p <= q) is kept however far it fell (the gradient raises it
    again), one that rose past the binary-KL bound is dropped, one that rose a little is kept;
    A < 0 the mirror image. The kept tokens' gradient is -A sg(min(r, C)) / T_tot, the dropped
    ones' exactly 0."""
    q = math.log(0.5)
    lp = [[math.log(0.05), math.log(0.95), math.log(0.55)], [math.log(0.95), math.log(0.05), math.log(0.45)]]
    g, metrics = run("dppo_kl", one_group(lp, [[q] * 3] * 2))
    keep = [[1, 0, 1], [1, 0, 1]]              # D(0.5 -> 0.95) = 0.83, D(0.5 -> 0.05) = 0.83 > 0.2; D(0.5 -> 0.55) = 0.005
    want = [[-sgn * ADV * min(math.exp(lp[i][t] - q), 3.0) / 6 * keep[i][t] for t in range(3)]
            for i, sgn in enumerate((1.0, -1.0))]
    close(g, want, what="gradient")
    assert (g == 0).tolist() == [[False, True, False], [False, True, False]]
    assert metrics["mask_frac"] == pytest.approx(2 / 6) and metrics["trunc_frac"] == 0.0
    close(corrections.binary_kl(torch.tensor(math.log(0.95), dtype=torch.float64), torch.tensor(q, dtype=torch.float64)),
          0.5 * math.log(0.5 / 0.95) + 0.5 * math.log((0.5 + 1e-8) / (0.05 + 1e-8)), what="binary KL")


def test_gmpo_at_r_1_is_grpo_and_its_ratio_is_the_clipped_geometric_mean():
    from pipeline.training.losses import grpo_loss
    g, metrics = run("gmpo", one_group(LP, LP))
    grpo = one_group(LP, LP)
    grpo_loss(grpo, TrainConfig(anchor="old", beta=0.0))[0].backward()
    close(g, grpo.lp.grad[0], what="gradient at r = 1")
    close(metrics["pg_loss"], 0.0, what="pg_loss at r = 1")            # -A summed over a balanced group
    # log ratios (0.3, -0.3), A > 0: R = 1, the geometric mean (the ratios' arithmetic mean, cosh 0.3, is not);
    # (1.0, -0.3), A > 0: the first clipped to 0.4, R = e^0.05, and only the second has a gradient
    zeros = [[0.0, 0.0]] * 4
    g, metrics = run("gmpo", one_group([[0.3, -0.3], [1.0, -0.3], [0.0, 0.0], [0.0, 0.0]], zeros,
                                       rewards=(1.0, 1.0, 0.0, 0.0)))
    adv = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    close(g[:2], [[-adv / 8] * 2, [0.0, -adv * math.exp(0.05) / 8]], what="gradient")   # n dR/d lp_t = R; 1/8 weight
    assert g[1, 0] == 0.0 and metrics["clip_frac"] == pytest.approx(1 / 8)


def test_opmd_log_avg_exp_baseline_lies_between_the_mean_and_the_max():
    """b = tau log mean exp(r / tau) >= mean r (Jensen), -> mean r as tau -> inf, -> max r as tau -> 0;
    the group's mean advantage, mean r - b, is minus GGPO's raw group loss (spec 5.1) at beta = tau
    on the unadjusted rewards."""
    from pipeline.training.losses import ggpo_group_loss
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0], [0.3, -1.0, 2.0, 0.0, 0.5]], dtype=torch.float64)
    mean, top = rewards.mean(1, keepdim=True), rewards.max(1, keepdim=True).values
    for tau in (0.01, 0.5, 1.0, 3.0):
        adv = corrections.opmd_advantages(rewards, tau, "logavgexp")
        b = rewards - adv
        assert (b > mean).all() and (b < top).all(), tau
        close(adv.mean(1), -ggpo_group_loss(rewards, tau), what=f"mean A at tau {tau}")
    assert (rewards - corrections.opmd_advantages(rewards, 1e6, "logavgexp") - mean).abs().max() < 1e-5
    assert (rewards - corrections.opmd_advantages(rewards, 1e-3, "logavgexp") - top).abs().max() < 1e-2
    close(corrections.opmd_advantages(rewards, 7.0, "mean"), rewards - mean, what="mean baseline")
    # the loss: -A lp / (1 + tau) per token; no ratio, lp_old and lp_beh not read
    inp = one_group(LP, LP)
    inp.lp_old = inp.lp_beh = None
    b = 2.0 * math.log((math.exp(1 / 2) + 1) / 2)
    g, _ = run("opmd", inp, opmd_tau=2.0)
    close(g, [[-(1 - b) / 3 / 4] * 2, [b / 3 / 4] * 2], what="gradient")


@pytest.mark.parametrize("sets, message", [
    (["train.method=sapo", "train.sapo_tau_neg=0"], "train.sapo_tau_neg"),
    (["train.method=vespo", "train.vespo_lambda_pos=0"], "train.vespo_lambda_pos"),
    (["train.method=vespo", "train.vespo_k_neg=-1"], "train.vespo_k_neg"),
    (["train.method=dppo_kl", "train.dppo_kl_delta_low=-0.1"], "train.dppo_kl_delta_low"),
    (["train.method=dppo_kl", "train.dppo_kl_clip_c=0"], "train.dppo_kl_clip_c"),
    (["train.method=gmpo", "train.gmpo_eps_high=-0.4"], "train.gmpo_eps_high"),
    (["train.method=opmd", "train.opmd_tau=0"], "train.opmd_tau"),
    (["train.method=opmd", "train.opmd_baseline=median"], "train.opmd_baseline"),
    (["train.method=grpo", "train.gmpo_eps_low=0.3"], "train.gmpo_eps_low applies to method 'gmpo' only"),
    (["train.method=sapo", "train.opmd_baseline=mean"], "train.opmd_baseline applies to method 'opmd' only"),
])
def test_the_new_options_are_checked_and_key_neutral_at_their_default(sets, message):
    """A bad value, or an option for another method, is one config error naming the field; at its
    default an option is in no cache key (given explicitly or not), so adding it moved none."""
    with pytest.raises(ConfigError, match=message):
        load_config("smoke", sets)
    option = sets[1].split("=")[0].removeprefix("train.")
    reader = next(m.name for m in methods.METHODS.values() if option in m.options)
    assert option not in load_config("smoke", []).slice(("train",))["train"]
    plain = load_config("smoke", [f"train.method={reader}"]).slice(("train",))
    assert option not in plain["train"]
    default = TrainConfig.model_fields[option].default
    assert load_config("smoke", [f"train.method={reader}", f"train.{option}={default}"]).slice(("train",)) == plain
