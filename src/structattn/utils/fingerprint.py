"""A content hash of data (tensors, arrays, strings, numbers and containers of them), so that a
run can tell whether it is given the data it started on."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np
import torch

__all__ = ["fingerprint"]


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
