"""Writing files and folders so that a reader never sees half of one and two writers never
share a temporary name: each write goes to a name unique to the process (``tempfile``) in the
target's own folder, then is renamed over the target (``os.replace``, atomic on one file
system)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_dir", "atomic_path"]


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary file name beside ``path``; when the block ends without an error
    the file written there replaces ``path``, otherwise it is removed. The parent folder is
    created if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _sibling_dir(path: Path, suffix: str) -> Path:
    return Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix))


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``path``; when the block ends without an error it
    takes the place of ``path`` (an existing ``path`` is removed first), otherwise it is removed.

    Two processes may build the same folder at once: the one that renames last wins, and as a
    folder is only ever renamed whole, ``path`` always holds one complete build."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling_dir(path, ".tmp")
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        for _ in range(10):
            try:
                os.replace(tmp, path)
                break
            except OSError:  # a folder is in the way (an older build): move it aside, retry
                if not path.is_dir():
                    raise
                aside = _sibling_dir(path, ".old")
                try:
                    os.replace(path, aside / "old")
                except FileNotFoundError:
                    pass  # another process moved it meanwhile
                shutil.rmtree(aside, ignore_errors=True)
        else:
            raise OSError(f"could not rename {tmp} to {path}: another process keeps replacing it")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_generated_modules() -> None:
    """Remove the Python files torch_geometric writes to the temporary folder for each message
    passing class a process builds (``<module>_<Class>_propagate_<random>.py``, never deleted by
    it): at exit, when the modules loaded from them are no longer needed. Only files of this
    process's own loaded modules are removed."""
    import sys

    tmp = Path(tempfile.gettempdir()).resolve()
    for name, module in list(sys.modules.items()):
        origin = getattr(getattr(module, "__spec__", None), "origin", None)
        if not origin or not name.endswith(("_propagate", "_edge_updater")):
            continue
        path = Path(origin)
        if path.parent.resolve() == tmp and path.name.startswith(f"{name}_"):
            path.unlink(missing_ok=True)
