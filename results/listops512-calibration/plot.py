"""Validation curves of the ListOps T = 512 calibration runs (see RUN.md):
``python results/listops512-calibration/plot.py runs/calib512``. Copies each run's
metrics.csv here and draws val_accuracy.png."""

import csv
import shutil
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/calib512")
here = Path(__file__).parent
fig, ax = plt.subplots(figsize=(6, 4))
for name in ("hkt-seed0", "mha-seed0"):
    metrics = root / name / "metrics.csv"
    if not metrics.exists():
        continue
    shutil.copy(metrics, here / f"{name}-metrics.csv")
    with open(metrics) as fh:
        val = [(int(r["step"]), 100 * float(r["acc"])) for r in csv.DictReader(fh)
               if r["split"] == "val"]  # fmt: skip
    ax.plot(*zip(*val), marker="o", label=f"{name.split('-')[0].upper()} (seed 0)")
    print(name, " ".join(f"{s}:{a:.1f}" for s, a in val))
ax.set_xlabel("step")
ax.set_ylabel("validation accuracy (%)")
ax.set_title("ListOps, T <= 512 (lengths 100-512), 96k training examples")
ax.grid(alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(here / "val_accuracy.png", dpi=120)
