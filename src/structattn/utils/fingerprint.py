"""A content hash of data (tensors, arrays, strings, numbers and containers of them), so that a
run can tell whether it is given the data it started on; and the content hash of a file, with a
record that lets an unchanged file skip the read next time (:func:`file_sha256`)."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["file_sha256", "fingerprint"]


def _feed(h, x: Any) -> None:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        h.update(t.numpy().tobytes())
    elif isinstance(x, np.ndarray):
        h.update(f"A{x.dtype}{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    elif isinstance(x, str):
        data = x.encode("utf-8", "surrogatepass")
        h.update(b"S" + struct.pack("<Q", len(data)) + data)
    elif isinstance(x, bytes):
        h.update(b"B" + struct.pack("<Q", len(x)) + x)
    elif isinstance(x, dict):
        h.update(b"D" + struct.pack("<Q", len(x)))
        for key in sorted(x, key=repr):
            _feed(h, key)
            _feed(h, x[key])
    elif isinstance(x, list | tuple):
        h.update(b"L" + struct.pack("<Q", len(x)))
        for item in x:
            _feed(h, item)
    elif x is None or isinstance(x, bool | int | float):
        h.update(f"N{x!r};".encode())
    else:
        raise TypeError(f"cannot fingerprint a {type(x).__name__}")


def fingerprint(*parts: Any) -> str:
    """The SHA-256 (hex) of ``parts``: equal for equal content, whatever object holds it."""
    h = hashlib.sha256()
    _feed(h, list(parts))
    return h.hexdigest()


#: Bytes read per call while hashing a file.
CHUNK = 1 << 24


def _file_stat(path: Path) -> dict[str, Any]:
    """What identifies one version of a file without reading it: its resolved path, device,
    inode, size, and modification and status-change times (ns). The kernel sets the
    status-change time on every write and on every ``utime``, so a content change that keeps
    the size and resets the modification time still changes this record."""
    st = path.stat()
    return {"path": str(path.resolve()), "device": st.st_dev, "inode": st.st_ino,
            "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}  # fmt: skip


def _sha256_stream(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def file_sha256(path: str | Path, known: Any = None) -> tuple[str, dict[str, Any]]:
    """The SHA-256 (hex) of a file's whole content, read in chunks, and the record that lets a
    later call skip the read: ``(digest, record)``, ``record`` being the file's stat
    (:func:`_file_stat`) plus ``"sha256"``. ``known`` is a record kept from an earlier call:
    while the file's stat equals it (path, inode, size, modification and status-change
    times), its digest is returned without reading the file; any difference reads the whole
    file again. A file that changes while it is read is an ``OSError``."""
    path = Path(path)
    stat = _file_stat(path)
    if isinstance(known, dict) and isinstance(known.get("sha256"), str):
        if all(known.get(k) == v for k, v in stat.items()):
            return known["sha256"], dict(known)
    digest = _sha256_stream(path)
    if _file_stat(path) != stat:
        raise OSError(f"{path} changed while it was read; read it again once it is written")
    return digest, {**stat, "sha256": digest}
