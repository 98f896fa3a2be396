"""A byte-level text corpus for causal language models.

Token ids: byte ``b`` is ``b + 1`` (1 .. 256), 0 is padding and ``EOD = 257`` ends a document, so
``VOCAB_SIZE = 258``. Each split is one stream of documents joined by ``EOD``; training and
evaluation read it as non-overlapping windows of ``seq_len`` tokens.

Sources (``CorpusSpec.source``):

* ``auto`` (default): IMDB reviews (``<data>/aclImdb``) when present, else the SpamAssassin
  message bodies (a **stand-in**, fetched by ``structattn data fetch``), split 80/10/10 by
  document with a fixed seed;
* ``stand-in`` / ``original``: force one of them;
* ``text_file``: a UTF-8 file of your own, documents separated by blank lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from structattn.errors import ConfigError, DataError

from .base import default_data_dir, split_indices
from .text import read_aclimdb, read_spam_assassin, stand_in_folder

__all__ = ["EOD", "VOCAB_SIZE", "ByteCorpus", "CorpusSpec", "decode_ids", "encode_text",
           "load_corpus"]  # fmt: skip

EOD = 257
VOCAB_SIZE = 258


def encode_text(text: str) -> Tensor:
    """UTF-8 bytes of ``text`` as token ids (byte + 1), int64 ``(n,)``."""
    raw = text.encode("utf-8", errors="replace")
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).astype(np.int64) + 1)


def decode_ids(ids) -> str:
    """Text of token ids: bytes ``id - 1``; padding and ``EOD`` are dropped, invalid UTF-8 is
    replaced."""
    ids = [int(i) for i in ids]
    return bytes(i - 1 for i in ids if 1 <= i <= 256).decode("utf-8", errors="replace")


@dataclass
class CorpusSpec:
    """Which text, and how it is cut."""

    source: str = "auto"  # auto | original (aclImdb) | stand-in (SpamAssassin bodies)
    text_file: Path | None = None  # a UTF-8 file of your own instead (documents: blank lines)
    data_dir: Path | None = None  # data cache (default $STRUCTATTN_DATA_DIR or ~/.cache/...)
    seq_len: int = 256  # tokens per window
    max_train_tokens: int | None = None  # cut the training stream to this many tokens
    split_seed: int = 0  # document split (fixed: the model seed never changes the test text)

    def __post_init__(self) -> None:
        if self.source not in ("auto", "original", "stand-in"):
            raise ValueError(f"source must be auto, original or stand-in, got {self.source!r}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (a window predicts), got {self.seq_len}")
        if self.max_train_tokens is not None and self.max_train_tokens < self.seq_len:
            raise ValueError(
                f"max_train_tokens must be >= seq_len ({self.seq_len}), got {self.max_train_tokens}"
            )


class WindowDataset(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len`` tokens of one stream (the tail is dropped)."""

    def __init__(self, stream: Tensor, seq_len: int):
        self.stream, self.seq_len = stream, seq_len

    def __len__(self) -> int:
        return len(self.stream) // self.seq_len

    def __getitem__(self, i: int) -> Tensor:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.stream[i * self.seq_len : (i + 1) * self.seq_len]


@dataclass
class ByteCorpus:
    """Train/validation/test token streams and their windows."""

    train: WindowDataset
    val: WindowDataset
    test: WindowDataset
    test_docs: list[Tensor]  # the test documents, for prompts
    source: str
    stand_in: bool
    seq_len: int
    vocab_size: int = VOCAB_SIZE

    def summary(self) -> str:
        kind = "STAND-IN" if self.stand_in else "original"
        sizes = ", ".join(
            f"{name} {len(getattr(self, name).stream):,} tokens"
            for name in ("train", "val", "test")
        )
        return f"byte corpus: {self.source} [{kind}]; {sizes}; windows of {self.seq_len}"


def _stream(docs: list[Tensor]) -> Tensor:
    if not docs:
        return torch.zeros(0, dtype=torch.long)
    eod = torch.tensor([EOD])
    return torch.cat([part for doc in docs for part in (doc, eod)])


def load_corpus(spec: CorpusSpec | None = None, **overrides) -> ByteCorpus:
    """Read, encode and split the corpus of ``spec``."""
    spec = CorpusSpec(**overrides) if spec is None else spec
    root = Path(spec.data_dir) if spec.data_dir is not None else default_data_dir()
    if spec.text_file is not None:
        path = Path(spec.text_file)
        if not path.is_file():
            raise FileNotFoundError(f"text file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{path}: not UTF-8 text ({err})") from None
        texts = [t.strip() for t in re.split(r"\n\s*\n", text) if t.strip()]
        source, stand_in = f"text file {path.name}", False
    else:
        imdb = root / "aclImdb"
        if spec.source == "original" or (spec.source == "auto" and imdb.exists()):
            train_texts, _ = read_aclimdb(imdb, "train")
            test_texts, _ = read_aclimdb(imdb, "test")
            texts = train_texts + test_texts
            source, stand_in = "IMDB reviews (aclImdb), bytes", False
        else:
            texts, _, _ = read_spam_assassin(stand_in_folder(root))
            texts = [t for t in texts if t.strip()]
            source, stand_in = "SpamAssassin message bodies (stand-in), bytes", True
    if len(texts) < 3:
        raise DataError(f"{source}: needs at least 3 documents to split, got {len(texts)}")
    docs = [encode_text(t) for t in texts]
    parts = split_indices(len(docs), [0.8, 0.1, 0.1], seed=spec.split_seed)
    train, val, test = ([docs[i] for i in p.tolist()] for p in parts)
    train_stream = _stream(train)
    if spec.max_train_tokens is not None:
        train_stream = train_stream[: spec.max_train_tokens]
    corpus = ByteCorpus(
        train=WindowDataset(train_stream, spec.seq_len),
        val=WindowDataset(_stream(val), spec.seq_len),
        test=WindowDataset(_stream(test), spec.seq_len),
        test_docs=test,
        source=source,
        stand_in=stand_in,
        seq_len=spec.seq_len,
    )
    for name in ("train", "val", "test"):
        if len(getattr(corpus, name)) == 0:
            raise ConfigError(
                f"{source}: the {name} split holds fewer than seq_len={spec.seq_len} tokens"
            )
    return corpus
