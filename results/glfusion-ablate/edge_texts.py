"""Pair the edge-texts runs (OUT/edge-texts/seed*/final.json) with the full model's runs of the
same seeds in ablations.json (one shared edge embedding), and write edge_texts.md / .json here."""

import json
import sys
from pathlib import Path

from structattn.experiments.stats import mean_std, paired_difference

here = Path(__file__).parent
out = Path(sys.argv[1])
full = json.loads((here / "ablations.json").read_text())["runs"]["full"]
rows, result = [], {"seeds": [], "edge_texts": {}, "shared_embedding": {}}
for run in sorted((out / "edge-texts").glob("seed*/final.json")):
    seed = run.parent.name.removeprefix("seed")
    if seed in full:
        result["seeds"].append(int(seed))
        result["edge_texts"][seed] = json.loads(run.read_text())["heads"]["test"]
        result["shared_embedding"][seed] = full[seed]["heads"]["test"]
lines = [f"Edge texts vs one shared edge embedding, preset recipe, seeds {result['seeds']}: "
         "test accuracy (%), mean ± std; differences paired by seed.", "",
         "| head | edge texts | shared embedding | Δ (pp) | 95% interval | verdict |",
         "|---|---:|---:|---:|---|---|"]
for head in ("ensemble", "gnn", "lm"):
    a = [100 * result["edge_texts"][str(s)][head] for s in result["seeds"]]
    b = [100 * result["shared_embedding"][str(s)][head] for s in result["seeds"]]
    d = paired_difference(a, b)
    result[f"diff_{head}"] = d
    word = {"a better": "edge texts better", "b better": "shared better"}.get(d["verdict"],
                                                                              "inconclusive")
    lines.append(f"| {head} | {mean_std(a)[0]:.2f} ± {mean_std(a)[1]:.2f} | "
                 f"{mean_std(b)[0]:.2f} ± {mean_std(b)[1]:.2f} | {d['mean']:+.2f} | "
                 f"[{d['ci_low']:+.2f}, {d['ci_high']:+.2f}] | {word} |")
(here / "edge_texts.md").write_text("\n".join(lines) + "\n")
(here / "edge_texts.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
print("\n".join(lines))
