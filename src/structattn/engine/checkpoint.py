"""Resumable checkpoints written atomically: a kill mid-write never leaves a broken one.

Layout of ``<run_dir>/checkpoints/``::

    step-00000300/model.safetensors     weights (safetensors)
    step-00000300/state.pt              optimizer, scheduler, step, RNG states, best metric
    latest                              name of the newest complete checkpoint

A checkpoint is written into a temporary folder and renamed into place (``os.replace`` of a
folder is atomic); ``latest`` is rewritten the same way. ``best.safetensors`` beside the
checkpoints holds the weights with the best validation accuracy.

:func:`load_latest_valid` resumes from the newest checkpoint that loads and holds finite
weights; a damaged one (truncated, unreadable, non-finite, or a broken ``latest`` pointer) is
reported with a warning naming the file and renamed ``damaged-step-*`` (never deleted), and the
one before it is tried. :func:`remove_litter` deletes what interrupted writes leave behind.

Weights are only ever loaded finite: :func:`load_weights` refuses a file holding NaN or
infinities, naming the first such tensor. A write that fails (a full disk, a folder that
cannot be written) is one :class:`~structattn.errors.RunError` naming the path and the free
space left, whatever layer (torch, safetensors, the OS) reported it.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from structattn.errors import RunError
from structattn.utils.files import atomic_path

__all__ = [
    "atomic_save_weights",
    "atomic_write_text",
    "checkpoint_dirs",
    "load_latest_valid",
    "remove_litter",
    "latest_checkpoint",
    "load_checkpoint",
    "load_weights",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "weights_metadata",
    "writing",
]


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    # safetensors refuses shared storage: keep the first name of each tied tensor.
    seen, out = set(), {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous().cpu()
    return out


def _saved_weights(model: nn.Module, only_trainable: bool) -> dict[str, torch.Tensor]:
    """The weights a file holds: all, or only the parameters that require grad."""
    weights = _weights(model)
    if only_trainable:
        keep = {n for n, p in model.named_parameters() if p.requires_grad}
        weights = {k: v for k, v in weights.items() if k in keep}
    return weights


def _free_space(path: Path) -> tuple[str, Path | None]:
    """The free space of the disk holding ``path`` (its nearest existing folder), readable,
    and that folder."""
    folder = Path(path).absolute()
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        free = float(shutil.disk_usage(folder).free)
    except OSError:
        return "unknown space", None
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if free < 1024 or unit == "TiB":
            break
        free /= 1024
    return (f"{free:.0f} {unit}" if unit == "B" else f"{free:.1f} {unit}"), folder


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Writes to ``path`` inside the block: a failure of the OS, torch's or safetensors' writer
    (a full disk, a folder that cannot be written) is one :class:`RunError` naming ``path`` and
    the free space left on its disk."""
    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as err:
        if isinstance(err, OSError) and err.strerror:
            reason = err.strerror
        else:
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            reason = (lines[0] if lines else type(err).__name__)[:200]
        free, folder = _free_space(path)
        where = f" on the disk of {folder}" if folder is not None else ""
        raise RunError(
            f"the disk or folder could not be written: {path} ({reason}); {free} free{where}: "
            "free some space, or choose another run_dir (--resume continues from the last "
            "checkpoint)"
        ) from None


def atomic_save_weights(
    model: nn.Module,
    path: Path,
    only_trainable: bool = False,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``model``'s weights (``only_trainable``: just those that require grad) to ``path``
    (safetensors, with ``metadata`` in its header) through a temporary file + rename; a failed
    write is a :class:`RunError` (see :func:`writing`)."""
    weights = _saved_weights(model, only_trainable)
    with writing(path), atomic_path(path) as tmp:
        save_file(weights, str(tmp), metadata=metadata)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file + rename (never half-written); a
    failed write is a :class:`RunError` (see :func:`writing`)."""
    with writing(path), atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        f.write(text)


def _tied_names(model: nn.Module) -> set[str]:
    by_storage: dict[int, list[str]] = {}
    for name, t in model.state_dict().items():
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    return {n for names in by_storage.values() if len(names) > 1 for n in names}


def load_weights(model: nn.Module, path: Path, partial: bool = False) -> None:
    """Load safetensors weights; only tied duplicates may be absent from the file (``partial``:
    any may be, as in an ``only_trainable`` file); unknown names always fail, and so does a
    file holding NaN or infinities (``ValueError`` naming the first such tensor)."""
    weights = load_file(str(path))
    _check_finite(weights, Path(path))
    _apply(model, weights, Path(path), partial)


def _check_finite(weights: dict[str, torch.Tensor], path: Path) -> None:
    """A ``ValueError`` naming ``path`` and its first floating-point tensor holding NaN or
    infinities, if any does."""
    bad = [k for k, t in weights.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise ValueError(f"{path} holds non-finite weights (NaN or inf) in {bad[0]!r}{more}")


def weights_metadata(path: Path) -> dict[str, str]:
    """The metadata in a safetensors file's header (empty when it has none)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def rng_state() -> dict[str, Any]:
    """Every generator's state in types that ``torch.load(weights_only=True)`` reads: numpy's
    key array travels as a tensor, so a state file never needs numpy's unpickling."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((kind, keys.astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    ckpt_dir: Path,
    step: int,
    model: nn.Module,
    extra: dict[str, Any],
    keep: int = 2,
    only_trainable: bool = False,
) -> Path:
    """Atomically write checkpoint ``step`` and point ``latest`` at it; prune old ones.

    ``only_trainable`` stores just the parameters that require grad (a frozen base LM with
    adapters need not be copied at every checkpoint). A failed write leaves the checkpoints
    before it as they were and is a :class:`RunError` (see :func:`writing`)."""
    ckpt_dir = Path(ckpt_dir)
    name = f"step-{step:08d}"
    final = ckpt_dir / name
    weights = _saved_weights(model, only_trainable)
    with writing(final):
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=ckpt_dir, prefix=f".{name}."))
        try:
            save_file(weights, str(tmp / "model.safetensors"))
            torch.save({"step": step, **extra}, tmp / "state.pt")
            os.chmod(tmp, 0o755)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        _write_pointer(ckpt_dir, name)
    steps = sorted(p for p in ckpt_dir.glob("step-*") if p.is_dir() and _STEP_DIR.match(p.name))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


_STEP_DIR = re.compile(r"^step-(\d{8})$")


def checkpoint_dirs(ckpt_dir: Path) -> list[Path]:
    """Complete-looking checkpoint folders (``step-*`` with both files), newest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The folder ``latest`` names when it is complete, else the newest complete folder."""
    ckpt_dir = Path(ckpt_dir)
    pointer = ckpt_dir / "latest"
    if pointer.is_file():
        try:
            name = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        path = ckpt_dir / name
        if _STEP_DIR.match(name) and (path / "state.pt").is_file():
            return path
    for path in checkpoint_dirs(ckpt_dir):
        if (path / "state.pt").is_file() and (path / "model.safetensors").is_file():
            return path
    return None


def _numpy_globals() -> list[Any]:
    """What numpy's pickled arrays need (state files written before the RNG state travelled as
    tensors hold numpy's key array): array reconstruction and dtypes, nothing that runs code."""
    from numpy import dtypes

    core = getattr(np, "_core", None) or np.core
    found = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    return found + [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")]


def _load_state(state_file: Path) -> Any:
    """``state.pt`` through ``torch.load(weights_only=True)``: tensors, numbers, strings and
    containers (plus numpy arrays of older files); a file holding any other object is refused
    before it can run (a pickled ``__reduce__`` never executes)."""
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(state_file, weights_only=True, map_location="cpu")


def _load_error(err: Exception) -> str:
    """One line for an error of :func:`_load_state`: for an object ``weights_only`` refuses,
    what was refused, without torch's advice to turn the safe loading off (never followed here:
    a state file is data)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        advice = ("(1)", "(2)", "Check the documentation")
        found = [line for line in lines[1:] if not line.startswith(advice)]
        cause = " ".join(found).removeprefix("WeightsUnpickler error:").strip()
        cause = cause.split(". ")[0].rstrip(".")  # the refused object, not how to allow it
        return f"it holds an object that is not training state: {cause[:300]}"
    return f"{type(err).__name__}: {' '.join(lines)[:300]}"


def _read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Weights and state of one checkpoint, checked: both files readable, the step matches the
    folder name, every floating-point weight finite. Raises ``ValueError`` saying what is wrong."""
    weights_file, state_file = path / "model.safetensors", path / "state.pt"
    for f in (weights_file, state_file):
        if not f.is_file():
            raise ValueError(f"{f} is missing")
    try:
        weights = load_file(str(weights_file))
    except Exception as err:  # safetensors raises its own error types for damaged files
        raise ValueError(f"{weights_file} cannot be read ({type(err).__name__}: {err})") from None
    try:
        state = _load_state(state_file)
    except Exception as err:  # truncated zip, unpickling errors, a refused object, ...
        raise ValueError(f"{state_file} cannot be read ({_load_error(err)})") from None
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{state_file} holds no training state")
    expected = int(path.name.split("-")[1])
    if state["step"] != expected:
        raise ValueError(f"{state_file} holds step {state['step']}, not {expected}")
    _check_finite(weights, weights_file)
    return weights, state


def _apply(model: nn.Module, weights: dict[str, torch.Tensor], path: Path, partial: bool):
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as err:  # shape mismatches: a different model, not a damaged file
        raise ValueError(f"{path} does not fit this model: {str(err).splitlines()[-1]}") from None
    if unexpected:
        raise ValueError(f"{path}: unexpected weights {unexpected[:5]}")
    if not partial:
        untied = sorted(set(missing) - _tied_names(model))
        if untied:
            raise ValueError(f"{path}: missing weights {untied[:5]}")


def load_latest_valid(
    ckpt_dir: Path, model: nn.Module, partial: bool = False, quarantine: bool = True
) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest checkpoint that reads and checks out into ``model``; return its folder
    and saved state, or ``None`` when there is no checkpoint folder at all.

    A damaged checkpoint is named in a ``RuntimeWarning``, renamed ``damaged-<name>`` (kept for
    inspection, never deleted) and the previous one is tried. If every checkpoint is damaged a
    ``ValueError`` lists them; nothing is loaded into ``model`` from a checkpoint that failed.
    A checkpoint that reads but does not fit ``model`` raises ``ValueError`` at once.
    ``quarantine=False`` (other ranks of a multi-process run) renames and repairs nothing."""
    ckpt_dir = Path(ckpt_dir)
    # Newest folder first, whatever ``latest`` says: a folder is only ever renamed into place
    # complete, and a kill between that rename and the pointer update leaves the pointer behind.
    candidates = checkpoint_dirs(ckpt_dir)
    if not candidates:
        return None
    problems = []
    for path in candidates:
        try:
            weights, state = _read_checkpoint(path)
        except ValueError as err:
            problems.append(str(err))
            if quarantine:
                target = path.with_name(f"damaged-{path.name}")
                if not target.exists():
                    os.replace(path, target)
                warnings.warn(
                    f"checkpoint {path} is damaged ({err}); moved to {target.name}, "
                    "trying the previous one",
                    RuntimeWarning,
                    stacklevel=2,
                )
            continue
        _apply(model, weights, path, partial)
        if quarantine and latest_checkpoint(ckpt_dir) != path:  # repair the pointer
            _write_pointer(ckpt_dir, path.name)
        return path, state
    raise ValueError(f"no usable checkpoint in {ckpt_dir}: " + "; ".join(problems))


def _write_pointer(ckpt_dir: Path, name: str) -> None:
    fd, tmp_latest = tempfile.mkstemp(dir=ckpt_dir, prefix=".latest.")
    with os.fdopen(fd, "w") as f:
        f.write(name + "\n")
    os.chmod(tmp_latest, 0o644)
    os.replace(tmp_latest, Path(ckpt_dir) / "latest")


def remove_litter(run_dir: Path) -> list[Path]:
    """Delete what interrupted atomic writes leave: ``checkpoints/.step-*`` folders,
    ``.latest.*`` and ``.*.tmp`` files. Returns what was removed."""
    run_dir = Path(run_dir)
    removed = []
    patterns = [run_dir / "checkpoints", run_dir]
    for folder in patterns:
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if p.name.startswith(".step-") and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.name.startswith(".latest.") or (
                p.name.startswith(".") and p.name.endswith(".tmp")
            ):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
            else:
                continue
            removed.append(p)
    return removed


def load_checkpoint(path: Path, model: nn.Module, partial: bool = False) -> dict[str, Any]:
    """Load one checkpoint's weights into ``model`` and return its saved state (optimizer,
    scheduler, RNG...). ``partial``: the file holds a subset (``only_trainable``).
    Raises ``ValueError`` naming the file when it is damaged."""
    weights, state = _read_checkpoint(Path(path))
    _apply(model, weights, Path(path), partial)
    return state
