"""``metrics.csv`` and TensorBoard: what a run logs as it trains."""

from __future__ import annotations

import csv
import io
import os
import warnings
from pathlib import Path

from .checkpoint import atomic_write_text
from .rundir import RunDir

__all__ = ["METRIC_FIELDS", "MetricsLog"]

METRIC_FIELDS = ["step", "split", "loss", "acc", "lr", "step_ms"]


def _parse(text: str) -> tuple[list[list[str]], bool] | None:
    """The data rows of a ``metrics.csv`` and whether its last line was cut by a kill; ``None``
    when the file is not what this log writes (another header, a malformed row before the
    last, a step that is not a number)."""
    lines = text.splitlines(keepends=True)
    if not lines or next(csv.reader([lines[0]]), None) != METRIC_FIELDS:
        return None
    rows, cut = [], False
    for i, line in enumerate(lines[1:], 1):
        row = next(csv.reader([line]), [])
        ok = len(row) == len(METRIC_FIELDS) and row[0].isdigit() and line.endswith("\n")
        if not ok:
            if i == len(lines) - 1:  # only the last line may be half-written
                cut = True
                break
            return None
        rows.append(row)
    return rows, cut


def _set_aside(path: Path, step: int) -> Path:
    target = path.with_name(f"{path.name}.before-resume-{step}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.before-resume-{step}.{n}")
    os.replace(path, target)
    return target


class MetricsLog:
    """``metrics.csv`` + TensorBoard. On resume (only after the checkpoint has loaded) the file
    is appended to; rows logged after the resumed checkpoint (the steps about to be trained
    again) and a half-written last line are dropped by an atomic rewrite of the rows that
    parsed. A file that does not parse as this log (edited by hand, another header) is never
    rewritten: it is set aside as ``metrics.csv.before-resume-STEP`` with a warning, and the
    log starts afresh beside it."""

    def __init__(self, run_dir: Path | RunDir, resume_step: int, enabled: bool):
        self.enabled = enabled
        run_dir = RunDir(run_dir)
        self.path = run_dir.metrics
        self.tb = None
        if not enabled:
            return
        if resume_step and self.path.is_file():
            self._resume(resume_step)
        else:
            self._write_rows([])
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(
            log_dir=str(run_dir.file(RunDir.TENSORBOARD)), purge_step=resume_step or None
        )

    def _write_rows(self, rows: list[list[str]]) -> None:
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow(METRIC_FIELDS)
        writer.writerows(rows)
        atomic_write_text(self.path, buf.getvalue())

    def _resume(self, step: int) -> None:
        try:
            parsed = _parse(self.path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            parsed = None
        if parsed is None:
            aside = _set_aside(self.path, step)
            warnings.warn(
                f"{self.path} does not read as this run's log (edited or damaged): kept as "
                f"{aside.name}, logging continues in a new {self.path.name}",
                RuntimeWarning,
                stacklevel=3,
            )
            self._write_rows([])
            return
        rows, cut = parsed
        kept = [r for r in rows if int(r[0]) <= step]
        if cut or len(kept) < len(rows):  # superseded rows or a cut line: drop just those
            self._write_rows(kept)

    def log(self, step: int, split: str, **values: float) -> None:
        if not self.enabled:
            return
        row = {"step": step, "split": split, **values}
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=METRIC_FIELDS).writerow(row)
        for key, value in values.items():
            if value is not None and value != "":
                self.tb.add_scalar(f"{split}/{key}", value, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def plot_metrics(run_dir: Path | RunDir, title: str = "") -> Path | None:
    """``curves.png`` beside ``metrics.csv``: training loss and validation loss against the
    step (left), training and validation accuracy where logged (right). ``None`` when the log
    has no rows."""
    rd = RunDir(run_dir)
    if not rd.metrics.is_file():
        return None
    with rd.metrics.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if (r.get("step") or "").isdigit()]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(split: str, key: str) -> tuple[list[int], list[float]]:
        pts = [(int(r["step"]), float(r[key])) for r in rows if r["split"] == split and r[key]]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key in zip(axes, ("loss", "acc")):
        for split, style in (("train", "-"), ("val", "o-")):
            steps, values = series(split, key)
            if steps:
                ax.plot(steps, values, style, ms=3, label=split)
        ax.set(xlabel="step", ylabel=key, title=f"{title} {key}".strip())
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    path = rd.file(RunDir.CURVES)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
