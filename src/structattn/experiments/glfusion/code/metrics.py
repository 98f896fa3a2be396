"""The ogbg-code2 metric: per-example precision, recall and F1 of the predicted sub-token set
against the true one, averaged over examples (OGB's ``Evaluator`` for ``ogbg-code2``), and exact
match of the whole sequence."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["name_scores"]


def _one(ref: Sequence[str], pred: Sequence[str]) -> tuple[float, float, float]:
    label, guess = set(ref), set(pred)
    tp = len(label & guess)
    precision = tp / len(guess) if guess else 0.0
    recall = tp / len(label) if label else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return precision, recall, f1


def name_scores(refs: Sequence[Sequence[str]], preds: Sequence[Sequence[str]]) -> dict[str, float]:
    """``precision``, ``recall``, ``f1`` (OGB's definitions: sub-tokens compared as sets, an
    empty prediction scores 0) and ``exact`` (the predicted sequence is the true one), each the
    mean over examples, in [0, 1]. ``refs`` are the whole true sub-token lists."""
    if len(refs) != len(preds):
        raise ValueError(f"{len(refs)} references but {len(preds)} predictions")
    if not refs:
        raise ValueError("no examples to score")
    for name, seqs in (("reference", refs), ("prediction", preds)):
        for i, s in enumerate(seqs):
            if isinstance(s, str) or any(not isinstance(t, str) for t in s):
                raise ValueError(f"{name} {i} must be a list of sub-token strings, got {s!r}")
    scores = [_one(r, p) for r, p in zip(refs, preds)]
    n = len(scores)
    return {
        "precision": sum(s[0] for s in scores) / n,
        "recall": sum(s[1] for s in scores) / n,
        "f1": sum(s[2] for s in scores) / n,
        "exact": sum(list(r) == list(p) for r, p in zip(refs, preds)) / n,
    }
