"""AdamW's parameter groups (one decay rule) and the learning-rate schedule."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from structattn.errors import ConfigError

from .config import OptimConfig

__all__ = [
    "DECAYED_MODULES",
    "build_optimizer",
    "check_optim",
    "describe_groups",
    "lr_lambda",
    "param_groups",
]


def check_optim(optim: OptimConfig) -> None:
    """AdamW's hyperparameters in their ranges (``0 <= beta < 1``, ``lr > 0``, ``weight_decay
    >= 0``), or one :class:`ConfigError` naming the key; checked before a run writes anything."""
    for name in ("beta1", "beta2"):
        value = getattr(optim, name)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"optim.{name} must be in [0, 1), got {value}")
    if not optim.lr > 0:
        raise ConfigError(f"optim.lr must be > 0, got {optim.lr}")
    if not optim.weight_decay >= 0:
        raise ConfigError(f"optim.weight_decay must be >= 0, got {optim.weight_decay}")


def lr_lambda(optim: OptimConfig, max_steps: int):
    """Multiplier of the peak rate at each step: linear warmup, then the decay schedule."""

    def fn(step: int) -> float:
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule == "constant":
            return 1.0
        progress = (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if optim.schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


#: Module types whose ``weight`` is decayed; every other parameter is not.
DECAYED_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def param_groups(
    model: nn.Module, weight_decay: float, lr: float | None = None
) -> list[dict[str, Any]]:
    """AdamW groups by one rule: **decay the ``weight`` of Linear and Conv layers, nothing
    else** (biases, norms, embeddings, HKT level logits and beta, GL-Fusion gates and graph
    tokens are not decayed). A parameter shared with any other module (a tied embedding) is
    not decayed. Frozen parameters are left out. Each group carries ``names`` for reporting."""
    owners: dict[int, list[bool]] = {}
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(
                isinstance(module, DECAYED_MODULES) and pname == "weight"
            )
    decay, no_decay, seen = ([], []), ([], []), set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        target = decay if all(owners.get(id(p), [False])) else no_decay
        target[0].append(p)
        target[1].append(name)
    groups = [
        {"params": decay[0], "names": decay[1], "group": "decayed", "weight_decay": weight_decay},
        {"params": no_decay[0], "names": no_decay[1], "group": "not decayed", "weight_decay": 0.0},
    ]
    if lr is not None:
        for g in groups:
            g["lr"] = lr
    return [g for g in groups if g["params"]]


def describe_groups(groups: list[dict[str, Any]]) -> str:
    """One line: each group's name (when it has one), weight decay, learning rate (when it sets
    its own), tensors and parameters."""
    parts = []
    for g in groups:
        n = sum(p.numel() for p in g["params"])
        name = f"{g['group']}: " if "group" in g else ""
        lr = f", lr={g['lr']:g}" if "lr" in g else ""
        parts.append(
            f"{name}weight_decay={g['weight_decay']}{lr}, {len(g['params'])} tensors, "
            f"{n:,} parameters"
        )
    return "param groups (decay: Linear/Conv weights only): " + "; ".join(parts)


def build_optimizer(
    groups: list[dict[str, Any]], optim: OptimConfig, max_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``groups`` (their ``names`` left out) and its warmup + decay schedule; bad
    hyperparameters are a :class:`ConfigError` (:func:`check_optim`)."""
    check_optim(optim)
    optimizer = torch.optim.AdamW(
        [{k: v for k, v in g.items() if k not in ("names", "group")} for g in groups],
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, max_steps))
