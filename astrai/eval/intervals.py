"""Confidence intervals for accuracies, so a reader can tell a real change from noise.

An accuracy over n problems is a binomial proportion; the Wilson score interval stays
inside [0, 1] and keeps its coverage near 0 and 1, where the normal approximation
(p ± 1.96·sqrt(p(1-p)/n)) collapses to a point.
"""

from __future__ import annotations

import math

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
