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


def _edge_index(ei, b: int, n: int) -> Tensor:
    """Graph ``b``'s local edge index as ``(2, E)`` long, checked against its ``n`` nodes."""
    if ei is None:
        return torch.zeros(2, 0, dtype=torch.long)
    ei = torch.as_tensor(ei)
    if ei.numel() == 0:
        return torch.zeros(2, 0, dtype=torch.long)
    if torch.is_floating_point(ei) or ei.dtype == torch.bool:
        raise ValueError(f"graph {b}: edge_index must hold integers, got {ei.dtype}")
    if ei.dim() != 2 or ei.shape[0] != 2:
        hint = (
            " (an (E, 2) edge list: pass edge_index.T)"
            if ei.dim() == 2 and ei.shape[1] == 2
            else ""
        )
        raise ValueError(f"graph {b}: edge_index must be (2, E), got {tuple(ei.shape)}{hint}")
    ei = ei.long()
    if int(ei.min()) < 0 or int(ei.max()) >= n:
        raise ValueError(f"graph {b}: edge_index refers to nodes outside 0..{n - 1}")
    return ei


def _check_no_graph(b: int, ei, targets) -> None:
    """Sequence ``b`` has no graph: it has no edges and no target either."""
    if ei is not None and torch.as_tensor(ei).numel():
        raise ValueError(f"sequence {b} has edges but no node texts")
    if targets is not None and targets[b] is not None:
        raise ValueError(f"sequence {b} has a target but no graph")


def _node_rows(nt, b: int) -> list[Tensor]:
    """Graph ``b``'s node texts as a list of ``(L >= 1, text_dim)`` tensors (at least one)."""
    rows = list(nt) if not isinstance(nt, Tensor) or nt.dim() == 3 else [nt]
    if not rows:
        raise ValueError(
            f"graph {b} is empty: give it >= 1 node, or None for a sequence without a graph"
        )
    for i, row in enumerate(rows):
        if row.dim() != 2 or row.shape[0] == 0:
            raise ValueError(
                f"graph {b}, node {i}: its text must be (L >= 1, text_dim), got {tuple(row.shape)}"
            )
    return rows


def _edge_attr(attr, b: int, num_edges: int) -> Tensor:
    if attr is None or attr.dim() != 2 or attr.shape[0] != num_edges:
        raise ValueError(
            f"graph {b}: edge_attrs must be (E, edge_dim) with E = {num_edges}, "
            f"got {None if attr is None else tuple(attr.shape)}"
        )
    return attr


def _target(t, b: int, n: int) -> int:
    if t is None or not 0 <= int(t) < n:
        raise ValueError(f"graph {b}: target {t} is not a node index in 0..{n - 1}")
    return int(t)


def _spans(spans, b: int, n: int) -> Tensor:
    """Graph ``b``'s text spans as ``(n, 2)`` long."""
    spans = torch.as_tensor(spans)
    if torch.is_floating_point(spans) or tuple(spans.shape) != (n, 2):
        raise ValueError(f"graph {b}: text_spans must be ({n}, 2) integer columns, "
                         f"got {spans.dtype} {tuple(spans.shape)}")  # fmt: skip
    return spans.long()


@dataclass
class GraphBatch:
    """Shapes: ``M`` nodes in the batch, ``E`` edges, ``Lt`` node-text tokens, ``B`` sequences.

    node_text:      (M, Lt, text_dim) frozen text-encoder token encodings of each node's text
    node_text_mask: (M, Lt) bool, True = real text token (every node needs at least one)
    edge_index:     (2, E) long, global node indices, messages flow edge_index[0] -> [1]
    node_batch:     (M,) long, the sequence each node belongs to (non-decreasing)
    edge_attr:      (E, edge_dim) or None
    target_nodes:   (B,) long global index of each sequence's target node, or None
    text_spans:     (M, 2) long ``[start, end)`` columns of each node's text in its prompt (the
                    gated form, whose prompts hold the node texts instead of node tokens; the
                    text's last token is then the node's slot), or None
    """

    node_text: Tensor
    node_text_mask: Tensor
    edge_index: Tensor
    node_batch: Tensor
    edge_attr: Tensor | None = None
    target_nodes: Tensor | None = None
    text_spans: Tensor | None = None

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
            move(self.text_spans),
        )

    @classmethod
    def from_graphs(
        cls,
        node_texts: Sequence[Tensor | None],
        edge_indices: Sequence[Tensor | None],
        edge_attrs: Sequence[Tensor | None] | None = None,
        targets: Sequence[int | None] | None = None,
        text_spans: Sequence[Tensor | None] | None = None,
    ) -> GraphBatch:
        """Collate per-sequence graphs: ``node_texts[b]`` is ``(n_b, L_b, text_dim)`` (or a list
        of ``(L, text_dim)`` tensors of varied length), ``edge_indices[b]`` local ``(2, E_b)``
        (source row first, as in PyG; an ``(E, 2)`` edge list must be transposed), ``targets[b]``
        the local index of the target node, ``text_spans[b]`` ``(n_b, 2)`` the ``[start, end)``
        columns of each node's text in prompt ``b`` (the gated form).

        A sequence without a graph (plain text in a mixed batch) has ``node_texts[b] = None``,
        ``edge_indices[b] = None`` and ``targets[b] = None`` (its target is then -1)."""
        if len(node_texts) != len(edge_indices):
            raise ValueError(
                f"{len(node_texts)} node-text entries but {len(edge_indices)} edge indices"
            )
        for name, seq in (("edge_attrs", edge_attrs), ("targets", targets),
                          ("text_spans", text_spans)):  # fmt: skip
            if seq is not None and len(seq) != len(node_texts):
                raise ValueError(f"{name} has {len(seq)} entries for {len(node_texts)} sequences")
        texts, batch, edges, attrs, offset, target_list, spans = [], [], [], [], 0, [], []
        for b, (nt, ei) in enumerate(zip(node_texts, edge_indices)):
            if nt is None:
                _check_no_graph(b, ei, targets)
                target_list.append(-1)
                continue
            rows = _node_rows(nt, b)
            n = len(rows)
            ei = _edge_index(ei, b, n)
            texts.extend(rows)
            batch.append(torch.full((n,), b, dtype=torch.long))
            edges.append(ei + offset)
            if edge_attrs is not None:
                attrs.append(_edge_attr(edge_attrs[b], b, ei.shape[1]))
            if targets is not None:
                target_list.append(offset + _target(targets[b], b, n))
            if text_spans is not None:
                spans.append(_spans(text_spans[b], b, n))
            offset += n
        if not texts:
            raise ValueError("no sequence of the batch has a graph (no nodes)")
        dims = {t.shape[-1] for t in texts}
        if len(dims) > 1:
            raise ValueError(f"node texts have different widths {sorted(dims)}")
        lengths = torch.tensor([len(t) for t in texts])
        node_text = pad_sequence(list(texts), batch_first=True)
        mask = torch.arange(node_text.shape[1])[None] < lengths[:, None]
        return cls(
            node_text,
            mask,
            torch.cat(edges, dim=1),
            torch.cat(batch),
            torch.cat(attrs) if edge_attrs is not None else None,
            torch.tensor(target_list) if targets is not None else None,
            torch.cat(spans) if text_spans is not None else None,
        )

    def validate(
        self, input_ids: Tensor, node_token_id: int, attention_mask: Tensor | None = None
    ) -> Tensor:
        """Check the batch against the prompts; return each node's slot ``(M, 2)`` (b, pos):
        its node token, or with ``text_spans`` its text's last token (every span column a real
        token of ``attention_mask``)."""
        B = input_ids.shape[0]
        self._check_shapes()
        per_seq_nodes = torch.bincount(self.node_batch, minlength=B)
        if per_seq_nodes.numel() > B:
            raise ValueError(
                f"node_batch names sequence {per_seq_nodes.numel() - 1} of a batch of {B}"
            )
        if self.text_spans is not None:
            slots = self._span_slots(input_ids, node_token_id, attention_mask)
        else:
            slots = torch.nonzero(input_ids == node_token_id)  # (M', 2) sorted by (b, pos)
            per_seq_tokens = torch.bincount(slots[:, 0], minlength=B)
            if not torch.equal(per_seq_tokens, per_seq_nodes):
                raise ValueError(
                    f"node count != <node> tokens per sequence: nodes {per_seq_nodes.tolist()}, "
                    f"tokens {per_seq_tokens.tolist()}"
                )
        if self.target_nodes is not None:
            self._check_targets(B, per_seq_nodes[:B] == 0)
        return slots

    def _check_shapes(self) -> None:
        """Node texts, edges and ``node_batch`` are consistent with each other."""
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
        ei = self.edge_index
        if ei.dim() != 2 or ei.shape[0] != 2:
            raise ValueError(f"edge_index must be (2, E), got {tuple(ei.shape)}")
        if ei.numel() and (int(ei.min()) < 0 or int(ei.max()) >= M):
            raise ValueError(f"edge_index refers to nodes outside 0..{M - 1}")
        if ei.numel() and bool((self.node_batch[ei[0]] != self.node_batch[ei[1]]).any()):
            raise ValueError("an edge connects nodes of different graphs")
        if self.edge_attr is not None and self.edge_attr.shape[0] != ei.shape[1]:
            raise ValueError("edge_attr must have one row per edge")
        if self.node_batch.shape != (M,) or bool(
            (self.node_batch[1:] < self.node_batch[:-1]).any()
        ):
            raise ValueError(
                "node_batch must be (M,) and non-decreasing (nodes grouped by sequence)"
            )

    def _check_targets(self, B: int, no_graph: Tensor) -> None:
        t, M = self.target_nodes, self.num_nodes
        if (
            t.shape != (B,)
            or bool(((t < -1) | (t >= M)).any())
            or bool(((t == -1) & ~no_graph).any())
            or bool(((t >= 0) & (self.node_batch[t.clamp_min(0)] != torch.arange(B))).any())
        ):
            raise ValueError(
                "target_nodes must be (B,): each sequence's target as a global index of one "
                "of its own nodes (-1 for a sequence without a graph)"
            )

    def _span_slots(self, input_ids: Tensor, node_token_id: int, attention_mask=None) -> Tensor:
        """Prompts that hold every node's text (``text_spans``) and no node token: each node's
        slot ``(M, 2)``, the (row, column) of its text's last token. Spans must be non-empty,
        inside their prompt and must not overlap."""
        B, S = input_ids.shape
        M = self.num_nodes
        spans = self.text_spans
        if tuple(spans.shape) != (M, 2):
            raise ValueError(f"text_spans must be (M, 2) = ({M}, 2), got {tuple(spans.shape)}")
        if bool((input_ids == node_token_id).any()):
            raise ValueError("prompts with text_spans hold the node texts, not <node> tokens")
        start, end = spans[:, 0], spans[:, 1]
        if bool(((start < 0) | (end <= start) | (end > S)).any()):
            raise ValueError(f"text_spans must be non-empty [start, end) columns in 0..{S}")
        lengths = end - start
        rows = self.node_batch.repeat_interleave(lengths)
        offsets = torch.arange(rows.numel(), device=spans.device) - (
            torch.cumsum(lengths, 0) - lengths
        ).repeat_interleave(lengths)
        cols = start.repeat_interleave(lengths) + offsets
        if torch.unique(rows * S + cols).numel() != rows.numel():
            raise ValueError("text_spans overlap: a column holds the text of two nodes")
        if attention_mask is not None and not bool(attention_mask.bool()[rows, cols].all()):
            raise ValueError("text_spans cover padding: shift each span by its row's left "
                             "padding (spans are columns of the padded prompt)")  # fmt: skip
        return torch.stack([self.node_batch, end - 1], dim=1)
