"""The results of one code-names run as markdown: scores per split, and test predictions beside
the true names."""

from __future__ import annotations

from typing import Any

__all__ = ["run_table"]

METRICS = ("f1", "precision", "recall", "exact")


def run_table(results: dict[str, Any]) -> str:
    """Validation and test scores (%, OGB's ogbg-code2 definitions) and example predictions."""
    n = results.get("examples", {})
    lines = [
        f"code-names (Python functions of 2025 wheels, built like ogbg-code2), model "
        f"`{results['model']}`, best step {results.get('best_step')}; examples: "
        + ", ".join(f"{k} {v}" for k, v in n.items()),
        "",
        "| split | " + " | ".join(METRICS) + " |",
        "|---|" + "---:|" * len(METRICS),
    ]
    for split in ("val", "test"):
        s = results[split]
        lines.append(f"| {split} | " + " | ".join(f"{100 * s[m]:.2f}" for m in METRICS) + " |")
    shown = results.get("test_examples") or []
    if shown:
        lines += ["", "| function (test) | true | predicted |", "|---|---|---|"]
        for ex in shown:
            true, pred = " ".join(ex["true"]), " ".join(ex["predicted"]) or "(nothing)"
            lines.append(f"| `{ex['qualname']}` | {true} | {pred} |")
    return "\n".join(lines)
