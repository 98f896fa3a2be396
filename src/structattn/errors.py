"""Errors about what a user gave (a config, a data file, a run directory).

The command line turns these, and only these, into one line naming the problem; any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["ConfigError", "DataError", "RunError", "UserError"]


class UserError(ValueError):
    """Bad input: the message names the key, file or run directory at fault."""


class ConfigError(UserError):
    """A configuration value, key, preset or file that cannot be used."""


class DataError(UserError):
    """A data file or source that cannot be read (the message names the file and line)."""


class RunError(UserError):
    """A run directory that cannot be started, resumed or evaluated as asked."""
