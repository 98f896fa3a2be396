"""k-hop neighbourhoods of a target node, the subgraph each prompt shows."""

from __future__ import annotations

import torch
from torch import Tensor

from .graph import TextAttributedGraph

__all__ = ["sample_subgraph"]


def _undirected_csr(graph: TextAttributedGraph) -> tuple[Tensor, Tensor]:
    """``(rowptr (N + 1,), col (2E',))`` of the graph with edges taken both ways, duplicates and
    self-loops as ``to_undirected`` leaves them; built once per graph and kept on it."""
    cached = getattr(graph, "_csr", None)
    if cached is not None and cached[0] is graph.edge_index:
        return cached[1], cached[2]
    from torch_geometric.utils import to_undirected

    und = to_undirected(graph.edge_index, num_nodes=graph.num_nodes)  # coalesced: sorted by row
    counts = torch.bincount(und[0], minlength=graph.num_nodes)
    rowptr = torch.zeros(graph.num_nodes + 1, dtype=torch.long)
    rowptr[1:] = counts.cumsum(0)
    graph._csr = (graph.edge_index, rowptr, und[1].contiguous())
    return rowptr, und[1]


def sample_subgraph(
    graph: TextAttributedGraph, target: int, num_hops: int = 2, max_nodes: int = 16, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """Nodes within ``num_hops`` of ``target`` (edges taken as undirected), at most
    ``max_nodes``: the target first, then nearer hops before farther ones, ties broken by a
    seeded shuffle. Returns ``(nodes (n,), local edge_index (2, E'))`` with both edge directions.

    A breadth-first search over a CSR index of the graph (built once, kept on the graph): the
    cost grows with the neighbourhood, never with the graph (ogbn-arxiv: 169k targets)."""
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    if not 0 <= target < graph.num_nodes:
        raise ValueError(f"target {target} outside 0..{graph.num_nodes - 1}")
    rowptr, col = _undirected_csr(graph)

    def neighbours(nodes: Tensor) -> Tensor:
        if nodes.numel() == 0:
            return nodes
        starts, ends = rowptr[nodes], rowptr[nodes + 1]
        sizes = ends - starts
        offsets = torch.repeat_interleave(starts - sizes.cumsum(0) + sizes, sizes)
        return col[offsets + torch.arange(int(sizes.sum()))]

    chosen = [target]
    seen = {target}
    frontier = torch.tensor([target])
    g = torch.Generator().manual_seed(seed * 1_000_003 + target)
    for _ in range(num_hops):
        if len(chosen) >= max_nodes:
            break
        ring = neighbours(frontier).unique()  # sorted
        new = [int(v) for v in ring if int(v) not in seen]
        seen.update(new)  # every node at this distance, chosen or not, is no longer new
        order = torch.randperm(len(new), generator=g).tolist()
        chosen.extend(new[i] for i in order[: max_nodes - len(chosen)])
        frontier = torch.tensor(new, dtype=torch.long)
    nodes = torch.tensor(chosen)
    inside = torch.zeros(graph.num_nodes, dtype=torch.bool)
    inside[nodes] = True
    src = nodes.sort().values  # rows in ascending order, as the coalesced edge list has them
    sizes = rowptr[src + 1] - rowptr[src]
    rows = torch.repeat_interleave(src, sizes)
    cols = neighbours(src)
    keep = inside[cols]
    local = torch.full((graph.num_nodes,), -1, dtype=torch.long)
    local[nodes] = torch.arange(len(nodes))  # global id -> position in `nodes` (target = 0)
    return nodes, torch.stack([local[rows[keep]], local[cols[keep]]])
