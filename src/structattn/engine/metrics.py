"""``metrics.csv`` and TensorBoard: what a run logs as it trains."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from .checkpoint import atomic_write_text
from .rundir import RunDir

__all__ = ["METRIC_FIELDS", "MetricsLog"]

METRIC_FIELDS = ["step", "split", "loss", "acc", "lr", "step_ms"]


class MetricsLog:
    """``metrics.csv`` + TensorBoard. On resume, rows past the resumed step are dropped by an
    atomic rewrite (only after the checkpoint has loaded)."""

    def __init__(self, run_dir: Path | RunDir, resume_step: int, enabled: bool):
        self.enabled = enabled
        run_dir = RunDir(run_dir)
        self.path = run_dir.metrics
        self.tb = None
        if not enabled:
            return
        rows = []
        if resume_step and self.path.is_file():
            with self.path.open(newline="") as f:
                for r in csv.DictReader(f):
                    try:
                        if int(r["step"]) <= resume_step:
                            rows.append({k: r.get(k, "") for k in METRIC_FIELDS})
                    except (TypeError, ValueError, KeyError):
                        continue  # a row cut by a kill
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=METRIC_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(self.path, buf.getvalue())
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(
            log_dir=str(run_dir.file(RunDir.TENSORBOARD)), purge_step=resume_step or None
        )

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
