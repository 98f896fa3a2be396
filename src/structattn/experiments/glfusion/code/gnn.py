"""OGB's ogbg-code2 GNN baselines: GCN and GIN with a virtual node over the syntax tree.

As in OGB's example (``examples/graphproppred/code2``): a node is embedded as the sum of its
type, its attribute (the most frequent training attributes; others ``__UNK__``, none
``__NONE__``) and its depth (capped); edges are the tree's parent -> child edges and the
next-token edges, each also reversed, with a 2-dimensional edge feature (kind, direction); five
layers of 300 with batch norm, a virtual node updated by an MLP between layers, mean pooling, and
one linear classifier per sub-token position over the most frequent training sub-tokens plus
``__UNK__`` and ``__EOS__``. The loss is the mean cross-entropy over the positions; a prediction
reads positions until the first ``__EOS__``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Batch, Data
from torch_geometric.nn import GINEConv, MessagePassing, global_add_pool, global_mean_pool
from torch_geometric.utils import degree

from structattn.data.code import MAX_SUBTOKENS, CodeExample

__all__ = ["GNNOutput", "NameGNN", "Vocabulary", "graph_data"]

UNK, EOS, NONE = "__UNK__", "__EOS__", "__NONE__"


@dataclass
class Vocabulary:
    """Node types, node attributes and target sub-tokens, each a list whose index is the id."""

    types: list[str]
    attributes: list[str]
    subtokens: list[str]

    @classmethod
    def from_examples(cls, examples: Sequence[CodeExample], num_vocab: int = 5000,
                      num_attributes: int = 10000) -> Vocabulary:  # fmt: skip
        """From the training examples only; ties broken by the token's text (deterministic)."""

        def top(counter: Counter, k: int) -> list[str]:
            return [t for t, _ in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]

        types = Counter(t for ex in examples for t in ex.node_types)
        attrs = Counter(a for ex in examples for a in ex.node_attributes if a is not None)
        subs = Counter(s for ex in examples for s in ex.target)
        return cls([UNK, *sorted(types)], [UNK, NONE, *top(attrs, num_attributes)],
                   [UNK, EOS, *top(subs, num_vocab)])  # fmt: skip

    def __post_init__(self) -> None:
        self.type_id = {t: i for i, t in enumerate(self.types)}
        self.attribute_id = {a: i for i, a in enumerate(self.attributes)}
        self.subtoken_id = {s: i for i, s in enumerate(self.subtokens)}

    def to_dict(self) -> dict[str, list[str]]:
        return {"types": self.types, "attributes": self.attributes, "subtokens": self.subtokens}

    def encode_target(self, subtokens: Sequence[str]) -> list[int]:
        """:data:`MAX_SUBTOKENS` ids: the first sub-tokens (unknown ones ``__UNK__``), then
        ``__EOS__`` (OGB's ``encode_y_to_arr``)."""
        ids = [self.subtoken_id.get(s, 0) for s in subtokens[:MAX_SUBTOKENS]]
        return ids + [1] * (MAX_SUBTOKENS - len(ids))

    def decode(self, ids: Sequence[int]) -> list[str]:
        """Sub-tokens up to the first ``__EOS__`` (``__UNK__`` is kept: it scores as wrong)."""
        out = []
        for i in ids:
            if i == 1:
                break
            out.append(self.subtokens[i])
        return out


def graph_data(ex: CodeExample, vocab: Vocabulary, max_depth: int) -> Data:
    """One example as a PyG ``Data``: node ids ``x`` (type, attribute), ``depth``, both edge
    directions with ``edge_attr`` (kind, direction), and the target ``y`` (1, 5)."""
    ids = [[vocab.type_id.get(t, 0), 1 if a is None else vocab.attribute_id.get(a, 0)]
           for t, a in zip(ex.node_types, ex.node_attributes)]  # fmt: skip
    x = torch.tensor(ids, dtype=torch.long)
    edges = torch.tensor(ex.edges, dtype=torch.long).reshape(-1, 2).T
    kinds = torch.tensor(ex.edge_kinds, dtype=torch.long)
    edge_index = torch.cat([edges, edges.flip(0)], dim=1)
    edge_attr = torch.stack(
        [kinds.repeat(2), torch.cat([torch.zeros_like(kinds), torch.ones_like(kinds)])], dim=1
    )
    depth = torch.tensor(ex.depth, dtype=torch.long).clamp(max=max_depth)
    y = torch.tensor([vocab.encode_target(ex.subtokens)], dtype=torch.long)
    return Data(x=x, depth=depth, edge_index=edge_index, edge_attr=edge_attr, y=y,
                num_nodes=ex.num_nodes)  # fmt: skip


class EdgeGCNConv(MessagePassing):
    """OGB's GCN layer with edge features: ``m_ij = norm_ij * relu(W x_j + e_ij)`` summed over
    neighbours, plus the node's own ``relu(W x_i + r) / deg_i`` (``r`` a learned root
    embedding), degrees counting the self-loop."""

    def __init__(self, dim: int):
        super().__init__(aggr="add")
        self.linear = nn.Linear(dim, dim)
        self.root = nn.Parameter(torch.zeros(dim))
        self.edge = nn.Linear(2, dim)

    def forward(self, x: Tensor, edge_index: Tensor, edge_attr: Tensor) -> Tensor:
        x = self.linear(x)
        src, dst = edge_index
        deg = degree(src, x.shape[0], dtype=x.dtype) + 1
        inv = deg.pow(-0.5)
        norm = inv[src] * inv[dst]
        out = self.propagate(edge_index, x=x, edge_attr=self.edge(edge_attr), norm=norm)
        return out + F.relu(x + self.root) / deg[:, None]

    def message(self, x_j: Tensor, edge_attr: Tensor, norm: Tensor) -> Tensor:
        return norm[:, None] * F.relu(x_j + edge_attr)


def _gin(dim: int) -> GINEConv:
    mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.BatchNorm1d(2 * dim), nn.ReLU(),
                        nn.Linear(2 * dim, dim))  # fmt: skip
    return GINEConv(mlp, train_eps=True, edge_dim=2)


@dataclass
class GNNOutput:
    loss: Tensor | None
    logits: Tensor  # (B, MAX_SUBTOKENS, vocabulary)


class NameGNN(nn.Module):
    """GCN or GIN (``kind``) with a virtual node, predicting :data:`MAX_SUBTOKENS` sub-tokens."""

    def __init__(self, vocab: Vocabulary, kind: str = "gcn", layers: int = 5, dim: int = 300,
                 virtual_node: bool = True, dropout: float = 0.0, max_depth: int = 20):  # fmt: skip
        super().__init__()
        if kind not in ("gcn", "gin"):
            raise ValueError(f"kind must be gcn or gin, got {kind!r}")
        self.kind, self.dropout, self.virtual_node = kind, dropout, virtual_node
        self.type_emb = nn.Embedding(len(vocab.types), dim)
        self.attr_emb = nn.Embedding(len(vocab.attributes), dim)
        self.depth_emb = nn.Embedding(max_depth + 1, dim)
        self.convs = nn.ModuleList(EdgeGCNConv(dim) if kind == "gcn" else _gin(dim)
                                   for _ in range(layers))  # fmt: skip
        self.norms = nn.ModuleList(nn.BatchNorm1d(dim) for _ in range(layers))
        if virtual_node:
            self.vn_emb = nn.Parameter(torch.zeros(dim))  # OGB starts it at 0
            self.vn_mlps = nn.ModuleList(
                nn.Sequential(nn.Linear(dim, 2 * dim), nn.BatchNorm1d(2 * dim), nn.ReLU(),
                              nn.Linear(2 * dim, dim), nn.BatchNorm1d(dim), nn.ReLU())
                for _ in range(layers - 1)
            )  # fmt: skip
        self.heads = nn.ModuleList(nn.Linear(dim, len(vocab.subtokens))
                                   for _ in range(MAX_SUBTOKENS))  # fmt: skip

    def node_states(self, batch: Batch) -> Tensor:
        h = (
            self.type_emb(batch.x[:, 0])
            + self.attr_emb(batch.x[:, 1])
            + self.depth_emb(batch.depth)
        )
        edge_attr = batch.edge_attr.to(h.dtype)
        n_graphs = int(batch.num_graphs)
        vn = self.vn_emb.expand(n_graphs, -1) if self.virtual_node else None
        last = len(self.convs) - 1
        for i, (conv, norm) in enumerate(zip(self.convs, self.norms)):
            if vn is not None:
                h = h + vn[batch.batch]
            out = norm(conv(h, batch.edge_index, edge_attr))
            if i < last:
                out = F.relu(out)
            out = F.dropout(out, self.dropout, self.training)
            if vn is not None and i < last:
                vn = F.dropout(self.vn_mlps[i](global_add_pool(h, batch.batch, n_graphs) + vn),
                               self.dropout, self.training)  # fmt: skip
            h = out
        return h

    def forward(self, graphs: Batch, labels: Tensor | None = None) -> GNNOutput:
        pooled = global_mean_pool(self.node_states(graphs), graphs.batch, int(graphs.num_graphs))
        logits = torch.stack([head(pooled) for head in self.heads], dim=1)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return GNNOutput(loss, logits)

    @torch.no_grad()
    def predict_ids(self, graphs: Batch) -> Tensor:
        return self(graphs).logits.argmax(-1)
