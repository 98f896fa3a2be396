"""HKT and its MHA baseline on the paper's three tasks: data + model + report on the engine.

    structattn train --config listops-hkt --preset quick --seed 0
    torchrun --nproc-per-node 2 -m structattn.cli train --config listops-hkt   # 2 processes

With P processes each step consumes ``P * batch_size`` examples. A run directory holds
``config.yaml`` (resolved), ``metrics.csv``, TensorBoard events in ``tb/``, ``checkpoints/``
(atomic, resumable), ``best.safetensors`` and ``final.json``. ``--resume`` restores weights,
optimizer, scheduler, step, RNG states and the data position, so N + N steps give exactly the
parameters of 2N straight steps (see :mod:`structattn.train.engine`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import DataLoader

from structattn.data import SequenceDataset, TaskData, load_task, pad_collate
from structattn.errors import ConfigError, RunError
from structattn.hkt.model import SequenceClassifier, count_parameters

from .checkpoint import load_run_weights
from .config import ExperimentConfig, config_from_dict
from .engine import Engine, json_safe

__all__ = ["build_model", "evaluate", "evaluate_run", "hkt_state", "load_run_config", "train"]


def _model_inputs(items) -> dict[str, torch.Tensor]:
    batch = pad_collate(items)
    return {"tokens": batch["tokens"], "mask": batch["mask"], "labels": batch["labels"]}


def _accuracy(out, batch) -> tuple[int, int]:
    return int((out.logits.argmax(-1) == batch["labels"]).sum()), len(batch["labels"])


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


def build_model(cfg: ExperimentConfig, data: TaskData) -> SequenceClassifier:
    """The classifier for ``cfg`` with vocab, classes and max length taken from ``data``."""
    model_cfg = cfg.model.replace(
        vocab_size=data.vocab_size, num_classes=data.num_classes, max_len=data.seq_len
    )
    return SequenceClassifier(model_cfg)


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


def _check_splits(data: TaskData) -> None:
    for split in ("train", "val", "test"):
        if len(getattr(data, split)) == 0:
            raise RunError(f"task {data.name}: the {split} split is empty ({data.source})")


def train(cfg: ExperimentConfig, data: TaskData | None = None, progress: bool = True) -> dict:
    """Train ``cfg``; returns the final metrics (also written to ``final.json``), or
    ``{"paused_at": step, ...}`` when ``train.stop_at`` paused the run."""
    run_dir = cfg.resolved_run_dir()
    engine = Engine.for_experiment(cfg, run_dir, cfg.name, progress)
    data = data if data is not None else load_task(cfg.data)
    _check_splits(data)
    model = build_model(cfg, data)
    acc = engine.accelerator

    def validate(m: nn.Module) -> dict[str, float]:
        return evaluate(
            m, data.val, cfg.train.batch_size, engine.device, cfg.train.eval_batches, acc.autocast
        )

    result = engine.fit(model, data.train, _model_inputs, validate, accuracy=_accuracy)
    if result.paused:
        return {"name": cfg.name, "paused_at": result.step, "run_dir": str(run_dir)}
    raw = result.model
    engine.load_best(raw)
    test = evaluate(raw, data.test, cfg.train.batch_size, engine.device, autocast=acc.autocast)
    final = {
        "name": cfg.name,
        "task": data.name,
        "attention": cfg.model.attention,
        "seed": cfg.seed,
        "data_source": data.source,
        "stand_in": data.stand_in,
        "seq_len": data.seq_len,
        "steps": result.step,
        "skipped_steps": result.skipped_steps,
        "best_step": result.best["step"],
        "val_acc": result.best["value"],
        "test_acc": test["acc"],
        "test_loss": test["loss"],
        "test_examples": test["n"],
        "median_step_ms": result.median_step_ms,
        "parameters": count_parameters(raw),
        "device": str(engine.device),
        "processes": acc.num_processes,
        "hkt": hkt_state(raw),
    }
    engine.write_json("final.json", final)
    return json_safe(final)


def load_run_config(run_dir: Path) -> ExperimentConfig:
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise RunError(f"{path} not found: is {run_dir} a run directory?")
    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise RunError(f"{path} is not valid YAML ({err})") from None
    if not isinstance(values, dict):
        raise RunError(f"{path} does not hold an experiment config")
    values["resume"] = False
    try:
        return config_from_dict(values)
    except ConfigError as err:
        raise RunError(f"{path}: {err}") from None


def evaluate_run(run_dir: Path, split: str = "test", data: TaskData | None = None) -> dict:
    """Evaluate a run's best weights (or its latest checkpoint) on ``split``."""
    if split not in ("train", "val", "test"):
        raise ConfigError(f"split must be train, val or test, got {split!r}")
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    data = data if data is not None else load_task(cfg.data)
    if len(getattr(data, split)) == 0:
        raise RunError(f"the {split} split of {data.name} is empty")
    model = build_model(cfg, data)
    weights = str(load_run_weights(model, run_dir))
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
