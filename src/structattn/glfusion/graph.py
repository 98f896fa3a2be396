"""A batch of subgraphs for GL-Fusion, aligned with the ``<node>`` tokens of the prompts.

Nodes are numbered globally across the batch in the order their ``<node>`` tokens appear
(sequence by sequence, left to right); ``edge_index`` uses those global numbers (batch offsets
applied), as ``torch_geometric`` does for mini-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

__all__ = ["GraphBatch"]


@dataclass
class GraphBatch:
    """Shapes: ``M`` nodes in the batch, ``E`` edges, ``Lt`` node-text tokens, ``B`` sequences.

    node_text:      (M, Lt, text_dim) frozen text-encoder token encodings of each node's text
    node_text_mask: (M, Lt) bool, True = real text token (every node needs at least one)
    edge_index:     (2, E) long, global node indices, messages flow edge_index[0] -> [1]
    node_batch:     (M,) long, the sequence each node belongs to (non-decreasing)
    edge_attr:      (E, edge_dim) or None
    target_nodes:   (B,) long global index of each sequence's target node, or None
    """

    node_text: Tensor
    node_text_mask: Tensor
    edge_index: Tensor
    node_batch: Tensor
    edge_attr: Tensor | None = None
    target_nodes: Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return self.node_text.shape[0]

    def to(self, device) -> GraphBatch:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return GraphBatch(
            move(self.node_text),
            move(self.node_text_mask),
            move(self.edge_index),
            move(self.node_batch),
            move(self.edge_attr),
            move(self.target_nodes),
        )

    @classmethod
    def from_graphs(
        cls,
        node_texts: Sequence[Tensor],
        edge_indices: Sequence[Tensor],
        edge_attrs: Sequence[Tensor] | None = None,
        targets: Sequence[int] | None = None,
    ) -> GraphBatch:
        """Collate per-sequence graphs: ``node_texts[b]`` is ``(n_b, L_b, text_dim)`` (or a list
        of ``(L, text_dim)`` tensors of varied length), ``edge_indices[b]`` local ``(2, E_b)``,
        ``targets[b]`` the local index of the target node."""
        texts, batch, edges, offset, target_list = [], [], [], 0, []
        for b, (nt, ei) in enumerate(zip(node_texts, edge_indices)):
            rows = list(nt) if not isinstance(nt, Tensor) or nt.dim() == 3 else [nt]
            n = len(rows)
            if n == 0:
                raise ValueError(f"graph {b} is empty: every sequence with a graph needs >= 1 node")
            ei = torch.as_tensor(ei, dtype=torch.long).reshape(2, -1)
            if ei.numel() and (int(ei.min()) < 0 or int(ei.max()) >= n):
                raise ValueError(f"graph {b}: edge_index refers to nodes outside 0..{n - 1}")
            texts.extend(rows)
            batch.append(torch.full((n,), b, dtype=torch.long))
            edges.append(ei + offset)
            if targets is not None:
                target_list.append(offset + int(targets[b]))
            offset += n
        lengths = torch.tensor([len(t) for t in texts])
        node_text = pad_sequence(list(texts), batch_first=True)
        mask = torch.arange(node_text.shape[1])[None] < lengths[:, None]
        attr = torch.cat(list(edge_attrs)) if edge_attrs is not None else None
        return cls(
            node_text,
            mask,
            torch.cat(edges, dim=1),
            torch.cat(batch),
            attr,
            torch.tensor(target_list) if targets is not None else None,
        )

    def validate(self, input_ids: Tensor, node_token_id: int) -> Tensor:
        """Check the batch against the prompts; return the node tokens' ``(M, 2)`` (b, pos)."""
        B = input_ids.shape[0]
        M = self.num_nodes
        if M == 0:
            raise ValueError("the graph batch is empty (no nodes)")
        if (
            self.node_text.dim() != 3
            or tuple(self.node_text_mask.shape) != self.node_text.shape[:2]
        ):
            raise ValueError("node_text must be (M, Lt, text_dim) with node_text_mask (M, Lt)")
        if not bool(self.node_text_mask.any(-1).all()):
            raise ValueError("every node needs at least one text token in node_text_mask")
        if self.edge_index.dim() != 2 or self.edge_index.shape[0] != 2:
            raise ValueError(f"edge_index must be (2, E), got {tuple(self.edge_index.shape)}")
        if self.edge_index.numel() and (
            int(self.edge_index.min()) < 0 or int(self.edge_index.max()) >= M
        ):
            raise ValueError(f"edge_index refers to nodes outside 0..{M - 1}")
        if self.edge_index.numel() and bool(
            (self.node_batch[self.edge_index[0]] != self.node_batch[self.edge_index[1]]).any()
        ):
            raise ValueError("an edge connects nodes of different graphs")
        if self.edge_attr is not None and self.edge_attr.shape[0] != self.edge_index.shape[1]:
            raise ValueError("edge_attr must have one row per edge")
        if self.node_batch.shape != (M,) or bool(
            (self.node_batch[1:] < self.node_batch[:-1]).any()
        ):
            raise ValueError(
                "node_batch must be (M,) and non-decreasing (nodes grouped by sequence)"
            )
        slots = torch.nonzero(input_ids == node_token_id)  # (M', 2) sorted by (b, pos)
        per_seq_tokens = torch.bincount(slots[:, 0], minlength=B)
        per_seq_nodes = torch.bincount(self.node_batch, minlength=B)
        if per_seq_nodes.numel() > B:
            raise ValueError(
                f"node_batch names sequence {per_seq_nodes.numel() - 1} of a batch of {B}"
            )
        if not torch.equal(per_seq_tokens, per_seq_nodes):
            raise ValueError(
                f"node count != <node> tokens per sequence: nodes {per_seq_nodes.tolist()}, "
                f"tokens {per_seq_tokens.tolist()}"
            )
        if self.target_nodes is not None and (
            self.target_nodes.shape != (B,)
            or bool(((self.target_nodes < 0) | (self.target_nodes >= M)).any())
        ):
            raise ValueError("target_nodes must be (B,) global node indices")
        return slots
