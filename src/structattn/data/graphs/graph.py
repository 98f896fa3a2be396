"""The in-memory form of a text-attributed graph: :class:`TextAttributedGraph` holds node
texts, labels with names, splits and ``edge_index`` (optionally edge texts and node ids), checks
them, saves / loads a folder and converts to and from ``torch_geometric``."""

from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from structattn.errors import DataError
from structattn.utils.files import atomic_path

__all__ = ["TextAttributedGraph"]


def _is_integer(t: Tensor) -> bool:
    return not (torch.is_floating_point(t) or torch.is_complex(t) or t.dtype == torch.bool)


def _describe(t) -> str:
    if isinstance(t, Tensor):
        return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
    return type(t).__name__


def _class_indices(t: Tensor, what: str) -> Tensor:
    """``t`` as int64, refusing values that are not whole numbers (``long()`` would truncate
    1.7 to 1 and give a node the wrong class)."""
    if torch.is_floating_point(t):
        whole = torch.isfinite(t) & (t == t.round())
        if not bool(whole.all()):
            count = int((~whole).sum())
            first = t[~whole][0].item()
            raise ValueError(
                f"{what} has {count} value(s) that are not whole numbers (e.g. {first}): "
                "give integer class / node indices"
            )
    elif not _is_integer(t):
        raise ValueError(f"{what} must hold integers, got {_describe(t)}")
    return t.long()


def _labels_from(y, label_names) -> Tensor:
    """``data.y`` as class indices: a tensor, array or list of integers, or of class names
    (``None``, ``""`` or NaN for an unlabelled node, -1); a name not in ``label_names`` is
    refused."""
    values = y.tolist() if hasattr(y, "tolist") and not isinstance(y, Tensor) else y
    if isinstance(values, (list, tuple)) and any(isinstance(v, str) for v in values):
        index = {name: i for i, name in enumerate(label_names)}

        def unlabelled(v) -> bool:
            return v is None or v == "" or (isinstance(v, float) and math.isnan(v))

        unknown = sorted({str(v) for v in values if not unlabelled(v) and v not in index})
        if unknown:
            raise ValueError(
                f"data.y holds class names that are not in label_names: {unknown[:10]}"
            )
        return torch.tensor([-1 if unlabelled(v) else index[v] for v in values], dtype=torch.long)
    return _class_indices(torch.as_tensor(y).reshape(-1), "data.y")


def _splits_from(data, split: dict | None, n: int) -> dict[str, Tensor]:
    """``{"train" / "val" / "test": node indices}`` from ``split`` (indices or ``(N,)`` bool
    masks) or, without it, from ``data``'s ``train_mask`` / ``val_mask`` / ``test_mask``."""
    if split is None:
        split = {}
        for key in ("train", "val", "test"):
            mask = getattr(data, f"{key}_mask", None)
            if mask is None:
                raise ValueError(f"data has no {key}_mask (or pass split={{...}})")
            mask = torch.as_tensor(mask)
            if mask.dtype != torch.bool or mask.shape != (n,):
                raise ValueError(f"{key}_mask must be (N,) bool = ({n},)")
            split[key] = mask
    splits = {}
    for key in ("train", "val", "test"):
        if key not in split:
            raise ValueError(f"split has no {key!r} entry")
        idx = torch.as_tensor(split[key])
        if idx.dtype == torch.bool:
            if idx.shape != (n,):
                raise ValueError(f"{key}_mask must be (N,) bool = ({n},)")
            idx = idx.nonzero().flatten()
        splits[key] = _class_indices(idx.reshape(-1), f"the {key} split")
    return splits


@dataclass
class TextAttributedGraph:
    """A graph whose nodes carry text and a class label."""

    name: str  # e.g. "wordnet-nouns"
    node_texts: list[str]
    labels: Tensor  # (N,) long
    label_names: list[str]
    edge_index: Tensor  # (2, E) long, directed source -> target
    splits: dict[str, Tensor]  # "train" / "val" / "test" -> node indices
    source: str  # the data actually used
    stand_in: bool  # True when standing in for the paper's dataset
    edge_texts: list[str] | None = None  # one per edge, optional
    node_ids: list[str] = field(default_factory=list)  # original identifiers

    def __post_init__(self) -> None:
        self.validate()
        if self.edge_index.shape[1] == 0:
            warnings.warn(
                f"{self.name} has no edges: message passing and the neighbours in each prompt "
                "have nothing to read (a model on it uses node texts alone)",
                UserWarning,
                stacklevel=3,
            )

    @property
    def num_nodes(self) -> int:
        return len(self.node_texts)

    def edge_text(self, u: int, v: int) -> str:
        """The text of the edge ``u -> v``: its own, or ``"reverse: <text>"`` when only
        ``v -> u`` is in the graph (subgraphs take edges both ways). Needs ``edge_texts``."""
        if self.edge_texts is None:
            raise ValueError(f"{self.name} has no edge texts")
        cached = self.__dict__.get("_edge_text_lookup")
        if cached is None or cached[0] is not self.edge_index or cached[1] is not self.edge_texts:
            src, dst = self.edge_index.tolist()
            lookup = {(b, a): f"reverse: {t}" for a, b, t in zip(src, dst, self.edge_texts)}
            lookup.update({(a, b): t for a, b, t in zip(src, dst, self.edge_texts)})
            cached = (self.edge_index, self.edge_texts, lookup)
            self.__dict__["_edge_text_lookup"] = cached
        return cached[2][(int(u), int(v))]

    def validate(self) -> None:
        """Check that the graph is one a model can be trained and scored on; raises
        ``ValueError`` naming the problem and how many nodes, edges or labels it concerns:
        node texts that are not a list, no nodes, a text that is not a string or is empty,
        label names that are not strings or repeat a name, labels that are not whole class
        indices or not one per node, labels beyond the label names (-1, "unlabelled", is
        allowed outside the splits), edges to nodes that do not exist, a split that is empty,
        repeats a node, names a node that does not exist, or shares nodes with another split
        (a test node that is also a training node would be scored on what it was trained
        on)."""
        n = self._validate_texts()
        self._validate_labels(n)
        self._validate_edges(n)
        self._validate_node_ids(n)
        self._validate_splits(n)

    def _validate_texts(self) -> int:
        if not isinstance(self.node_texts, (list, tuple)):  # a string would be one node a char
            got = _describe(self.node_texts)
            raise ValueError(f"node_texts must be a list of strings (one per node), got {got}")
        n = len(self.node_texts)
        if n == 0:
            raise ValueError("the graph has zero nodes")
        not_text = sum(not isinstance(t, str) for t in self.node_texts)
        if not_text:
            raise ValueError(f"{not_text} node text(s) are not strings")
        blank = [i for i, t in enumerate(self.node_texts) if not t.strip()]
        if blank:
            raise ValueError(f"{len(blank)} node(s) {blank[:10]} have an empty text")
        return n

    def _validate_labels(self, n: int) -> None:
        names = self.label_names
        if not isinstance(names, (list, tuple)) or not all(isinstance(x, str) for x in names):
            raise ValueError(f"label_names must be a list of strings, got {_describe(names)}")
        k = len(names)
        if k == 0:
            raise ValueError("label_names is empty")
        repeated = sorted(x for x, count in Counter(names).items() if count > 1)
        if repeated:
            raise ValueError(f"label_names repeat {repeated[:10]}: each class needs its own name")
        y = self.labels
        if not isinstance(y, Tensor) or y.dim() != 1 or not _is_integer(y):
            raise ValueError(
                f"labels must be a (N,) integer tensor, got {_describe(y)}: class indices are "
                "whole numbers"
            )
        if y.numel() != n:
            raise ValueError(f"{y.numel()} labels for {n} nodes: give one label per node")
        bad = ((y < -1) | (y >= k)).nonzero().flatten()
        if bad.numel():
            raise ValueError(
                f"{bad.numel()} node(s) {bad[:10].tolist()} have labels outside 0..{k - 1} "
                f"({k} label names; -1 marks an unlabelled node)"
            )

    def _validate_edges(self, n: int) -> None:
        ei = self.edge_index
        if not isinstance(ei, Tensor) or ei.dim() != 2 or ei.shape[0] != 2 or not _is_integer(ei):
            raise ValueError(f"edge_index must be (2, E) integers, got {_describe(ei)}")
        outside = ((ei < 0) | (ei >= n)).any(0).nonzero().flatten()
        if outside.numel():
            raise ValueError(
                f"{outside.numel()} edge(s) refer to nodes outside 0..{n - 1} "
                f"(e.g. edge {int(outside[0])}: {ei[:, outside[0]].tolist()})"
            )
        if self.edge_texts is not None and len(self.edge_texts) != ei.shape[1]:
            raise ValueError(f"{len(self.edge_texts)} edge texts for {ei.shape[1]} edges")

    def _validate_splits(self, n: int) -> None:
        k, y = len(self.label_names), self.labels
        owner = torch.full((n,), -1, dtype=torch.long)  # which split each node is in
        for number, (key, idx) in enumerate(self.splits.items()):
            if not isinstance(idx, Tensor) or idx.dim() != 1 or not _is_integer(idx):
                raise ValueError(
                    f"the {key} split must be a 1-D tensor of node indices, got {_describe(idx)}"
                )
            if idx.numel() == 0:
                raise ValueError(f"the {key} split is empty")
            outside = ((idx < 0) | (idx >= n)).sum()
            if outside:
                raise ValueError(f"the {key} split names {int(outside)} node(s) outside 0..{n - 1}")
            repeats = idx.numel() - idx.unique().numel()
            if repeats:
                raise ValueError(
                    f"the {key} split repeats {repeats} node index(es): each node at most once"
                )
            unlabelled = idx[y[idx] < 0]
            if unlabelled.numel():
                raise ValueError(
                    f"{unlabelled.numel()} {key} node(s) {unlabelled[:10].tolist()} have labels "
                    f"outside 0..{k - 1} (a node in a split needs a label)"
                )
            clash = owner[idx]
            clash = clash[clash >= 0]
            if clash.numel():
                others = " / ".join(list(self.splits)[i] for i in clash.unique().tolist())
                raise ValueError(
                    f"{clash.numel()} node(s) of the {key} split are also in the {others} split: "
                    "the splits must not share nodes"
                )
            owner[idx] = number

    def _validate_node_ids(self, n: int) -> None:
        ids = self.node_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"node_ids must be a list of strings, got {_describe(ids)}")
        if not ids:
            return
        if len(ids) != n:
            raise ValueError(f"{len(ids)} node ids for {n} nodes: give one id per node")
        if not all(isinstance(x, str) and x.strip() for x in ids):
            raise ValueError("node ids must be non-empty strings (a node's name)")
        repeated = sorted(x for x, count in Counter(ids).items() if count > 1)
        if repeated:
            raise ValueError(f"node ids repeat {repeated[:10]}: each node needs its own id")

    def node_index(self, node: int | str) -> int:
        """The index of ``node``: an index ``0..N-1`` (an int, or a string of digits), one of the
        graph's node ids, or ``"id:<id>"`` (always an id). A string that is both one node's id
        and another node's index is ambiguous, and an unknown node is a ValueError naming it."""
        ids = self.__dict__.get("_id_lookup")
        if ids is None or ids[0] is not self.node_ids:
            ids = (self.node_ids, {x: i for i, x in enumerate(self.node_ids)})
            self.__dict__["_id_lookup"] = ids
        if isinstance(node, str) and node.startswith("id:") and node[3:] in ids[1]:
            return ids[1][node[3:]]  # an id, whatever it looks like
        text = str(node).strip()
        as_index = int(text) if text.isascii() and text.isdigit() else None
        if isinstance(node, str) and node in ids[1]:
            j = ids[1][node]
            if as_index is not None and as_index < self.num_nodes and as_index != j:
                raise ValueError(
                    f"node {node!r} is ambiguous: the id of node {j} and the index of node "
                    f"{as_index} (id {self.node_ids[as_index]!r}); write 'id:{node}' for node "
                    f"{j}, or {self.node_ids[as_index]!r} for node {as_index}"
                )
            return j
        if as_index is not None and as_index < self.num_nodes:
            return as_index
        some = ", ".join(repr(x) for x in self.node_ids[:3])
        named = f" or a node id ({some}, ...)" if self.node_ids else ""
        raise ValueError(
            f"node {node!r} is not in {self.name}: give 0..{self.num_nodes - 1}{named}"
        )

    @classmethod
    def from_pyg(
        cls,
        data,
        texts: list[str],
        label_names: list[str],
        split: dict[str, Tensor] | None = None,
        name: str = "custom-graph",
        source: str | None = None,
        edge_texts: list[str] | None = None,
        node_ids: list[str] | None = None,
    ) -> TextAttributedGraph:
        """Your own graph: a ``torch_geometric`` ``Data`` with ``edge_index (2, E)`` and
        ``y (N,)`` (class indices, or class names from ``label_names`` with ``None`` for an
        unlabelled node), one text per node, the class names, and the split as ``train_mask`` /
        ``val_mask`` / ``test_mask`` on ``data`` or ``split = {"train": idx, "val": idx,
        "test": idx}`` (node indices, or ``(N,)`` bool masks). Nodes outside every split may
        carry ``y = -1``. ``edge_texts``: one string per edge of ``edge_index`` ("cites"), fed
        to message passing as edge features with ``edge_texts: true`` in the config.
        ``node_ids``: one unique name per node ("pkg:bash"), accepted wherever a node is named
        (``predict --nodes``, ``generate --node``) and printed beside predictions.

        Raises ``ValueError`` naming the problem: a graph with zero nodes, a node without text,
        texts that do not match the node count, edge indices out of range, labels that are not
        whole numbers or out of range, a missing or empty split, a split that repeats a node,
        splits that share nodes (see :meth:`validate`)."""
        n = int(data.num_nodes) if data.num_nodes is not None else 0
        if n == 0:
            raise ValueError("the graph has zero nodes")
        if len(texts) != n:
            raise ValueError(f"{len(texts)} texts for {n} nodes: give one text per node")
        empty = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()]
        if empty:
            raise ValueError(f"node(s) {empty[:10]} have no text")
        ei = getattr(data, "edge_index", None)
        ei = torch.zeros(2, 0, dtype=torch.long) if ei is None else torch.as_tensor(ei)
        y = getattr(data, "y", None)
        if y is None:
            raise ValueError("data.y (one class index per node) is required")
        y = _labels_from(y, label_names)
        splits = _splits_from(data, split, n)
        return cls(
            name=name,
            node_texts=list(texts),
            labels=y,
            label_names=list(label_names),
            edge_index=ei.long() if _is_integer(ei) else ei,
            splits=splits,
            source=source or f"{name} (your own graph)",
            stand_in=False,
            edge_texts=None if edge_texts is None else list(edge_texts),
            node_ids=list(node_ids) if node_ids is not None else [str(i) for i in range(n)],
        )

    def save(self, path: str | Path) -> None:
        """Write the graph to the folder ``path``: ``graph.json`` (texts, names, provenance)
        and ``graph.safetensors`` (edges, labels, splits); :meth:`load` reads it back."""
        import json

        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {"edge_index": self.edge_index.contiguous(), "labels": self.labels.contiguous()}
        tensors.update({f"split.{k}": v.contiguous() for k, v in self.splits.items()})
        with atomic_path(path / "graph.safetensors") as tmp:
            save_file(tensors, str(tmp))
        meta = {
            "name": self.name,
            "node_texts": self.node_texts,
            "label_names": self.label_names,
            "source": self.source,
            "stand_in": self.stand_in,
            "node_ids": self.node_ids,
            "edge_texts": self.edge_texts,
        }
        with atomic_path(path / "graph.json") as tmp:
            tmp.write_text(json.dumps(meta, ensure_ascii=False))

    @classmethod
    def load(cls, path: str | Path) -> TextAttributedGraph:
        """A graph written by :meth:`save`; a damaged or incomplete folder is named."""
        import json

        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path)
        for file in ("graph.json", "graph.safetensors"):
            if not (path / file).is_file():
                raise FileNotFoundError(
                    f"{path / file} not found: give the folder TextAttributedGraph.save wrote "
                    "(a graph folder that moved: pass its new path, --graph PATH)"
                )
        try:
            meta = json.loads((path / "graph.json").read_text())
            tensors = load_file(str(path / "graph.safetensors"))
            fields = dict(
                name=meta["name"],
                node_texts=meta["node_texts"],
                labels=tensors["labels"],
                label_names=meta["label_names"],
                edge_index=tensors["edge_index"],
                splits={k.removeprefix("split."): v for k, v in tensors.items() if "." in k},
                source=meta["source"],
                stand_in=meta["stand_in"],
                edge_texts=meta.get("edge_texts"),
                node_ids=meta.get("node_ids") or [],
            )
        except (KeyError, ValueError, OSError, TypeError, AttributeError, SafetensorError) as err:
            raise DataError(f"{path}: not a readable graph ({type(err).__name__}: {err})") from None
        missing = [key for key in ("train", "val", "test") if key not in fields["splits"]]
        if missing:
            raise DataError(f"{path}: graph.safetensors has no {' / '.join(missing)} split")
        try:
            return cls(**fields)
        except ValueError as err:  # read, but not a graph a model can be trained and scored on
            raise DataError(f"{path}: {err}") from None

    def to_pyg(self):
        """A ``torch_geometric.data.Data`` with ``edge_index``, ``y`` and split masks."""
        from torch_geometric.data import Data

        data = Data(edge_index=self.edge_index, y=self.labels, num_nodes=self.num_nodes)
        for split, idx in self.splits.items():
            mask = torch.zeros(self.num_nodes, dtype=torch.bool)
            mask[idx] = True
            data[f"{split}_mask"] = mask
        return data

    def summary(self) -> str:
        kind = "STAND-IN" if self.stand_in else "original"
        sizes = ", ".join(f"{k} {len(v)}" for k, v in self.splits.items())
        return (
            f"graph {self.name}: {self.source} [{kind}]\n  {self.num_nodes} nodes, "
            f"{self.edge_index.shape[1]} edges, {len(self.label_names)} classes; {sizes}"
        )
