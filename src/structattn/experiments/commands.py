"""What the training commands share (``structattn train``, ``lm``, ``glfusion train``): an
experiment file and a preset choose the defaults, every other flag overrides them."""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from structattn.engine.config import find_config, load_config, preset_from_args

__all__ = ["PresetCommand"]


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
        """The command with the preset that ``args`` choose as its defaults."""
        config, preset = preset_from_args(args, cls.default_config)
        return cls(config, preset, load_config(cls.config_class, config, preset))

    def announce(self) -> None:
        """Say which file and preset the run uses (stderr)."""
        print(f"config: {find_config(self.config)} [{self.preset}]", file=sys.stderr)
