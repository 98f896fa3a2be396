"""Every baseline of a GL-Fusion config over seeds, without training GL-Fusion: the same targets,
prompts (subgraphs) and encodings the runs of those seeds use, so the table can be set beside
finished runs, including runs of earlier versions that lacked a baseline. The config is a
preset with train's flags on top, or a run's own (``--run-dir``); each seed's scored nodes are
recorded, and a finished run given with ``--against`` must have scored the same ones.

    structattn glfusion baselines --preset recipe --seeds 0 1 2 \\
        --against results/glfusion-ablate/ablations.json
    structattn glfusion baselines --dataset file --graph-path DIR --against runs/mine
    structattn glfusion baselines --run-dir runs/mine --against runs/mine
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from structattn.engine import RunDir, json_safe
from structattn.errors import ConfigError, RunError

from ..stats import mean_std, paired_difference
from ..tables import comparison_table, mean_std_cell, verdict
from .baselines import BASELINE_NAMES, LABEL_BASELINES
from .config import GLFusionTrainConfig, load_glfusion
from .targets import node_record, split_sizes

__all__ = ["baselines_over_seeds", "baselines_table", "read_against"]


def _one_seed(cfg: GLFusionTrainConfig, models=None, notify: bool = True, check=None) -> dict:
    """One seed's scored nodes and baselines; ``check(record)`` sees the nodes before any
    baseline trains."""
    from .run import NodeClassification

    llm, encoder = models() if models is not None else (None, None)
    task = NodeClassification(cfg, llm=llm, encoder=encoder, progress=False)
    task.notify = notify  # the notes on the graph, once for every seed
    task.build_data()  # targets, prompts, encodings: what a run of this seed builds
    graph, targets = task.graph, task.targets
    record = {"targets": {k: len(v) for k, v in targets.items()},
              "split_sizes": split_sizes(graph), "data_source": graph.source,
              "val_nodes": node_record(graph, targets["val"]),
              "test_nodes": node_record(graph, targets["test"])}  # fmt: skip
    if check is not None:
        check(record)
    return {**record, "baselines": task.baselines()}


def read_against(path: str | Path) -> dict[int, dict[str, Any]]:
    """The finished GL-Fusion results ``--against`` names, per seed: an ``ablations.json`` (its
    full model's runs), a run folder, or a run's ``final.json``. A ConfigError (one line) when
    it is none of them."""
    path = Path(path)
    final = path / RunDir.FINAL if path.is_dir() else path
    what = "an ablations.json, a finished run folder or its final.json"
    try:
        doc = json.loads(final.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"--against {path}: not {what} ({err})") from None
    if isinstance(doc, dict) and isinstance(doc.get("runs"), dict):
        full = doc["runs"].get("full")
        try:
            return {int(s): r for s, r in full.items() if isinstance(r, dict)}
        except (AttributeError, ValueError) as err:
            raise ConfigError(f"--against {path}: no full model's runs ({err})") from None
    if isinstance(doc, dict) and isinstance(doc.get("heads"), dict):
        seed = doc.get("seed")
        if seed is None:  # a run from before final.json recorded its seed
            try:
                seed = RunDir(final.parent).read_config().get("seed", 0)
            except RunError as err:
                raise ConfigError(f"--against {path}: its seed is not known ({err})") from None
        return {int(seed): doc}
    raise ConfigError(f"--against {path}: not {what}")


def _pairs(record: dict[str, list]) -> set[tuple[int, str]]:
    return set(zip(record["indices"], record["ids"]))


def _recorded(run: dict[str, Any] | None) -> bool:
    return run is not None and all(isinstance(run.get(f"{s}_nodes"), dict) for s in ("val", "test"))


def _check_nodes(against, seed: int, record: dict[str, Any], run: dict[str, Any]) -> None:
    """A ConfigError (one line) when ``run`` (of ``seed``) scored other validation or test
    nodes than ``record``."""
    for split in ("test", "val"):
        here, there = _pairs(record[f"{split}_nodes"]), _pairs(run[f"{split}_nodes"])
        if here != there:
            raise ConfigError(
                f"--against {against}: the run of seed {seed} scored other {split} nodes than "
                f"these baselines ({len(there)} there, {len(here)} here, {len(here & there)} in "
                "common): give baselines the run's data and target flags, or --run-dir RUN to "
                "read its config"
            )


def baselines_over_seeds(
    preset: str = "recipe",
    seeds: tuple[int, ...] = (0, 1, 2),
    config: str | Path = "glfusion",
    against: Path | None = None,
    models=None,
    base: GLFusionTrainConfig | None = None,
    described: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Every baseline for every seed, on the config ``base`` (each seed replacing its
    ``seed``), else on ``preset`` of ``config`` with ``overrides``; ``described`` names the
    config in the table. With ``against`` (see :func:`read_against`), the full model's ensemble
    minus each label-aware baseline, paired by seed, after checking that each run scored the
    nodes scored here."""
    if not seeds:
        raise ConfigError("seeds must name at least one seed")
    if base is not None and overrides:
        raise ValueError("give either base or overrides")
    runs = read_against(against) if against is not None else {}
    if against is not None and not set(runs) & set(seeds):
        have = sorted(runs)
        raise ConfigError(
            f"--against {against}: its runs are of seeds {have}, none among the seeds scored "
            f"here {list(seeds)}: give --seeds {' '.join(map(str, have))}"
        )

    def cfg(seed: int) -> GLFusionTrainConfig:
        if base is not None:
            return dataclasses.replace(base, seed=seed)
        return load_glfusion(config, preset, seed=seed, **overrides)

    def check(seed: int):
        run = runs.get(seed)
        return (lambda record: _check_nodes(against, seed, record, run)) if _recorded(run) else None

    per_seed = {s: _one_seed(cfg(s), models, notify=i == 0, check=check(s))
                for i, s in enumerate(seeds)}  # fmt: skip
    out: dict[str, Any] = {"preset": preset, "config": described or f"preset `{preset}`",
                           "seeds": list(seeds), "per_seed": per_seed}  # fmt: skip
    if against is not None:
        checked = [s for s in seeds if _recorded(runs.get(s))]
        unrecorded = [s for s in seeds if s in runs and not _recorded(runs[s])]
        full = {s: 100 * runs[s]["heads"]["test"]["ensemble"] for s in seeds if s in runs}
        common = [s for s in seeds if s in full]
        out["against"] = str(against)
        out["nodes_checked"] = checked
        out["nodes_not_recorded"] = unrecorded
        out["full_ensemble"] = full
        out["full_minus"] = {
            k: {**paired_difference([full[s] for s in common],
                                    [100 * per_seed[s]["baselines"][k]["test"] for s in common]),
                "seeds": common}
            for k in LABEL_BASELINES
        }  # fmt: skip
    return json_safe(out)


def _digest(record: dict[str, list]) -> str:
    return hashlib.sha256(json.dumps(sorted(record["indices"])).encode()).hexdigest()[:12]


def _scored(seed: int, one: dict[str, Any]) -> str:
    """Which nodes one seed scored: counts (of the split), the first ids, a digest."""
    parts = []
    for split in ("test", "val"):
        record = one[f"{split}_nodes"]
        of = one.get("split_sizes", {}).get(split)
        first = ", ".join(record["ids"][:3]) + (", ..." if len(record["ids"]) > 3 else "")
        parts.append(f"{len(record['ids'])}{f' of {of}' if of else ''} {split} nodes "
                     f"({first}; sha256 {_digest(record)})")  # fmt: skip
    return f"seed {seed}: " + ", ".join(parts)


def baselines_table(out: dict[str, Any]) -> str:
    """Mean ± std of each baseline's test (and validation) accuracy, then the paired
    differences when a finished ablation was given."""
    seeds = out["seeds"]
    first = out["per_seed"][seeds[0]]
    described = out.get("config") or f"preset `{out['preset']}`"
    lines = [
        f"Baselines of {described}, seeds {seeds}, on "
        f"{first['data_source']}; targets {first['targets']} per seed. Accuracy (%), "
        "mean ± std over seeds.",
        "",
    ]
    if "test_nodes" in first:
        scored = "; ".join(_scored(s, out["per_seed"][s]) for s in seeds)
        lines += [f"Scored nodes: {scored}.", ""]
    lines += ["| baseline | val | test |", "|---|---:|---:|"]
    for key, name in BASELINE_NAMES.items():
        vals = [out["per_seed"][s]["baselines"][key] for s in seeds]
        val = mean_std_cell(*mean_std([100 * v["val"] for v in vals]))
        test = mean_std_cell(*mean_std([100 * v["test"] for v in vals]))
        lines.append(f"| {name} | {val} | {test} |")
    if "full_minus" in out:
        full = out["full_ensemble"]
        cell = mean_std_cell(*mean_std(list(full.values())))
        lines += ["", f"GL-Fusion full ensemble ({out['against']}): {cell}", ""]
        if out.get("nodes_checked"):
            lines += [f"The same test and validation nodes as {out['against']} (seeds "
                      f"{out['nodes_checked']}).", ""]  # fmt: skip
        if out.get("nodes_not_recorded"):
            lines += [f"{out['against']} records no scored nodes for seeds "
                      f"{out['nodes_not_recorded']} (runs from before they were recorded): "
                      "not checked.", ""]  # fmt: skip
        rows = [(f"GL-Fusion full − {BASELINE_NAMES[k]}", d,
                 verdict(d, "GL-Fusion better", "the baseline better"))
                for k, d in out["full_minus"].items()]  # fmt: skip
        lines += comparison_table(rows)
    return "\n".join(lines)
