"""HKT and its MHA baseline on the paper's three tasks, as an :class:`Experiment`.

    structattn train --config listops-hkt --preset quick --seed 0
    torchrun --nproc-per-node 2 -m structattn.cli train --config listops-hkt   # 2 processes

With P processes each step consumes ``P * batch_size`` examples. A run folder holds what
:class:`~structattn.engine.RunDir` names (``config.yaml``, ``metrics.csv``, ``tb/``,
``checkpoints/``, ``best.safetensors``, ``final.json``). ``--resume`` restores weights,
optimizer, scheduler, step, RNG states and the data position, so N + N steps give exactly the
parameters of 2N straight steps (see :mod:`structattn.engine.loop`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from structattn.data import SequenceDataset, TaskData, load_task, pad_collate
from structattn.engine import Experiment, FitResult, RunDir, build_dataclass, json_safe
from structattn.engine.experiment import check_data_decided, check_run_data
from structattn.errors import ConfigError, RunError
from structattn.experiments import check_run_kind
from structattn.hkt.model import SequenceClassifier, count_parameters
from structattn.utils.fingerprint import fingerprint

from .config import LRAConfig

__all__ = [
    "SequenceClassification",
    "build_model",
    "data_identity",
    "evaluate",
    "evaluate_run",
    "hkt_state",
    "load_run_config",
    "train",
]


def _model_inputs(items) -> dict[str, torch.Tensor]:
    batch = pad_collate(items)
    return {"tokens": batch["tokens"], "mask": batch["mask"], "labels": batch["labels"]}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: SequenceDataset,
    batch_size: int,
    device: torch.device | str = "cpu",
    max_batches: int | None = None,
    autocast=contextlib.nullcontext,
) -> dict[str, float]:
    """Mean loss and accuracy of ``model`` on ``dataset`` (first ``max_batches`` batches)."""
    if len(dataset) == 0:
        raise RunError("cannot evaluate on an empty split")
    was_training = model.training
    model.eval()
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=_model_inputs)
    total_loss, correct, count = 0.0, 0, 0
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast():
            logits = model(batch["tokens"], batch["mask"]).logits
        labels = batch["labels"]
        total_loss += F.cross_entropy(logits.float(), labels, reduction="sum").item()
        correct += (logits.argmax(-1) == labels).sum().item()
        count += len(labels)
    model.train(was_training)
    return {"loss": total_loss / count, "acc": correct / count, "n": count}


def check_shapes(cfg: LRAConfig, data: TaskData) -> None:
    """``model.vocab_size``, ``num_classes`` and ``max_len`` are the data's: a value set in
    ``cfg`` that differs is a ConfigError (left at their defaults, the data decides them)."""
    what = f"the data ({data.source})"
    check_data_decided(cfg.model, {"vocab_size": (data.vocab_size, what),
                                   "num_classes": (data.num_classes, what),
                                   "max_len": (data.seq_len, what)}, "model")  # fmt: skip


def build_model(cfg: LRAConfig, data: TaskData) -> SequenceClassifier:
    """The classifier for ``cfg`` with vocab, classes and max length taken from ``data``
    (:func:`check_shapes`)."""
    check_shapes(cfg, data)
    model_cfg = cfg.model.replace(
        vocab_size=data.vocab_size, num_classes=data.num_classes, max_len=data.seq_len
    )
    return SequenceClassifier(model_cfg)


def data_identity(data: TaskData) -> dict[str, Any]:
    """``{"source", "sha256"}`` of a task's three splits (the content: sequences and labels),
    as ``data.json`` records it; hashed once per loaded dataset (``reproduce`` runs many seeds
    on one ``TaskData``)."""
    digest = data.__dict__.get("_sha256")
    if digest is None:
        splits = [(d.sequences, d.labels) for d in (data.train, data.val, data.test)]
        digest = data.__dict__["_sha256"] = fingerprint(*splits)
    return {"source": data.source, "sha256": digest}


def hkt_state(model: SequenceClassifier) -> dict[str, Any] | None:
    """Learned level weights (H, L) and beta (H,) per HKT layer, as lists."""
    layers = model.encoder.hkt_layers()
    if not layers:
        return None
    with torch.no_grad():
        return {
            "level_weights": [layer.level_weights().float().cpu().tolist() for layer in layers],
            "beta": [layer.beta().float().cpu().tolist() for layer in layers],
        }


class SequenceClassification(Experiment):
    """One LRA task (ListOps, sequential images, byte-level text) with HKT or MHA: accuracy on
    validation picks the best weights, which are then scored on the test split."""

    def __init__(self, cfg: LRAConfig, data: TaskData | None = None, progress: bool = True):
        super().__init__(cfg, progress)
        self.data = data

    def build_data(self) -> None:
        if self.data is None:  # a resumed run's data folder may be a handed config's: read only
            self.data = load_task(self.cfg.data, write_cache=not self.cfg.resume)
        for split in ("train", "val", "test"):
            if len(getattr(self.data, split)) == 0:
                raise RunError(f"task {self.data.name}: the {split} split is empty "
                               f"({self.data.source})")  # fmt: skip
        check_shapes(self.cfg, self.data)  # before data.json is written
        self.train_set = self.data.train

    def build_model(self) -> SequenceClassifier:
        return build_model(self.cfg, self.data)

    def data_identity(self) -> dict[str, Any]:
        return data_identity(self.data)

    def collate(self, items) -> dict[str, torch.Tensor]:
        return _model_inputs(items)

    def accuracy(self, output, batch) -> tuple[int, int]:
        return int((output.logits.argmax(-1) == batch["labels"]).sum()), len(batch["labels"])

    def _evaluate(self, model, split: str, max_batches: int | None = None) -> dict[str, float]:
        engine = self.engine
        return evaluate(model, getattr(self.data, split), self.cfg.train.batch_size,
                        engine.device, max_batches, engine.accelerator.autocast)  # fmt: skip

    def validate(self, model: nn.Module) -> dict[str, float]:
        return self._evaluate(model, "val", self.cfg.train.eval_batches)

    def report(self, model: SequenceClassifier, fit: FitResult) -> dict[str, Any]:
        cfg, data, engine = self.cfg, self.data, self.engine
        test = self._evaluate(model, "test")
        return {
            "name": cfg.name,
            "task": data.name,
            "attention": cfg.model.attention,
            "seed": cfg.seed,
            "data_source": data.source,
            "stand_in": data.stand_in,
            "seq_len": data.seq_len,
            "steps": fit.step,
            "skipped_steps": fit.skipped_steps,
            "best_step": fit.best["step"],
            "val_acc": fit.best["value"],
            "test_acc": test["acc"],
            "test_loss": test["loss"],
            "test_examples": test["n"],
            "median_step_ms": fit.median_step_ms,
            "parameters": count_parameters(model),
            "device": str(engine.device),
            "processes": engine.accelerator.num_processes,
            "hkt": hkt_state(model),
        }


def train(cfg: LRAConfig, data: TaskData | None = None, progress: bool = True) -> dict:
    """Train ``cfg``; returns the final metrics (also written to ``final.json``), or
    ``{"paused_at": step, ...}`` when ``train.stop_at`` paused the run."""
    return SequenceClassification(cfg, data, progress).run()


def load_run_config(run_dir: Path) -> LRAConfig:
    """The config a run folder was trained with (``resume`` off)."""
    rd = RunDir(run_dir)
    values = rd.read_config()
    values["resume"] = False
    check_run_kind(run_dir, values, "lra", "an HKT/MHA classifier")
    try:
        return build_dataclass(LRAConfig, values)
    except ConfigError as err:
        raise RunError(f"{rd.config}: {err}") from None


def evaluate_run(run_dir: Path, split: str = "test", data: TaskData | None = None) -> dict:
    """Evaluate a run's best weights (or its latest checkpoint) on ``split``: only on the data
    the run trained on (its ``data.json``, compared as ``--resume`` compares it)."""
    if split not in ("train", "val", "test"):
        raise ConfigError(f"split must be train, val or test, got {split!r}")
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    data = data if data is not None else load_task(cfg.data, write_cache=False)
    check_run_data(run_dir, data_identity(data))
    if len(getattr(data, split)) == 0:
        raise RunError(f"the {split} split of {data.name} is empty")
    model = build_model(cfg, data)
    weights = str(RunDir(run_dir).load_weights(model))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    metrics = evaluate(model.to(device), getattr(data, split), cfg.train.batch_size, device)
    return json_safe(
        {
            "run_dir": str(run_dir),
            "split": split,
            "weights": weights,
            "data_source": data.source,
            "stand_in": data.stand_in,
            **metrics,
        }
    )
