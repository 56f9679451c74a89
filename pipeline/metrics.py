"""Evaluation estimators (spec section 10)."""
from __future__ import annotations

import math
from collections.abc import Sequence


def mean_at_k(correct: Sequence[int], n: int) -> float:
    """Mean over problems of c_p / n (mean@n; equals pass@1)."""
    return sum(c / n for c in correct) / len(correct)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k), in the stable product form."""
    if k > n:
        raise ValueError(f"pass@k needs k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / j for j in range(n - c + 1, n + 1))
