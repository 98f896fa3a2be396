"""Training: the shared engine, experiment configs, checkpoints, and the experiments
(HKT vs MHA on the three tasks, GL-Fusion on text-attributed graphs)."""

from .config import ExperimentConfig, OptimConfig, TrainConfig, load_experiment
from .engine import Engine, FitResult, NonFiniteLossError, param_groups
from .hkt import evaluate, evaluate_run, train

__all__ = [
    "Engine",
    "ExperimentConfig",
    "FitResult",
    "NonFiniteLossError",
    "OptimConfig",
    "TrainConfig",
    "evaluate",
    "evaluate_run",
    "load_experiment",
    "param_groups",
    "train",
]
