"""Resumable checkpoints written atomically: a kill mid-write never leaves a broken one.

Layout of ``<run_dir>/checkpoints/``::

    step-00000300/model.safetensors     weights (safetensors)
    step-00000300/state.pt              optimizer, scheduler, step, RNG states, best metric
    latest                              name of the newest complete checkpoint

A checkpoint is written into a temporary folder and renamed into place (``os.replace`` of a
folder is atomic); ``latest`` is rewritten the same way. ``best.safetensors`` beside the
checkpoints holds the weights with the best validation accuracy.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

__all__ = [
    "atomic_save_weights",
    "latest_checkpoint",
    "load_checkpoint",
    "load_weights",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
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


def atomic_save_weights(model: nn.Module, path: Path) -> None:
    """Write ``model``'s weights to ``path`` (safetensors) through a temporary file + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(_weights(model), tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _tied_names(model: nn.Module) -> set[str]:
    by_storage: dict[int, list[str]] = {}
    for name, t in model.state_dict().items():
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    return {n for names in by_storage.values() if len(names) > 1 for n in names}


def load_weights(model: nn.Module, path: Path) -> None:
    """Load safetensors weights; only tied duplicates may be absent from the file."""
    missing, unexpected = model.load_state_dict(load_file(str(path)), strict=False)
    untied_missing = sorted(set(missing) - _tied_names(model))
    if untied_missing or unexpected:
        raise ValueError(f"{path}: missing {untied_missing}, unexpected {unexpected}")


def rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
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
    adapters need not be copied at every checkpoint)."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    final = ckpt_dir / name
    tmp = Path(tempfile.mkdtemp(dir=ckpt_dir, prefix=f".{name}."))
    try:
        weights = _weights(model)
        if only_trainable:
            keep_names = {n for n, p in model.named_parameters() if p.requires_grad}
            weights = {k: v for k, v in weights.items() if k in keep_names}
        save_file(weights, str(tmp / "model.safetensors"))
        torch.save({"step": step, **extra}, tmp / "state.pt")
        os.chmod(tmp, 0o755)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    fd, tmp_latest = tempfile.mkstemp(dir=ckpt_dir, prefix=".latest.")
    with os.fdopen(fd, "w") as f:
        f.write(name + "\n")
    os.chmod(tmp_latest, 0o644)
    os.replace(tmp_latest, ckpt_dir / "latest")
    steps = sorted(p for p in ckpt_dir.glob("step-*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    pointer = Path(ckpt_dir) / "latest"
    if not pointer.is_file():
        return None
    path = Path(ckpt_dir) / pointer.read_text().strip()
    return path if (path / "state.pt").is_file() else None


def load_checkpoint(path: Path, model: nn.Module, partial: bool = False) -> dict[str, Any]:
    """Load weights into ``model`` and return the saved state (optimizer, scheduler, RNG...).
    ``partial``: the file holds a subset (``only_trainable``); unknown names still fail."""
    if partial:
        _, unexpected = model.load_state_dict(
            load_file(str(Path(path) / "model.safetensors")), strict=False
        )
        if unexpected:
            raise ValueError(f"{path}: unexpected weights {unexpected}")
    else:
        load_weights(model, Path(path) / "model.safetensors")
    return torch.load(Path(path) / "state.pt", weights_only=False)
