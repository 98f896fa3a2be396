"""GL-Fusion's ablations: every variant for every seed on one preset, one table, paired
statistics against the full model and the better label-aware baseline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from structattn.engine import config_to_dict, json_safe
from structattn.engine.config import default_config
from structattn.errors import ConfigError, RunError

from ..stats import paired_difference
from ..sweep import SweepRun, finished_folders, read_finished, run_sweep
from .baselines import LABEL_BASELINES
from .config import GLFusionTrainConfig, load_glfusion
from .report import ablation_table
from .run import train_glfusion

__all__ = ["GLFUSION_ABLATIONS", "ablate_glfusion", "ablation_statistics"]

#: GL-Fusion ablations: config changes from the preset, each trained on the same splits.
GLFUSION_ABLATIONS: dict[str, dict[str, Any]] = {
    "full": {},
    "no-neighbour-labels": {"show_neighbour_labels": False},
    "no-message-passing": {"message_passing_layers": []},
    "no-cross-attention": {"cross_attention_layers": []},
    "gnn-head-only": {"heads": "gnn"},
    "lm-head-only": {"heads": "lm"},
    "edge-texts": {"edge_texts": True},  # edge features from the edge texts, not one embedding
    "paper-form": {"variant": "paper"},  # the paper's node tokens instead of the gated form
}


def _sweep_run(root: Path, variant: str, seed: int, config, preset, overrides, progress,
               models) -> SweepRun:  # fmt: skip
    """One variant and seed as a sweep run (trained, or resumed, when it is missing)."""
    run_dir = root / variant / f"seed{seed}"

    def resolved(resume: bool = False):
        changes = {**overrides, **GLFUSION_ABLATIONS[variant], "seed": seed,
                   "run_dir": run_dir, "resume": resume}  # fmt: skip
        return load_glfusion(config, preset, **changes)

    def train_it(resume: bool) -> dict:
        cfg = resolved(resume)
        llm, encoder = models() if models is not None else (None, None)
        result = train_glfusion(cfg, progress=progress, llm=llm, encoder=encoder)
        if "paused_at" in result:
            raise RunError(f"{run_dir} paused at step {result['paused_at']}; run again")
        return result

    label = f"[glfusion ablate] {variant} seed {seed}"
    defaults = default_config(GLFusionTrainConfig)
    return SweepRun((variant, seed), run_dir, label, train_it, lambda: config_to_dict(resolved()),
                    defaults)  # fmt: skip


def _collect_runs(root: Path, variants, seeds, train_missing: bool, **train):
    """``{variant: {seed: results}}``: finished runs read back, missing ones trained (or, with
    ``train_missing=False``, left out), and every other finished run of the folder whose config
    matches (the table is their union); plus those of another configuration, named."""
    progress = train["progress"]
    runs = [_sweep_run(root, v, s, **train) for v in variants for s in seeds]
    done = run_sweep(runs, train_missing, root, log=None if progress else (lambda text: None))
    asked = {r.key for r in runs}
    others = [_sweep_run(root, v, s, **train) for v, s in finished_folders(root)
              if v in GLFUSION_ABLATIONS and (v, s) not in asked]  # fmt: skip
    read_back, left_out = read_finished(others)
    out: dict[str, dict[int, dict]] = {}
    for (variant, seed), result in sorted({**read_back, **done.finals}.items()):
        out.setdefault(variant, {})[seed] = result
    return out, left_out


def _ensembles(runs: dict[int, dict], seeds: list[int]) -> list[float]:
    return [runs[s]["heads"]["test"]["ensemble"] * 100 for s in seeds]


def ablation_statistics(runs: dict[str, dict[int, dict]], variants) -> dict[str, Any]:
    """The better label-aware baseline (chosen on validation), the full model's ensemble minus
    it, and each ablation's ensemble minus the full model's, all paired by seed."""
    full = runs["full"]
    ordered = sorted(full)
    present = [k for k in LABEL_BASELINES if all(k in full[s]["baselines"] for s in ordered)]
    best_key = max(present, key=lambda k: sum(full[s]["baselines"][k]["val"] for s in ordered))
    diff = paired_difference(
        _ensembles(full, ordered),
        [full[s]["baselines"][best_key]["test"] * 100 for s in ordered],
    )
    # Does each path earn its place? (a head-only variant's ensemble is that head)
    ablation_diffs = {}
    for variant in variants:
        common = sorted(set(runs.get(variant, {})) & set(full)) if variant != "full" else []
        if common:
            d = paired_difference(_ensembles(runs[variant], common), _ensembles(full, common))
            ablation_diffs[variant] = {**d, "seeds": common}
    return {
        "best_label_baseline": best_key,
        "full_minus_best_label_baseline": diff,
        "ablation_minus_full": ablation_diffs,
    }


def ablate_glfusion(
    preset: str = "recipe",
    seeds: tuple[int, ...] = (0, 1, 2),
    out_dir: str | Path = "results/glfusion",
    variants: tuple[str, ...] = tuple(GLFUSION_ABLATIONS),
    progress: bool = True,
    models=None,
    config: str | Path = "glfusion",
    train_missing: bool = True,
    **overrides,
) -> dict[str, Any]:
    """Train every variant for every seed on one preset (finished runs are kept, interrupted
    ones resumed) and write one table: GL-Fusion's heads per variant beside the four baselines,
    mean ± std over seeds, the paired difference between the full model's ensemble and the
    better label-aware baseline, and each ablation's paired difference from the full model.
    ``train_missing=False`` trains nothing and tables the finished runs only (a partial table says
    how many seeds each row has). ``models()`` may return fresh ``(llm, encoder)`` pairs
    (tests); otherwise they load offline per run."""
    unknown = [v for v in variants if v not in GLFUSION_ABLATIONS]
    if unknown:
        raise ConfigError(f"unknown variants {unknown}; choose from {list(GLFUSION_ABLATIONS)}")
    if "full" not in variants:
        variants = ("full", *variants)
    root = Path(out_dir) / preset
    runs, left_out = _collect_runs(root, variants, seeds, train_missing, config=config,
                                   preset=preset, overrides=overrides, progress=progress,
                                   models=models)  # fmt: skip
    variants = tuple(v for v in GLFUSION_ABLATIONS if v in variants or v in runs)
    if not runs.get("full"):
        raise RunError(f"no finished run of the full model under {root}; train it first")
    stats = ablation_statistics(runs, variants)
    table = ablation_table(preset, variants, runs, stats)
    for reason in left_out:
        table += f"\n\nNot in the table (finished, not reusable here): {reason}"
    summary = {
        "preset": preset,
        "seeds": sorted(runs["full"]),
        "variants": list(variants),
        "runs": {v: {str(s): r for s, r in rs.items()} for v, rs in runs.items()},
        "left_out": left_out,
        **stats,
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "ablations.md").write_text(table + "\n")
    (root / "ablations.json").write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    return {"table": table, **summary}
