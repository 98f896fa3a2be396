"""The training step of GL-Fusion on code-names against the same LLM reading text.

Four models of the code-names table, each SmolLM2-135M + LoRA as the ``cpu-llm`` preset builds
it (bfloat16 autocast, batches of 4 training functions of the preset's draw):

* ``glfusion``: the gated form (the node texts in the prompt, message passing and
  cross-attention on the nodes' slots, the twin GNN head);
* ``glfusion-paper``: the paper's form (node tokens, two-stage cross-attention to the texts);
* ``llm-tree``: the LLM reading the node texts (the gated form's prompt, no graph);
* ``llm-code``: the LLM reading the masked code.

Each timed step is a forward and backward pass (the loss each model trains on) of the same
batch, the models taking turns batch by batch, so the machine's load falls on all of them
alike. Before training, the first batch's LM loss of ``glfusion`` and ``llm-tree`` in float32
(as initialised they are the same function of the same tokens). Reported: the median step per
model, its ratio to ``llm-tree`` and ``llm-code`` (of
medians), the prompts' lengths, and how much of each tree the prompt budget keeps (the gated
form's graph is the nodes whose lines fit in ``max_prompt_tokens``).

Usage::

    python benchmarks/glfusion_step.py --batches 12 --threads 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

MODELS = {
    "glfusion": {"model": "glfusion"},
    "glfusion-paper": {"model": "glfusion", "variant": "paper"},
    "llm-tree": {"model": "llm-tree"},
    "llm-code": {"model": "llm-code"},
}


def build(name: str, max_train: int):
    from structattn.experiments.glfusion.code.config import load_code_config
    from structattn.experiments.glfusion.code.experiment import LLMNaming

    cfg = load_code_config("glfusion-code", "cpu-llm", max_train=max_train, max_val=1,
                           max_test=1, **MODELS[name])  # fmt: skip
    exp = LLMNaming(cfg, progress=False)
    exp.build_data()
    return exp


def step(exp, batch) -> float:
    model = exp.model
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**batch)
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=12, help="timed batches per model")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.batches * args.batch_size
    exps = {name: build(name, 1000) for name in MODELS}
    for exp in exps.values():
        exp.model.train()
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(1000, generator=g)[:n].tolist()
    first = order[: args.batch_size]
    with torch.no_grad():
        step0 = {name: float(exps[name].model(**exps[name].collate(
            [exps[name].prompts["train"][j] for j in first])).lm_loss)
            for name in ("glfusion", "llm-tree")}  # fmt: skip
    print(f"LM loss as initialised (float32, one batch): glfusion {step0['glfusion']:.6f}, "
          f"llm-tree {step0['llm-tree']:.6f}")  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in MODELS}
    lengths: dict[str, list[int]] = {name: [] for name in MODELS}
    for i in range(-1, args.batches):  # batch -1: one untimed warm-up step each
        idx = order[max(i, 0) * args.batch_size : (max(i, 0) + 1) * args.batch_size]
        for name, exp in exps.items():
            batch = exp.collate([exp.prompts["train"][j] for j in idx])
            elapsed = step(exp, batch)
            if i >= 0:
                times[name].append(elapsed)
                lengths[name] += batch["attention_mask"].sum(-1).tolist()
    tree = exps["glfusion"]
    kept = [len(p.spans) / ex.num_nodes for p, ex in zip(tree.prompts["train"],
                                                           tree.splits["train"])]  # fmt: skip
    med = {name: statistics.median(t) for name, t in times.items()}
    rows = {
        name: {
            "median_step_s": med[name],
            "vs_llm_tree": med[name] / med["llm-tree"],
            "vs_llm_code": med[name] / med["llm-code"],
            "median_prompt_tokens": statistics.median(lengths[name]),
        }
        for name in MODELS
    }
    budget = {
        "max_prompt_tokens": tree.cfg.max_prompt_tokens,
        "node_text_tokens": tree.cfg.node_text_tokens,
        "functions_cut": sum(k < 1 for k in kept) / len(kept),
        "mean_fraction_of_nodes_kept": statistics.mean(kept),
        "min_fraction_of_nodes_kept": min(kept),
    }
    print(f"{'model':16} {'median step':>12} {'/ llm-tree':>11} {'/ llm-code':>11} {'tokens':>7}")
    for name, r in rows.items():
        print(f"{name:16} {r['median_step_s']:11.2f}s {r['vs_llm_tree']:10.2f}x "
              f"{r['vs_llm_code']:10.2f}x {r['median_prompt_tokens']:7.0f}")  # fmt: skip
    print(f"prompt budget {budget['max_prompt_tokens']} tokens ({budget['node_text_tokens']} per "
          f"node line): {100 * budget['functions_cut']:.1f}% of the training functions lose "
          f"nodes; {100 * budget['mean_fraction_of_nodes_kept']:.1f}% of nodes kept on average, "
          f"{100 * budget['min_fraction_of_nodes_kept']:.1f}% at least")  # fmt: skip
    if args.json:
        meta = {"threads": args.threads, "batches": args.batches, "batch_size": args.batch_size,
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "models": rows, "budget": budget, "step0_lm_loss": step0,
                       "step_s": times}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
