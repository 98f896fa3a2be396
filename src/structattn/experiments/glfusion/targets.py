"""Which nodes are predicted: seeded target samples per split, and their prompts."""

from __future__ import annotations

import torch

from structattn.data.graphs import TextAttributedGraph
from structattn.errors import ConfigError
from structattn.glfusion.configuration import GLFusionConfig
from structattn.glfusion.prompts import NodeExample, build_example

from .config import GLFusionTrainConfig

__all__ = ["SPLITS", "prompt_examples", "sample_targets", "split_targets"]

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


def prompt_examples(
    graph: TextAttributedGraph,
    nodes: list[int],
    tokenizer,
    model_config: GLFusionConfig,
    cfg: GLFusionTrainConfig,
) -> list[NodeExample]:
    """One prompt per node: its sampled subgraph, neighbours' labels shown as ``cfg`` says."""
    train_nodes = set(graph.splits["train"].tolist())
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
        )
        for v in nodes
    ]
