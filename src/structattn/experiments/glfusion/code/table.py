"""The code-names table: every model and GL-Fusion ablation, every seed, on the same examples,
with shallow baselines beside them and GL-Fusion's paired differences (``structattn code-names
ablate``).

Rows (:data:`ROWS`) train on one of two presets of the experiment file: the LLM rows on
``preset``, OGB's GNN rows on ``gnn_preset`` (their own optimiser and steps; the same example
draw, checked). A learning-rate sweep (``lr_sweep`` for the GNNs, ``llm_lr_sweep`` for the LLM
models) trains each base model once per rate on :data:`SWEEP_SEED` and keeps the rate with the
best validation F1; the ablations take GL-Fusion's rate. Every run is resumable and a finished
run is read back (:mod:`..sweep`).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from structattn.engine import config_to_dict, json_safe
from structattn.engine.config import default_config, merge_overrides
from structattn.errors import ConfigError, RunError

from ...stats import mean_std, paired_difference
from ...sweep import SweepRun, check_rates, finished_folders, read_finished, run_sweep
from ...tables import comparison_table, mean_std_cell, verdict
from .config import GNN_MODELS, CodeNamesConfig, load_code_config
from .metrics import name_scores

__all__ = [
    "BASELINE_ROWS",
    "ROWS",
    "SWEEP_SEED",
    "code_names_table",
    "plot_table",
    "shallow_baselines",
    "table_markdown",
]

#: Each row: the config changes from its preset and what it is.
ROWS: dict[str, tuple[dict[str, Any], str]] = {
    "gcn": ({"model": "gcn"}, "GCN + virtual node (OGB)"),
    "gin": ({"model": "gin"}, "GIN + virtual node (OGB)"),
    "llm-tree": ({"model": "llm-tree"}, "LLM reading the node texts in source order"),
    "llm-code": ({"model": "llm-code"}, "LLM reading the masked code"),
    "glfusion": ({"model": "glfusion"}, "GL-Fusion"),
    "glfusion-paper": ({"model": "glfusion", "variant": "paper", "gate_lr": 0.02,
                        "optim": {"lr": 0.001}}, "GL-Fusion, the paper's form"),
    "no-message-passing": ({"model": "glfusion", "message_passing": False},
                           "GL-Fusion without message passing"),
    "no-cross-attention": ({"model": "glfusion", "cross_attention": False},
                           "GL-Fusion without cross-attention"),
    "no-edge-texts": ({"model": "glfusion", "edge_texts": False},
                      "GL-Fusion without edge texts (one shared edge feature)"),
    "no-gnn-head": ({"model": "glfusion", "gnn_head": False},
                    "GL-Fusion without the twin GNN head (LM loss only)"),
}  # fmt: skip
BASELINE_ROWS = ("gcn", "gin", "llm-tree", "llm-code", "glfusion-paper")
#: Rows trained at the rate their changes give, never swept: the paper's form keeps the rate of
#: the runs that first measured it (its gates need their own rate, 0.02).
FIXED_RATE_ROWS = ("glfusion-paper",)
ABLATION_ROWS = ("no-message-passing", "no-cross-attention", "no-edge-texts", "no-gnn-head")
SWEEP_SEED = 1000  # the learning-rate sweep's seed, apart from the reported seeds
DRAW_KEYS = ("max_train", "max_val", "max_test", "dataset_path", "data_dir")


def _base_model(row: str) -> str:
    """The row whose learning rate ``row`` takes: its model's (the ablations take GL-Fusion's),
    or its own for :data:`FIXED_RATE_ROWS`."""
    return row if row in FIXED_RATE_ROWS else ROWS[row][0]["model"]


def shallow_baselines(train_names: Sequence[Sequence[str]], refs: dict[str, list]) -> dict:
    """Floors any model must clear: the most frequent training name, and the most frequent
    training first sub-token alone, scored on each split (OGB's F1, in %)."""
    names = Counter(tuple(n) for n in train_names)
    firsts = Counter(n[0] for n in train_names if n)
    guesses = {
        "most frequent name": list(names.most_common(1)[0][0]) if names else [],
        "most frequent first sub-token": [firsts.most_common(1)[0][0]] if firsts else [],
    }
    out = {}
    for label, guess in guesses.items():
        out[label] = {"guess": guess}
        for split, split_refs in refs.items():
            s = name_scores(split_refs, [guess] * len(split_refs))
            out[label][split] = {k: 100 * v for k, v in s.items()}
    return out


class _Jobs:
    """The configs of one table: a row's preset, seed, folder and learning rate."""

    def __init__(self, config, preset, gnn_preset, overrides, progress, models):
        self.config, self.preset, self.gnn_preset = config, preset, gnn_preset
        self.overrides, self.progress, self.models = overrides, progress, models

    def resolved(self, row, seed, run_dir, lr=None, resume=False) -> CodeNamesConfig:
        changes, _ = ROWS[row]
        preset = self.gnn_preset if _base_model(row) in GNN_MODELS else self.preset
        extra = {**merge_overrides(self.overrides, changes), "seed": seed, "run_dir": run_dir,
                 "resume": resume}  # fmt: skip
        if lr is not None and row not in FIXED_RATE_ROWS:
            extra["optim"] = {**extra.get("optim", {}), "lr": lr}
        return load_code_config(self.config, preset, **extra)

    def run(self, key, row, seed, run_dir: Path, label: str, lr=None) -> SweepRun:
        from .experiment import train_code_names

        def train_it(resume: bool) -> dict:
            cfg = self.resolved(row, seed, run_dir, lr, resume)
            llm, encoder = (None, None)
            if self.models is not None and _base_model(row) not in GNN_MODELS:
                llm, encoder = self.models()
            result = train_code_names(cfg, progress=self.progress, llm=llm, encoder=encoder)
            if "paused_at" in result:
                raise RunError(f"{run_dir} paused at step {result['paused_at']}; run again")
            return result

        def config() -> dict:
            return config_to_dict(self.resolved(row, seed, run_dir, lr))

        return SweepRun(key, run_dir, label, train_it, config, default_config(CodeNamesConfig))


def _check(jobs: _Jobs, rows, seeds, lr_sweep, llm_lr_sweep) -> None:
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ConfigError(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if not seeds:
        raise ConfigError("seeds must name at least one seed")
    if any(r in ABLATION_ROWS for r in rows) and "glfusion" not in rows:
        raise ConfigError("the ablations are compared with GL-Fusion: add the glfusion row")
    check_rates(lr_sweep)
    check_rates(llm_lr_sweep)
    gnn = jobs.resolved("gcn", 0, None)
    llm = jobs.resolved("glfusion", 0, None)
    differ = [k for k in DRAW_KEYS if getattr(gnn, k) != getattr(llm, k)]
    if differ:
        raise ConfigError(
            f"presets {jobs.gnn_preset!r} and {jobs.preset!r} draw different examples "
            f"({', '.join(differ)} differ): every row must see the same data"
        )


def _tune(jobs: _Jobs, root: Path, rows, lr_sweep, llm_lr_sweep, log, train_missing=True):
    """Each base model's learning rate, chosen on validation F1 (one seed per rate); with
    ``train_missing=False`` only from the sweep runs that are already finished."""
    tuned, sweeps = {}, {}
    for model in dict.fromkeys(_base_model(r) for r in rows):
        rates = lr_sweep if model in GNN_MODELS else llm_lr_sweep
        if not rates or model in FIXED_RATE_ROWS:
            continue

        def make(lr, model=model):
            label = f"[sweep] {model} lr {lr:g} (seed {SWEEP_SEED})"
            run_dir = root / "sweep" / model / f"lr{lr:g}"
            return jobs.run(("sweep", model, lr), model, SWEEP_SEED, run_dir, label, lr)

        done = run_sweep([make(lr) for lr in rates], train_missing, root=root, log=log)
        scores = {f"{k[2]:g}": r["val"]["f1"] for k, r in done.finals.items()}
        if scores:  # ties go to the smaller rate
            best = max(scores, key=lambda k: (scores[k], -float(k)))
            tuned[model] = float(best)
            sweeps[model] = {"val_f1": {k: 100 * v for k, v in scores.items()}, "chosen": best}
    return tuned, sweeps


def _data_refs(cfg: CodeNamesConfig) -> tuple[list[list[str]], dict[str, list], dict[str, int]]:
    """The drawn training names, the val / test references, and the split sizes every row sees."""
    from structattn.data.code import load_code_names

    from .experiment import draw

    data = load_code_names(cfg.resolved_dataset())
    train = draw(data.train, cfg.max_train)
    refs = {"val": [ex.subtokens for ex in draw(data.val, cfg.max_val)],
            "test": [ex.subtokens for ex in draw(data.test, cfg.max_test)]}  # fmt: skip
    sizes = {"train": len(train), **{s: len(r) for s, r in refs.items()}}
    return [ex.subtokens for ex in train], refs, sizes


def summarise(root: Path, rows, seeds, finals, plateaus) -> dict[str, Any]:
    """Mean ± std per row, and the paired differences: GL-Fusion minus each baseline, each
    ablation minus GL-Fusion (F1 in pp, paired by seed)."""
    out: dict[str, Any] = {}
    for row in rows:
        runs = {s: finals[row, s] for s in seeds if (row, s) in finals}
        f1 = [100 * r["test"]["f1"] for r in runs.values()]
        out[row] = {
            "name": ROWS[row][1],
            "seeds": list(runs),
            "val_f1": [100 * r["val"]["f1"] for r in runs.values()],
            "test_f1": f1,
            "test_exact": [100 * r["test"]["exact"] for r in runs.values()],
            "mean": mean_std(f1)[0],
            "std": mean_std(f1)[1],
            "heads": [r.get("head", "gnn") for r in runs.values()],
            "best_step": [r["best_step"] for r in runs.values()],
            "median_step_ms": [r["median_step_ms"] for r in runs.values()],
            "wall_s": [r["wall_s"] for r in runs.values()],
            "plateau": [plateaus.get((row, s)) for s in runs],
        }
    comparisons = {}

    def paired(a: str, b: str):
        both = [s for s in seeds if (a, s) in finals and (b, s) in finals]
        if both:
            return paired_difference([100 * finals[a, s]["test"]["f1"] for s in both],
                                     [100 * finals[b, s]["test"]["f1"] for s in both])  # fmt: skip
        return None

    for other in (r for r in BASELINE_ROWS if r in rows):
        d = paired("glfusion", other) if "glfusion" in rows else None
        if d is not None:
            comparisons[f"glfusion - {other}"] = d
    for ablation in (r for r in ABLATION_ROWS if r in rows):
        d = paired(ablation, "glfusion")
        if d is not None:
            comparisons[f"{ablation} - glfusion"] = d
    return {"rows": out, "comparisons": comparisons}


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    return mean_std_cell(*mean_std(values))


def table_markdown(results: dict[str, Any]) -> str:
    """The table of :func:`code_names_table`'s results."""
    n = results["examples"]
    lines = [
        "code-names (Python functions of 2025 wheels, built like ogbg-code2; split by project), "
        f"examples train {n['train']}, val {n['val']}, test {n['test']}; seeds "
        f"{' '.join(map(str, results['seeds']))}; LLM rows on preset `{results['preset']}`, "
        f"GNN rows on `{results['gnn_preset']}`. F1 and exact match (%, OGB's ogbg-code2 "
        "definitions), mean ± std over seeds.",
        "",
        "| model | seeds | head (on val) | val F1 | test F1 | test exact | lr | "
        "median step (ms) | flattened |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for label, b in results["shallow"].items():
        guess = " ".join(b["guess"]) or "(nothing)"
        lines.append(f"| {label} (`{guess}`, shallow) | - | - | {b['val']['f1']:.2f} | "
                     f"{b['test']['f1']:.2f} | {b['test']['exact']:.2f} | - | - | - |")  # fmt: skip
    for row, r in results["summary"]["rows"].items():
        heads = "/".join(sorted(set(r["heads"]))) if r["heads"] else "-"
        steps = f"{sorted(r['median_step_ms'])[len(r['median_step_ms']) // 2]:.0f}" \
            if r["median_step_ms"] else "-"  # fmt: skip
        flat = {True: "yes", False: "no", None: "?"}
        flattened = " ".join(flat[p] for p in r["plateau"]) or "-"
        lr = results["rates"].get(row)
        lines.append(
            f"| {r['name']} | {len(r['seeds'])} | {heads} | {_cell(r['val_f1'])} | "
            f"{_cell(r['test_f1'])} | {_cell(r['test_exact'])} | "
            f"{'-' if lr is None else f'{lr:g}'} | {steps} | {flattened} |"
        )
    comps = results["summary"]["comparisons"]
    if comps:
        words = []
        for key, d in comps.items():
            a, b = key.split(" - ")
            la, lb = ROWS[a][1], ROWS[b][1]
            words.append((f"{la} − {lb}", d, verdict(d, f"{la} better", f"{lb} better")))
        lines += ["", "Test F1, paired by seed (95% t-interval; inconclusive where it covers 0):",
                  "", *comparison_table(words)]  # fmt: skip
    sweeps = results.get("lr_sweep") or {}
    if sweeps:
        lines += ["", f"Learning rates chosen on validation F1 (seed {SWEEP_SEED}): " + "; ".join(
            f"{m} {s['chosen']} of " + ", ".join(f"{k} ({v:.2f})" for k, v in s["val_f1"].items())
            for m, s in sweeps.items())]  # fmt: skip
    if results.get("incomplete"):
        lines += ["", "Unfinished runs: " + ", ".join(results["incomplete"])]
    for reason in results.get("left_out", []):
        lines += ["", f"Not in the table (finished, not reusable here): {reason}"]
    lines += ["", "Flattened: no gain of 1 pp or more in validation F1 over the last fifth of "
              "training, per seed."]  # fmt: skip
    return "\n".join(lines)


def plot_table(results: dict[str, Any], path: Path) -> Path:
    """Test F1 of every seed (dots) and its mean (bar) per row, the shallow baselines as
    dashed lines: whether a row leaves the floor is seen at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(results["summary"]["rows"].values())
    fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 2.5, 4))
    for i, r in enumerate(rows):
        if r["test_f1"]:
            ax.bar(i, r["mean"], color="tab:blue", alpha=0.35, width=0.6)
            ax.plot([i] * len(r["test_f1"]), r["test_f1"], "o", color="tab:blue", ms=5)
    for (label, b), style in zip(results["shallow"].items(), ("--", ":")):
        guess = " ".join(b["guess"]) or "(nothing)"
        ax.axhline(b["test"]["f1"], color="tab:red", ls=style, lw=1,
                   label=f"{label} ({guess}), shallow")  # fmt: skip
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], rotation=25, ha="right",
                  fontsize=8)  # fmt: skip
    ax.set(ylabel="test F1 (%)", title=f"code-names, test F1 per seed (preset {results['preset']})")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tune_others(jobs: _Jobs, root: Path, tuned, sweeps, lr_sweep, llm_lr_sweep, log):
    """``tuned`` and ``sweeps`` with the folder's other rows at the rates their finished sweeps
    chose: a call for one row still tables the others, not at their config's default rate."""
    others = [r for r, _ in finished_folders(root) if r in ROWS and _base_model(r) not in tuned]
    more, more_sweeps = _tune(jobs, root, others, lr_sweep, llm_lr_sweep, log, False)
    order = list(dict.fromkeys(_base_model(r) for r in ROWS))
    sweeps = dict(sorted({**more_sweeps, **sweeps}.items(), key=lambda kv: order.index(kv[0])))
    return {**more, **tuned}, sweeps


def _with_other_runs(jobs: _Jobs, root: Path, runs, finals, tuned) -> tuple[dict, list[str]]:
    """``finals`` and every other finished run of ``root`` whose config is the one this call
    gives its row (the table is the union of the folder's finished runs); those of another
    configuration are named."""
    asked = {r.key for r in runs}
    others = [
        jobs.run((row, s), row, s, root / row / f"seed{s}", row, tuned.get(_base_model(row)))
        for row, s in finished_folders(root) if row in ROWS and (row, s) not in asked
    ]  # fmt: skip
    read_back, left_out = read_finished(others)
    return {**read_back, **finals}, left_out


def code_names_table(
    preset: str = "cpu-llm",
    gnn_preset: str = "cpu-gnn",
    seeds: Sequence[int] = (0, 1, 2),
    rows: Sequence[str] = tuple(ROWS),
    out_dir: str | Path = "results/glfusion-code",
    lr_sweep: Sequence[float] | None = None,
    llm_lr_sweep: Sequence[float] | None = None,
    config: str | Path = "glfusion-code",
    progress: bool = True,
    train_missing: bool = True,
    models=None,
    **overrides: Any,
) -> dict[str, Any]:
    """Train what is missing of every row and seed (learning rates swept first when asked),
    then write ``table.md`` / ``table.json`` / ``table.png`` to ``<out_dir>/<preset>/``.
    ``models()`` may return fresh ``(llm, encoder)`` pairs for the LLM rows (tests); otherwise
    they load offline per run. ``overrides`` change every run's config (``max_train=100``)."""
    from ...sweep import plateau

    started = time.perf_counter()
    jobs = _Jobs(config, preset, gnn_preset, overrides, progress, models)
    rows = tuple(dict.fromkeys(rows))
    _check(jobs, rows, seeds, lr_sweep, llm_lr_sweep)
    root = Path(out_dir) / preset
    log = None if progress else (lambda text: None)
    tuned, sweeps = _tune(jobs, root, rows, lr_sweep, llm_lr_sweep, log, train_missing)
    runs = [
        jobs.run((row, s), row, s, root / row / f"seed{s}", f"[code-names] {row} seed {s}",
                 tuned.get(_base_model(row)))
        for row in rows for s in seeds
    ]  # fmt: skip
    done = run_sweep(runs, train_missing, root, log=log)
    tuned, sweeps = _tune_others(jobs, root, tuned, sweeps, lr_sweep, llm_lr_sweep, log)
    finals, left_out = _with_other_runs(jobs, root, runs, done.finals, tuned)
    if not finals:
        raise RunError(f"no finished run under {root}; train them first")
    rows = tuple(r for r in ROWS if r in rows or any(k[0] == r for k in finals))
    seeds = sorted(set(seeds) | {k[1] for k in finals})
    plateaus = {k: plateau(root / k[0] / f"seed{k[1]}") for k in finals}
    train_names, refs, sizes = _data_refs(jobs.resolved("glfusion", 0, None))
    rates = {row: jobs.resolved(row, 0, None, tuned.get(_base_model(row))).optim.lr for row in rows}
    results = {
        "preset": preset,
        "gnn_preset": gnn_preset,
        "seeds": list(seeds),
        "examples": sizes,
        "shallow": shallow_baselines(train_names, refs),
        "summary": summarise(root, rows, seeds, finals, plateaus),
        "rates": rates,
        "lr_sweep": sweeps,
        "incomplete": done.incomplete,
        "left_out": left_out,
        "runs": {f"{row} seed{s}": r for (row, s), r in sorted(finals.items())},
        "wall_s": time.perf_counter() - started,
    }
    _write_table(root, results)
    return results


def _write_table(root: Path, results: dict[str, Any]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "table.json").write_text(json.dumps(json_safe(results), indent=2, allow_nan=False))
    (root / "table.md").write_text(table_markdown(results) + "\n")
    plot_table(results, root / "table.png")
