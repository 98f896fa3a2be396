"""Does a trained code-names GL-Fusion run read the graph? The LM and GNN-head losses of its first
N training prompts with each function's own graph, against the same targets with the next
function's graph (the prompt text differs only in the number of node tokens).

    python benchmarks/glfusion_code_graph_use.py RUN_DIR [N]
"""

import argparse
import dataclasses
from pathlib import Path

import torch

from structattn.engine.checkpoint import load_weights
from structattn.engine.config import build_dataclass, read_yaml
from structattn.experiments.glfusion.code.config import CodeNamesConfig
from structattn.experiments.glfusion.code.experiment import LLMNaming


def losses(exp: LLMNaming, model, prompts, batch: int = 4) -> tuple[float, float]:
    rows = []
    for i in range(0, len(prompts), batch):
        b = exp.collate(prompts[i : i + batch])
        # the run's precision (its train.bf16), as its validation ran
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=exp.cfg.train.bf16):
            out = model(b["input_ids"], b["attention_mask"], labels=b["labels"], graph=b["graph"],
                        name_ids=b["name_ids"])  # fmt: skip
        rows.append((out.lm_loss.item(), out.gnn_loss.item()))
    return tuple(sum(r[k] for r in rows) / len(rows) for k in (0, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("n", type=int, nargs="?", default=64)
    args = ap.parse_args()
    cfg = build_dataclass(CodeNamesConfig, read_yaml(args.run / "config.yaml"))
    if cfg.model != "glfusion":
        raise SystemExit(f"{args.run}: a glfusion run is needed, this one is {cfg.model}")
    exp = LLMNaming(cfg, progress=False)
    exp.build_data()
    model = exp.build_model()
    load_weights(model, args.run / "best.safetensors", partial=True)
    model.eval()
    own = exp.prompts["train"][: args.n]
    other = [dataclasses.replace(own[(i + 1) % len(own)], target_ids=p.target_ids,
                                 name_ids=p.name_ids, subtokens=p.subtokens)
             for i, p in enumerate(own)]  # fmt: skip
    for what, prompts in (("own graph", own), ("next function's graph", other)):
        lm, gnn = losses(exp, model, prompts)
        print(f"{what:>22}: LM loss {lm:.3f}, GNN-head loss {gnn:.3f} ({len(prompts)} functions)")


if __name__ == "__main__":
    main()
