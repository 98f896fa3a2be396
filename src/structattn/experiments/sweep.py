"""Sweeps: many runs of one experiment (variants x seeds x learning rates) into one folder tree,
resumable at any point. A finished run (``final.json``) is read back, never retrained; a run
with a checkpoint is resumed; a paused one is reported as incomplete. A sweep's table is the
union of the finished runs in its folder (:func:`read_finished`). ``reproduce`` and
``ablate`` of both systems are sweeps (:mod:`.lra.reproduce`, :mod:`.glfusion.ablate`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from structattn.engine import RunDir, config_diff
from structattn.errors import ConfigError, UserError

__all__ = [
    "REUSE_IGNORES",
    "SweepResult",
    "SweepRun",
    "finished_folders",
    "plateau",
    "read_finished",
    "read_val_curve",
    "run_sweep",
    "tune_lr",
]

#: Config keys that may differ between a finished run and the one a sweep asks for.
REUSE_IGNORES = frozenset(
    {"resume", "overwrite", "run_dir", "data.data_dir", "data_dir", "train.stop_at",
     "train.log_every", "train.keep_checkpoints"}
)  # fmt: skip


def check_reusable(run: SweepRun, rd: RunDir) -> None:
    """A finished run is the one asked for, or a ConfigError names what differs."""
    if run.config is None:
        return
    diff = config_diff(rd.read_config(), run.config(), run.defaults)
    changed = [k for k in diff if k not in REUSE_IGNORES]
    if changed:
        shown = ", ".join(changed[:6]) + (", ..." if len(changed) > 6 else "")
        raise ConfigError(
            f"{rd.path} holds a finished run of another configuration ({shown} differ): it is "
            "not reused; choose another output folder, or remove that run to retrain it"
        )


@dataclass
class SweepRun:
    """One run of a sweep: its key in the results, its folder, a label for the log, and
    ``train(resume)`` that trains it (or resumes it) and returns its results."""

    key: Hashable
    run_dir: Path
    label: str
    train: Callable[[bool], dict[str, Any]]
    #: The plain config this run resolves to (``config_to_dict``): a finished run is reused
    #: only when its ``config.yaml`` equals it (up to :data:`REUSE_IGNORES`, and keys added
    #: since it was written while they hold the ``defaults``).
    config: Callable[[], dict[str, Any]] | None = None
    defaults: dict[str, Any] | None = None


@dataclass
class SweepResult:
    """The finished runs by key, and the folders of those left unfinished."""

    finals: dict[Hashable, dict[str, Any]] = field(default_factory=dict)
    incomplete: list[str] = field(default_factory=list)


def run_sweep(
    runs: Iterable[SweepRun],
    train_missing: bool = True,
    root: Path | None = None,
    log: Callable[[str], None] | None = None,
) -> SweepResult:
    """Every run in order: read back when finished, else trained (resumed when it has a
    checkpoint); ``train_missing=False`` trains nothing. ``incomplete`` names paused runs
    relative to ``root``."""
    say = log if log is not None else (lambda text: print(text, file=sys.stderr))
    out = SweepResult()
    for run in runs:
        rd = RunDir(run.run_dir)
        if rd.is_finished():
            check_reusable(run, rd)
            say(f"{run.label}: done, skipped")
            out.finals[run.key] = rd.read_final()
            continue
        if not train_missing:
            continue
        say(f"{run.label} -> {rd}")
        result = run.train(rd.is_resumable())
        if "paused_at" in result:  # train.stop_at: not a finished run
            where = Path(run.run_dir).relative_to(root) if root is not None else run.run_dir
            out.incomplete.append(f"{where} (paused at {result['paused_at']})")
            continue
        out.finals[run.key] = result
    return out


def finished_folders(root: Path) -> list[tuple[str, int]]:
    """``(name, seed)`` of every finished run ``root/<name>/seed<k>``: what a table of the
    folder may hold besides the runs one call asked for."""
    found = []
    for folder in sorted(Path(root).glob("*/seed*")):
        seed = re.fullmatch(r"seed(0|[1-9][0-9]*)", folder.name)  # as runs name their folders
        if seed and folder.is_dir() and RunDir(folder).is_finished():
            found.append((folder.parent.name, int(seed.group(1))))
    return found


def read_finished(runs: Iterable[SweepRun]) -> tuple[dict[Hashable, dict[str, Any]], list[str]]:
    """The finished runs among ``runs`` (others are skipped), read back for a table that is the
    union of the finished runs in its folder: a later call adds rows and never drops the earlier
    ones. A run that cannot be reused (another configuration, files that do not read, data that
    is not here) is left out and named with the reason."""
    finals, left_out = {}, []
    for run in runs:
        rd = RunDir(run.run_dir)
        if not rd.is_finished():
            continue
        try:
            check_reusable(run, rd)
            finals[run.key] = rd.read_final()
        except (UserError, OSError) as err:  # another config, damaged files, data not here
            left_out.append(
                f"{run.run_dir}: {err}" if str(run.run_dir) not in str(err) else str(err)
            )
    return finals, left_out


def check_rates(rates: Sequence[float] | None) -> None:
    if rates is not None and (not rates or min(rates) <= 0):
        raise ConfigError(f"lr_sweep must list positive learning rates, got {list(rates)}")


def tune_lr(
    rates: Sequence[float],
    make_run: Callable[[float], SweepRun],
    score: str,
    **sweep: Any,
) -> tuple[float | None, dict[str, float]]:
    """Train one run per learning rate (``make_run(lr)``) and choose the rate whose finished
    run has the highest ``score`` (a validation metric; ties go to the smaller rate). Returns
    the chosen rate (``None`` when no run finished) and every finished rate's score."""
    check_rates(rates)
    runs = {f"{lr:g}": make_run(lr) for lr in rates}
    done = run_sweep(runs.values(), **sweep)
    scores = {k: done.finals[r.key][score] for k, r in runs.items() if r.key in done.finals}
    if not scores:
        return None, scores
    best = max(scores, key=lambda k: (scores[k], -float(k)))
    return float(best), scores


def read_val_curve(run_dir: Path) -> tuple[list[int], list[float]]:
    """The validation curve of a run's ``metrics.csv``: steps, and the metric its experiment
    logs in the ``acc`` column (accuracy, or F1 for method naming) in %."""
    import csv

    path = RunDir(run_dir).metrics
    if not path.is_file():
        return [], []
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r["split"] == "val" and r["acc"] != ""]
    return [int(r["step"]) for r in rows], [100 * float(r["acc"]) for r in rows]


def plateau(run_dir: Path) -> bool | None:
    """The validation curve had flattened: its best value in the last fifth of training
    improves on the best before it by less than 1 pp (None without enough evaluations)."""
    steps, acc = read_val_curve(run_dir)
    if len(steps) < 3:
        return None
    cut = 0.8 * steps[-1]
    before = [a for s, a in zip(steps, acc) if s <= cut]
    after = [a for s, a in zip(steps, acc) if s > cut]
    if not before or not after:
        return None
    return max(after) - max(before) < 1.0
