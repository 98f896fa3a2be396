"""Statistics that say what they mean: mean ± std per model and paired differences with a 95%
confidence interval (Student's t over seeds), "inconclusive" where the interval covers 0."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["mean_std", "paired_difference"]


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (NaN for none; one value has a mean but no spread, so
    its standard deviation is None, never a measured 0; None also survives a JSON round trip)."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return float("nan"), float("nan")
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None


def paired_difference(
    a: Sequence[float], b: Sequence[float], confidence: float = 0.95
) -> dict[str, float | int | str]:
    """``a - b`` paired by position (the same seed): mean, 95% t-interval, and a verdict.

    ``verdict`` is ``"a better"`` / ``"b better"`` when the interval excludes 0, else
    ``"inconclusive"`` (also with fewer than two pairs: no interval can be formed)."""
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
    diffs = [x - y for x, y in zip(a, b)]
    n = len(diffs)
    if n == 0:
        nan = float("nan")
        return {"n": 0, "mean": nan, "std": nan, "ci_low": nan, "ci_high": nan,
                "verdict": "inconclusive"}  # fmt: skip
    mean, std = mean_std(diffs)
    if n < 2:
        return {"n": n, "mean": mean, "std": std, "ci_low": -math.inf, "ci_high": math.inf,
                "verdict": "inconclusive"}  # fmt: skip
    from scipy.stats import t

    half = float(t.ppf(0.5 + confidence / 2, n - 1)) * std / math.sqrt(n)
    low, high = mean - half, mean + half
    verdict = "a better" if low > 0 else "b better" if high < 0 else "inconclusive"
    return {"n": n, "mean": mean, "std": std, "ci_low": low, "ci_high": high, "verdict": verdict}
