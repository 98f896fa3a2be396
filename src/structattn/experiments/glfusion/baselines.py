"""The graph baselines beside GL-Fusion: an MLP and GraphSAGE on the cached node-text encodings,
each also with the training labels GL-Fusion's prompts show."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["BASELINE_NAMES", "LABEL_BASELINES", "run_baselines"]

#: Every baseline, in table order, with the name every table gives it.
BASELINE_NAMES = {
    "mlp": "MLP on node-text encodings",
    "graphsage": "GraphSAGE on node-text encodings",
    "mlp+labels": "MLP + neighbours' training labels",
    "graphsage+labels": "GraphSAGE + training labels (target masked)",
    "neighbour-vote": "majority of the labels the prompt shows (no text, no training)",
    "label-propagation": "label propagation from the training labels (no text)",
}

#: The baselines that read training labels, as GL-Fusion's prompts do.
LABEL_BASELINES = ("mlp+labels", "graphsage+labels", "neighbour-vote", "label-propagation")


class BaselineNet(nn.Module):
    """Two layers, Linear (MLP) or SAGEConv (GraphSAGE), ReLU and dropout between."""

    def __init__(self, dim: int, classes: int, graph_conv: bool, hidden: int = 256):
        super().__init__()
        from torch_geometric.nn import SAGEConv

        self.graph_conv = graph_conv
        self.l1 = SAGEConv(dim, hidden) if graph_conv else nn.Linear(dim, hidden)
        self.l2 = SAGEConv(hidden, classes) if graph_conv else nn.Linear(hidden, classes)

    def _apply(self, layer, h, edge_index):
        return layer(h, edge_index) if self.graph_conv else layer(h)

    def forward(self, x, edge_index):
        h = F.dropout(F.relu(self._apply(self.l1, x, edge_index)), 0.2, self.training)
        return self._apply(self.l2, h, edge_index)


@dataclass
class BaselineData:
    """The subgraph induced by the targets' prompts, its features and labels (positions in the
    sorted node list ``universe``)."""

    pooled: Tensor  # (n, dim) mean-pooled node-text encodings
    edges: Tensor  # (2, E) undirected edges between universe positions
    y: Tensor  # (n,) labels
    idx: dict[str, Tensor]  # the targets of each split, as positions
    train_mask: Tensor  # (n,) in the graph's training split
    one_hot: Tensor  # (n, K)
    degree: Tensor  # (n, 1) in-degree, at least 1

    @classmethod
    def build(cls, graph, universe: list[int], pooled: Tensor, targets: dict[str, list[int]]):
        from torch_geometric.utils import subgraph, to_undirected

        local = {v: i for i, v in enumerate(universe)}
        nodes = torch.tensor(universe)
        edges, _ = subgraph(
            nodes,
            to_undirected(graph.edge_index, num_nodes=graph.num_nodes),
            relabel_nodes=False,
            num_nodes=graph.num_nodes,
        )
        lookup = torch.full((graph.num_nodes,), -1, dtype=torch.long)
        lookup[nodes] = torch.arange(len(nodes))
        edges = lookup[edges]  # positions in `universe`
        y = graph.labels[nodes]
        train_mask = torch.zeros(graph.num_nodes, dtype=torch.bool)  # the graph's training split
        train_mask[graph.splits["train"]] = True
        return cls(
            pooled=pooled,
            edges=edges,
            y=y,
            idx={k: torch.tensor([local[v] for v in vs]) for k, vs in targets.items()},
            train_mask=train_mask[nodes],  # over `universe`; val / test targets never in it
            # unlabelled nodes (-1) are context: a zero row, never a target or a shown label
            one_hot=F.one_hot(y.clamp_min(0), len(graph.label_names)).float()
            * (y >= 0)[:, None].float(),
            degree=torch.bincount(edges[1], minlength=len(nodes)).clamp_min(1).float()[:, None],
        )

    def features(self, name: str, shown: Tensor) -> Tensor:
        """Baseline ``name``'s input with the labels of the nodes in ``shown``."""
        if not name.endswith("+labels"):
            return self.pooled
        labels = self.one_hot * shown[:, None].float()  # (n, K): zeros where not shown
        if name.startswith("graphsage"):
            return torch.cat([self.pooled, labels], 1)
        edges = self.edges
        neighbours = torch.zeros_like(labels).index_add_(0, edges[1], labels[edges[0]])
        return torch.cat([self.pooled, neighbours / self.degree], 1)

    def epoch_targets(self, name: str, g: torch.Generator) -> tuple[Tensor, Tensor]:
        """The training targets of one epoch and the nodes whose labels it shows: with labels
        as input, a fresh half of the targets is predicted with its labels hidden."""
        fit_on = self.idx["train"]
        shown = torch.zeros_like(self.train_mask)
        if name.endswith("+labels"):
            order = self.idx["train"][torch.randperm(len(self.idx["train"]), generator=g)]
            fit_on = order[len(order) // 2 :]
            shown = self.train_mask.clone()
            shown[fit_on] = False
        return fit_on, shown


def train_baseline(name: str, data: BaselineData, epochs: int, seed: int) -> dict[str, float]:
    """Full-batch AdamW; the validation and test accuracy of the epoch best on validation."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    shown_all = data.features(name, data.train_mask)  # evaluation features: fixed
    model = BaselineNet(shown_all.shape[1], data.one_hot.shape[1], name.startswith("graphsage"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=5e-4)
    y, idx = data.y, data.idx
    best, best_state = -1.0, None
    for _ in range(epochs):
        model.train()
        opt.zero_grad()
        fit_on, shown = data.epoch_targets(name, g)
        logits = model(data.features(name, shown), data.edges)
        F.cross_entropy(logits[fit_on], y[fit_on]).backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            pred = model(shown_all, data.edges).argmax(-1)
        val = (pred[idx["val"]] == y[idx["val"]]).float().mean().item()
        if val > best:
            test = (pred[idx["test"]] == y[idx["test"]]).float().mean().item()
            best, best_state = val, {"val": val, "test": test}
    return best_state


def _accuracies(pred: Tensor, y: Tensor, idx: dict[str, Tensor]) -> dict[str, float]:
    return {k: (pred[idx[k]] == y[idx[k]]).float().mean().item() for k in ("val", "test")}


def neighbour_vote(graph, examples: dict[str, list], show_labels: bool) -> dict[str, float]:
    """Each target's class as the most frequent label among the training-split nodes of its own
    prompt (the labels GL-Fusion is shown; never the target's): ties and prompts without a
    shown label go to the most frequent training label. With ``show_labels`` off the prompts
    show no label and the vote is that majority class."""
    k = len(graph.label_names)
    train = torch.zeros(graph.num_nodes, dtype=torch.bool)
    train[graph.splits["train"]] = True
    prior = torch.bincount(graph.labels[graph.splits["train"]], minlength=k).float()
    out = {}
    for split in ("val", "test"):
        hits = []
        for ex in examples[split]:
            others = ex.nodes[1:]
            shown = others[train[others]] if show_labels else others[:0]
            votes = torch.bincount(graph.labels[shown], minlength=k).float()
            pred = int((votes + prior / (prior.sum() + 1)).argmax())  # prior breaks ties
            hits.append(pred == ex.label)
        out[split] = sum(hits) / len(hits)
    return out


def label_propagation(data: BaselineData, alphas=(0.5, 0.9, 0.99)) -> dict[str, float]:
    """torch_geometric's ``LabelPropagation`` (3 layers) over the subgraph the prompts span,
    seeded with the training-split labels (targets' own labels included only for training
    targets, which are never scored); a target no label reaches gets the most frequent training
    label, as in :func:`neighbour_vote`; ``alpha`` chosen on validation."""
    from torch_geometric.nn import LabelPropagation

    y = data.y.clamp_min(0)
    prior = data.one_hot[data.train_mask].sum(0)  # training label counts
    best = None
    for alpha in alphas:
        out = LabelPropagation(num_layers=3, alpha=alpha)(y, data.edges, mask=data.train_mask)
        pred = out.argmax(-1)
        reached = out.sum(-1) > 0  # no training label within 3 hops: the majority class
        pred = torch.where(reached, pred, prior.argmax())
        acc = _accuracies(pred, data.y, data.idx)
        if best is None or acc["val"] > best["val"]:
            best = acc
    return best


def run_baselines(
    graph,
    universe: list[int],
    pooled: Tensor,
    targets: dict[str, list[int]],
    epochs: int,
    seed: int,
    examples: dict[str, list] | None = None,
    show_labels: bool = True,
) -> dict[str, dict[str, float]]:
    """MLP and GraphSAGE, full batch on the subgraph induced by ``universe``; each also with
    training labels as input features, the information GL-Fusion's prompts carry:

    * ``graphsage+labels``: node features ``[text, one-hot label]``, the label shown for nodes
      of the graph's training split that are not being predicted (zeros otherwise), as
      GL-Fusion's prompts show training-split neighbours' labels; GraphSAGE aggregates them;
    * ``mlp+labels``: ``[text, mean of the neighbours' shown labels]`` (an MLP sees no graph);
    * ``neighbour-vote`` (with ``examples``, the prompts): :func:`neighbour_vote`;
    * ``label-propagation``: :func:`label_propagation`.

    While training, a fresh seeded half of the training targets per epoch are predicted with
    their labels hidden (every other training-split node shows its label), so no node is ever
    predicted from its own label; at evaluation every training-split node shows its label and
    validation / test nodes never do."""
    data = BaselineData.build(graph, universe, pooled, targets)
    trained = ("mlp", "graphsage", "mlp+labels", "graphsage+labels")
    out = {name: train_baseline(name, data, epochs, seed) for name in trained}
    if examples is not None:
        out["neighbour-vote"] = neighbour_vote(graph, examples, show_labels)
    out["label-propagation"] = label_propagation(data)
    return out
