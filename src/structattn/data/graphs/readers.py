"""Which graph a run's ``dataset`` names: one registry line per reader.

A reader is ``from_config(cfg, data_root) -> TextAttributedGraph``, where ``cfg`` is the run's
config (its ``seed``, and any path fields the reader reads) and ``data_root`` the data folder
(``--data-dir``, else the default). A new graph dataset is one module defining ``from_config``
plus one line here, ``"name": "package.module:from_config"`` (a ``"module:function"`` string is
imported only when that dataset is read), or, outside this package,
``GRAPH_READERS["name"] = my_reader`` before the run is configured."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from .graph import TextAttributedGraph

__all__ = ["GRAPH_READERS", "graph_reader", "read_graph"]

GraphReader = Callable[[object, Path], TextAttributedGraph]

GRAPH_READERS: dict[str, str | GraphReader] = {
    "wordnet": "structattn.data.graphs.wordnet:from_config",
    "arxiv": "structattn.data.graphs.arxiv:from_config",
    "file": "structattn.data.graphs.readers:from_folder",
}


def from_folder(cfg, data_root: Path) -> TextAttributedGraph:
    """``dataset: file``: a folder ``TextAttributedGraph.save`` wrote, named by ``graph_path``."""
    if cfg.graph_path is None:
        raise ValueError("dataset=file needs graph_path (a folder written by graph.save)")
    return TextAttributedGraph.load(cfg.graph_path)


def graph_reader(name: str) -> GraphReader:
    """The reader registered as ``name``; an unknown name lists the known ones."""
    if name not in GRAPH_READERS:
        known = ", ".join(sorted(GRAPH_READERS))
        raise ValueError(f"dataset must be one of {known}, got {name!r}")
    reader = GRAPH_READERS[name]
    if isinstance(reader, str):
        module, _, attr = reader.partition(":")
        try:
            reader = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(
                f"the {name!r} graph reader {GRAPH_READERS[name]!r} cannot be loaded ({err}): "
                "register it as 'package.module:function'"
            ) from None
    return reader


def read_graph(name: str, cfg, data_root: Path) -> TextAttributedGraph:
    """The graph the reader ``name`` builds for ``cfg``."""
    graph = graph_reader(name)(cfg, data_root)
    if not isinstance(graph, TextAttributedGraph):
        raise TypeError(
            f"the {name!r} graph reader returned {type(graph).__name__}, not a TextAttributedGraph"
        )
    return graph
