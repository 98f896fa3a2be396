"""The markdown every results table shares: mean ± std cells and the paired-comparison table
(:func:`structattn.experiments.stats.paired_difference` rows with their verdict)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["COMPARISON_HEADER", "comparison_row", "comparison_table", "mean_std_cell", "verdict"]

COMPARISON_HEADER = [
    "| comparison (paired by seed) | Δ mean (pp) | 95% interval | verdict |",
    "|---|---:|---|---|",
]


def mean_std_cell(mean: float | None, std: float | None) -> str:
    """``mean ± std``; the mean alone where there is no spread (one seed), ``-`` for none."""
    if mean is None or math.isnan(mean):
        return "-"
    return f"{mean:.2f}" if std is None or math.isnan(std) else f"{mean:.2f} ± {std:.2f}"


def verdict(d: dict[str, Any], a_better: str, b_better: str) -> str:
    """The words for a paired difference ``a - b``: which is better, or "inconclusive"."""
    return {"a better": a_better, "b better": b_better}.get(d["verdict"], "inconclusive")


def comparison_row(label: str, d: dict[str, Any], words: str) -> str:
    """One row of the paired-comparison table: the mean difference and its 95% interval (a
    difference read back from JSON may hold null for what one seed or none cannot give)."""
    low, high = d["ci_low"], d["ci_high"]
    finite = low is not None and high is not None and math.isfinite(low) and math.isfinite(high)
    interval = f"[{low:+.2f}, {high:+.2f}]" if finite else "- (one seed: no interval)"
    mean = "-" if d["mean"] is None or math.isnan(d["mean"]) else f"{d['mean']:+.2f}"
    return f"| {label} | {mean} | {interval} | {words} |"


def comparison_table(rows: Sequence[tuple[str, dict[str, Any], str]]) -> list[str]:
    """The header and one row per ``(label, difference, verdict words)``."""
    return [*COMPARISON_HEADER, *(comparison_row(*r) for r in rows)]
