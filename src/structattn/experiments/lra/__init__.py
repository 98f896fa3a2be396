"""HKT against its retrained MHA baseline on the paper's three long-sequence tasks (ListOps,
sequential images, byte-level text): the experiment, its shallow baselines, the theory
diagnostics of a trained run, and ``reproduce`` (the sweep over tasks, variants and seeds)."""

from .config import LRAConfig, load_lra
from .experiment import (
    SequenceClassification,
    build_model,
    evaluate,
    evaluate_run,
    hkt_state,
    load_run_config,
    train,
)

__all__ = [
    "LRAConfig",
    "SequenceClassification",
    "build_model",
    "evaluate",
    "evaluate_run",
    "hkt_state",
    "load_lra",
    "load_run_config",
    "train",
]
