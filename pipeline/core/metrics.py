"""Evaluation estimators (spec section 10).

Per problem with n samples and c correct: mean@n = c/n; unbiased pass@k in the stable
product form; best@k = expected max reward among k of the n samples (non-binary
rewards); across benchmarks the problem-weighted average; across seeds mean and sample
std (ddof 1); the MATH-500 difficulty split by base-model accuracy p0.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def mean_at_k(correct: Sequence[int], n: int) -> float:
    """Mean over problems of c_p / n (mean@n; equals pass@1)."""
    return sum(c / n for c in correct) / len(correct)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k) = 1 - prod_{j=n-c+1}^{n} (1 - k/j)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / j for j in range(n - c + 1, n + 1))


def best_at_k(rewards: Sequence[float], k: int) -> float:
    """E[max of k of the n rewards] = sum_{j>=k} r_(j) C(j-1, k-1) / C(n, k), r ascending."""
    r, n = sorted(rewards), len(rewards)
    if not 1 <= k <= n:
        raise ValueError(f"best@k needs 1 <= k <= n, got k={k}, n={n}")
    return sum(r[j - 1] * math.comb(j - 1, k - 1) for j in range(k, n + 1)) / math.comb(n, k)


def problem_weighted_average(scores: Mapping[str, float], sizes: Mapping[str, int]) -> float:
    """sum_b n_b score_b / sum_b n_b: every problem counts once, whatever its benchmark."""
    missing = set(scores) - set(sizes)
    if missing:
        raise ValueError(f"no size for benchmarks {sorted(missing)}")
    return sum(sizes[b] * s for b, s in scores.items()) / sum(sizes[b] for b in scores)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; nan for one value) across seeds."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def difficulty_split(p0: Mapping[str, float], correct: Mapping[str, int], n: int) -> dict[str, float]:
    """Spec 10 / paper Fig. 5: problems bucketed by the base model's mean@n p0; the hard
    bucket (p0 = 0) reports the fraction solved at least once, the others mean@n."""
    hard = [correct[p] > 0 for p, v in p0.items() if v == 0]
    mid = [correct[p] / n for p, v in p0.items() if 0 < v <= 0.75]
    easy = [correct[p] / n for p, v in p0.items() if v > 0.75]
    avg = lambda xs: sum(xs) / len(xs) if xs else float("nan")   # noqa: E731
    return {"p0=0 pass@n": avg(hard), "0<p0<=0.75 mean@n": avg(mid), "p0>0.75 mean@n": avg(easy),
            "count p0=0": len(hard), "count mid": len(mid), "count easy": len(easy)}
