"""Text-attributed graphs: the graph (:mod:`.graph`), one reader per dataset registered in
:mod:`.readers` (WordNet nouns, the offline stand-in; ogbn-arxiv; a saved folder), and the
k-hop neighbourhood each prompt shows (:mod:`.sampling`)."""

from .arxiv import read_ogbn_arxiv
from .graph import TextAttributedGraph
from .readers import GRAPH_READERS, graph_reader, read_graph
from .sampling import sample_subgraph
from .wordnet import WORDNET_NOUN_CLASSES, read_wordnet_nouns

__all__ = [
    "GRAPH_READERS",
    "TextAttributedGraph",
    "WORDNET_NOUN_CLASSES",
    "graph_reader",
    "read_graph",
    "read_ogbn_arxiv",
    "read_wordnet_nouns",
    "sample_subgraph",
]
