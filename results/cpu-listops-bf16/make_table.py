"""The bfloat16-against-float32 table of this folder from its four run folders (see RUN.md):
``python results/cpu-listops-bf16/make_table.py runs/bf16``."""

import csv
import json
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/bf16")
here = Path(__file__).parent
rows = {}
for name in ("hkt-f32", "hkt-bf16", "mha-f32", "mha-bf16"):
    final = json.loads((root / name / "final.json").read_text())
    with open(root / name / "metrics.csv") as fh:
        val = [(int(r["step"]), 100 * float(r["acc"])) for r in csv.DictReader(fh)
               if r["split"] == "val"]  # fmt: skip
    cut = 0.8 * max(s for s, _ in val)
    gain = max(a for s, a in val if s > cut) - max(a for s, a in val if s <= cut)
    rows[name] = {"test_acc": 100 * final["test_acc"], "val_acc": 100 * final["val_acc"],
                  "best_step": final["best_step"], "median_step_ms": final["median_step_ms"],
                  "last_fifth_val_gain_pp": gain}  # fmt: skip
lines = [
    "ListOps (project generator, LRA rules, T <= 128, 40k/2k/2k), `cpu` preset, seed 0, one "
    "thread per run; bfloat16 = `--train.bf16` (autocast: HKT's bfloat16 kernel, PyTorch's "
    "bfloat16 SDPA for MHA).",
    "",
    "| model | precision | test % | val % | best step | median step ms "
    "| val gain in last fifth (pp) |",
    "|---|---|---:|---:|---:|---:|---:|",
]
for name, r in rows.items():
    model, prec = name.split("-")
    lines.append(f"| {model.upper()} | {'bfloat16' if prec == 'bf16' else 'float32'} "
                 f"| {r['test_acc']:.2f} | {r['val_acc']:.2f} | {r['best_step']} "
                 f"| {r['median_step_ms']:.1f} | {r['last_fifth_val_gain_pp']:+.2f} |")  # fmt: skip
lines.append("")
ms = {name: r["median_step_ms"] for name, r in rows.items()}
for model in ("hkt", "mha"):
    diff = rows[f"{model}-bf16"]["test_acc"] - rows[f"{model}-f32"]["test_acc"]
    ratio = ms[f"{model}-bf16"] / ms[f"{model}-f32"]
    lines.append(
        f"- {model.upper()}: bfloat16 minus float32 test {diff:+.2f} pp; "
        f"step time bfloat16 / float32 {ratio:.2f}x."
    )
lines.append(
    f"- bfloat16 HKT/MHA step time {ms['hkt-bf16'] / ms['mha-bf16']:.2f}x "
    f"(float32: {ms['hkt-f32'] / ms['mha-f32']:.2f}x)."
)
(here / "results.md").write_text("\n".join(lines) + "\n")
(here / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
print("\n".join(lines))
