"""Evaluation of a GL-Fusion model on prompts: the heads' class distributions, their accuracies,
the ensemble and its weight. Each pass takes ``stop``, a function that returns a signal number
once a stop is requested: it is read before every batch, and a pass asked to stop raises
:class:`EvaluationStopped` instead of returning a result of part of the examples."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from tqdm import tqdm

from structattn.errors import ConfigError
from structattn.experiments.glfusion.prompts import collate_examples
from structattn.glfusion.modeling import GLFusionForCausalLM

__all__ = [
    "WEIGHT_GRID",
    "EvaluationStopped",
    "check_stop",
    "choose_ensemble_weight",
    "evaluate_heads",
    "gnn_accuracy",
    "head_accuracies",
    "head_probabilities",
    "stop_exits",
]

#: Ensemble weights tried on validation when ``ensemble_weight`` is None.
WEIGHT_GRID = [i / 10 for i in range(11)]

#: ``() -> signal number or None``: whether an evaluation pass should stop (read between batches).
Stop = Callable[[], "int | None"]


class EvaluationStopped(Exception):
    """An evaluation pass stopped between two batches because ``stop()`` returned ``signum``;
    it returns nothing (no accuracy of part of the examples)."""

    def __init__(self, signum: int):
        super().__init__(f"evaluation stopped by signal {signum}")
        self.signum = signum


def check_stop(stop: Stop | None) -> None:
    """Raise :class:`EvaluationStopped` when ``stop()`` reports a signal (read between batches)."""
    signum = stop() if stop is not None else None
    if signum:
        raise EvaluationStopped(signum)


@contextmanager
def stop_exits(run_dir) -> Iterator[None]:
    """A validation pass inside the block that stops on a signal ends the process as a stop
    during training does (exit status ``128 + signal``), with nothing of the pass recorded and
    no checkpoint of this step: ``--resume`` continues from the last checkpoint."""
    try:
        yield
    except EvaluationStopped as stopped:
        name = signal.Signals(stopped.signum).name
        print(
            f"{name}: stopped during validation, before this step's checkpoint (nothing of "
            "this evaluation is recorded); continue with --resume from the last checkpoint "
            f"(run_dir {run_dir})",
            file=sys.stderr,
        )
        raise SystemExit(128 + stopped.signum) from None


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _batches(examples, encode, batch_size: int, device, progress: bool = False,
             stop: Stop | None = None):  # fmt: skip
    from accelerate.utils import send_to_device

    if not examples:
        raise ConfigError("cannot evaluate on an empty split")
    for start in tqdm(
        range(0, len(examples), batch_size),
        desc="evaluating",
        disable=not progress,
        file=sys.stderr,
    ):
        check_stop(stop)
        chunk = examples[start : start + batch_size]
        yield send_to_device(collate_examples(chunk, encode, with_labels=False), device)


@torch.no_grad()
def head_probabilities(
    model: GLFusionForCausalLM,
    examples,
    encode,
    label_ids,
    batch_size: int,
    progress: bool = False,
    stop: Stop | None = None,
) -> dict[str, Tensor]:
    """The GNN and LM heads' class distributions ``(N, K)`` and the classes ``(N,)``."""
    model.eval()
    gnn, lm, classes = [], [], []
    for batch in _batches(examples, encode, batch_size, _device_of(model), progress, stop):
        pred = model.predict(batch["input_ids"], batch["attention_mask"], batch["graph"], label_ids)
        gnn.append(pred["gnn"].cpu())
        lm.append(pred["lm"].cpu())
        classes.append(batch["classes"].cpu())
    return {"gnn": torch.cat(gnn), "lm": torch.cat(lm), "classes": torch.cat(classes)}


def choose_ensemble_weight(probs: dict[str, Tensor]) -> float:
    """The weight of the GNN head with the best validation accuracy (ties: nearest 0.5)."""

    def acc(w: float) -> float:
        mix = w * probs["gnn"] + (1 - w) * probs["lm"]
        return (mix.argmax(-1) == probs["classes"]).double().mean().item()

    return max(WEIGHT_GRID, key=lambda w: (acc(w), -abs(w - 0.5)))


def head_accuracies(probs: dict[str, Tensor], weight: float) -> dict[str, float]:
    """Accuracy of the GNN head, the LM head and their ensemble with ``weight``."""
    mix = weight * probs["gnn"] + (1 - weight) * probs["lm"]
    hit = lambda p: (p.argmax(-1) == probs["classes"]).double().mean().item()  # noqa: E731
    return {"gnn": hit(probs["gnn"]), "lm": hit(probs["lm"]), "ensemble": hit(mix)}


def evaluate_heads(model: GLFusionForCausalLM, examples, encode, label_ids, batch_size: int,
                   progress: bool = False, weight: float = 0.5,
                   stop: Stop | None = None) -> dict[str, float]:  # fmt: skip
    """Accuracy of the GNN head, the LM head (label scoring) and their ensemble with ``weight``;
    the other arguments are :func:`head_probabilities`'s."""
    probs = head_probabilities(model, examples, encode, label_ids, batch_size, progress, stop)
    return head_accuracies(probs, weight)


@torch.no_grad()
def gnn_accuracy(
    model: GLFusionForCausalLM, examples, encode, batch_size: int, stop: Stop | None = None
) -> float:
    """Accuracy of the GNN head on ``examples`` (the validation metric of a run that trains
    the GNN head alone)."""
    model.eval()
    hits = 0
    for batch in _batches(examples, encode, batch_size, _device_of(model), stop=stop):
        logits = model.node_logits(batch["input_ids"], batch["attention_mask"], batch["graph"])
        pred = logits[batch["graph"].target_nodes].argmax(-1)
        hits += (pred == batch["classes"]).sum().item()
    return hits / len(examples)
