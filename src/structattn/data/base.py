"""What every sequence-classification task in :mod:`structattn.data` returns.

A task is three :class:`SequenceDataset` splits of integer token sequences (id 0 is padding,
real tokens are >= 1) with integer labels, plus where the data came from. :func:`pad_collate`
right-pads a batch and returns the key padding mask the models take.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

__all__ = [
    "PAD_ID",
    "SequenceDataset",
    "TaskData",
    "default_data_dir",
    "pad_collate",
    "split_indices",
]

PAD_ID = 0


def default_data_dir() -> Path:
    """``$STRUCTATTN_DATA_DIR`` if set, else ``~/.cache/structattn``."""
    return Path(os.environ.get("STRUCTATTN_DATA_DIR", Path.home() / ".cache" / "structattn"))


class SequenceDataset(torch.utils.data.Dataset):
    """Token sequences (1-D int64 tensors, ids >= 1) and their integer labels."""

    def __init__(self, sequences: Sequence[Tensor], labels: Sequence[int] | Tensor):
        labels = torch.as_tensor(labels, dtype=torch.long)
        if len(sequences) != len(labels):
            raise ValueError(f"{len(sequences)} sequences but {len(labels)} labels")
        for i, s in enumerate(sequences):
            if s.dim() != 1 or s.numel() == 0:
                raise ValueError(f"sequence {i} must be a non-empty 1-D tensor")
        self.sequences = [s.long() for s in sequences]
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.sequences[i], int(self.labels[i])

    def subset(self, indices: Sequence[int] | Tensor) -> SequenceDataset:
        idx = [int(i) for i in indices]
        return SequenceDataset([self.sequences[i] for i in idx], self.labels[idx])

    def lengths(self) -> Tensor:
        return torch.tensor([len(s) for s in self.sequences])


def pad_collate(batch: Sequence[tuple[Tensor, int]]) -> dict[str, Tensor]:
    """Right-pad a batch: ``tokens (B, T)`` int64, ``mask (B, T)`` bool (True = real token),
    ``labels (B,)``; ``T`` is the longest sequence in the batch."""
    seqs = [s for s, _ in batch]
    tokens = pad_sequence(seqs, batch_first=True, padding_value=PAD_ID)
    lengths = torch.tensor([len(s) for s in seqs])
    mask = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
    labels = torch.tensor([y for _, y in batch], dtype=torch.long)
    return {"tokens": tokens, "mask": mask, "labels": labels}


def split_indices(n: int, fractions: Sequence[float], seed: int) -> list[Tensor]:
    """Deterministic random split of ``range(n)`` into parts of the given fractions (the last
    part takes the remainder)."""
    if any(f < 0 for f in fractions) or sum(fractions) > 1 + 1e-9:
        raise ValueError(f"fractions must be non-negative and sum to <= 1, got {fractions}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    parts, start = [], 0
    for f in fractions[:-1]:
        stop = start + int(round(f * n))
        parts.append(perm[start:stop])
        start = stop
    parts.append(perm[start:])
    return parts


@dataclass
class TaskData:
    """A classification task ready for training."""

    name: str  # task name, e.g. "listops"
    train: SequenceDataset
    val: SequenceDataset
    test: SequenceDataset
    num_classes: int
    vocab_size: int  # embedding rows needed (ids 0 .. vocab_size - 1; 0 = padding)
    seq_len: int  # maximum sequence length T
    source: str  # the data actually used, e.g. "Fashion-MNIST (stand-in for CIFAR-10)"
    stand_in: bool  # True when the data is a stand-in for the paper's dataset
    class_names: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """Sizes, length statistics, label balance and provenance, as text."""
        kind = "STAND-IN" if self.stand_in else "original"
        lines = [
            f"task {self.name}: {self.source} [{kind}]",
            f"  classes {self.num_classes}, vocab {self.vocab_size}, T <= {self.seq_len}",
        ]
        for split in ("train", "val", "test"):
            ds: SequenceDataset = getattr(self, split)
            if len(ds) == 0:
                lines.append(f"  {split:5s} 0 examples")
                continue
            lens = ds.lengths().float()
            counts = torch.bincount(ds.labels, minlength=self.num_classes)
            share = ", ".join(f"{100 * c / len(ds):.0f}%" for c in counts.tolist())
            lines.append(
                f"  {split:5s} {len(ds):6d} examples, length min {int(lens.min())} "
                f"mean {lens.mean():.0f} max {int(lens.max())}; labels {share}"
            )
        return "\n".join(lines)
