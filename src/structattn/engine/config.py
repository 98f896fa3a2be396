"""The run vocabulary every experiment shares: :class:`RunConfig` (name, seed, run_dir,
resume, ``optim``, ``train``), its plain form and how a saved config differs from another.
Experiment files and the loader that builds these classes from them: :mod:`.loader` (its
names are importable from here too)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from structattn.errors import ConfigError
from structattn.utils.checks import require_positive

from . import loader
from .loader import *  # noqa: F403 (the loader's names, importable from here as before)
from .loader import plain

__all__ = [
    "OptimConfig",
    "RESUMABLE_CHANGES",
    "RunConfig",
    "TrainConfig",
    "check_run_name",
    "config_diff",
    "config_to_dict",
    "default_config",
    "with_saved_defaults",
    *loader.__all__,
]


#: Keys that ``--resume`` lets change: the budget, logging and where things live.
RESUMABLE_CHANGES = frozenset(
    {
        "resume",
        "overwrite",
        "run_dir",
        "data.data_dir",
        "train.max_steps",
        "train.stop_at",
        "train.log_every",
        "train.keep_checkpoints",
    }
)


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
        for name in ("lr", "weight_decay", "beta1", "beta2", "grad_clip"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"optim.{name} must be a finite number, got {getattr(self, name)}")
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
    """Loop lengths, batching, evaluation, precision and what to do with a bad step."""

    max_steps: int = 1000  # optimizer steps
    batch_size: int = 32  # examples per step (per process)
    grad_accum: int = 1  # split each step's batch into this many micro-batches (memory lever)
    eval_every: int = 100  # evaluate on validation (and checkpoint) every N steps
    eval_batches: int | None = None  # cap on validation batches per evaluation (None: all)
    log_every: int = 10  # write training loss/accuracy every N steps
    keep_checkpoints: int = 2  # most recent resumable checkpoints kept on disk
    stop_at: int | None = None  # pause after this step (checkpointed); continue with --resume
    bf16: bool = False  # bfloat16 autocast (accelerate mixed precision)
    nonfinite: str = "error"  # a NaN/inf loss: "error" stops the run; "skip" drops the update
    max_skipped: int = 10  # with nonfinite=skip: stop after this many skipped steps

    def __post_init__(self) -> None:
        require_positive(self, ("max_steps", "batch_size", "grad_accum", "eval_every", "log_every",
                                "keep_checkpoints"), prefix="train.")  # fmt: skip
        if self.grad_accum > self.batch_size:
            raise ValueError(
                f"train.grad_accum ({self.grad_accum}) must be <= train.batch_size "
                f"({self.batch_size})"
            )
        if self.stop_at is not None and not 1 <= self.stop_at <= self.max_steps:
            raise ValueError(f"train.stop_at must be in [1, max_steps], got {self.stop_at}")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise ValueError(f"train.eval_batches must be >= 1 or None, got {self.eval_batches}")
        if self.nonfinite not in ("error", "skip"):
            raise ValueError(f"train.nonfinite must be error or skip, got {self.nonfinite!r}")
        if self.max_skipped < 0:
            raise ValueError(f"train.max_skipped must be >= 0, got {self.max_skipped}")


@dataclass
class RunConfig:
    """What every run has: a name, a seed, a folder, whether to resume, and the engine's two
    sections. An experiment's config subclasses it and adds its own sections and fields (a
    subclass may redeclare a field to change its default)."""

    #: Dotted keys ``--resume`` lets change (the budget, logging, where things live).
    resumable: ClassVar[frozenset[str]] = RESUMABLE_CHANGES

    name: str = "run"  # run name (runs/<name>/seed<seed> unless run_dir is given)
    seed: int = 0  # seeds model init, data order and dropout
    run_dir: Path | None = None  # output folder (default runs/<name>/seed<seed>)
    resume: bool = False  # continue from the run directory's latest checkpoint
    # a fresh run in a folder that holds a run: delete what that run wrote first
    overwrite: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)  # AdamW + schedule
    train: TrainConfig = field(default_factory=TrainConfig)  # steps, batch, eval, stop_at

    def resolved_run_dir(self) -> Path:
        if self.run_dir is not None:
            return Path(self.run_dir)
        return Path("runs") / check_run_name(self.name) / f"seed{self.seed}"


def check_run_name(name: str) -> str:
    """``name`` as one folder name under ``runs/`` (no separator, no ``..``, not hidden), else
    a ConfigError: a config handed to the library must not place its run outside ``runs/``."""
    bad = not name or name.strip() != name or name.startswith(".")
    if bad or any(c in name for c in "/\\\0") or any(ord(c) < 32 for c in name):
        raise ConfigError(
            f"name {name!r} must be one folder name (no '/', '\\', '..', leading dot or "
            "control characters); give run_dir to choose another folder"
        )
    return name


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict (paths as strings, tuples as lists), e.g. for YAML."""
    return plain(cfg)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_diff(
    saved: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any] | None = None
) -> list[str]:
    """Dotted keys whose values differ between two plain config dicts. With ``defaults`` (the
    plain default config), a key the saved config lacks (written before the key existed) is
    no difference while the current value is its default."""
    a, b = _flatten(saved), _flatten(current)
    d = _flatten(defaults) if defaults is not None else {}
    missing = object()
    changed = []
    for k in set(a) | set(b):
        if a.get(k, missing) == b.get(k, missing) or _same_path(a.get(k), b.get(k)):
            continue
        if k not in a and k in d and b.get(k, missing) == d[k]:
            continue
        changed.append(k)
    return sorted(changed)


def _same_path(saved: Any, current: Any) -> bool:
    """A relative path saved by an earlier version and the absolute path a config now keeps
    for it: the same file when the relative one is read from the working directory."""
    if not (isinstance(saved, str) and isinstance(current, str)):
        return False
    if os.path.isabs(saved) or not os.path.isabs(current):
        return False
    return str(Path(saved).expanduser().absolute()) == current


def default_config(cls) -> dict[str, Any] | None:
    """The plain form of ``cls()``, or ``None`` when the class has no valid default: what a
    saved config means by a key it lacks. A class's ``SAVED_DEFAULTS`` (a mapping) names keys
    whose default changed since configs without them were written, with their old value."""
    try:
        values = config_to_dict(cls())
    except (TypeError, ValueError):
        return None
    return {**values, **getattr(cls, "SAVED_DEFAULTS", {})}


def with_saved_defaults(cls, values: dict[str, Any]) -> dict[str, Any]:
    """A saved config's ``values`` with the keys it lacks that ``cls.SAVED_DEFAULTS`` names, at
    the value they meant when it was written."""
    return {**values, **{k: v for k, v in getattr(cls, "SAVED_DEFAULTS", {}).items()
                         if k not in values}}  # fmt: skip
