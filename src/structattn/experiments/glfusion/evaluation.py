"""Evaluation of a GL-Fusion model on prompts: the heads' class distributions, their accuracies,
the ensemble and its weight."""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn
from tqdm import tqdm

from structattn.errors import ConfigError
from structattn.glfusion.modeling import GLFusionForCausalLM
from structattn.glfusion.prompts import collate_examples

__all__ = [
    "WEIGHT_GRID",
    "choose_ensemble_weight",
    "evaluate_heads",
    "gnn_accuracy",
    "head_accuracies",
    "head_probabilities",
]

#: Ensemble weights tried on validation when ``ensemble_weight`` is None.
WEIGHT_GRID = [i / 10 for i in range(11)]


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _batches(examples, encode, batch_size: int, device, progress: bool = False):
    from accelerate.utils import send_to_device

    if not examples:
        raise ConfigError("cannot evaluate on an empty split")
    for start in tqdm(
        range(0, len(examples), batch_size),
        desc="evaluating",
        disable=not progress,
        file=sys.stderr,
    ):
        chunk = examples[start : start + batch_size]
        yield send_to_device(collate_examples(chunk, encode, with_labels=False), device)


@torch.no_grad()
def head_probabilities(
    model: GLFusionForCausalLM, examples, encode, label_ids, batch_size: int, progress: bool = False
) -> dict[str, Tensor]:
    """The GNN and LM heads' class distributions ``(N, K)`` and the classes ``(N,)``."""
    model.eval()
    gnn, lm, classes = [], [], []
    for batch in _batches(examples, encode, batch_size, _device_of(model), progress):
        pred = model.predict(batch["input_ids"], batch["attention_mask"], batch["graph"], label_ids)
        gnn.append(pred["gnn"].cpu())
        lm.append(pred["lm"].cpu())
        classes.append(batch["classes"].cpu())
    return {"gnn": torch.cat(gnn), "lm": torch.cat(lm), "classes": torch.cat(classes)}


def choose_ensemble_weight(probs: dict[str, Tensor]) -> float:
    """The weight of the GNN head with the best validation accuracy (ties: nearest 0.5)."""

    def acc(w: float) -> float:
        mix = w * probs["gnn"] + (1 - w) * probs["lm"]
        return (mix.argmax(-1) == probs["classes"]).float().mean().item()

    return max(WEIGHT_GRID, key=lambda w: (acc(w), -abs(w - 0.5)))


def head_accuracies(probs: dict[str, Tensor], weight: float) -> dict[str, float]:
    """Accuracy of the GNN head, the LM head and their ensemble with ``weight``."""
    mix = weight * probs["gnn"] + (1 - weight) * probs["lm"]
    hit = lambda p: (p.argmax(-1) == probs["classes"]).float().mean().item()  # noqa: E731
    return {"gnn": hit(probs["gnn"]), "lm": hit(probs["lm"]), "ensemble": hit(mix)}


def evaluate_heads(
    model: GLFusionForCausalLM,
    examples,
    encode,
    label_ids,
    batch_size: int,
    progress: bool = False,
    weight: float = 0.5,
) -> dict[str, float]:
    """Accuracy of the GNN head, the LM head (label scoring) and their ensemble."""
    probs = head_probabilities(model, examples, encode, label_ids, batch_size, progress)
    return head_accuracies(probs, weight)


@torch.no_grad()
def gnn_accuracy(model: GLFusionForCausalLM, examples, encode, batch_size: int) -> float:
    """Accuracy of the GNN head on ``examples`` (the validation metric during training)."""
    model.eval()
    hits = 0
    for batch in _batches(examples, encode, batch_size, _device_of(model)):
        logits = model.node_logits(batch["input_ids"], batch["attention_mask"], batch["graph"])
        pred = logits[batch["graph"].target_nodes].argmax(-1)
        hits += (pred == batch["classes"]).sum().item()
    return hits / len(examples)
