"""Small shared utilities."""

from .memory import TensorMemoryTracker

__all__ = ["TensorMemoryTracker"]
