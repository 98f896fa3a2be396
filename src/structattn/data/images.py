"""Images as pixel sequences: CIFAR-10 python batches and IDX files (MNIST, Fashion-MNIST).

An image becomes a sequence of 8-bit levels in row-major order, ``T = H * W``: grey like LRA's
sequential CIFAR-10 (``0.2989 R + 0.5870 G + 0.1140 B``, rounded), or with ``rgb=True`` the three
channels interleaved pixel by pixel (``T = 3 * H * W``). Token id = level + 1 (0 is padding).
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np

from structattn.errors import DataError

__all__ = ["images_to_sequences", "read_cifar10", "read_idx", "CIFAR10_CLASSES", "FASHION_CLASSES"]

CIFAR10_CLASSES = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
]
FASHION_CLASSES = [
    "t-shirt",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "boot",
]
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped): magic ``0 0 dtype ndim``, big-endian int32 dims,
    then the data. Raises ``ValueError`` naming the file when it is malformed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"IDX file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as err:
        raise DataError(f"{path}: cannot read IDX file ({err})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(f"{path}: not an IDX file (bad magic number {raw[:4]!r})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise DataError(f"{path}: truncated IDX header")
    dims = tuple(int(x) for x in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - header != expected:
        raise DataError(
            f"{path}: IDX data has {len(raw) - header} bytes, header {dims} needs {expected}"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)


#: The only globals a CIFAR-10 python batch refers to: numpy's array (and scalar)
#: reconstruction under its old and new module names (``_frombuffer``: pickle protocol 5), the
#: byte-string decoding that protocol 2 uses for ``bytes``, and plain containers. Anything else
#: is refused before it can be called.
_CIFAR_GLOBALS = frozenset(
    [
        *(
            (module, name)
            for module in ("numpy.core.multiarray", "numpy._core.multiarray")
            for name in ("_reconstruct", "scalar")
        ),
        *((module, "_frombuffer") for module in ("numpy.core.numeric", "numpy._core.numeric")),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
        *(
            ("builtins", name)
            for name in ("dict", "list", "tuple", "set", "frozenset", "bytes", "bytearray")
        ),
    ]
)


class _BatchUnpickler(pickle.Unpickler):
    """Reads a pickle that holds only containers and numpy arrays; a pickle naming any other
    global (``os.system``, ``builtins.eval`` ...) is refused before anything of it runs."""

    def find_class(self, module: str, name: str):
        module = "builtins" if module == "__builtin__" else module  # pickled by Python 2
        if (module, name) not in _CIFAR_GLOBALS:
            raise pickle.UnpicklingError(
                f"refused global {module}.{name}: a CIFAR-10 batch holds only arrays and "
                "containers, so this file is not one (nothing in it was run)"
            )
        return super().find_class(module, name)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise FileNotFoundError(f"CIFAR-10 batch not found: {path}")
    try:
        with path.open("rb") as f:
            batch = _BatchUnpickler(f, encoding="bytes").load()
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except Exception as err:  # pickle raises many types on corrupt input
        raise DataError(
            f"{path}: not a CIFAR-10 python batch ({type(err).__name__}: {err})"
        ) from None
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise DataError(f"{path}: expected data (N, 3072) and N labels, got {data.shape}")
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels  # (N, 32, 32, 3)


def read_cifar10(root: str | Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Read ``cifar-10-batches-py``: ``{"train": (images, labels), "test": (...)}`` with images
    ``(N, 32, 32, 3)`` uint8."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"CIFAR-10 directory not found: {root}")
    parts = [_read_cifar_batch(root / f"data_batch_{i}") for i in range(1, 6)]
    train = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    return {"train": train, "test": _read_cifar_batch(root / "test_batch")}


def images_to_sequences(images: np.ndarray, rgb: bool = False) -> np.ndarray:
    """``(N, H, W)`` or ``(N, H, W, 3)`` uint8 -> token ids ``(N, T)`` int64 (level + 1)."""
    if images.ndim == 4 and not rgb:
        grey = images.astype(np.float64) @ np.array([0.2989, 0.5870, 0.1140])
        images = np.clip(np.rint(grey), 0, 255).astype(np.uint8)
    elif images.ndim == 3 and rgb:
        raise ValueError("rgb=True needs colour images (N, H, W, 3)")
    return images.reshape(len(images), -1).astype(np.int64) + 1
