"""ogbn-arxiv from OGB's on-disk layout (``raw/edge.csv.gz``, ``raw/node-label.csv.gz``,
``split/time/{train,valid,test}.csv.gz``, ``mapping/nodeidx2paperid.csv.gz``,
``mapping/labelidx2arxivcategeory.csv.gz``) joined with the title/abstract TSV
(``paper id<TAB>title<TAB>abstract``)."""

from __future__ import annotations

import csv
import gzip
import io
from pathlib import Path

import torch

from structattn.errors import DataError

from .graph import TextAttributedGraph

__all__ = ["read_ogbn_arxiv", "from_config"]


def _read_csv_gz(path: Path) -> list[list[str]]:
    if not path.is_file():
        raise FileNotFoundError(f"ogbn-arxiv file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        return [row for row in csv.reader(f) if row]


def _ints(rows: list[list[str]], path: Path, skip_header: bool = False) -> list[list[int]]:
    out = []
    for lineno, row in enumerate(rows, start=1):
        if skip_header and lineno == 1:
            continue
        try:
            out.append([int(x) for x in row])
        except ValueError:
            raise DataError(f"{path}:{lineno}: expected integers, got {row!r}") from None
    return out


def read_ogbn_arxiv(root: str | Path, titleabs: str | Path) -> TextAttributedGraph:
    """ogbn-arxiv from OGB's folder ``root`` (``raw/``, ``split/time/``, ``mapping/``) and the
    title/abstract TSV. Node text = title + abstract; the time split of OGB."""
    root, titleabs = Path(root), Path(titleabs)
    edges = _ints(_read_csv_gz(root / "raw" / "edge.csv.gz"), root / "raw" / "edge.csv.gz")
    labels = _ints(
        _read_csv_gz(root / "raw" / "node-label.csv.gz"), root / "raw" / "node-label.csv.gz"
    )
    n = len(labels)
    mapping_path = root / "mapping" / "nodeidx2paperid.csv.gz"
    mapping = _ints(_read_csv_gz(mapping_path), mapping_path, skip_header=True)
    if len(mapping) != n:
        raise DataError(f"{mapping_path}: {len(mapping)} rows but {n} node labels")
    label_path = root / "mapping" / "labelidx2arxivcategeory.csv.gz"
    label_rows = _read_csv_gz(label_path)[1:]
    label_names = [row[1].replace("arxiv cs ", "cs.") for row in label_rows]
    splits = {}
    for ours, theirs in (("train", "train"), ("val", "valid"), ("test", "test")):
        path = root / "split" / "time" / f"{theirs}.csv.gz"
        splits[ours] = torch.tensor([r[0] for r in _ints(_read_csv_gz(path), path)])
    paper_text: dict[int, str] = {}
    if not titleabs.is_file():
        raise FileNotFoundError(f"title/abstract TSV not found: {titleabs}")
    opener = gzip.open if titleabs.suffix == ".gz" else open
    with opener(titleabs, "rb") as raw:
        for lineno, line in enumerate(
            io.TextIOWrapper(raw, encoding="utf-8", errors="replace"), start=1
        ):
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 3 or not parts[0].strip().isdigit():
                if lineno == 1:
                    continue  # a header
                raise DataError(f"{titleabs}:{lineno}: expected 'paper id<TAB>title<TAB>abstract'")
            paper_text[int(parts[0])] = f"{parts[1].strip()}. {parts[2].strip()}"
    texts = []
    for i, row in enumerate(mapping):
        if len(row) != 2 or row[0] != i:
            raise DataError(f"{mapping_path}:{i + 2}: expected 'node idx,paper id' for node {i}")
        paper = row[1]
        if paper not in paper_text:
            raise DataError(f"{titleabs}: no title/abstract for paper {paper} (node {i})")
        texts.append(paper_text[paper])
    edge_index = torch.tensor(edges, dtype=torch.long).reshape(-1, 2).T.contiguous()
    if edge_index.numel() and int(edge_index.max()) >= n:
        raise DataError(f"{root / 'raw' / 'edge.csv.gz'}: edge to node >= {n}")
    return TextAttributedGraph(
        name="ogbn-arxiv",
        node_texts=texts,
        labels=torch.tensor([r[0] for r in labels]),
        label_names=label_names,
        edge_index=edge_index,
        splits=splits,
        source="ogbn-arxiv (OGB time split) with titles and abstracts",
        stand_in=False,
        node_ids=[str(row[1]) for row in mapping],
    )


def from_config(cfg, data_root: Path) -> TextAttributedGraph:
    """``dataset: arxiv``: OGB's folder ``arxiv_root`` and the TSV ``arxiv_titleabs``."""
    if cfg.arxiv_root is None or cfg.arxiv_titleabs is None:
        raise ValueError("dataset=arxiv needs arxiv_root and arxiv_titleabs")
    return read_ogbn_arxiv(cfg.arxiv_root, cfg.arxiv_titleabs)
