"""The reports' statistics over seeds (pipeline/reports/stats.py) against an independent fp64
computation: mpmath at 40 digits (the t distribution through its regularized incomplete
beta, the quantile by root finding), and the t-quantiles of a standard table. Every test
here takes milliseconds (mpmath's root finding included).

Tolerance (tests/tolerance.py): an fp64 result of size `scale`; scipy's t (Boost's
incomplete beta and its inverse) sums series of up to ~64 terms, so terms = 64 for the
quantile, the p-value and whatever is built from them.
"""
import math
import random

import mpmath as mp  # type: ignore[import-untyped]  # no stubs; tests only
import pytest
import torch

from pipeline.reports import stats

from tolerance import assert_close

F64 = torch.float64
TERMS = 64
mp.mp.dps = 40

# two-sided 95 % quantiles of Student's t, from a standard table (e.g. NIST/SEMATECH
# e-Handbook 1.3.6.7.2, upper 0.025 critical values), to the digits tables print
TABLE = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 9: 2.262}


def pair(a, b) -> stats.Estimate:
    """stats.paired where the two share seeds (never None here)."""
    est = stats.paired(a, b)
    assert est is not None
    return est


def bounds(est: stats.Estimate) -> tuple[float, float, float]:
    """(low, high, p) of an estimate with an interval and a test."""
    assert est.low is not None and est.high is not None and est.p is not None
    return est.low, est.high, est.p


def t_sf(t, dof):
    """P(T > t) for t >= 0: I_{dof / (dof + t^2)}(dof / 2, 1 / 2) / 2."""
    t, dof = mp.mpf(t), mp.mpf(dof)
    return mp.betainc(dof / 2, mp.mpf(1) / 2, 0, dof / (dof + t * t), regularized=True) / 2


def t_quantile(level, dof):
    return mp.findroot(lambda t: t_sf(t, dof) - (1 - mp.mpf(level)) / 2, 2)


def reference(xs, level=0.95):
    """mean, sd (ddof 1), interval and two-sided p of one sample, in mpmath."""
    xs = [mp.mpf(x) for x in xs]
    n = len(xs)
    mean = mp.fsum(xs) / n
    sd = mp.sqrt(mp.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    se = sd / mp.sqrt(n)
    q = t_quantile(level, n - 1)
    return mean, sd, mean - q * se, mean + q * se, 2 * t_sf(abs(mean) / se, n - 1)


@pytest.mark.parametrize("dof", sorted(TABLE))
def test_t_quantile_against_a_standard_table_and_mpmath(dof):
    q = stats.t_quantile(0.95, dof)
    assert round(q, 3) == TABLE[dof]
    assert_close(q, float(t_quantile(0.95, dof)), F64, scale=q, terms=TERMS, what=f"t quantile, {dof} dof")


@pytest.mark.parametrize("xs", [[0.12, 0.31, 0.27], [0.5, 0.56, 0.53, 0.41, 0.6], [-0.02, 0.09], [3e-4, 1e-4, 2e-4]])
def test_summary_against_mpmath(xs):
    got = stats.summary(xs)
    mean, sd, low, high, _ = reference(xs)
    scale = max(abs(x) for x in xs)
    assert got.n == len(xs) and got.p is None and got.dof == len(xs) - 1
    assert_close(got.mean, float(mean), F64, scale=scale, terms=len(xs), what="mean")
    assert_close(got.sd, float(sd), F64, scale=scale, terms=len(xs), what="sd")
    for name, g, e in (("low", got.low, low), ("high", got.high, high)):
        assert_close(g, float(e), F64, scale=float(abs(e) + abs(high - low)), terms=TERMS, what=name)


def test_paired_difference_interval_and_p_against_mpmath():
    """Only seeds in both count; the difference's interval and p are the one-sample ones
    of the per-seed differences (mpmath), and with 2 dof p has the closed form
    1 - |t| / sqrt(2 + t^2)."""
    a = {42: 0.22, 1234: 0.15, 2027: 0.21, 7: 0.9}
    b = {42: 0.20, 1234: 0.14, 2027: 0.18, 99: 0.0}
    got = pair(a, b)
    g_low, g_high, g_p = bounds(got)
    d = [a[s] - b[s] for s in (42, 1234, 2027)]
    mean, sd, low, high, p = reference(d)
    assert got.seeds == (42, 1234, 2027) and got.n == 3 and got.dof == 2
    assert_close(got.mean, float(mean), F64, scale=0.22, terms=3, what="mean difference")
    assert_close(got.sd, float(sd), F64, scale=0.22, terms=3, what="sd of differences")
    assert_close(g_low, float(low), F64, scale=0.22, terms=TERMS, what="low")
    assert_close(g_high, float(high), F64, scale=0.22, terms=TERMS, what="high")
    assert_close(g_p, float(p), F64, scale=1.0, terms=TERMS, what="p")
    t = float(mean / (sd / mp.sqrt(3)))
    assert_close(g_p, 1 - t / math.sqrt(2 + t * t), F64, scale=1.0, terms=TERMS, what="p, closed form")
    assert got.text(scale=100) == f"{100 * got.mean:+.2f} [{100 * g_low:+.2f}, {100 * g_high:+.2f}], n=3, p=0.074"


def test_pairing_removes_what_a_seed_shares():
    """Seeds that differ a lot (a base model each) and a method that adds 2 points on
    every one: the paired interval is narrow and excludes 0, the unpaired (Welch) one is
    wide and holds it. Welch's interval and dof against mpmath."""
    base = {42: 0.05, 1234: 0.25, 2027: 0.45}
    shift = {42: 0.021, 1234: 0.019, 2027: 0.020}
    a = {s: base[s] + shift[s] for s in base}
    paired, unpaired = pair(a, base), stats.welch(list(a.values()), list(base.values()))
    (p_low, p_high, p_p), (u_low, u_high, u_p) = bounds(paired), bounds(unpaired)
    assert p_low > 0 and p_high - p_low < 0.01 and p_p < 0.01
    assert u_low < 0 < u_high and u_p > 0.5
    assert unpaired.mean == pytest.approx(paired.mean, abs=1e-15)
    xa, xb = [mp.mpf(v) for v in a.values()], [mp.mpf(v) for v in base.values()]
    va = mp.fsum((x - mp.fsum(xa) / 3) ** 2 for x in xa) / 2 / 3
    vb = mp.fsum((x - mp.fsum(xb) / 3) ** 2 for x in xb) / 2 / 3
    dof = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 2)
    half = t_quantile(0.95, dof) * mp.sqrt(va + vb)
    assert_close(unpaired.dof, float(dof), F64, scale=float(dof), terms=6, what="Welch dof")
    assert_close(u_high - unpaired.mean, float(half), F64, scale=float(half), terms=TERMS, what="Welch half")


def test_stalls_and_bimodal_cells():
    assert stats.stalls([True, False, False]).text() == "1/3" and stats.bimodal([True, False, False])
    assert stats.stalls([True, True, True]) == stats.Stalls(3, 3) and not stats.bimodal([True, True, True])
    assert stats.stalls([False, False]).k == 0 and not stats.bimodal([False, False])
    assert not stats.bimodal([True])        # one seed: nothing to mix


def test_one_seed_has_no_interval():
    one = stats.summary([0.3])
    assert (one.mean, one.n, one.sd, one.low, one.high, one.p) == (0.3, 1, None, None, None, None)
    diff = pair({42: 0.3, 7: 0.1}, {42: 0.2})
    assert diff.n == 1 and diff.low is None and diff.p is None and diff.seeds == (42,)
    assert diff.text(scale=100) == "+10.00 (n=1, no interval)"
    assert stats.paired({42: 0.3}, {7: 0.2}) is None          # no seed in both: no comparison
    assert stats.welch([0.3], [0.1, 0.2]).low is None


def test_equal_differences_and_bad_input():
    low, high, p = bounds(pair({1: 0.5, 2: 0.7}, {1: 0.4, 2: 0.6}))
    assert low == pytest.approx(high) and p == 0.0        # t infinite
    none = pair({1: 0.5, 2: 0.7}, {1: 0.5, 2: 0.7})
    assert (none.mean, none.low, none.high, none.p) == (0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="not finite"):
        stats.summary([0.1, float("nan")])
    with pytest.raises(ValueError, match="at least one seed"):
        stats.summary([])


def test_holm_against_its_definition_in_exact_arithmetic():
    """stats.holm against p_holm_(k) = min(1, max_{j <= k} (m - j + 1) p_(j)) in fractions,
    over random p-values with ties and missing ones; None stays None and is not counted."""
    from fractions import Fraction
    rng = random.Random(7)
    for _ in range(200):
        ps = [None if rng.random() < 0.2 else rng.choice([rng.random(), 0.01, 0.5]) for _ in range(rng.randint(1, 12))]
        got = stats.holm(ps)
        present = sorted((Fraction(p), i) for i, p in enumerate(ps) if p is not None)
        m, want = len(present), {}
        for k in range(m):
            want[present[k][1]] = min(Fraction(1), max((m - j) * present[j][0] for j in range(k + 1)))
        for i, p in enumerate(ps):
            if p is None:
                assert got[i] is None
            else:
                assert abs(got[i] - float(want[i])) <= 4 * 2.0 ** -52 * max(float(want[i]), 1e-300) * m
    assert stats.holm([0.01, 0.04, 0.03, 0.005, None]) == [0.03, 0.06, 0.06, 0.02, None]


def power_reference(delta, sd, n, level=0.95):
    """Two-sided paired t-test power in mpmath: T' = (Z + lam) / sqrt(V / dof), V ~ chi2(dof),
    so P(|T'| > q) = int_0^inf [Phi(-q sqrt(v/dof) + lam) + Phi(-q sqrt(v/dof) - lam)] f(v) dv."""
    dof, q = n - 1, t_quantile(level, n - 1)
    lam = mp.mpf(delta) * mp.sqrt(n) / mp.mpf(sd)
    k = mp.mpf(dof) / 2

    def chi2_pdf(v):
        return v ** (k - 1) * mp.exp(-v / 2) / (2 ** k * mp.gamma(k))

    def integrand(v):
        c = q * mp.sqrt(v / dof)
        return (mp.ncdf(-c + lam) + mp.ncdf(-c - lam)) * chi2_pdf(v)

    return mp.quad(integrand, [0, dof, 4 * dof + 40, mp.inf])


@pytest.mark.parametrize("n,delta,sd", [(2, 0.06, 0.0075), (2, 0.01, 0.0075), (3, 0.05, 0.02), (5, 3.0, 2.5), (8, 0.4, 1.0), (5, -1.2, 0.7)])
def test_power_against_the_noncentral_t_in_mpmath(n, delta, sd):
    got = stats.power(delta, sd, n)
    want = float(power_reference(delta, sd, n))
    # quad at relative 1e-11 over three pieces and the tail; 1e-9 absolute leaves room
    assert abs(got - want) < 1e-9, (got, want)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_detectable_difference_has_the_target_power_and_scales_with_sd(n):
    d1 = stats.detectable(1.0, n)
    assert abs(float(power_reference(d1, 1.0, n)) - 0.8) < 1e-8
    assert stats.detectable(2.5, n) == pytest.approx(2.5 * d1, rel=1e-9)
    # the t-test needs more than the normal approximation (z_0.975 + z_0.8) sd / sqrt(n)
    assert d1 > (1.959964 + 0.841621) / math.sqrt(n)
    assert stats.power(0.0, 1.0, n) == pytest.approx(0.05, abs=1e-12)   # the level, under H0


def test_detectable_difference_is_what_a_simulated_test_finds_four_times_in_five():
    """The meaning, not the formula: paired t-tests of n = 5 simulated seeds at the detectable
    difference reject in ~80 % of 20 000 trials (binomial sd 0.0028; 5 sd of slack)."""
    gen = torch.Generator().manual_seed(0)
    n, sd = 5, 1.7
    delta = stats.detectable(sd, n)
    d = delta + sd * torch.randn(20_000, n, generator=gen, dtype=F64)
    t = d.mean(1) / (d.std(1) / math.sqrt(n))
    rate = float((t.abs() > stats.t_quantile(0.95, n - 1)).to(F64).mean())
    assert abs(rate - 0.8) < 0.014, rate


def test_power_rejects_what_it_cannot_compute():
    with pytest.raises(ValueError, match="n >= 2"):
        stats.power(1.0, 1.0, 1)
    with pytest.raises(ValueError, match="sd > 0"):
        stats.power(1.0, 0.0, 5)
    with pytest.raises(ValueError, match="target power"):
        stats.detectable(1.0, 5, target=0.01)
