"""WordNet nouns, the offline stand-in graph: a node per noun synset of WordNet's ``data.noun``
(Debian ``wordnet-base``), text = lemmas + gloss, edges = hypernym (``@``) and instance-hypernym
(``@i``) pointers with their relation as edge text, label = lexicographer file (26 classes
``noun.Tops`` .. ``noun.time``), seeded 60/20/20 split."""

from __future__ import annotations

from pathlib import Path

import torch

from structattn.errors import DataError

from ..base import split_indices
from .graph import TextAttributedGraph

__all__ = ["WORDNET_NOUN_CLASSES", "read_wordnet_nouns", "from_config"]

#: Lexicographer files of noun synsets (lex_filenum 3..28), in order.
WORDNET_NOUN_CLASSES = [
    "noun.Tops",
    "noun.act",
    "noun.animal",
    "noun.artifact",
    "noun.attribute",
    "noun.body",
    "noun.cognition",
    "noun.communication",
    "noun.event",
    "noun.feeling",
    "noun.food",
    "noun.group",
    "noun.location",
    "noun.motive",
    "noun.object",
    "noun.person",
    "noun.phenomenon",
    "noun.plant",
    "noun.possession",
    "noun.process",
    "noun.quantity",
    "noun.relation",
    "noun.shape",
    "noun.state",
    "noun.substance",
    "noun.time",
]

#: WordNet pointer symbols kept as edges, and the edge text each gives.
_WORDNET_RELATIONS = {"@": "hypernym", "@i": "instance hypernym"}


def read_wordnet_nouns(
    path: str | Path, seed: int = 0, fractions: tuple[float, float, float] = (0.6, 0.2, 0.2)
) -> TextAttributedGraph:
    """Parse WordNet's ``data.noun``. Raises ``ValueError`` naming the file and line on a
    malformed data line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"WordNet data.noun not found: {path} (run `make data`)")
    offsets, texts, labels, pointers = [], [], [], []
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if line.startswith("  ") or not line.strip():
                continue  # licence header
            try:
                head, _, gloss = line.partition(" | ")
                fields = head.split()
                offset, lex_filenum, ss_type = fields[0], int(fields[1]), fields[2]
                if ss_type != "n" or not 3 <= lex_filenum <= 28 or len(offset) != 8:
                    raise ValueError(f"not a noun synset (type {ss_type!r}, lexfile {lex_filenum})")
                w_cnt = int(fields[3], 16)
                words = [fields[4 + 2 * i].replace("_", " ") for i in range(w_cnt)]
                p_at = 4 + 2 * w_cnt
                p_cnt = int(fields[p_at])
                ptrs = []
                for i in range(p_cnt):
                    symbol, target, pos = fields[p_at + 1 + 4 * i : p_at + 4 + 4 * i]
                    if symbol in ("@", "@i") and pos == "n":
                        ptrs.append((target, _WORDNET_RELATIONS[symbol]))
                if len(fields) < p_at + 1 + 4 * p_cnt:
                    raise ValueError("pointer list shorter than its count")
            except (IndexError, ValueError) as err:
                raise DataError(f"{path}:{lineno}: malformed WordNet data line ({err})") from None
            offsets.append(offset)
            texts.append(f"{', '.join(words)}: {gloss.strip()}")
            labels.append(lex_filenum - 3)
            pointers.append(ptrs)
    if not offsets:
        raise DataError(f"{path}: no noun synsets found")
    index = {off: i for i, off in enumerate(offsets)}
    src, dst, relations = [], [], []
    for i, ptrs in enumerate(pointers):
        for target, relation in ptrs:
            if target in index:
                src.append(i)
                dst.append(index[target])
                relations.append(relation)
    edge_index = torch.tensor([src, dst], dtype=torch.long).reshape(2, -1)
    parts = split_indices(len(offsets), list(fractions), seed=seed)
    return TextAttributedGraph(
        name="wordnet-nouns",
        node_texts=texts,
        labels=torch.tensor(labels),
        label_names=[n.removeprefix("noun.") for n in WORDNET_NOUN_CLASSES],
        edge_index=edge_index,
        splits=dict(zip(("train", "val", "test"), parts)),
        source="WordNet 3.0 noun synsets (stand-in for ogbn-arxiv)",
        stand_in=True,
        node_ids=offsets,
        edge_texts=relations,  # synset -> its hypernym; the other way is "reverse: ..."
    )


def from_config(cfg, data_root: Path) -> TextAttributedGraph:
    """``dataset: wordnet``: ``<data>/wordnet/data.noun``, split by the run's seed."""
    return read_wordnet_nouns(data_root / "wordnet" / "data.noun", seed=cfg.seed)
