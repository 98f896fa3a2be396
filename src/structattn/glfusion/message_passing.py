"""GNN message passing inside the LLM, on the hidden states of the node tokens.

For node ``u`` with in-neighbours ``v`` (edges ``v -> u``) and edge embeddings ``e_vu``::

    m_vu  = h_v * e_vu                                  (elementwise)
    agg_u = [mean_v m_vu, max_v m_vu, std_v m_vu]       (torch_geometric aggregations; 0 if none)
    h_u  <- h_u + tanh(g) * Linear([h_u, agg_u])        (gate g initialised to 0)

With ``norm=True`` (this project's recipe, not the paper's) a LayerNorm normalises
``[h_u, agg_u]`` before the update: LLM hidden states are large and uneven across channels.
With ``zero_update=True`` (the gated form) the update's weights start at 0 and the gate at 1,
as LoRA starts its second matrix at 0: the step is the identity at first and every weight of
the update learns at the modules' rate (a closed scalar gate opens only by about lr per step).

Vectorised over every graph of the batch (global node indices, no Python loop over nodes).
Shapes: ``h (M, D)``, ``edge_index (2, E)``, ``edge_attr (E, edge_dim)`` or None -> ``(M, D)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch_geometric.nn.aggr import MaxAggregation, MeanAggregation, StdAggregation

__all__ = ["NodeMessagePassing"]


class NodeMessagePassing(nn.Module):
    """One gated message-passing step (see module docstring).

    Args:
        hidden_size: ``D`` of the LM.
        edge_dim: width of edge features; 0 = one learned edge embedding shared by all edges.
        norm: LayerNorm on ``[h, agg]`` before the update.
        zero_update: the update starts at 0 and the gate at 1 (see module docstring).
    """

    def __init__(
        self, hidden_size: int, edge_dim: int = 0, norm: bool = False, zero_update: bool = False
    ):
        super().__init__()
        self.edge_dim = edge_dim
        if edge_dim > 0:
            self.edge_embed = nn.Linear(edge_dim, hidden_size)
        else:
            self.edge_embed = nn.Parameter(torch.ones(hidden_size))
        self.aggregations = nn.ModuleList([MeanAggregation(), MaxAggregation(), StdAggregation()])
        self.norm = nn.LayerNorm(4 * hidden_size) if norm else None
        self.update = nn.Linear(4 * hidden_size, hidden_size)
        self.gate = nn.Parameter(torch.zeros(()))
        if zero_update:
            nn.init.zeros_(self.update.weight)
            nn.init.zeros_(self.update.bias)
            nn.init.ones_(self.gate)

    def edge_embeddings(self, num_edges: int, edge_attr: Tensor | None, like: Tensor) -> Tensor:
        if self.edge_dim > 0:
            if edge_attr is None:
                raise ValueError(f"edge_attr (E, {self.edge_dim}) is required (edge_dim > 0)")
            return self.edge_embed(edge_attr.to(like.dtype))
        return self.edge_embed.to(like.dtype).expand(num_edges, -1)

    def aggregate(self, h: Tensor, edge_index: Tensor, edge_attr: Tensor | None) -> Tensor:
        """``[mean, max, std]`` of incoming messages per node: ``(M, 3 D)``."""
        src, dst = edge_index
        messages = h[src] * self.edge_embeddings(src.numel(), edge_attr, h)  # (E, D)
        return torch.cat(
            [agg(messages, dst, dim_size=h.shape[0]) for agg in self.aggregations], dim=-1
        )

    def forward(self, h: Tensor, edge_index: Tensor, edge_attr: Tensor | None = None) -> Tensor:
        agg = self.aggregate(h, edge_index, edge_attr)
        x = torch.cat([h, agg], dim=-1)
        h_new = self.update(x if self.norm is None else self.norm(x))
        return h + torch.tanh(self.gate) * h_new
