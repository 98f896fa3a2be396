"""HKT attention by the C++/OpenMP kernel (``csrc/hkt_cpu.cpp``, ``impl="fused_cpp"``), built
just in time by :mod:`.extension` (with the decoding step and the convolution).

The kernel computes float32 (vectorised) and float64 inputs in their dtype. bfloat16 and float16
inputs run the reduced-precision kernel (``csrc/hkt_cpu_lowp.cpp``: tile GEMMs on oneDNN's
batch-reduce GEMM, AMX or AVX-512 BF16 / FP16, float32 accumulation and softmax) where this CPU
runs that GEMM (:func:`lowp_route`), else they are computed in float32 and cast back.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..levels import round_tile
from .blockwise import Backend, blockwise_attention
from .extension import cpu_kernel, cpu_kernel_error

__all__ = ["CPP_BACKEND", "cpp_hkt_attention", "lowp_route"]

# Query x key tile, 256 x 256: against 128 x 256, forward + backward on 2 cores take
# 0.92-0.95x the time at d = 32 (T = 512 and 1024, bidirectional, B = 32), 0.94-0.96x at
# d = 64 causal (T = 1024 and 4096), 0.97-0.99x (noise) at d = 64 bidirectional.
DEFAULT_TILE_Q = 256
DEFAULT_TILE_K = 256
# The reduced-precision kernel's tile (its GEMMs are faster, the float32 passes over a tile a
# larger share): 128 x 128 against 256 x 256 at B = 8, H = 4, T = 1024, d = 32, causal, one
# thread, forward + backward in bfloat16 on AVX-512 BF16: 161 against 171 ms.
LOWP_TILE = 128


_REDUCED = (torch.bfloat16, torch.float16)


def lowp_route(dtype: torch.dtype) -> str | None:
    """How the C++ kernel computes ``dtype`` inputs on this CPU: ``"brgemm-amx"`` or
    ``"brgemm-avx512"`` (the reduced-precision kernel on AMX tiles or AVX-512 BF16 dot
    products), ``"float32"`` (a reduced dtype this CPU's GEMM does not run with the kernel's
    packed layout, or ``torch.backends.mkldnn`` turned off: computed in float32 and cast back),
    the dtype's own name for float32 / float64, or None without a kernel. Detected once at run
    time by two products on the batch-reduce GEMM. float16 runs the kernel only on AMX-FP16
    CPUs (oneDNN reads float16 in another layout on AVX-512 FP16 without AMX)."""
    kernel = cpu_kernel()
    if kernel is None:
        return None
    if dtype not in _REDUCED:
        return str(dtype).removeprefix("torch.")
    if not torch.backends.mkldnn.enabled:  # oneDNN's GEMM turned off by the user
        return "float32"
    return _reduced_route(kernel, dtype)


@functools.cache
def _reduced_route(kernel, dtype: torch.dtype) -> str:
    if not kernel.lowp_supported(torch.empty(0, dtype=dtype)):
        return "float32"
    if dtype == torch.float16:
        amx = torch.cpu._is_amx_fp16_supported()
    else:
        amx = torch.cpu._is_amx_tile_supported()
    return "brgemm-amx" if amx else "brgemm-avx512"


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.float32, torch.float64):
        return dtype
    if dtype in _REDUCED and lowp_route(dtype) != "float32":
        return dtype
    return torch.float32


def _cpp_prepare(q, v, stride, tiles):
    if v.device.type != "cpu":
        raise RuntimeError(f"impl='fused_cpp' runs on the CPU; got tensors on {v.device}")
    if cpu_kernel() is None:
        raise RuntimeError(f"the C++ HKT kernel is unavailable: {cpu_kernel_error()}")
    work = _work_dtype(v.dtype)
    default = (LOWP_TILE, LOWP_TILE) if work in _REDUCED else (DEFAULT_TILE_Q, DEFAULT_TILE_K)
    tile_q, tile_k = default if tiles is None else tiles
    tile_q, tile_k = tile_q or default[0], tile_k or default[1]
    return work, tuple(round_tile(t, len(q), stride) for t in (tile_q, tile_k))


def _cpp_forward(q, k, v, lam, key_mask, causal, stride, scale, tiles):
    return tuple(cpu_kernel().forward(q, k, v, lam, key_mask, causal, stride, scale, *tiles))


def _cpp_backward(q, k, v, lam, key_mask, causal, stride, scale, tiles, out, lse, grad_out):
    L = len(q)
    grads = cpu_kernel().backward(
        q, k, v, lam, key_mask, causal, stride, scale, *tiles, out, lse, grad_out
    )
    return grads[:L], grads[L : 2 * L], grads[2 * L], grads[2 * L + 1]


#: The C++/OpenMP kernel as a blockwise backend: float32, float64, and bfloat16 / float16 where
#: :func:`lowp_route` says the CPU runs them (else in float32, cast back).
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
    tile_q: int | None = None,
    tile_k: int | None = None,
) -> Tensor:
    """Registered as ``impl="fused_cpp"``; the contract of the other implementations.
    ``tile_q`` / ``tile_k``: the query x key tile (default: :data:`DEFAULT_TILE_Q` x
    :data:`DEFAULT_TILE_K`, :data:`LOWP_TILE` square for the reduced-precision kernel; rounded
    up to multiples of ``stride^(L-1)``).

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
        None if tile_q is None and tile_k is None else (tile_q, tile_k),
    )
