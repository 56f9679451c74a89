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

from pipeline.core.config import TrainConfig
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
            for t in tokens(a, g, i):
                lp, old, beh = a["lp"][g, i, t], a["old"][g, i, t], a["beh"][g, i, t]
                pg, dpg, clipped = ppo(adv, lp - old, cfg)
                w = math.exp(old - beh)
                if clipped and name not in ("cispo", "gspo", "dppo_tv", "topr", "plain_is"):
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
}
# the metric each rule's band shows in, which must be strictly between 0 and 1 with METHOD_CFG
RULE_METRIC = {"tis_seq": "trunc_frac", "icepop": "mask_frac", "geo_mask": "seq_mask_frac", "opsm": "seq_mask_frac",
               "cispo": "clip_frac", "gspo": "seq_clip_frac", "m2po": "m2_mask_frac", "dppo_tv": "mask_frac",
               "decoupled_ppo": "mask_frac", "topr": "trunc_frac"}
CASES = [(n, o, agg) for n, o in METHOD_CFG.items() for agg in ("token-mean", "seq-mean-token-mean")]
CASES += [(n, {}, "token-mean") for n, o in METHOD_CFG.items() if o]          # the source's defaults


def check(name: str, options: dict, how: str, seed: int = 0) -> dict[str, float]:
    """The loss, its gradient and metrics against the reference; returns the metrics."""
    a = arrays(seed)
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
    if name not in ("cispo", "gspo", "dppo_tv", "topr", "plain_is"):
        assert 0 < got["clip_frac"] < 1      # PPO's clip active on some tokens, not all


@pytest.mark.parametrize("seed", [1, 2])
def test_other_draws(seed):
    for name, options in METHOD_CFG.items():
        check(name, options, "token-mean", seed)


@pytest.mark.parametrize("name", [n for n in METHOD_CFG if n != "m2po"])
def test_micro_batches_sum_to_the_update(name):
    """Token-mean over the update: two micro-batches' losses, gradients and metrics add up to the
    whole's (M2PO's mask is taken per micro-batch, as AReaL's is, so it is left out)."""
    a, cfg = arrays(3), TrainConfig(method=name, **METHOD_CFG[name])
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
                                           ("dppo_tv", "lp_beh"), ("plain_is", "lp_beh")])
def test_a_missing_anchor_is_one_error_naming_it(name, missing):
    inp = inputs(arrays())
    inp.lp_old, inp.lp_beh = None, None
    with pytest.raises(ValueError, match=f"{name} needs {missing}"):
        get_loss(name)(inp, TrainConfig(method=name))
