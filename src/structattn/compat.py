"""Run folders and experiment files written by earlier versions of the library, read as today's:
the one place that knows their older layouts (it imports nothing of the library, so the engine
and the model packages can call it).

* GL-Fusion runs wrote their results to ``results.json`` where every run now writes
  ``final.json``.
* ``model`` sections held HKT's options (``n_levels``, ``stride``, ...) at the top level; they now
  live under ``model.hkt``.
* A config key added later reads, in a folder saved before it, as the behaviour that folder was
  trained with: each config class lists those keys in ``SAVED_DEFAULTS`` (e.g. GL-Fusion's
  ``variant: paper``), applied by ``structattn.engine.config.with_saved_defaults``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["EARLIER_FINAL", "FLAT_HKT_KEYS", "final_file", "nest_flat_hkt_keys"]

#: Where GL-Fusion runs of earlier versions wrote their results.
EARLIER_FINAL = "results.json"

#: HKT keys that older ``model`` sections held at their top level, now under ``model.hkt``.
FLAT_HKT_KEYS = (
    "n_levels",
    "stride",
    "hybrid",
    "downsample_kernel",
    "conv_kernel",
    "beta_init",
    "impl",
)


def final_file(folder: Path, final: Path) -> Path:
    """The results file of the run in ``folder``: ``final`` (``final.json``), or the earlier
    versions' file when only that one exists."""
    earlier = folder / EARLIER_FINAL
    return earlier if not final.is_file() and earlier.is_file() else final


def nest_flat_hkt_keys(values: dict) -> dict:
    """A ``model`` mapping with the flat HKT keys of older files moved under ``hkt`` (the
    nested ones win where both are given)."""
    values = dict(values)
    flat = {k: values.pop(k) for k in FLAT_HKT_KEYS if k in values}
    if flat:
        values["hkt"] = {**flat, **dict(values.get("hkt") or {})}
    return values
