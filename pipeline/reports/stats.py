"""Statistics over seeds for the reports: pure functions, every sum in float64 (math.fsum).

The seed is the unit of replication. Every method of one seed starts from that seed's base
model, reads the same seeded prompt order and, offline, trains on the same pool, so two
methods' results on one seed are paired: their difference removes what the seed shares.

One sample x_1 .. x_n (`summary`):

    mean = (1/n) sum_i x_i
    sd   = sqrt( sum_i (x_i - mean)^2 / (n - 1) )            sample std, ddof 1
    se   = sd / sqrt(n)
    interval = mean -/+ q * se,   q = t_{(1 + level)/2, n - 1}  Student t quantile, n - 1 dof
                                                              (scipy.stats.t.ppf; level 0.95)
    t = mean / se,   p = 2 * (1 - F_{n-1}(|t|))                two-sided, H0: the mean is 0

A paired difference (`paired`): a and b keyed by seed, d_s = a_s - b_s over the seeds present
in both (the others are left out and not counted), then the one-sample statistics of d.

An unpaired difference (`welch`, for cells that share no seeds, and to show what pairing
gains): mean_a - mean_b, se = sqrt(sd_a^2 / n_a + sd_b^2 / n_b), Welch-Satterthwaite dof
    nu = se^4 / ( (sd_a^2 / n_a)^2 / (n_a - 1) + (sd_b^2 / n_b)^2 / (n_b - 1) ),
the interval and p as above with nu dof.

Degenerate samples: n = 1 has a mean and nothing else (sd, interval and p are None; the
tables print "n=1, no interval"); n = 0 raises. A spread of exactly 0 gives the interval
[mean, mean] and p = 1 where the mean is 0, else p = 0 (the limit of t -> infinity).

Many comparisons at once (`holm`): a table of m paired differences, each tested at 5 %,
excludes zero by chance in ~0.05 m of them when no difference is real. Holm's step-down
adjustment keeps the chance of any false exclusion in the whole table at the level: with the
p-values sorted p_(1) <= .. <= p_(m),

    p_holm_(k) = min(1, max_{j <= k} (m - j + 1) p_(j))

and a difference is settled at the table's level where p_holm < level's complement (0.05).

What a table can resolve (`power`, `detectable`): a paired t-test of n seeds at two-sided
level alpha = 1 - level rejects where |t| > q = t_{1 - alpha/2, n - 1}. A true difference
delta with a spread sigma of the differences gives t noncentral with n - 1 dof and
noncentrality lambda = delta sqrt(n) / sigma, so

    power(delta) = P(T'_{n-1, lambda} > q) + P(T'_{n-1, lambda} < -q)     (noncentral t)

and `detectable` is the delta where power(delta) = 0.8, its root found by scipy's brentq (power
rises in |delta|). It is the smallest difference the table would find four times in five, if the
spread the seeds measured is the true one; it scales with sigma and falls with n: 3.26 sigma
at n = 3, 1.68 sigma at n = 5, 1.16 sigma at n = 8 (tests/test_stats.py checks power against
an mpmath integral and a simulation of the test itself).

Stalls: a seed whose online cell stopped before its last update (a round that could not fill
its pool, or the drift guard) stalled; a cell reports k/n. A cell is bimodal when some but not
all of its seeds stalled (0 < k < n): its seeds then come from two regimes (a policy frozen at
its stop against one that ran every update), a mean +- sd describes neither, and the tables
print each seed's value instead. No rule on the values themselves is used: with 3 seeds no
test of bimodality has power, while a stall is an observed event.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scipy import integrate as scipy_integrate, optimize as scipy_optimize, stats as scipy_stats  # type: ignore[import-untyped]  # no stubs

LEVEL = 0.95      # the reports' interval level


@dataclass(frozen=True)
class Estimate:
    """A mean (of values or of paired differences) with its spread over n seeds: sd, the
    t-interval [low, high] and the two-sided p of mean = 0; None where n < 2 (or p for a
    one-sample summary of values, where a test of mean = 0 means nothing)."""
    mean: float
    n: int
    sd: float | None = None
    low: float | None = None
    high: float | None = None
    p: float | None = None
    dof: float | None = None
    seeds: tuple[Any, ...] = ()

    def text(self, scale: float = 1.0, digits: int = 2, with_p: bool = True) -> str:
        """'-3.21 [-8.10, 1.68], n=3, p=0.12' (values times `scale`); 'x (n=1, no interval)'."""
        mean = f"{scale * self.mean:+.{digits}f}" if with_p else f"{scale * self.mean:.{digits}f}"
        if self.low is None or self.high is None:
            return f"{mean} (n={self.n}, no interval)"
        interval = f"[{scale * self.low:+.{digits}f}, {scale * self.high:+.{digits}f}]"
        return f"{mean} {interval}, n={self.n}" + (f", p={p_text(self.p)}" if with_p and self.p is not None else "")


def p_text(p: float) -> str:
    """A p-value as text: 2 significant digits, '<0.001' below."""
    return "<0.001" if p < 1e-3 else f"{p:.2g}"


def t_quantile(level: float, dof: float) -> float:
    """The two-sided `level` quantile of Student's t with `dof` degrees of freedom."""
    return float(scipy_stats.t.ppf((1.0 + level) / 2.0, dof))


def checked(values: Iterable[float], what: str) -> list[float]:
    out = [float(v) for v in values]
    bad = [v for v in out if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{what}: a value is not finite ({bad[0]!r}); statistics over seeds need numbers")
    return out


def mean_sd(values: Sequence[float]) -> tuple[float, float | None]:
    """(mean, sample std with ddof 1, None for one value), fp64 with fsum."""
    n = len(values)
    mean = math.fsum(values) / n
    return mean, (math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None)


def _t_estimate(mean: float, se: float, dof: float, n: int, level: float, sd: float | None,
                seeds: tuple[Any, ...], test: bool) -> Estimate:
    q = t_quantile(level, dof)
    if se > 0.0:
        p = 2.0 * float(scipy_stats.t.sf(abs(mean) / se, dof))
    else:       # every seed the same: t is 0/0 (p 1) or infinite (p 0)
        p = 1.0 if mean == 0.0 else 0.0
    return Estimate(mean, n, sd, mean - q * se, mean + q * se, p if test else None, dof, seeds)


def summary(values: Sequence[float], level: float = LEVEL, seeds: Sequence[Any] = ()) -> Estimate:
    """Mean, sd (ddof 1), n and the t-interval (n - 1 dof) of one sample; no p."""
    xs = checked(values, "summary")
    if not xs:
        raise ValueError("summary of no values: a cell needs at least one seed")
    mean, sd = mean_sd(xs)
    if sd is None:
        return Estimate(mean, 1, seeds=tuple(seeds))
    return _t_estimate(mean, sd / math.sqrt(len(xs)), len(xs) - 1, len(xs), level, sd, tuple(seeds), test=False)


def paired(a: Mapping[Any, float], b: Mapping[Any, float], level: float = LEVEL) -> Estimate | None:
    """a - b paired by seed (the keys): the mean difference over the seeds in both, its sd,
    t-interval (n - 1 dof) and two-sided p; None when no seed is in both."""
    common = [s for s in a if s in b]
    if not common:
        return None
    d = checked((a[s] - b[s] for s in common), "paired difference")
    mean, sd = mean_sd(d)
    if sd is None:
        return Estimate(mean, 1, seeds=tuple(common))
    return _t_estimate(mean, sd / math.sqrt(len(d)), len(d) - 1, len(d), level, sd, tuple(common), test=True)


def welch(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Estimate:
    """mean(a) - mean(b) of two independent samples (Welch's unequal-variance t; `n` is
    the number of values in both, `dof` Welch-Satterthwaite's); no interval unless both
    have two values or more."""
    xa, xb = checked(a, "welch a"), checked(b, "welch b")
    if not xa or not xb:
        raise ValueError("welch: each sample needs at least one value")
    (ma, sa), (mb, sb) = mean_sd(xa), mean_sd(xb)
    if sa is None or sb is None:
        return Estimate(ma - mb, min(len(xa), len(xb)))
    va, vb = sa * sa / len(xa), sb * sb / len(xb)
    se = math.sqrt(va + vb)
    dof = (va + vb) ** 2 / (va * va / (len(xa) - 1) + vb * vb / (len(xb) - 1)) if se > 0 else len(xa) + len(xb) - 2.0
    return _t_estimate(ma - mb, se, dof, len(xa) + len(xb), level, None, (), test=True)


@dataclass(frozen=True)
class Stalls:
    """k of n seeds stalled (stopped before their last update)."""
    k: int
    n: int

    @property
    def bimodal(self) -> bool:
        return bimodal_k(self.k, self.n)

    def text(self) -> str:
        return f"{self.k}/{self.n}"


def stalls(stopped: Iterable[bool]) -> Stalls:
    """Count the stalled seeds of one cell: one flag per seed."""
    flags = [bool(s) for s in stopped]
    return Stalls(sum(flags), len(flags))


def bimodal_k(k: int, n: int) -> bool:
    """Some but not all seeds stalled (see the module docstring)."""
    return 0 < k < n


def bimodal(stopped: Iterable[bool]) -> bool:
    return stalls(stopped).bimodal


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values, in the order given (None stays None and is not
    counted in m): p_holm_(k) = min(1, max_{j <= k} (m - j + 1) p_(j))."""
    present = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    out: list[float | None] = [None] * len(p_values)
    running, m = 0.0, len(present)
    for j, (p, i) in enumerate(present):
        running = max(running, min(1.0, (m - j) * p))
        out[i] = running
    return out


def power(delta: float, sd: float, n: int, level: float = LEVEL) -> float:
    """Power of the two-sided paired t-test of n seeds at `level` (alpha = 1 - level) for a
    true mean difference `delta` with spread `sd` of the differences (module docstring),
    integrated over the sample variance: with V ~ chi2(dof), c = q sqrt(V / dof),

        power = E_V[ Phi(lam - c) + Phi(-lam - c) ]

    (scipy's quad). scipy.stats.nct would be one call, but at dof 1 (two seeds) it returns
    NaN for noncentralities near 11, which a report of two seeds reaches."""
    if n < 2 or sd <= 0.0:
        raise ValueError(f"power needs n >= 2 seeds and sd > 0 (got n={n}, sd={sd})")
    dof, q = n - 1, t_quantile(level, n - 1)
    lam = delta * math.sqrt(n) / sd

    def given_variance(v: float) -> float:
        c = q * math.sqrt(v / dof)
        return float((scipy_stats.norm.cdf(lam - c) + scipy_stats.norm.cdf(-lam - c)) * scipy_stats.chi2.pdf(v, dof))

    # split where the chi2 density has its mass, so quad does not miss it on a half-line
    edges = [0.0, float(dof), float(4 * dof + 40)]
    total = sum(scipy_integrate.quad(given_variance, a, b, epsabs=1e-13, epsrel=1e-11, limit=200)[0]
                for a, b in zip(edges, edges[1:]))
    tail = scipy_integrate.quad(given_variance, edges[-1], math.inf, epsabs=1e-13, limit=200)[0]
    return min(1.0, total + tail)


def detectable(sd: float, n: int, target: float = 0.8, level: float = LEVEL) -> float:
    """The smallest |difference| a paired t-test of n seeds at `level` finds with probability
    `target`, given the spread `sd` of the differences: the root of power(delta) = target
    (scipy's brentq, to a relative 1e-12; power is increasing in delta > 0)."""
    if not 1.0 - level < target < 1.0:
        raise ValueError(f"target power must lie in (alpha, 1) = ({1.0 - level}, 1), got {target}")
    hi = sd
    while power(hi, sd, n, level) < target:     # bracket the root: double until power exceeds target
        hi *= 2.0
    return float(scipy_optimize.brentq(lambda d: power(d, sd, n, level) - target, 0.0, hi, rtol=1e-12))
