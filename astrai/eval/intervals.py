"""Confidence intervals for accuracies, so a reader can tell a real change from noise.

An accuracy over n problems is a binomial proportion; the Wilson score interval stays
inside [0, 1] and keeps its coverage near 0 and 1, where the normal approximation
(p ± 1.96·sqrt(p(1-p)/n)) collapses to a point. A mean of many values (a preference
margin over hundreds of pairs) takes the normal approximation.
"""

from __future__ import annotations

import math
from typing import Sequence

from astrai.errors import DataError

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of ``successes`` out of ``n`` (95% by default)."""
    if n <= 0 or not 0 <= successes <= n:
        raise DataError(f"an interval needs 0 <= successes <= n and n > 0, got {successes} of {n}")
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # at 0 or n successes the bound on that side is exactly 0 or 1 (rounding would miss it)
    return (0.0 if successes == 0 else max(0.0, centre - half)), (1.0 if successes == n else min(1.0, centre + half))


def mean_interval(values: Sequence[float], z: float = Z_95) -> tuple[float, float]:
    """The normal-approximation interval of the mean of ``values`` (95% by default): mean ± z·s/√n."""
    n = len(values)
    if n < 2:
        raise DataError(f"an interval of a mean needs at least 2 values, got {n}")
    mean = sum(values) / n
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
    return mean - z * spread, mean + z * spread
