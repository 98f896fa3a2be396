"""Training: experiment configs, the accelerate training loop, checkpoints, reproduction."""

from .config import ExperimentConfig, OptimConfig, TrainConfig, load_experiment
from .loop import evaluate, evaluate_run, train

__all__ = [
    "ExperimentConfig",
    "OptimConfig",
    "TrainConfig",
    "evaluate",
    "evaluate_run",
    "load_experiment",
    "train",
]
