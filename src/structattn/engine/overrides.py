"""``--set KEY=VALUE`` overrides of a run config, parsed into the nested mapping the config
loader takes (shared by every command that accepts them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from structattn.engine.config import parse_yaml
from structattn.errors import ConfigError

__all__ = ["parse_settings"]


def parse_settings(items: Sequence[str]) -> dict[str, Any]:
    """``["train.max_steps=50", "data.seq_len=64"]`` -> ``{"train": {"max_steps": 50}, "data":
    {"seq_len": 64}}`` (values parsed as YAML); a malformed item is a one-line error."""
    out: dict[str, Any] = {}
    seen: set[tuple[str, ...]] = set()
    for item in items:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(p.isidentifier() for p in parts):
            raise SystemExit(f"--set takes KEY=VALUE with a dotted key, got {item!r}")
        if tuple(parts) in seen:  # a second value would silently win
            raise SystemExit(f"--set {key.strip()} is given twice; give it once")
        for other in seen:  # train=... and train.max_steps=...: one would replace the other
            if other[: len(parts)] == tuple(parts) or tuple(parts[: len(other)]) == other:
                raise SystemExit(
                    f"--set {key.strip()} and {'.'.join(other)} overlap (one is inside the "
                    "other); give each key once"
                )
        seen.add(tuple(parts))
        try:
            value = parse_yaml(text, f"--set {key.strip()}")
        except ConfigError as err:
            raise SystemExit(str(err)) from None
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise SystemExit(f"--set {key}: {p!r} is set to a value and used as a section")
        node[parts[-1]] = value
    return out
