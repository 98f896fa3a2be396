"""What a training run carries from step to step, and what it ends with."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["FitResult", "TrainState", "Window"]


@dataclass
class TrainState:
    """The loop's own state, checkpointed beside the weights, optimizer, scheduler and RNG: the
    step, the best validation value (and its step), the step times and the skipped steps."""

    step: int = 0
    best: dict[str, Any] = field(default_factory=lambda: {"value": -math.inf, "step": 0})
    step_times: list[float] = field(default_factory=list)
    skipped: int = 0
    #: Wall time (s) of the run up to its last checkpoint, over every segment of a resumed run.
    wall_s: float = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "best": dict(self.best),
            "step_times": list(self.step_times),
            "skipped": self.skipped,
            "wall_s": self.wall_s,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.best = dict(state["best"])
        self.step_times = list(state["step_times"])
        self.skipped = int(state.get("skipped", 0))
        self.wall_s = float(state.get("wall_s", 0.0))  # 0 in checkpoints that predate it

    def improve(self, value: float) -> bool:
        """Record ``value`` as the best when it is; whether it was."""
        if value > self.best["value"]:
            self.best = {"value": value, "step": self.step}
            return True
        return False


@dataclass
class Window:
    """Training loss and accuracy summed over the steps since the last log line."""

    loss: float = 0.0
    correct: int = 0
    count: int = 0

    def add(self, loss: float, correct: int, count: int) -> None:
        self.loss += loss * count
        self.correct += correct
        self.count += count


@dataclass
class FitResult:
    """What :meth:`Engine.fit` ends with."""

    step: int
    best: dict[str, Any]
    step_times: list[float]
    skipped_steps: int
    paused: bool
    model: nn.Module  # the unwrapped model (weights of the last step)
    history: list[dict[str, Any]] = field(default_factory=list)
    #: Wall time (s) of the segments before this one (a resumed run), up to the checkpoint it
    #: resumed from: an experiment's ``wall_s`` is this plus its own segment's.
    earlier_wall_s: float = 0.0

    @property
    def median_step_ms(self) -> float | None:
        return 1e3 * statistics.median(self.step_times) if self.step_times else None


@dataclass
class Fit:
    """What one :meth:`~structattn.engine.Engine.fit` holds while it trains: the prepared model
    and the model it wraps (``raw``, what is evaluated and saved), the optimizer and schedule,
    the parameters that train (clipped together), the loop's state, the training-accuracy hook,
    and the wall time of earlier segments plus this segment's start (a resumed run's
    ``wall_s``)."""

    model: nn.Module
    raw: nn.Module
    optimizer: Any
    scheduler: Any
    trainable: list
    state: TrainState
    accuracy: Any = None
    earlier_wall_s: float = 0.0
    segment_start: float = 0.0
