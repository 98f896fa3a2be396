"""Every baseline of a GL-Fusion preset over seeds, without training GL-Fusion: the same targets,
prompts (subgraphs) and encodings the runs of those seeds use, so the table can be set beside
finished runs, including runs of earlier versions that lacked a baseline.

    structattn glfusion baselines --preset recipe --seeds 0 1 2 \\
        --against results/glfusion-ablate/ablations.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from structattn.engine import json_safe
from structattn.errors import ConfigError

from ..stats import mean_std, paired_difference
from ..tables import comparison_table, mean_std_cell, verdict
from .baselines import BASELINE_NAMES, LABEL_BASELINES
from .config import load_glfusion

__all__ = ["baselines_over_seeds", "baselines_table"]


def _one_seed(config, preset: str, seed: int, overrides: dict, models=None) -> dict:
    from .run import NodeClassification

    cfg = load_glfusion(config, preset, seed=seed, **overrides)
    llm, encoder = models() if models is not None else (None, None)
    task = NodeClassification(cfg, llm=llm, encoder=encoder, progress=False)
    task.build_data()  # targets, prompts, encodings: what a run of this seed builds
    return {"targets": {k: len(v) for k, v in task.targets.items()},
            "data_source": task.graph.source, "baselines": task.baselines()}  # fmt: skip


def _against(path: Path, seeds: list[int]) -> dict[int, float]:
    """The full model's test ensemble accuracy (%) per seed in an ``ablations.json``."""
    try:
        runs = json.loads(Path(path).read_text())["runs"]["full"]
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"--against {path}: not an ablations.json ({err})") from None
    return {s: 100 * runs[str(s)]["heads"]["test"]["ensemble"] for s in seeds if str(s) in runs}


def baselines_over_seeds(
    preset: str = "recipe",
    seeds: tuple[int, ...] = (0, 1, 2),
    config: str | Path = "glfusion",
    against: Path | None = None,
    models=None,
    **overrides: Any,
) -> dict[str, Any]:
    """Every baseline for every seed; with ``against`` (an ``ablations.json``), the full model's
    ensemble minus each label-aware baseline, paired by seed."""
    if not seeds:
        raise ConfigError("seeds must name at least one seed")
    per_seed = {s: _one_seed(config, preset, s, overrides, models) for s in seeds}
    out: dict[str, Any] = {"preset": preset, "seeds": list(seeds), "per_seed": per_seed}
    if against is not None:
        full = _against(against, list(seeds))
        common = [s for s in seeds if s in full]
        out["against"] = str(against)
        out["full_ensemble"] = full
        out["full_minus"] = {
            k: {**paired_difference([full[s] for s in common],
                                    [100 * per_seed[s]["baselines"][k]["test"] for s in common]),
                "seeds": common}
            for k in LABEL_BASELINES
        }  # fmt: skip
    return json_safe(out)


def baselines_table(out: dict[str, Any]) -> str:
    """Mean ± std of each baseline's test (and validation) accuracy, then the paired
    differences when a finished ablation was given."""
    seeds = out["seeds"]
    first = out["per_seed"][seeds[0]]
    lines = [
        f"Baselines of preset `{out['preset']}`, seeds {seeds}, on {first['data_source']}; "
        f"targets {first['targets']} per seed. Accuracy (%), mean ± std over seeds.",
        "",
        "| baseline | val | test |",
        "|---|---:|---:|",
    ]
    for key, name in BASELINE_NAMES.items():
        vals = [out["per_seed"][s]["baselines"][key] for s in seeds]
        val = mean_std_cell(*mean_std([100 * v["val"] for v in vals]))
        test = mean_std_cell(*mean_std([100 * v["test"] for v in vals]))
        lines.append(f"| {name} | {val} | {test} |")
    if "full_minus" in out:
        full = out["full_ensemble"]
        cell = mean_std_cell(*mean_std(list(full.values())))
        lines += ["", f"GL-Fusion full ensemble ({out['against']}): {cell}", ""]
        rows = [(f"GL-Fusion full − {BASELINE_NAMES[k]}", d,
                 verdict(d, "GL-Fusion better", "the baseline better"))
                for k, d in out["full_minus"].items()]  # fmt: skip
        lines += comparison_table(rows)
    return "\n".join(lines)
