"""What the training commands share (``structattn train``, ``lm``, ``glfusion train``): an
experiment file and a preset choose the defaults, every other flag overrides them."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import sys
from pathlib import Path
from typing import Annotated, Any, ClassVar

import tyro

from structattn.engine.config import (
    build_dataclass,
    find_config,
    load_config,
    preset_from_args,
    preset_names,
    with_saved_defaults,
)
from structattn.engine.rundir import RunDir
from structattn.errors import ConfigError, RunError
from structattn.hkt.attention import HKTConfig
from structattn.hkt.model import FROM_MODEL

__all__ = [
    "PresetCommand",
    "preset_command",
    "check_sampling",
    "parse_command",
    "run_config_values",
    "refuse_other_kind",
    "saved_run_config",
]


def check_sampling(max_new_tokens: int, temperature: float, top_k: int) -> None:
    """The generation flags every ``generate`` command takes, checked before anything loads."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ConfigError(f"temperature must be a finite number > 0, got {temperature}")
    if top_k < 1:
        raise ConfigError(f"top_k must be >= 1, got {top_k}")


#: How to continue a run of each kind, for a resume given to another kind's command.
RESUME_COMMANDS = {
    "glfusion": "structattn glfusion train",
    "code-names": "structattn code-names train",
    "lm": "structattn lm",
    "lra": "structattn train",
}


def refuse_other_kind(args: list[str], kind: str) -> None:
    """``--run-dir X --resume`` alone on a run of another kind than ``kind``: a ConfigError
    naming the command that continues it (a saved config of this kind passes)."""
    from structattn.experiments import RUN_KINDS, run_kind

    saved = saved_run_config(args)
    if saved is None or run_kind(saved[1]) == kind:
        return
    folder, found = saved[0].parent, run_kind(saved[1])
    what = RUN_KINDS[found][0]
    if found in RESUME_COMMANDS:
        command = f"{RESUME_COMMANDS[found]} --run-dir {folder} --resume"
        raise ConfigError(f"{folder} is {what}: resume it with `{command}`")
    raise ConfigError(f"{folder} holds {what}: see `structattn --help`")


#: The type of a preset command's ``--config``: an experiment file.
ConfigFile = Annotated[str, tyro.conf.arg(help="experiment file: a shipped name or a YAML path")]


def PresetOf(config: str) -> Any:  # noqa: N802 (used as a type: ``preset: PresetOf("lm")``)
    """The type of ``--preset``: a preset of --config, the help listing ``config``'s presets."""
    shipped = " | ".join(preset_names(config))
    return Annotated[str, tyro.conf.arg(help=f"a preset of --config (shipped {config}: {shipped})")]


class PresetCommand:
    """A tyro dataclass with the fields ``config``, ``preset`` and ``experiment`` (an instance
    of :attr:`config_class`): :meth:`defaults` loads the preset the command line names, so that
    tyro shows and overrides its values."""

    #: The shipped experiment file used without ``--config``.
    default_config: ClassVar[str]
    #: The :class:`~structattn.engine.RunConfig` subclass the file describes.
    config_class: ClassVar[type]

    config: str
    preset: str
    experiment: Any

    @classmethod
    def defaults(cls, args: list[str]):
        """The command with the preset that ``args`` choose as its defaults; ``--run-dir X
        --resume`` without ``--config`` or ``--preset`` takes the run's own ``config.yaml``
        (a run folder knows its config: no flag needs repeating)."""
        saved = saved_run_config(args)
        if saved is not None:
            path, values = saved
            values = cls.adopt_saved(with_saved_defaults(cls.config_class, values))
            return cls(str(path), SAVED_PRESET, build_dataclass(cls.config_class, values))
        config, preset = preset_from_args(args, cls.default_config)
        return cls(config, preset, load_config(cls.config_class, config, preset))

    @classmethod
    def adopt_saved(cls, values: dict[str, Any]) -> dict[str, Any]:
        """A run's saved config values as the defaults of a command continuing it (a hook)."""
        return values

    def announce(self) -> None:
        """Say which file and preset the run uses (stderr)."""
        where = self.config if self.preset == SAVED_PRESET else find_config(self.config)
        print(f"config: {where} [{self.preset}]", file=sys.stderr)


def preset_command(config: str, config_class: type) -> type:
    """The base of a command whose defaults are a preset of the experiment file ``config``
    (``quick`` unless ``--preset`` names another): the fields ``--config``, ``--preset`` and
    ``experiment``, a ``config_class`` whose fields are flags without a prefix. A command
    subclasses it (``@dataclass class Train(preset_command("lm", LMConfig))``), adding its own
    fields and ``run``."""
    fields = [
        ("config", ConfigFile, dataclasses.field(default=config)),
        ("preset", PresetOf(config), dataclasses.field(default="quick")),
        ("experiment", Annotated[config_class, tyro.conf.arg(name="")],
         dataclasses.field(default_factory=lambda: load_config(config_class, config, "quick"))),
    ]  # fmt: skip
    namespace = {"default_config": config, "config_class": config_class}
    return dataclasses.make_dataclass(f"{config_class.__name__}Command", fields,
                                      bases=(PresetCommand,), namespace=namespace)  # fmt: skip


#: The preset name shown for a config read from a run folder.
SAVED_PRESET = "the run's own config"


def saved_run_config(args: list[str]) -> tuple[Path, dict[str, Any]] | None:
    """``(path, values)`` of the ``config.yaml`` of the run that ``args`` resume (``--resume``
    and ``--run-dir X``, neither ``--config`` nor ``--preset``), else None; a folder without a
    config continues to the usual preset (and its own error). The earlier segment's
    ``train.stop_at`` is dropped: the run continues to its end unless the flags pause it."""
    import argparse

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--resume", action="store_true")
    pre.add_argument("--run-dir")
    pre.add_argument("--config")
    pre.add_argument("--preset")
    known, _ = pre.parse_known_args(args)
    if not known.resume or not known.run_dir or known.config or known.preset:
        return None
    run = RunDir(known.run_dir)
    if not run.config.is_file():
        return None
    return run.config, run_config_values(run)


def run_config_values(run: RunDir) -> dict[str, Any]:
    """A run's saved config as the defaults of a command that continues or reads it: not
    ``resume``/``overwrite`` (the flags of this call decide), no pause point of an earlier
    segment, and no data folder that no longer exists (a moved run reads the default data
    folder, or ``--data-dir``)."""
    try:
        values = run.read_config()
    except RunError as err:
        raise ConfigError(str(err)) from None
    values.update(resume=False, overwrite=False)
    if isinstance(values.get("train"), dict):  # a pause point belongs to one segment, not the run
        values["train"] = {**values["train"], "stop_at": None}
    for section in (values, values.get("data")):
        if isinstance(section, dict) and section.get("data_dir"):
            if not Path(str(section["data_dir"])).is_dir():
                section["data_dir"] = None
    return values


def _box_text(text: str) -> str:
    """The message inside tyro's error box, as one line."""
    lines = []
    for line in text.splitlines():
        if line.strip().startswith("╭"):  # the box's title
            continue
        body = line.strip().strip("│╰╯─ ").strip()
        if body and not body.startswith("For full helptext"):
            lines.append(body)
    return " ".join(" ".join(lines).split())


def refuse_repeated_flags(args: list[str]) -> None:
    """A flag given twice is a :class:`ConfigError`: the parser would keep only the last one, so
    ``--set a=1 --set b=2`` would silently drop ``a=1``."""
    seen = set()
    for arg in args:
        if arg == "--":
            return
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0].replace("_", "-")  # --run_dir is --run-dir
        *section, name = flag.removeprefix("--").split(".")
        flag = "--" + ".".join([*section, name.removeprefix("no-")])  # --a.no-x sets --a.x
        if flag in seen:
            raise ConfigError(
                f"{flag} is given twice and only the last would count; give it once "
                f"(a flag taking several values takes them all after one {flag}: {flag} A B)"
            )
        seen.add(flag)


#: Fields a configuration takes from the one it sits in, so never command-line flags: an HKT
#: layer's width, heads and causality are its model's (:data:`structattn.hkt.model.FROM_MODEL`).
HIDDEN_FIELDS: dict[type, tuple[str, ...]] = {HKTConfig: FROM_MODEL}

FLAGS = tyro.constructors.ConstructorRegistry()
_hiding: set[type] = set()  # the types whose hidden fields are being looked up


@FLAGS.struct_rule
def _hide_fields(info):
    """tyro's own fields of a :data:`HIDDEN_FIELDS` type, those named there suppressed."""
    hidden = HIDDEN_FIELDS.get(info.type)
    if hidden is None or info.type in _hiding:
        return None
    _hiding.add(info.type)
    try:
        spec = tyro.constructors.ConstructorRegistry.get_struct_spec(info)
    finally:
        _hiding.discard(info.type)
    if not isinstance(spec, tyro.constructors.StructConstructorSpec):
        return spec
    fields = tuple(
        dataclasses.replace(f, type=Annotated[f.type, tyro.conf.Suppress]) if f.name in hidden
        else f
        for f in spec.fields
    )  # fmt: skip
    return dataclasses.replace(spec, fields=fields)


def parse_command(cls, args: list[str], prog: str, default=None, **kwargs):
    """``tyro.cli`` whose bad-input errors (an unknown flag, a value a dataclass rejects, a flag
    given twice) are one :class:`ConfigError` line instead of tyro's box; ``--help`` prints as
    tyro prints it."""
    refuse_repeated_flags(args)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            if default is not None:
                kwargs["default"] = default
            return tyro.cli(cls, args=args, prog=prog, registry=FLAGS, **kwargs)
    except SystemExit as stop:
        if stop.code in (0, None):
            sys.stderr.write(captured.getvalue())
            raise
        raise ConfigError(_box_text(captured.getvalue()) or f"{prog}: bad arguments") from None
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:  # a flag value its dataclass rejects
        raise ConfigError(str(err)) from None
