"""GL-Fusion's structure-aware attention mask and shared node position ids.

Rules (for a query ``i`` and a key ``j`` of one sequence):

* text attends causally (``j <= i``), so text after the graph sees everything before it;
* a node token attends to the text before the graph and to every node token of its graph (in
  both directions: the graph has no token order);
* padding is never attended to, and padded queries attend to nothing.

Shapes: ``node_mask (B, N)`` bool, one contiguous block of node tokens per sequence (or none);
``attention_mask (B, N)``, 1 = real token. Returns ``(B, 1, N, N)`` bool, True = may attend.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["build_structure_mask", "node_position_ids", "to_additive_mask"]


def _check_node_mask(node_mask: Tensor) -> None:
    if node_mask.dim() != 2 or node_mask.dtype != torch.bool:
        raise ValueError(
            f"node_mask must be (B, N) bool, got {node_mask.dtype} {tuple(node_mask.shape)}"
        )
    # One contiguous block: at most one False->True edge per row.
    starts = (node_mask[:, 1:] & ~node_mask[:, :-1]).sum(-1) + node_mask[:, 0].long()
    if bool((starts > 1).any()):
        rows = torch.nonzero(starts > 1).flatten().tolist()
        raise ValueError(f"node tokens must form one contiguous block per sequence (rows {rows})")


def build_structure_mask(node_mask: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """The structure-aware mask ``(B, 1, N, N)``, True = query may attend key (see module)."""
    _check_node_mask(node_mask)
    B, N = node_mask.shape
    idx = torch.arange(N, device=node_mask.device)
    causal = (idx[None, :] <= idx[:, None]).expand(B, N, N)  # (B, N, N) [query, key]
    big = torch.full_like(idx, N).expand(B, N)
    first_node = torch.where(node_mask, idx.expand(B, N), big).min(-1).values  # (B,) N if none
    before_graph = idx[None, :] < first_node[:, None]  # (B, N) keys before the graph
    node_rows = node_mask[:, :, None] & (before_graph[:, None, :] | node_mask[:, None, :])
    allowed = torch.where(node_mask[:, :, None], node_rows, causal)
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (B, N):
            raise ValueError(
                f"attention_mask must be (B, N) = {(B, N)}, got {tuple(attention_mask.shape)}"
            )
        real = attention_mask.bool()
        allowed = allowed & real[:, None, :] & real[:, :, None]
    return allowed.unsqueeze(1)


def node_position_ids(node_mask: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Position ids ``(B, N)``: text counts up, every node token of a graph shares the position of
    the first one, and text after the graph continues from it + 1. Padding gets position 0."""
    _check_node_mask(node_mask)
    real = torch.ones_like(node_mask) if attention_mask is None else attention_mask.bool()
    # A node token advances the position only if it is the first of its block.
    prev_node = torch.zeros_like(node_mask)
    prev_node[:, 1:] = node_mask[:, :-1]
    advances = real & ~(node_mask & prev_node)
    pos = advances.long().cumsum(-1) - 1
    return pos.clamp_min(0).masked_fill(~real, 0)


def to_additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool mask -> additive float mask (0 where allowed, the dtype's minimum elsewhere); rows
    with nothing allowed stay finite."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
