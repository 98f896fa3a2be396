"""The config of one LRA-task run (HKT or its MHA baseline on ListOps, images or text)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from structattn.data.tasks import TaskSpec
from structattn.engine.config import RunConfig, load_config
from structattn.hkt.model import ModelConfig

__all__ = ["LRAConfig", "load_lra"]


@dataclass
class LRAConfig(RunConfig):
    """One training run: data, model, optimizer, loop, seed and where it writes."""

    name: str = "listops-hkt"  # run name (runs/<name>/seed<seed> unless run_dir is given)
    data: TaskSpec = field(default_factory=TaskSpec)  # the task and its data
    model: ModelConfig = field(default_factory=ModelConfig)  # the classifier (HKT or MHA)

    def __post_init__(self) -> None:
        if self.data.data_dir is not None and not Path(self.data.data_dir).is_dir():
            raise ValueError(f"data.data_dir does not exist: {self.data.data_dir}")


def load_lra(name_or_path: str | Path, preset: str = "quick", **overrides: Any) -> LRAConfig:
    """One preset of an LRA experiment file (``listops-hkt``, ``image-mha``, a YAML path);
    ``overrides`` replace fields or change sections given as dicts (``train={"max_steps": 10}``)."""
    return load_config(LRAConfig, name_or_path, preset, **overrides)
