"""The training engine every experiment runs on.

* :mod:`.config`: :class:`RunConfig` (name, seed, run_dir, resume, ``optim``, ``train``) and the
  one loader of YAML presets + overrides, with type checks;
* :mod:`.rundir`: :class:`RunDir`, the file names of a run folder, its lock and its rules;
* :mod:`.experiment`: :class:`Experiment`, the interface an experiment implements;
* :mod:`.loop`: :class:`Engine`, the training loop over a :class:`TrainState`;
* :mod:`.checkpoint`, :mod:`.metrics`, :mod:`.optim`, :mod:`.sampler`: atomic checkpoints and
  exact resume, ``metrics.csv`` + TensorBoard, AdamW groups and the schedule, step-addressed
  batches.
"""

from .config import (
    RESUMABLE_CHANGES,
    OptimConfig,
    RunConfig,
    TrainConfig,
    build_dataclass,
    config_diff,
    config_to_dict,
    find_config,
    load_config,
    load_preset,
    preset_names,
)
from .experiment import Experiment
from .loop import Engine, FitRules, NonFiniteLossError
from .metrics import METRIC_FIELDS, MetricsLog
from .optim import lr_lambda, param_groups
from .rundir import RunDir, json_safe
from .sampler import StepBatchSampler
from .state import FitResult, TrainState

__all__ = [
    "Engine",
    "FitRules",
    "Experiment",
    "FitResult",
    "METRIC_FIELDS",
    "MetricsLog",
    "NonFiniteLossError",
    "OptimConfig",
    "RESUMABLE_CHANGES",
    "RunConfig",
    "RunDir",
    "StepBatchSampler",
    "TrainConfig",
    "TrainState",
    "build_dataclass",
    "config_diff",
    "config_to_dict",
    "find_config",
    "json_safe",
    "load_config",
    "load_preset",
    "lr_lambda",
    "param_groups",
    "preset_names",
]
