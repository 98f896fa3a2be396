"""Checks that configuration dataclasses share."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["require_positive"]


def require_positive(config: Any, names: Iterable[str], prefix: str = "",
                     allow_none: bool = False) -> None:  # fmt: skip
    """A ``ValueError`` naming the first of ``names`` whose value on ``config`` is below 1
    (``prefix`` before the name, e.g. ``"train."``; ``None`` passes with ``allow_none``)."""
    for name in names:
        value = getattr(config, name)
        if allow_none and value is None:
            continue
        if value < 1:
            also = " or None" if allow_none else ""
            raise ValueError(f"{prefix}{name} must be >= 1{also}, got {value}")
