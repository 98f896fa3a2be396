"""The C++/OpenMP HKT kernels (``csrc/hkt_cpu.cpp``: attention; ``csrc/hkt_decode.cpp``: one
decoding step; ``csrc/hkt_conv.cpp``: the causal depthwise convolution), built just in time.

The kernel is compiled on first use by :func:`torch.utils.cpp_extension.load` (about a minute on
two cores, then cached under ``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``).
Importing structattn never compiles anything. When no C++ compiler is found, the build fails, or
``STRUCTATTN_NO_CPP_KERNEL=1`` is set, :func:`cpu_kernel` returns None after one one-line
warning and the callers fall back to the PyTorch paths.

The kernel computes in float32 (vectorised) or float64; other floating dtypes are computed in
float32 and cast back by :func:`cpp_hkt_attention`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from .blockwise import Backend, blockwise_attention, round_tile

__all__ = ["CPP_BACKEND", "cpp_hkt_attention", "cpu_kernel", "cpu_kernel_error", "cpu_kernel_for"]

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "hkt_cpu.cpp", _CSRC / "hkt_decode.cpp", _CSRC / "hkt_conv.cpp"]
_HEADER = _CSRC / "hkt_cpu_common.h"
_NAME = "structattn_hkt_cpu"
# Query x key tile. 256 x 256 against the earlier 128 x 256, forward + backward on 2 cores:
# 0.92-0.95x the time at d = 32 (T = 512 and 1024, bidirectional, B = 32), 0.94-0.96x at
# d = 64 causal (T = 1024 and 4096), 0.97-0.99x (noise) at d = 64 bidirectional.
DEFAULT_TILE_Q = 256
DEFAULT_TILE_K = 256

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
    from torch.utils.cpp_extension import load

    # The build is cached by a hash of the sources and flags; the header's hash goes into the
    # flags so that a changed header rebuilds too.
    header = hashlib.sha1(_HEADER.read_bytes()).hexdigest()[:16]
    flags = ["-O3", "-fopenmp", "-march=native", f"-DSTRUCTATTN_HEADER_HASH={header}"]
    return load(
        name=_NAME,
        sources=[str(p) for p in _SOURCES],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        verbose=os.environ.get("STRUCTATTN_VERBOSE_BUILD", "") not in ("", "0"),
    )


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


def _cpp_prepare(q, v, stride, tiles):
    if v.device.type != "cpu":
        raise RuntimeError(f"impl='fused_cpp' runs on the CPU; got tensors on {v.device}")
    if cpu_kernel() is None:
        raise RuntimeError(f"the C++ HKT kernel is unavailable: {cpu_kernel_error()}")
    work = v.dtype if v.dtype in (torch.float32, torch.float64) else torch.float32
    tile_q, tile_k = tiles if tiles is not None else (DEFAULT_TILE_Q, DEFAULT_TILE_K)
    return work, tuple(round_tile(t, len(q), stride) for t in (tile_q, tile_k))


def _cpp_forward(q, k, v, lam, key_mask, causal, stride, scale, tiles):
    return tuple(cpu_kernel().forward(q, k, v, lam, key_mask, causal, stride, scale, *tiles))


def _cpp_backward(q, k, v, lam, key_mask, causal, stride, scale, tiles, out, lse, grad_out):
    L = len(q)
    grads = cpu_kernel().backward(
        q, k, v, lam, key_mask, causal, stride, scale, *tiles, out, lse, grad_out
    )
    return grads[:L], grads[L : 2 * L], grads[2 * L], grads[2 * L + 1]


#: The C++/OpenMP kernel as a blockwise backend. It computes in float32 or float64; other
#: floating dtypes are computed in float32 and cast back.
CPP_BACKEND = Backend("fused_cpp", _cpp_prepare, _cpp_forward, _cpp_backward, strided=True)


def cpp_hkt_attention(
    q,
    k,
    v: Tensor,
    lam: Tensor,
    stride: int,
    causal: bool,
    key_padding_mask: Tensor | None,
    scale: float,
    dropout_p: float,
    tile_q: int = DEFAULT_TILE_Q,
    tile_k: int = DEFAULT_TILE_K,
) -> Tensor:
    """Registered as ``impl="fused_cpp"``; the contract of the other implementations.

    Raises:
        RuntimeError: when the kernel cannot be built (see :func:`cpu_kernel_error`) or the
            inputs are not on the CPU.
        ValueError: for ``dropout_p > 0`` (not implemented by the fused kernels).
    """
    return blockwise_attention(
        CPP_BACKEND,
        q,
        k,
        v,
        lam,
        stride,
        causal,
        key_padding_mask,
        scale,
        dropout_p,
        (tile_q, tile_k),
    )
