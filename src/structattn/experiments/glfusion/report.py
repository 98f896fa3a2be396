"""The markdown tables: one run's results beside the baselines and the paper, and the
ablations over seeds with their paired differences."""

from __future__ import annotations

from typing import Any

from ..stats import mean_std
from ..tables import comparison_table, mean_std_cell, verdict
from .baselines import BASELINE_NAMES

__all__ = ["PAPER_ARXIV", "ablation_table", "results_table"]

#: The paper's ogbn-arxiv test accuracies (%), Llama-3-8B.
PAPER_ARXIV = {"ensemble": 78.20, "gnn": 77.09, "lm": 76.43}

#: The three heads as the results table names them.
HEAD_NAMES = {
    "ensemble": "GL-Fusion ensemble (GNN + LM)",
    "gnn": "GL-Fusion GNN head",
    "lm": "GL-Fusion LM head (label names scored)",
}


def _data(r: dict[str, Any]) -> str:
    return r["data_source"] + (" **(stand-in)**" if r["stand_in"] else "")


def _of_splits(r: dict[str, Any]) -> str:
    """`` of the splits' {...} nodes`` when a split was sampled, not scored whole."""
    sizes = r.get("split_sizes")
    if not sizes or all(r["targets"].get(k) == n for k, n in sizes.items()):
        return ""
    return f" of the splits' {sizes} nodes"


def results_table(r: dict[str, Any]) -> str:
    """One run: val / test accuracy of each head and baseline; on ogbn-arxiv the paper's
    figures in a column beside (on any other graph they would compare different data)."""
    paper = r.get("paper_ogbn_arxiv")
    h, b = r["heads"], r["baselines"]
    rows = [(name, h["val"][k], h["test"][k], paper and paper[k]) for k, name in HEAD_NAMES.items()]
    rows += [
        (name, b[k]["val"], b[k]["test"], None) for k, name in BASELINE_NAMES.items() if k in b
    ]
    header = "| model | val | test |" + (" paper (ogbn-arxiv) |" if paper else "")
    lines = [
        f"GL-Fusion node classification on {_data(r)}; LLM {r['llm']}; targets "
        f"{r['targets']}{_of_splits(r)}. Accuracy (%)"
        + ("; the paper's column is ogbn-arxiv with Llama-3-8B." if paper else "."),
        "",
        header,
        "|---|---:|---:|" + ("---:|" if paper else ""),
    ]
    for name, val, test, p in rows:
        cells = f"| {name} | {100 * val:.2f} | {100 * test:.2f} |"
        if paper:
            cells += f" {'-' if p is None else f'{p:.2f}'} |"
        lines.append(cells)
    lines.append("")
    lines.append(
        f"Median training step {r['median_step_ms'] or float('nan'):.0f} ms; "
        f"wall time {r['wall_s'] / 60:.1f} min."
    )
    return "\n".join(lines)


def _cell(values: list[float]) -> str:
    return mean_std_cell(*mean_std([100 * v for v in values]))


def _variant_row(variant: str, runs: dict[int, dict]) -> str:
    if not runs:
        return f"| GL-Fusion {variant} | none finished | - | - | - | - |"
    done = sorted(runs)
    rs = [runs[s] for s in done]
    heads = {h: _cell([r["heads"]["test"][h] for r in rs]) for h in ("ensemble", "gnn", "lm")}
    for h in ("gnn", "lm"):  # a head its variant does not train is not a result
        if any(r.get("heads_trained", "both") not in ("both", h) for r in rs):
            heads[h] = "(not trained)"
    weights = sorted({r["ensemble_weight"] for r in rs})
    return (
        f"| GL-Fusion {variant} | {', '.join(map(str, done))} | {heads['ensemble']} | "
        f"{heads['gnn']} | {heads['lm']} | {', '.join(f'{w:g}' for w in weights)} |"
    )


def _baseline_rows(full: dict[int, dict]) -> list[str]:
    ordered = sorted(full)
    rows = []
    for key, name in BASELINE_NAMES.items():
        vals = [full[s]["baselines"][key]["test"] for s in ordered if key in full[s]["baselines"]]
        if vals:
            rows.append(f"| {name} | {', '.join(map(str, ordered))} | {_cell(vals)} | - | - | - |")
    return rows


def _comparison_rows(stats: dict[str, Any]) -> list[str]:
    best_key, diff = stats["best_label_baseline"], stats["full_minus_best_label_baseline"]
    rows = [(f"GL-Fusion full ensemble − {BASELINE_NAMES[best_key]}", diff,
             verdict(diff, "GL-Fusion better", f"{best_key} better"))]  # fmt: skip
    for variant, d in stats["ablation_minus_full"].items():
        word = verdict(d, "the ablation is better", "costs accuracy")
        rows.append((f"GL-Fusion {variant} − full (ensemble)", d, word))
    return ["", *comparison_table(rows)]


def ablation_table(
    preset: str, variants: tuple[str, ...], runs: dict[str, dict[int, dict]], stats: dict
) -> str:
    """Test accuracy mean ± std per variant and baseline, then the paired differences
    (``stats`` from :func:`~structattn.experiments.glfusion.ablate.ablation_statistics`)."""
    full = runs["full"]
    ordered = sorted(full)
    first = full[ordered[0]]
    lines = [
        f"GL-Fusion ablations, preset `{preset}`, seeds {ordered}: test accuracy (%) mean ± std. "
        f"Data: {_data(first)}; LLM {first['llm']}; targets {first['targets']}.",
        "",
        "| model | seeds | ensemble | GNN head | LM head | ensemble weight |",
        "|---|---|---:|---:|---:|---|",
    ]
    lines += [_variant_row(v, runs.get(v, {})) for v in variants]
    lines += _baseline_rows(full)
    lines += _comparison_rows(stats)
    return "\n".join(lines)
