"""The one loader of the compiled C++ pieces: blockwise attention (``csrc/hkt_cpu.cpp``,
``impl="fused_cpp"``), one decoding step (``csrc/hkt_decode.cpp``) and the causal depthwise
convolution (``csrc/hkt_conv.cpp``), built together just in time as one extension.

The extension is compiled on first use by :func:`torch.utils.cpp_extension.load` (about a
minute on two cores, then cached under ``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``). Importing structattn never compiles anything. When no C++
compiler is found, the build fails, or ``STRUCTATTN_NO_CPP_KERNEL=1`` is set, :func:`cpu_kernel`
returns None after one one-line warning and the callers fall back to the PyTorch paths. A leaf
module: it imports nothing from structattn.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

__all__ = ["CSRC", "cpu_kernel", "cpu_kernel_error", "cpu_kernel_for", "header_hash"]

#: The C++ sources and their shared headers.
CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    CSRC / "hkt_cpu.cpp",
    CSRC / "hkt_cpu_lowp.cpp",
    CSRC / "hkt_decode.cpp",
    CSRC / "hkt_conv.cpp",
]
_HEADERS = [CSRC / "hkt_cpu_common.h", CSRC / "hkt_cpu_tiles.h"]
_NAME = "structattn_hkt_cpu"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "module" or "error", set once


def _build() -> ModuleType:
    if os.environ.get("STRUCTATTN_NO_CPP_KERNEL", "") not in ("", "0"):
        raise RuntimeError("disabled by STRUCTATTN_NO_CPP_KERNEL")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} not found on PATH)")
    if shutil.which("ninja") is None:  # the ninja wheel's binary, when its bin/ is not on PATH
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    from torch.utils import cpp_extension

    # The build is cached by a hash of the sources and flags; the header's hash goes into the
    # flags so that a changed header rebuilds too.
    flags = ["-O3", "-fopenmp", "-march=native", f"-DSTRUCTATTN_HEADER_HASH={header_hash()}"]
    with _build_lock(_build_directory()):
        return cpp_extension.load(
            name=_NAME,
            sources=[str(p) for p in _SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            verbose=os.environ.get("STRUCTATTN_VERBOSE_BUILD", "") not in ("", "0"),
        )


def _build_directory() -> Path | None:
    """Where torch builds and caches the extension (None if this torch does not say)."""
    from torch.utils import cpp_extension

    where = getattr(cpp_extension, "_get_build_directory", None)
    return None if where is None else Path(where(_NAME, False))


@contextmanager
def _build_lock(build_dir: Path | None):
    """Hold an OS lock on the build folder while torch loads or builds the extension, and
    clear a stale torch build lock inside it.

    torch marks a build in progress with a ``lock`` file and every later load waits for it to
    go, without limit; a process killed mid-build (Ctrl-C, SIGTERM, a timeout) leaves it behind
    and every later process would hang. This lock is released by the OS when its holder dies,
    so while it is held no other structattn process is building here and a ``lock`` file found
    is stale."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's own lock alone
        fcntl = None
    if build_dir is None or fcntl is None:
        yield
        return
    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / "structattn-build.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits for another process building here
        baton = build_dir / "lock"
        if baton.exists():
            baton.unlink()
            warnings.warn(
                f"structattn: removed a stale build lock ({baton}) left by a process stopped "
                "while building the C++ kernel",
                RuntimeWarning,
                stacklevel=4,
            )
        yield
    finally:
        os.close(fd)  # releases the lock


def header_hash() -> str:
    """The first 16 hex digits of the shared headers' SHA-1 (part of the build flags)."""
    return hashlib.sha1(b"".join(h.read_bytes() for h in _HEADERS)).hexdigest()[:16]


def cpu_kernel() -> ModuleType | None:
    """The compiled kernel module, building it on the first call; None when unavailable."""
    with _lock:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        if "error" in _state:
            return None
        try:
            _state["module"] = _build()
            return _state["module"]  # type: ignore[return-value]
        except Exception as exc:  # any build failure must leave the PyTorch paths working
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            _state["error"] = first
            warnings.warn(
                f"structattn: C++ HKT kernel unavailable ({first[:200]}); "
                "using the PyTorch implementation",
                RuntimeWarning,
                stacklevel=3,
            )
            return None


def cpu_kernel_for(x: Tensor) -> ModuleType | None:
    """The compiled module when ``x`` is a float32 / float64 CPU tensor (what the compiled
    decoding step and convolution take), else None (then callers use their PyTorch path)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return None
    return cpu_kernel()


def cpu_kernel_error() -> str | None:
    """Why the kernel is unavailable (after a failed :func:`cpu_kernel`), else None."""
    return _state.get("error")  # type: ignore[return-value]
