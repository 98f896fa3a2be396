"""Experiment files and the one loader: YAML presets < overrides < command-line flags.

An experiment file (shipped in ``structattn/configs/``, or any YAML path) holds one mapping per
preset (``quick``, ``paper``, ...), each with the fields of the experiment's config class::

    quick:
      name: listops-hkt
      data:  {task: listops, ...}
      model: {attention: hkt, ..., hkt: {n_levels: 3, ...}}
      optim: {lr: 1e-3, ...}          # OptimConfig
      train: {max_steps: 300, ...}    # TrainConfig

:func:`load_config` builds any such class from one preset. Values are checked against the
dataclass field types (``lr: 1e-3``, which PyYAML reads as a string, is a float;
``seq_len: 128.5`` and ``causal: "no"`` are errors); a section given as a mapping changes the
field's default (an experiment's own optimiser defaults stay unless a key is given). Unknown
keys and bad values raise :class:`~structattn.errors.ConfigError` naming the key
(``train.max_steps``). A config class may normalise its mapping before it is built
(classmethod ``from_config_values(values, where)``) and its plain form after
(``to_config_values(out)``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from structattn.errors import ConfigError

__all__ = [
    "CONFIG_DIR",
    "build_dataclass",
    "find_config",
    "load_config",
    "load_preset",
    "merge_overrides",
    "parse_yaml",
    "plain",
    "preset_from_args",
    "preset_names",
    "read_yaml",
]

#: The shipped experiment files (package data, found from an installed package too).
CONFIG_DIR = Path(str(resources.files("structattn") / "configs"))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` as field type ``tp``, or a ConfigError naming ``where``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, typing.get_args(tp), where)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return build_dataclass(tp, value, where)
    if tp in _SCALARS:
        return _SCALARS[tp](value, where)
    if origin in (tuple, list):
        return _coerce_sequence(value, tp, where)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return dict(value)
    return value


def _coerce_union(value: Any, args: tuple, where: str) -> Any:
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(value, arg, where)
        except ConfigError as err:
            errors.append(err)
    raise errors[0]


def _coerce_sequence(value: Any, tp: Any, where: str) -> list | tuple:
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{where} must be a list, got {value!r}")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(f"{where} must have {len(args)} items, got {len(value)}")
        items = [_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
    else:
        item = args[0] if args else Any
        items = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _as_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{where} must be true or false, got {value!r}")


def _as_int(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConfigError(f"{where} must be an integer, got {value!r}")


def _as_float(value: Any, where: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"{where} must be a number, got {value!r}")


def _as_str(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    raise ConfigError(f"{where} must be a string, got {value!r}")


def _as_path(value: Any, where: str) -> Path:
    if isinstance(value, str | Path):
        return Path(value)
    raise ConfigError(f"{where} must be a path, got {value!r}")


_SCALARS = {bool: _as_bool, int: _as_int, float: _as_float, str: _as_str, Path: _as_path}


def _section_default(f: dataclasses.Field, tp: Any) -> dict[str, Any] | None:
    """The plain form of a dataclass field's default when it differs from ``tp()`` (an
    experiment's own defaults, which a given mapping changes rather than replaces)."""
    if f.default_factory is dataclasses.MISSING:
        return None
    default = f.default_factory()
    try:
        same = default == tp()
    except (TypeError, ValueError):
        same = False
    return None if same else plain(default)


def _deep_merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes``; nested mappings merged key by key."""
    out = dict(base)
    for k, v in changes.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def build_dataclass(cls, values: dict, where: str = ""):
    """``cls(**values)`` with every value checked against its field type; errors name the key
    as ``where.key`` (nested dataclass sections included). A nested section that is missing or
    ``None`` keeps its default; one given as a mapping changes the default's keys."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where or 'the config'} must be a mapping, got {type(values).__name__}")
    values = dict(values)
    prefix = f"{where}." if where else ""
    hook = getattr(cls, "from_config_values", None)
    if hook is not None:
        values = hook(values, where)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(f'{prefix}{k}' for k in unknown)}")
    kwargs = {}
    for key, value in values.items():
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if value is None:
                continue
            default = _section_default(fields[key], tp)
            if default is not None and isinstance(value, dict):
                hook = getattr(tp, "from_config_values", None)
                if hook is not None:  # the given keys in their current form, then merged
                    value = hook(value, f"{prefix}{key}")
                value = _deep_merge(default, value)
        kwargs[key] = _coerce(value, tp, f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        msg = str(err)
        raise ConfigError(msg if msg.startswith(prefix) else f"{prefix}{msg}") from None


def find_config(name_or_path: str | Path) -> Path:
    """A shipped experiment by name (``listops-hkt``, ``glfusion``, ...: always the installed
    package's file, whatever folders the working directory holds), or a YAML path as given
    (anything with a ``.yaml``/``.yml`` suffix or a folder separator)."""
    text = str(name_or_path)
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or "/" in text or "\\" in text:
        if path.is_file():
            return path
        raise ConfigError(f"config file {text!r} not found")
    candidate = CONFIG_DIR / f"{text}.yaml"
    if candidate.is_file():
        return candidate
    shipped = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"config {text!r} not found: give a YAML path or one of {shipped}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML
    silently keeps the last: ``optim: {lr: 0.002, lr: 5.0}`` trained at 5.0). Merge keys
    (``<<: *base``) work as YAML defines them: the mapping's own keys override merged ones."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    merges = 0
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            merges += 1
            if merges > 1:  # YAML allows one merge key; a second would silently lose one
                line = key_node.start_mark.line + 1
                raise ConfigError(f"merge key '<<' is given twice in one mapping (line {line})")
            continue
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise ConfigError(f"key {key!r} is given twice in one mapping (line {line})")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def parse_yaml(text: str, source: str = "<text>") -> Any:
    """YAML text with unique keys (merge keys allowed); bad YAML or a repeated key is a
    ConfigError naming ``source``. The one loader of configs: files, ``--set`` values and a run
    folder's ``config.yaml``."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML ({err})") from None
    except TypeError as err:  # a key YAML allows but a mapping cannot hold (a list, a mapping)
        raise ConfigError(f"{source}: a key must be a plain value ({err})") from None
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def read_yaml(path: Path) -> Any:
    """A YAML file with unique keys; bad YAML or a repeated key is a ConfigError naming it."""
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not a text file ({err.reason})") from None
    return parse_yaml(text, str(path))


def load_preset(name_or_path: str | Path, preset: str) -> tuple[Path, dict[str, Any]]:
    """The mapping of one preset of an experiment file, and the file's path."""
    path = find_config(name_or_path)
    doc = read_yaml(path) or {}
    if not isinstance(doc, dict) or preset not in doc:
        has = sorted(doc) if isinstance(doc, dict) else []
        raise ConfigError(f"{path}: no preset {preset!r} (has {has})")
    if not isinstance(doc[preset], dict | None):
        kind = type(doc[preset]).__name__
        raise ConfigError(f"{path}: preset {preset!r} must be a mapping of keys, got a {kind}")
    return path, dict(doc[preset] or {})


def preset_names(name_or_path: str | Path) -> list[str]:
    """The presets of an experiment file, in file order ([] when it cannot be read)."""
    try:
        doc = read_yaml(find_config(name_or_path))
    except ConfigError:
        return []
    return list(doc) if isinstance(doc, dict) else []


def preset_from_args(args: list[str], default_config: str) -> tuple[str, str]:
    """The ``--config`` and ``--preset`` among command-line ``args`` (``--flag value`` or
    ``--flag=value``), defaults ``default_config`` and ``quick``: they choose the defaults the
    other flags override."""
    import argparse

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=default_config)
    pre.add_argument("--preset", default="quick")
    known, _ = pre.parse_known_args(args)
    return known.config, known.preset


def merge_overrides(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``values`` with ``overrides``: a section given as a dict changes that section's keys
    (two levels deep, e.g. ``model={"hkt": {"n_levels": 2}}``); anything else replaces."""
    out = dict(values)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict | None):
            section = dict(out.get(key) or {})
            for k, v in value.items():
                if isinstance(v, dict) and isinstance(section.get(k), dict):
                    section[k] = {**section[k], **v}
                else:
                    section[k] = v
            out[key] = section
        else:
            out[key] = value
    return out


def load_config(cls, name_or_path: str | Path, preset: str, **overrides: Any):
    """One preset of an experiment file as ``cls`` (a :class:`RunConfig`), with ``overrides``
    on top (sections as dicts of changes: ``train={"max_steps": 10}``)."""
    path, values = load_preset(name_or_path, preset)
    try:
        return build_dataclass(cls, merge_overrides(values, overrides))
    except ConfigError as err:
        raise ConfigError(f"{path} [{preset}]: {err}") from None


def plain(x: Any) -> Any:
    """Dataclasses, paths and tuples as plain dicts, strings and lists (for YAML and JSON)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        out = {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        hook = getattr(x, "to_config_values", None)
        return hook(out) if hook is not None else out
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, tuple | list):
        return [plain(v) for v in x]
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    return x
