"""Shallow baselines: what a task gives away without learning its structure.

A comparison of attention models only means something where they beat these:

* ``majority``: the most frequent training label;
* ``token_counts_mlp``: an MLP on the normalised counts of every token id (a bag of tokens,
  order ignored), trained on the training split, early-stopped on validation;
* ``outermost_operator`` (ListOps): the most frequent answer for each outermost operator (the
  first token of a sequence), fitted on the training split: on LRA-format ListOps about 34%.

Every baseline is fitted on ``train`` only and reports accuracy on ``val`` and ``test``.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from structattn.data import SequenceDataset, TaskData

__all__ = ["majority", "outermost_operator", "shallow_baselines", "token_counts_mlp"]


def _accuracy(pred: torch.Tensor, labels: torch.Tensor) -> float:
    return float((pred == labels).float().mean()) if len(labels) else float("nan")


def majority(data: TaskData) -> dict[str, float]:
    """Predict the most frequent training label everywhere."""
    label = Counter(data.train.labels.tolist()).most_common(1)[0][0]
    return {
        split: _accuracy(
            torch.full_like(getattr(data, split).labels, label), getattr(data, split).labels
        )  # fmt: skip
        for split in ("val", "test")
    }


def outermost_operator(data: TaskData) -> dict[str, float]:
    """Most frequent training answer per first token (the outermost operator on ListOps);
    unseen first tokens get the overall majority."""
    by_first: dict[int, Counter] = {}
    for seq, y in zip(data.train.sequences, data.train.labels.tolist()):
        by_first.setdefault(int(seq[0]), Counter())[y] += 1
    overall = Counter(data.train.labels.tolist()).most_common(1)[0][0]
    answer = {tok: c.most_common(1)[0][0] for tok, c in by_first.items()}
    out = {}
    for split in ("val", "test"):
        ds = getattr(data, split)
        pred = torch.tensor([answer.get(int(s[0]), overall) for s in ds.sequences])
        out[split] = _accuracy(pred, ds.labels)
    return out


def _counts(ds: SequenceDataset, vocab: int) -> torch.Tensor:
    x = torch.zeros(len(ds), vocab)
    for i, seq in enumerate(ds.sequences):
        x[i] = torch.bincount(seq, minlength=vocab)[:vocab].float() / len(seq)
    return x


def token_counts_mlp(
    data: TaskData, hidden: int = 128, epochs: int = 60, lr: float = 3e-3, seed: int = 0
) -> dict[str, float]:
    """An MLP on normalised token counts, full-batch AdamW, the epoch with the best validation
    accuracy kept."""
    torch.manual_seed(seed)
    v = data.vocab_size
    xs = {s: _counts(getattr(data, s), v) for s in ("train", "val", "test")}
    ys = {s: getattr(data, s).labels for s in ("train", "val", "test")}
    mean, std = xs["train"].mean(0), xs["train"].std(0).clamp_min(1e-6)
    xs = {s: (x - mean) / std for s, x in xs.items()}
    model = nn.Sequential(nn.Linear(v, hidden), nn.ReLU(), nn.Linear(hidden, data.num_classes))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    best = {"val": -1.0, "test": float("nan")}
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(ys["train"])).split(256):
            opt.zero_grad()
            F.cross_entropy(model(xs["train"][idx]), ys["train"][idx]).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            val = _accuracy(model(xs["val"]).argmax(-1), ys["val"])
            if val > best["val"]:
                best = {"val": val, "test": _accuracy(model(xs["test"]).argmax(-1), ys["test"])}
    return best


def shallow_baselines(data: TaskData) -> dict[str, dict[str, float]]:
    """Every baseline that applies to ``data`` (the outermost operator on ListOps only)."""
    out = {"majority": majority(data), "token_counts_mlp": token_counts_mlp(data)}
    if data.name == "listops":
        out["outermost_operator"] = outermost_operator(data)
    return out
