"""HKT attention by the C++/OpenMP kernel (``csrc/hkt_cpu.cpp``, ``impl="fused_cpp"``), built
just in time by :mod:`.extension` (with the decoding step and the convolution).

The kernel computes in float32 (vectorised) or float64; other floating dtypes are computed in
float32 and cast back by :func:`cpp_hkt_attention`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..levels import round_tile
from .blockwise import Backend, blockwise_attention
from .extension import cpu_kernel, cpu_kernel_error

__all__ = ["CPP_BACKEND", "cpp_hkt_attention"]

# Query x key tile. 256 x 256 against the earlier 128 x 256, forward + backward on 2 cores:
# 0.92-0.95x the time at d = 32 (T = 512 and 1024, bidirectional, B = 32), 0.94-0.96x at
# d = 64 causal (T = 1024 and 4096), 0.97-0.99x (noise) at d = 64 bidirectional.
DEFAULT_TILE_Q = 256
DEFAULT_TILE_K = 256


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
