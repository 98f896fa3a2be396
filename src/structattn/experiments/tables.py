"""The markdown every results table shares: mean ± std cells and the paired-comparison table
(:func:`structattn.experiments.stats.paired_difference` rows with their verdict)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["COMPARISON_HEADER", "comparison_row", "comparison_table", "mean_std_cell", "verdict"]

COMPARISON_HEADER = [
    "| comparison (paired by seed) | Δ mean (pp) | 95% interval | verdict |",
    "|---|---:|---|---|",
]


def mean_std_cell(mean: float, std: float) -> str:
    return f"{mean:.2f} ± {std:.2f}"


def verdict(d: dict[str, Any], a_better: str, b_better: str) -> str:
    """The words for a paired difference ``a - b``: which is better, or "inconclusive"."""
    return {"a better": a_better, "b better": b_better}.get(d["verdict"], "inconclusive")


def comparison_row(label: str, d: dict[str, Any], words: str) -> str:
    """One row of the paired-comparison table: the mean difference and its 95% interval."""
    return f"| {label} | {d['mean']:+.2f} | [{d['ci_low']:+.2f}, {d['ci_high']:+.2f}] | {words} |"


def comparison_table(rows: Sequence[tuple[str, dict[str, Any], str]]) -> list[str]:
    """The header and one row per ``(label, difference, verdict words)``."""
    return [*COMPARISON_HEADER, *(comparison_row(*r) for r in rows)]
