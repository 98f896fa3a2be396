"""Experiment configuration: dataclasses, layered as YAML preset < command-line overrides.

An experiment file (shipped in ``structattn/configs/``, or any YAML path) holds one mapping per
preset (``quick``, ``paper``), each with the sections of :class:`ExperimentConfig`::

    quick:
      name: listops-hkt
      data:  {task: listops, ...}     # TaskSpec
      model: {attention: hkt, ..., hkt: {n_levels: 3, ...}}  # ModelConfig (nests HKTConfig)
      optim: {lr: 1e-3, ...}          # OptimConfig
      train: {max_steps: 300, ...}    # TrainConfig

Values are checked against the dataclass field types (``lr: 1e-3``, which PyYAML reads as a
string, is a float; ``seq_len: 128.5`` and ``causal: "no"`` are errors). Unknown keys and bad
values raise :class:`~structattn.errors.ConfigError` naming the key (``train.max_steps``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from structattn.data.tasks import TaskSpec
from structattn.errors import ConfigError
from structattn.hkt.model import ModelConfig

__all__ = [
    "ExperimentConfig",
    "OptimConfig",
    "RESUMABLE_CHANGES",
    "TrainConfig",
    "build_dataclass",
    "config_diff",
    "config_to_dict",
    "find_config",
    "load_experiment",
    "load_preset",
]

#: The shipped experiment files (package data, found from an installed package too).
CONFIG_DIR = Path(str(resources.files("structattn") / "configs"))

#: Keys that ``--resume`` lets change: the budget, logging and where things live.
RESUMABLE_CHANGES = frozenset(
    {
        "resume",
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
        for key in (
            "max_steps",
            "batch_size",
            "grad_accum",
            "eval_every",
            "log_every",
            "keep_checkpoints",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key} must be >= 1, got {getattr(self, key)}")
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
class ExperimentConfig:
    """One training run: data, model, optimizer, loop, seed and where it writes."""

    name: str = "listops-hkt"  # run name
    seed: int = 0  # seeds model init, data order and dropout
    run_dir: Path | None = None  # output folder (default runs/<name>/seed<seed>)
    resume: bool = False  # continue from the run directory's latest checkpoint
    data: TaskSpec = field(default_factory=TaskSpec)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.data.data_dir is not None and not Path(self.data.data_dir).is_dir():
            raise ValueError(f"data.data_dir does not exist: {self.data.data_dir}")

    def resolved_run_dir(self) -> Path:
        return (
            Path(self.run_dir)
            if self.run_dir is not None
            else Path("runs") / self.name / (f"seed{self.seed}")
        )


SECTIONS = {"data": TaskSpec, "model": ModelConfig, "optim": OptimConfig, "train": TrainConfig}

#: Flat HKT keys of older ``model`` sections, now under ``model.hkt``.
_LEGACY_HKT_KEYS = (
    "n_levels",
    "stride",
    "hybrid",
    "downsample_kernel",
    "conv_kernel",
    "beta_init",
    "impl",
)


#: HKTConfig fields that ModelConfig sets from its own.
_FROM_MODEL = ("d_model", "n_heads", "causal")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` as field type ``tp``, or a ConfigError naming ``where``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
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
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return build_dataclass(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {value!r}")
    if tp is Path:
        if isinstance(value, str | Path):
            return Path(value)
        raise ConfigError(f"{where} must be a path, got {value!r}")
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{where} must have {len(args)} items, got {len(value)}")
            items = [_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            item = args[0] if args else Any
            items = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return dict(value)
    return value


def build_dataclass(cls, values: dict, where: str):
    """``cls(**values)`` with every value checked against its field type; errors name the key
    as ``where.key`` (nested dataclass sections included)."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where or 'the config'} must be a mapping, got {type(values).__name__}")
    values = dict(values)
    prefix = f"{where}." if where else ""
    if cls is ModelConfig:
        legacy = {k: values.pop(k) for k in _LEGACY_HKT_KEYS if k in values}
        if legacy:
            values["hkt"] = {**legacy, **dict(values.get("hkt") or {})}
        hkt_values = values.get("hkt") or {}
        defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
        shared = sorted(  # written back by config.yaml: fine when they agree with the model
            k
            for k in _FROM_MODEL
            if k in hkt_values and hkt_values[k] != values.get(k, defaults[k])
        )
        if shared:
            raise ConfigError(
                f"{', '.join(f'{where}.hkt.{k}' for k in shared)}: set {where}.{shared[0]} "
                "(the attention takes width, heads and causality from the model)"
            )
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(f'{prefix}{k}' for k in unknown)}")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}{k}") for k, v in values.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        msg = str(err)
        raise ConfigError(msg if msg.startswith(prefix) else f"{prefix}{msg}") from None


def config_from_dict(values: dict[str, Any]) -> ExperimentConfig:
    """Build an :class:`ExperimentConfig` from nested dicts, naming any bad key."""
    if not isinstance(values, dict):
        raise ConfigError(f"an experiment must be a mapping, got {type(values).__name__}")
    values = dict(values)
    for key in SECTIONS:
        if values.get(key) is None:
            values.pop(key, None)
    hints = typing.get_type_hints(ExperimentConfig)
    names = {f.name for f in dataclasses.fields(ExperimentConfig)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)}")
    kwargs = {
        k: build_dataclass(SECTIONS[k], v, k) if k in SECTIONS else _coerce(v, hints[k], k)
        for k, v in values.items()
    }
    try:
        return ExperimentConfig(**kwargs)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from None


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
    silently keeps the last: ``optim: {lr: 0.002, lr: 5.0}`` trained at 5.0)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise ConfigError(f"key {key!r} is given twice in one mapping (line {line})")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping
)


def read_yaml(path: Path) -> Any:
    """A YAML file with unique keys; bad YAML or a repeated key is a ConfigError naming it."""
    try:
        return yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def load_preset(name_or_path: str | Path, preset: str) -> tuple[Path, dict[str, Any]]:
    """The mapping of one preset of an experiment file, and the file's path."""
    path = find_config(name_or_path)
    print(f"config: {path} [{preset}]", file=sys.stderr)
    doc = read_yaml(path) or {}
    if not isinstance(doc, dict) or preset not in doc:
        has = sorted(doc) if isinstance(doc, dict) else []
        raise ConfigError(f"{path}: no preset {preset!r} (has {has})")
    if not isinstance(doc[preset], dict | None):
        kind = type(doc[preset]).__name__
        raise ConfigError(f"{path}: preset {preset!r} must be a mapping of keys, got a {kind}")
    return path, dict(doc[preset] or {})


def load_experiment(
    name_or_path: str | Path, preset: str = "quick", **overrides: Any
) -> ExperimentConfig:
    """Load one preset of an experiment file; ``overrides`` replace top-level fields or whole
    sections given as dicts of changes (``train={"max_steps": 10}``)."""
    path, values = load_preset(name_or_path, preset)
    for key, value in overrides.items():
        if key in SECTIONS and isinstance(value, dict):
            section = dict(values.get(key) or {})
            for k, v in value.items():  # one level deeper for model.hkt
                if isinstance(v, dict) and isinstance(section.get(k), dict):
                    section[k] = {**section[k], **v}
                else:
                    section[k] = v
            values[key] = section
        else:
            values[key] = value
    try:
        return config_from_dict(values)
    except ConfigError as err:
        raise ConfigError(f"{path} [{preset}]: {err}") from None


def plain(x: Any) -> Any:
    """Dataclasses, paths and tuples as plain dicts, strings and lists (for YAML and JSON)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        out = {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, ModelConfig):  # the model's own width, heads and causality
            out["hkt"] = {k: v for k, v in out["hkt"].items() if k not in _FROM_MODEL}
        return out
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, tuple | list):
        return [plain(v) for v in x]
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    return x


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


def config_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two plain config dicts."""
    a, b = _flatten(saved), _flatten(current)
    return sorted(k for k in set(a) | set(b) if a.get(k, object()) != b.get(k, object()))
