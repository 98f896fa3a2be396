"""Which nodes are predicted: seeded target samples per split, and their prompts."""

from __future__ import annotations

import torch

from structattn.data.graphs import TextAttributedGraph
from structattn.errors import ConfigError
from structattn.experiments.glfusion.prompts import NodeExample, build_example, framing
from structattn.glfusion.configuration import GLFusionConfig

from .config import GLFusionTrainConfig

__all__ = [
    "SPLITS",
    "cut_notice",
    "node_record",
    "prompt_examples",
    "sample_targets",
    "split_sizes",
    "split_targets",
]

#: The splits, each with the offset its sample's seed gets.
SPLITS = {"train": 0, "val": 1, "test": 2}


def sample_targets(graph: TextAttributedGraph, split: str, n: int, seed: int) -> list[int]:
    """``n`` nodes of ``split`` (all when it has fewer), in a seeded random order."""
    idx = graph.splits[split]
    g = torch.Generator().manual_seed(seed + SPLITS[split])
    return idx[torch.randperm(len(idx), generator=g)[:n]].tolist()


def split_targets(graph: TextAttributedGraph, cfg: GLFusionTrainConfig) -> dict[str, list[int]]:
    """The run's targets per split (``max_train`` / ``max_val`` / ``max_test``); none empty."""
    sizes = {"train": cfg.max_train, "val": cfg.max_val, "test": cfg.max_test}
    targets = {s: sample_targets(graph, s, n, cfg.seed) for s, n in sizes.items()}
    for split, ts in targets.items():
        if not ts:
            raise ConfigError(f"{graph.name}: the {split} split has no targets")
    return targets


def split_sizes(graph: TextAttributedGraph) -> dict[str, int]:
    """The number of nodes in each split of ``graph``."""
    return {s: len(graph.splits[s]) for s in SPLITS}


def node_record(graph: TextAttributedGraph, nodes: list[int]) -> dict[str, list]:
    """``nodes`` as ``{"indices": [...], "ids": [...]}``: their indices and node ids (the index
    as text for a graph without ids), in the order they were sampled."""
    ids = graph.node_ids
    return {"indices": [int(v) for v in nodes],
            "ids": [ids[int(v)] if ids else str(int(v)) for v in nodes]}  # fmt: skip


def cut_notice(graph: TextAttributedGraph, targets: dict[str, list[int]]) -> str | None:
    """One line when ``max_val`` / ``max_test`` score a sample of their split rather than all of
    it (``None`` when every validation and test node is scored)."""
    sizes = split_sizes(graph)
    cut = [s for s in ("val", "test") if len(targets[s]) < sizes[s]]
    if not cut:
        return None
    parts = [f"{len(targets[s])} of the {sizes[s]} {s} nodes (max_{s}={len(targets[s])})"
             for s in cut]  # fmt: skip
    flags = " ".join(f"--max-{s} {sizes[s]}" for s in cut)
    return (
        f"note: {graph.name}: scoring a seeded sample of {' and '.join(parts)}; pass {flags} "
        "to score them all"
    )


def prompt_examples(
    graph: TextAttributedGraph,
    nodes: list[int],
    tokenizer,
    model_config: GLFusionConfig,
    cfg: GLFusionTrainConfig,
) -> list[NodeExample]:
    """One prompt per node: its sampled subgraph, neighbours' labels shown as ``cfg`` says."""
    train_nodes = set(graph.splits["train"].tolist())
    frame = framing(tokenizer, cfg.chat)  # once: a chat template is rendered, not per prompt
    return [
        build_example(
            graph,
            int(v),
            tokenizer,
            model_config,
            num_hops=cfg.num_hops,
            max_nodes=cfg.max_nodes,
            seed=cfg.seed,
            show_neighbour_labels=cfg.show_neighbour_labels,
            train_nodes=train_nodes,
            edge_texts=cfg.edge_texts,
            node_text_tokens=cfg.node_text_tokens,
            max_prompt_tokens=cfg.max_prompt_tokens,
            frame=frame,
        )
        for v in nodes
    ]
