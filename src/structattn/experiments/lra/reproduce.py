"""Reproduce the paper's comparison: HKT vs the retrained MHA baseline on the three tasks.

``reproduce(preset, seeds, tasks)`` trains the shipped ``<task>-{hkt,mha}`` experiments for every
seed into ``<out_dir>/<preset>/<task>-<variant>/seed<k>`` (runs with a ``final.json`` are
skipped, runs with a checkpoint are resumed), then writes ``results.md`` / ``results.json`` and
PNG plots beside them (validation accuracy against step, and the learned level weights and
beta) over every finished run in the folder: a later call with other seeds or variants adds
rows, never drops them.

Beyond HKT and MHA, ``variants`` adds models trained on the same budget, data order and seeds:
``mha-wide`` (MHA widened to HKT's parameter count, so that extra parameters are not mistaken for
structure) and the HKT ablations (:data:`VARIANTS`). ``lr_sweep`` tunes the learning rate of HKT
and of MHA on validation (one seed per rate, never the test split) before the seeds run; the
variants use the rate of the model they derive from. Every table carries the shallow baselines
(:mod:`.baselines`), the paired difference of each comparison with its 95% interval and the word
"inconclusive" where it covers 0 (:mod:`.stats`), and whether each run's validation curve had
flattened (no gain of 1 pp or more in its last fifth).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from structattn.data import TASKS, load_task
from structattn.engine import RunDir, config_to_dict, json_safe
from structattn.engine.config import default_config, merge_overrides
from structattn.errors import ConfigError

from ..stats import mean_std, paired_difference
from ..sweep import (
    SweepRun,
    check_rates,
    finished_folders,
    plateau,
    read_finished,
    read_val_curve,
    run_sweep,
    tune_lr,
)
from ..tables import comparison_table, mean_std_cell, verdict
from .baselines import shallow_baselines
from .config import LRAConfig, load_lra
from .diagnose import diagnose
from .experiment import build_model, train

__all__ = ["PAPER_RESULTS", "VARIANTS", "reproduce", "results_table", "variant_spec"]

#: The paper's test accuracies (%, mean +- std over 3 seeds) and sequence lengths.
PAPER_RESULTS = {
    "listops": {"data": "synthetic ListOps", "T": 512, "hkt": (55.10, 0.29), "mha": (50.33, 0.12)},
    "image": {"data": "sequential CIFAR-10", "T": 1024, "hkt": (35.45, 0.09), "mha": (34.01, 0.19)},
    "text": {"data": "IMDB char-level", "T": 1024, "hkt": (70.19, 0.57), "mha": (62.72, 0.40)},
}
PAPER_OVERHEAD = 1.31
MODELS = ("hkt", "mha")

#: Models trained by ``reproduce``: (experiment model, model overrides, what it is). ``"wide"``
#: widens MHA to HKT's parameter count (found for each task's data).
VARIANTS: dict[str, tuple[str, Any, str]] = {
    "hkt": ("hkt", {}, "HKT"),
    "mha": ("mha", {}, "MHA"),
    "mha-wide": ("mha", "wide", "MHA widened to HKT's parameter count"),
    "hkt-no-hybrid": ("hkt", {"hkt": {"hybrid": False}}, "HKT without the hybrid head"),
    "hkt-L1-hybrid": ("hkt", {"hkt": {"n_levels": 1}}, "HKT with L = 1 plus the hybrid head"),
    "hkt-fixed-lambda": ("hkt", {"hkt": {"learn_levels": False}}, "HKT with fixed uniform λ"),
    "hkt-L2": ("hkt", {"hkt": {"n_levels": 2}}, "HKT with L = 2"),
    "hkt-L4": ("hkt", {"hkt": {"n_levels": 4}}, "HKT with L = 4"),
}
ABLATIONS = ("hkt", "hkt-no-hybrid", "hkt-L1-hybrid", "hkt-fixed-lambda", "hkt-L2", "hkt-L4")
SWEEP_SEED = 1000  # the learning-rate sweep's seed, apart from the reported seeds


def _wide_width(cfg, data, target: int) -> int:
    """The MHA width (a multiple of the head count) whose parameter count is closest to
    ``target``."""
    heads = cfg.model.n_heads
    best, best_gap = cfg.model.d_model, None
    for width in range(cfg.model.d_model, 4 * cfg.model.d_model + 1, heads):
        n = sum(p.numel() for p in build_model(_with_model(cfg, d_model=width), data).parameters())
        gap = abs(n - target)
        if best_gap is None or gap < best_gap:
            best, best_gap = width, gap
    return best


def variant_spec(name: str) -> tuple[str, Any, str]:
    """``(experiment model, model overrides, what it is)`` of a variant: one of
    :data:`VARIANTS`, or any other attention registered in :data:`structattn.hkt.model.ATTENTIONS`
    (the MHA experiment with ``model.attention`` set to it, trained at MHA's rate)."""
    if name in VARIANTS:
        return VARIANTS[name]
    if name in known_variants():
        return ("mha", {"attention": name}, f"{name} attention (registered)")
    raise ConfigError(f"unknown variant {name!r}; choose from {known_variants()}")


def known_variants() -> list[str]:
    """:data:`VARIANTS`, then every other registered attention, in the order tables use."""
    from structattn.hkt.model import ATTENTIONS

    return [*VARIANTS, *(a for a in ATTENTIONS if a not in VARIANTS)]


def _with_model(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, model=cfg.model.replace(**changes))


def _variant_overrides(variant: str, overrides, data_dir, lr) -> dict[str, Any]:
    """The overrides of one variant's runs: the caller's, the data folder, the tuned rate and
    the variant's model changes."""
    change = variant_spec(variant)[1]
    extra = dict(overrides or {})
    if data_dir is not None:
        extra["data"] = {**extra.get("data", {}), "data_dir": str(data_dir)}
    if lr is not None:
        extra["optim"] = {**extra.get("optim", {}), "lr": lr}
    if isinstance(change, dict) and change:
        extra["model"] = merge_overrides(extra.get("model", {}), change)
    return extra


class _Jobs:
    """Configs and data of one ``reproduce`` call (each task's data loaded once)."""

    def __init__(self, preset, overrides, data_dir, progress):
        self.preset, self.overrides, self.data_dir = preset, overrides, data_dir
        self.progress = progress
        self.data: dict[str, Any] = {}

    def config(self, task, variant, seed, run_dir, lr=None, resume=False):
        extra = _variant_overrides(variant, self.overrides, self.data_dir, lr)
        model, change, _ = variant_spec(variant)
        cfg = load_lra(f"{task}-{model}", self.preset, seed=seed, run_dir=str(run_dir),
                       resume=resume, **extra)  # fmt: skip
        data = self.task_data(cfg)
        if change == "wide":  # HKT's parameter count, from the HKT twin
            twin_overrides = {k: v for k, v in extra.items() if k != "optim"}
            twin = load_lra(f"{task}-hkt", self.preset, **twin_overrides)
            target = sum(p.numel() for p in build_model(twin, data).parameters())
            cfg = _with_model(cfg, d_model=_wide_width(cfg, data, target))
        return cfg, data

    def task_data(self, cfg):
        key = repr(cfg.data)
        if key not in self.data:
            self.data[key] = load_task(cfg.data)
        return self.data[key]

    def run(self, key, task, variant, seed, run_dir, label, lr=None) -> SweepRun:
        def train_it(resume: bool) -> dict:
            cfg, data = self.config(task, variant, seed, run_dir, lr, resume)
            return train(cfg, data=data, progress=self.progress)

        def config() -> dict:
            return config_to_dict(self.config(task, variant, seed, run_dir, lr)[0])

        return SweepRun(key, run_dir, label, train_it, config, default_config(LRAConfig))


def _check_args(tasks, seeds, variants, lr_sweep) -> None:
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise ConfigError(f"unknown task(s) {unknown}; choose from {list(TASKS)}")
    if not seeds:
        raise ConfigError("seeds must name at least one seed")
    bad = sorted(set(variants) - set(known_variants()))
    if bad:
        raise ConfigError(f"unknown variant(s) {bad}; choose from {known_variants()}")
    check_rates(lr_sweep)


def _tune(jobs: _Jobs, root: Path, tasks, variants, lr_sweep):
    """The learning rate of HKT and of MHA per task, chosen on validation (one seed)."""
    tuned, sweeps = {}, {}
    for task in tasks:
        for model in [m for m in MODELS if any(variant_spec(v)[0] == m for v in variants)]:

            def make(lr, task=task, model=model):
                label = f"[sweep] {task} {model} lr {lr:g} (seed {SWEEP_SEED})"
                run_dir = root / "sweep" / f"{task}-{model}" / f"lr{lr:g}"
                return jobs.run(("sweep", task, model, lr), task, model, SWEEP_SEED, run_dir,
                                label, lr)  # fmt: skip

            best, scores = tune_lr(lr_sweep, make, "val_acc", root=root)
            if best is not None:
                tuned[task, model] = best
                sweeps.setdefault(task, {})[model] = {"val_acc": scores, "chosen": f"{best:g}"}
    return tuned, sweeps


def _diagnostics(root: Path, tasks, seeds, finals) -> dict:
    """The theory diagnostics of each finished HKT run in the table (measured once, then read
    back)."""
    out = {}
    for task in tasks:
        for seed in seeds:
            if (task, "hkt", seed) not in finals:  # unfinished, or not reusable here
                continue
            rd = RunDir(root / f"{task}-hkt" / f"seed{seed}")
            path = rd.file("diagnostics") / "diagnostics.json"
            if path.is_file():
                out[task, seed] = json.loads(path.read_text())["summary"]
            elif rd.best.is_file():
                out[task, seed] = diagnose(rd.path, n_sequences=2, max_len=128)["summary"]
    return out


def _other_runs(jobs: _Jobs, root: Path, tuned, asked) -> list[SweepRun]:
    """The finished runs under ``root`` that this call did not ask for, as sweep runs of the
    configuration this call would give them (the table keeps those that match)."""
    runs, known = [], known_variants()
    for name, seed in finished_folders(root):
        task, _, variant = name.partition("-")
        if task in TASKS and variant in known and (task, variant, seed) not in asked:
            lr = tuned.get((task, variant_spec(variant)[0]))
            runs.append(jobs.run((task, variant, seed), task, variant, seed,
                                 root / name / f"seed{seed}", name, lr))  # fmt: skip
    return runs


def _table_axes(finals, tasks, variants, seeds) -> tuple[list[str], list[str], list[int]]:
    """Tasks, variants and seeds of the table: those asked for and those of every finished run
    read back, in the shipped order."""
    keys = set(finals)
    tasks = [t for t in TASKS if t in tasks or any(k[0] == t for k in keys)]
    variants = [v for v in known_variants() if v in variants or any(k[1] == v for k in keys)]
    return tasks, variants, sorted(set(seeds) | {k[2] for k in keys})


def reproduce(
    preset: str = "quick",
    seeds: Sequence[int] = (0, 1, 2),
    tasks: Sequence[str] = TASKS,
    out_dir: Path = Path("results/reproduce"),
    data_dir: Path | None = None,
    progress: bool = True,
    overrides: dict[str, Any] | None = None,
    variants: Sequence[str] = MODELS,
    lr_sweep: Sequence[float] | None = None,
    baselines: bool = True,
) -> dict[str, Any]:
    """Train what is missing, then summarise every run into a table, JSON and plots."""
    _check_args(tasks, seeds, variants, lr_sweep)
    root = Path(out_dir) / preset
    started = time.perf_counter()
    jobs = _Jobs(preset, overrides, data_dir, progress)
    tuned, sweeps = _tune(jobs, root, tasks, variants, lr_sweep) if lr_sweep else ({}, {})
    grid = [(t, v, s) for t in tasks for v in variants for s in seeds]
    runs = [
        jobs.run((t, v, s), t, v, s, root / f"{t}-{v}" / f"seed{s}",
                 f"[{i}/{len(grid)}] {t} {v} seed {s}", tuned.get((t, variant_spec(v)[0])))
        for i, (t, v, s) in enumerate(grid, 1)
    ]  # fmt: skip
    done = run_sweep(runs, root=root)
    others, left_out = read_finished(_other_runs(jobs, root, tuned, set(grid)))
    finals = {**others, **done.finals}
    tasks, variants, seeds = _table_axes(finals, tasks, variants, seeds)
    diagnostics = _diagnostics(root, tasks, seeds, finals) if "hkt" in variants else {}
    shallow = {}
    if baselines:
        for task in tasks:
            _, data = jobs.config(task, "mha", seeds[0], root / f"{task}-mha" / f"seed{seeds[0]}")
            shallow[task] = {k: {s: 100 * a for s, a in v.items()}
                             for k, v in shallow_baselines(data).items()}  # fmt: skip
    results = summarise(root, tasks, seeds, finals, diagnostics, variants, shallow)
    results["incomplete"] = done.incomplete
    results["left_out"] = left_out
    results["lr_sweep"] = {"rates": list(lr_sweep or []), "seed": SWEEP_SEED, "tasks": sweeps}
    results["wall_s"] = time.perf_counter() - started
    results["preset"] = preset
    results["overrides"] = overrides or {}
    (root / "results.json").write_text(json.dumps(json_safe(results), indent=2, allow_nan=False))
    (root / "results.md").write_text(results_table(results) + "\n")
    plot_curves(root, tasks, seeds, root / "val_accuracy.png", variants)
    plot_hkt_parameters(results, root / "hkt_levels_beta.png")
    return results


def summarise(
    root: Path, tasks, seeds, finals, diagnostics=None, variants=MODELS, shallow=None
) -> dict[str, Any]:
    rows = {}
    for task in tasks:
        row: dict[str, Any] = {"paper": PAPER_RESULTS[task]}
        ratios = []
        for model in dict.fromkeys((*MODELS, *variants)):
            runs = [finals[task, model, s] for s in seeds if (task, model, s) in finals]
            accs = [100 * r["test_acc"] for r in runs if r.get("test_acc") is not None]
            mean, std = mean_std(accs)
            row[model] = {
                "name": variant_spec(model)[2],
                "seeds": [s for s in seeds if (task, model, s) in finals],
                "test_acc": accs,
                "mean": mean,
                "std": std,
                "step_ms": [r["median_step_ms"] for r in runs],
                "parameters": runs[0]["parameters"] if runs else None,
                "plateau": [
                    plateau(root / f"{task}-{model}" / f"seed{s}")
                    for s in seeds
                    if (task, model, s) in finals
                ],  # fmt: skip
            }
            if runs:
                row["seq_len"] = runs[0].get("seq_len")
                row["data_source"] = runs[0]["data_source"]
                row["stand_in"] = runs[0]["stand_in"]
        for s in seeds:
            h, m = finals.get((task, "hkt", s)), finals.get((task, "mha", s))
            if h and m and h["median_step_ms"] and m["median_step_ms"]:
                ratios.append(h["median_step_ms"] / m["median_step_ms"])
        row["step_time_ratio"] = statistics.median(ratios) if ratios else None
        row["comparisons"] = {}
        for other in (v for v in variants if v != "hkt"):
            both = [s for s in seeds if (task, "hkt", s) in finals and (task, other, s) in finals]
            a = [100 * finals[task, "hkt", s]["test_acc"] for s in both]
            b = [100 * finals[task, other, s]["test_acc"] for s in both]
            if both and None not in a + b:
                row["comparisons"][f"hkt - {other}"] = {**paired_difference(a, b), "seeds": both}
        # the headline Δ pairs seeds too: a table read back from a folder may hold more seeds
        # of one model than of the other
        paired = row["comparisons"].get("hkt - mha")
        row["diff_pp"] = paired["mean"] if paired else float("nan")
        row["diff_seeds"] = paired["seeds"] if paired else []
        row["shallow"] = (shallow or {}).get(task, {})
        cue = row["shallow"].get("outermost_operator", {}).get("test")
        if cue is not None:  # ListOps: do the attention models clearly beat the cue?
            row["beats_outermost"] = {
                v: _clearly_above(row[v]["test_acc"], cue) for v in variants if row[v]["test_acc"]
            }
        diag = [diagnostics[task, s] for s in seeds if (task, s) in (diagnostics or {})]
        row["kappa"] = statistics.mean(d["kappa_mean"] for d in diag) if diag else None
        row["reciprocity"] = statistics.mean(d["reciprocity_mean"] for d in diag) if diag else None
        row["hkt_state"] = [
            finals[task, "hkt", s]["hkt"] for s in seeds if (task, "hkt", s) in finals
        ]
        rows[task] = row
    return {"seeds": list(seeds), "variants": list(variants), "tasks": rows, "root": str(root)}


def _clearly_above(accs: Sequence[float], level: float) -> bool:
    """The lower end of the 95% t-interval of the mean accuracy lies above ``level``."""
    if len(accs) < 2:
        return bool(accs) and min(accs) > level
    d = paired_difference(list(accs), [level] * len(accs))
    return bool(d["ci_low"] > 0)


def _acc_cell(x: dict[str, Any]) -> str:
    """Mean ± std of a model's test accuracy, "-" for a model not trained in this call."""
    return mean_std_cell(x["mean"], x["std"]) if x["test_acc"] else "-"


def results_table(results: dict[str, Any]) -> str:
    """The markdown comparison table."""
    lines = [
        f"HKT vs retrained MHA, preset `{results.get('preset', '?')}`, seeds "
        f"{results['seeds']}: test accuracy (%) mean ± std; paper figures beside (3 seeds).",
        "",
        "| task | data used | T | HKT | MHA | Δ (pp) | paper HKT | paper MHA | paper Δ "
        "| step time HKT/MHA | params HKT/MHA | HKT κ | HKT reciprocity |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for task, r in results["tasks"].items():
        p = r["paper"]
        data = r.get("data_source", "-")
        if r.get("stand_in"):
            data += " **(stand-in)**"
        ratio = f"{r['step_time_ratio']:.2f}x" if r["step_time_ratio"] else "-"
        h, m = r["hkt"], r["mha"]
        params = (
            f"{h['parameters'] / m['parameters']:.2f}x"
            if h["parameters"] and m["parameters"]
            else "-"
        )
        paired = r.get("diff_seeds") if h["test_acc"] and m["test_acc"] else None
        diff = f"{r['diff_pp']:+.2f}" if paired else "-"
        if paired and not h["seeds"] == m["seeds"] == paired:
            diff += f" (seeds {', '.join(map(str, paired))})"
        lines.append(
            f"| {task} | {data} | {r.get('seq_len') or '-'} "
            f"| {_acc_cell(h)} | {_acc_cell(m)} | {diff} "
            f"| {p['hkt'][0]:.2f} ± {p['hkt'][1]:.2f} "
            f"| {p['mha'][0]:.2f} ± {p['mha'][1]:.2f} | {p['hkt'][0] - p['mha'][0]:+.2f} "
            f"| {ratio} | {params} | {_num(r.get('kappa'))} | {_num(r.get('reciprocity'))} |"
        )
    paper_data = ", ".join(f"{t}: {p['data']} (T={p['T']})" for t, p in PAPER_RESULTS.items())
    lines += [
        "",
        f"Paper data: {paper_data}; "
        f"paper overhead {PAPER_OVERHEAD}x. Δ: HKT − MHA paired by seed, over the seeds both "
        "models finished. Step time: median training-step time of HKT over MHA, measured in "
        "this run (median over those seeds). HKT κ: Mardia kurtosis index b₂,p / p(p+2) of "
        "the per-level score vectors (1 for a Gaussian; the paper's κ ≈ 33 reads as b₂,p itself, "
        "15 times this index at L = 3: docs/theory.md), "
        "reciprocity: symmetric share of the bilinear forms (`structattn diagnose`), means over "
        "layers, heads and seeds.",
    ]
    for task, r in results["tasks"].items():
        lines += ["", *task_block(task, r, results)]
    if results.get("incomplete"):
        lines.append(
            "Not in the table (unfinished; rerun to resume): " + ", ".join(results["incomplete"])
        )
    for reason in results.get("left_out", []):
        lines.append(f"Not in the table (finished, not reusable here): {reason}")
    if "wall_s" in results:
        lines.append(f"Wall time of this reproduce call: {results['wall_s'] / 60:.1f} min.")
    return "\n".join(lines)


SHALLOW_NAMES = {
    "majority": "shallow: majority class",
    "token_counts_mlp": "shallow: MLP on token counts",
    "outermost_operator": "shallow: most frequent answer per outermost operator",
}


def task_block(task: str, r: dict[str, Any], results: dict[str, Any]) -> list[str]:
    """Every model of ``task`` beside the shallow baselines, and the paired comparisons."""
    data = r.get("data_source", "-") + (" **(stand-in)**" if r.get("stand_in") else "")
    lines = [
        f"### {task}: {data}, T = {r.get('seq_len') or '-'}",
        "",
        "| model | parameters | test accuracy (%) | seeds | curve flat at the end |",
        "|---|---:|---:|---|---|",
    ]
    for variant in results.get("variants", MODELS):
        m = r[variant]
        flat = m.get("plateau") or []
        flat_text = f"{sum(1 for f in flat if f)}/{len(flat)}" if flat else "-"
        params = f"{m['parameters']:,}" if m.get("parameters") else "-"
        lines.append(
            f"| {m['name']} | {params} | {mean_std_cell(m['mean'], m['std'])} "
            f"| {len(m['test_acc'])} | {flat_text} |"
        )
    for key, acc in r.get("shallow", {}).items():
        lines.append(f"| {SHALLOW_NAMES.get(key, key)} | - | {acc['test']:.2f} | - | - |")
    if r.get("comparisons"):
        rows = []
        for name, d in r["comparisons"].items():
            other = name.split(" - ")[1]
            rows.append(
                (f"HKT − {r[other]['name']}", d, verdict(d, "HKT better", f"{other} better"))
            )
        lines += ["", *comparison_table(rows)]
    if "beats_outermost" in r:
        cue = r["shallow"]["outermost_operator"]["test"]
        above = [v for v, ok in r["beats_outermost"].items() if ok]
        below = [v for v, ok in r["beats_outermost"].items() if not ok]
        text = (
            f"Above the outermost-operator cue ({cue:.2f}%, the lower end of the 95% interval "
            f"of the mean): {', '.join(above) or 'none'}"
        )
        if below:
            text += (
                f"; not clearly above it: {', '.join(below)}. A comparison involving those "
                "models does not count"
            )
        lines += ["", text + "."]
    sweep = results.get("lr_sweep", {}).get("tasks", {}).get(task)
    if sweep:
        parts = [
            f"{m}: "
            + ", ".join(f"{lr} → {100 * v:.2f}" for lr, v in s["val_acc"].items())
            + f" (chosen {s['chosen']})"
            for m, s in sweep.items()
        ]
        lines += ["", "Learning-rate sweep (validation accuracy, %): " + "; ".join(parts) + "."]
    return lines


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot_curves(root: Path, tasks, seeds, path: Path, variants=MODELS) -> None:
    """Validation accuracy vs step, one panel per task, one line per model and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.8), squeeze=False)
    palette = ["tab:red", "tab:blue", "tab:green", "tab:orange", "tab:purple", "tab:brown",
               "tab:pink", "tab:gray"]  # fmt: skip
    colours = {v: palette[i % len(palette)] for i, v in enumerate(variants)}
    for ax, task in zip(axes[0], tasks):
        for model in variants:
            for j, seed in enumerate(seeds):
                steps, acc = read_val_curve(root / f"{task}-{model}" / f"seed{seed}")
                ax.plot(
                    steps,
                    acc,
                    "o-",
                    ms=3,
                    color=colours[model],
                    alpha=0.8,
                    label=model if j == 0 else None,
                )
        ax.set(title=task, xlabel="step", ylabel="validation accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_hkt_parameters(results: dict[str, Any], path: Path) -> None:
    """Learned level weights (mean over heads and seeds) and beta per layer, per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = [t for t, r in results["tasks"].items() if r["hkt_state"]]
    if not tasks:
        return
    fig, axes = plt.subplots(2, len(tasks), figsize=(5 * len(tasks), 7), squeeze=False)
    for col, task in enumerate(tasks):
        states = results["tasks"][task]["hkt_state"]
        lam = np.array([s["level_weights"] for s in states])  # (seeds, layers, H, L)
        beta = np.array([s["beta"] for s in states])  # (seeds, layers, H)
        mean_lam = lam.mean(axis=(0, 2))  # (layers, L)
        n_layers, n_levels = mean_lam.shape
        width = 0.8 / n_levels
        ax = axes[0, col]
        for level in range(n_levels):
            ax.bar(
                np.arange(n_layers) + level * width,
                mean_lam[:, level],
                width,
                label=f"level {level}",
            )
        ax.axhline(1 / n_levels, color="k", ls=":", lw=0.8, label="uniform (init)")
        ax.set(
            title=f"{task}: level weights λ",
            xlabel="layer",
            ylabel="λ (mean over heads)",
            xticks=np.arange(n_layers) + 0.4 - width / 2,
            xticklabels=range(n_layers),
        )
        ax.legend(fontsize=7)
        ax = axes[1, col]
        per_layer = beta.mean(axis=0)  # (layers, H)
        for h in range(per_layer.shape[1]):
            ax.plot(range(n_layers), per_layer[:, h], "o-", label=f"head {h}")
        ax.set(
            title=f"{task}: attention share β",
            xlabel="layer",
            ylabel="β",
            xticks=range(n_layers),
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
