"""Experiment configuration: dataclasses, layered as YAML preset < command-line overrides.

An experiment file under ``configs/`` holds one mapping per preset (``quick``, ``paper``), each
with the sections of :class:`ExperimentConfig`::

    quick:
      name: listops-hkt
      data:  {task: listops, ...}     # TaskSpec
      model: {attention: hkt, ...}    # ModelConfig (vocab, classes, max_len come from the data)
      optim: {lr: 1e-3, ...}          # OptimConfig
      train: {max_steps: 300, ...}    # TrainConfig

Unknown keys and bad values fail with a ``ValueError`` naming the key (``train.max_steps``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from structattn.data.tasks import TaskSpec
from structattn.hkt.model import ModelConfig

__all__ = [
    "ExperimentConfig",
    "OptimConfig",
    "TrainConfig",
    "config_to_dict",
    "find_config",
    "load_experiment",
]

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"


@dataclass
class OptimConfig:
    """AdamW with linear warmup and a decay schedule."""

    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.01  # AdamW decoupled weight decay (matrices only)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.98  # AdamW beta2
    warmup_steps: int = 50  # linear warmup from 0 to lr
    schedule: str = "cosine"  # decay after warmup: cosine | linear | constant
    grad_clip: float = 1.0  # clip the global gradient norm to this (0 = off)

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(
                f"optim.schedule must be cosine|linear|constant, got {self.schedule!r}"
            )
        if self.grad_clip < 0:
            raise ValueError(f"optim.grad_clip must be >= 0, got {self.grad_clip}")


@dataclass
class TrainConfig:
    """Loop lengths, batching, evaluation and precision."""

    max_steps: int = 1000  # optimizer steps
    batch_size: int = 32  # examples per step (per process)
    eval_every: int = 100  # evaluate on validation (and checkpoint) every N steps
    eval_batches: int | None = None  # cap on validation batches per evaluation (None: all)
    log_every: int = 10  # write training loss/accuracy every N steps
    keep_checkpoints: int = 2  # most recent resumable checkpoints kept on disk
    stop_at: int | None = None  # pause after this step (checkpointed); continue with --resume
    bf16: bool = False  # bfloat16 autocast (accelerate mixed precision)

    def __post_init__(self) -> None:
        for key in ("max_steps", "batch_size", "eval_every", "log_every", "keep_checkpoints"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key} must be >= 1, got {getattr(self, key)}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.max_steps:
            raise ValueError(f"train.stop_at must be in [1, max_steps], got {self.stop_at}")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise ValueError(f"train.eval_batches must be >= 1 or None, got {self.eval_batches}")


@dataclass
class ExperimentConfig:
    """One training run: data, model, optimizer, loop, seed and where it writes."""

    name: str = "listops-hkt"  # run name
    seed: int = 0  # seeds model init, data order and dropout
    run_dir: Path | None = None  # output folder (default runs/<name>/seed<seed>)
    resume: bool = False  # continue from the run directory's latest checkpoint
    data: TaskSpec = field(default_factory=TaskSpec)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.data.data_dir is not None and not Path(self.data.data_dir).is_dir():
            raise ValueError(f"data.data_dir does not exist: {self.data.data_dir}")

    def resolved_run_dir(self) -> Path:
        return (
            Path(self.run_dir)
            if self.run_dir is not None
            else Path("runs") / self.name / (f"seed{self.seed}")
        )


SECTIONS = {"data": TaskSpec, "model": ModelConfig, "optim": OptimConfig, "train": TrainConfig}


def _build(cls, values: dict, where: str):
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(f'{where}.{k}' for k in unknown)}")
    kwargs = {}
    for key, value in values.items():
        if key == "data_dir" and value is not None:
            value = Path(value)
        if isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except ValueError as err:
        msg = str(err)
        raise ValueError(msg if msg.startswith(f"{where}.") else f"{where}.{msg}") from None
    except TypeError as err:
        raise ValueError(f"{where}: {err}") from None


def config_from_dict(values: dict[str, Any]) -> ExperimentConfig:
    """Build an :class:`ExperimentConfig` from nested dicts, naming any bad key."""
    values = dict(values)
    sections = {}
    for key, cls in SECTIONS.items():
        section = values.pop(key, None) or {}
        if not isinstance(section, dict):
            raise ValueError(f"{key} must be a mapping, got {type(section).__name__}")
        sections[key] = _build(cls, section, key)
    top = {f.name for f in dataclasses.fields(ExperimentConfig)} - set(SECTIONS)
    unknown = sorted(set(values) - top)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}")
    if values.get("run_dir") is not None:
        values["run_dir"] = Path(values["run_dir"])
    return ExperimentConfig(**values, **sections)


def find_config(name_or_path: str | Path) -> Path:
    """A YAML path as given, or ``configs/<name>.yaml`` (e.g. ``listops-hkt``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for folder in (Path("configs"), CONFIG_DIR):
        candidate = folder / f"{name_or_path}.yaml"
        if candidate.is_file():
            return candidate
    raise ValueError(f"config {name_or_path!r} not found (a YAML path or a name in configs/)")


def load_experiment(
    name_or_path: str | Path, preset: str = "quick", **overrides: Any
) -> ExperimentConfig:
    """Load one preset of an experiment file; ``overrides`` replace top-level fields or whole
    sections given as dicts of changes (``train={"max_steps": 10}``)."""
    path = find_config(name_or_path)
    doc = yaml.safe_load(path.read_text()) or {}
    if preset not in doc:
        raise ValueError(f"{path}: no preset {preset!r} (has {sorted(doc)})")
    values = dict(doc[preset])
    for key, value in overrides.items():
        if key in SECTIONS and isinstance(value, dict):
            values[key] = {**(values.get(key) or {}), **value}
        else:
            values[key] = value
    try:
        return config_from_dict(values)
    except ValueError as err:
        raise ValueError(f"{path} [{preset}]: {err}") from None


def config_to_dict(cfg: ExperimentConfig) -> dict[str, Any]:
    """Plain nested dict (paths as strings, tuples as lists), e.g. for YAML."""

    def plain(x):
        if isinstance(x, Path):
            return str(x)
        if isinstance(x, tuple | list):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(dataclasses.asdict(cfg))
