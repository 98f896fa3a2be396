"""Datasets for the paper's tasks: canonical-format readers, offline stand-ins, collation."""

from .base import PAD_ID, SequenceDataset, TaskData, default_data_dir, pad_collate, split_indices
from .tasks import TASKS, TaskSpec, load_task

__all__ = [
    "PAD_ID",
    "SequenceDataset",
    "TASKS",
    "TaskData",
    "TaskSpec",
    "default_data_dir",
    "load_task",
    "pad_collate",
    "split_indices",
]
