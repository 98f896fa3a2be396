"""HKT attention as Triton kernels (``impl="fused_triton"``), for CUDA GPUs.

The kernels (:mod:`._triton_hkt`) are imported on first use, so structattn never needs Triton
to import. They run on CUDA tensors, or on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before the first call), which is how the test suite checks them
without a GPU. Supported: strides that are powers of two, up to four levels, any T, causal or
bidirectional, key padding, float32 / bfloat16 / float16 (float32 accumulation) and float64.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

from .blockwise import Backend, blockwise_attention

__all__ = ["TRITON_BACKEND", "triton_available", "triton_hkt_attention", "triton_supports"]

MAX_LEVELS = 4


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def triton_available() -> bool:
    """Triton is installed and there is a device it can run on (CUDA, or the interpreter)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or _interpreting()


def triton_supports(n_levels: int, stride: int) -> bool:
    """The kernels need ``stride`` a power of two and at most :data:`MAX_LEVELS` levels."""
    return n_levels <= MAX_LEVELS and stride >= 2 and stride & (stride - 1) == 0


def _pow2(n: int, floor: int) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _tiles(n_levels: int, stride: int, interpret: bool, block: int | None) -> int:
    """Square tiles: a power of two, a multiple of ``stride^(L-1)``; on a GPU each coarse tile
    keeps at least 16 rows (the smallest ``tl.dot``)."""
    coarsest = stride ** (n_levels - 1)
    if block is None:
        block = max(64, 16 * coarsest) if not interpret else max(16, 4 * coarsest)
    if block & (block - 1) or block % coarsest:
        raise ValueError(
            f"the Triton tile {block} must be a power of two and a multiple of "
            f"stride^(L-1) = {coarsest}"
        )
    return block


def _triton_prepare(q, v, stride, block):
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("impl='fused_triton' needs Triton (pip install triton)")
    interpret = _interpreting()
    if v.device.type != "cuda" and not interpret:
        raise RuntimeError(
            f"impl='fused_triton' runs on CUDA tensors (got {v.device}); on the CPU set "
            "TRITON_INTERPRET=1 before the first call to run it in Triton's interpreter"
        )
    L = len(q)
    if not triton_supports(L, stride):
        raise ValueError(
            f"impl='fused_triton' supports strides that are powers of two and at most "
            f"{MAX_LEVELS} levels (got stride={stride}, L={L}); use impl='fused_torch'"
        )
    return v.dtype, _tiles(L, stride, interpret, block)


def _triton_forward(q, k, v, lam, key_mask, causal, stride, scale, block):
    from . import _triton_hkt as K

    L = len(q)
    B, H, T, DV = v.shape
    meta = _meta(q, v, L, stride, causal, key_mask, block)
    out = torch.empty_like(v)
    lse = torch.empty(B, H, T, dtype=torch.float32 if v.dtype != torch.float64 else v.dtype,
                      device=v.device)  # fmt: skip
    grid = (triton_cdiv(T, block), B * H)
    K.hkt_fwd_kernel[grid](
        *_levels(q, k), v, lam, meta["km"], out, lse,
        *meta["lengths"], H, meta["D"], DV, scale, **meta["const"],
    )  # fmt: skip
    return out, lse


def _triton_backward(q, k, v, lam, key_mask, causal, stride, scale, block, out, lse, grad_out):
    from . import _triton_hkt as K

    L = len(q)
    B, H, T, DV = v.shape
    meta = _meta(q, v, L, stride, causal, key_mask, block)
    delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # (B, H, T)
    dq = [torch.zeros_like(x) for x in q]
    dk = [torch.zeros_like(x) for x in k]
    dv = torch.zeros_like(v)
    nkb = triton_cdiv(T, block)
    dlam = torch.zeros(B * H, nkb, L, dtype=lse.dtype, device=v.device)
    common = (*meta["lengths"], H, meta["D"], DV, scale)
    K.hkt_bwd_dkdv_kernel[(nkb, B * H)](
        *_levels(q, k), v, lam, meta["km"], lse, delta, grad_out,
        *_pad4(dk), dv, dlam, *common, nkb, **meta["const"],
    )  # fmt: skip
    K.hkt_bwd_dq_kernel[(triton_cdiv(T, block), B * H)](
        *_levels(q, k), v, lam, meta["km"], lse, delta, grad_out,
        *_pad4(dq), *common, **meta["const"],
    )  # fmt: skip
    return dq, dk, dv, dlam.view(B, H, nkb, L).sum((0, 2)).to(lam.dtype)


#: The Triton kernels as a blockwise backend (CUDA, or Triton's interpreter on the CPU).
TRITON_BACKEND = Backend("fused_triton", _triton_prepare, _triton_forward, _triton_backward)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad4(xs: list[Tensor]) -> list[Tensor]:
    """Pointers for four levels; levels past L repeat level 0 and are never touched."""
    return list(xs) + [xs[0]] * (MAX_LEVELS - len(xs))


def _levels(q: list[Tensor], k: list[Tensor]) -> list[Tensor]:
    qs, ks = _pad4(q), _pad4(k)
    return [t for pair in zip(qs, ks) for t in pair]


def _meta(q, v, L, stride, causal, key_mask, block) -> dict:
    import triton.language as tl

    lengths = [x.shape[2] for x in q] + [1] * (MAX_LEVELS - L)  # T, T1, T2, T3
    D = q[0].shape[-1]
    # coarse tile sizes; levels past L get a placeholder (never used)
    cm = [block // stride**l if l < L else 16 for l in range(1, MAX_LEVELS)]
    const = dict(
        L=L,
        S=stride,
        CAUSAL=causal,
        HAS_MASK=key_mask is not None,
        BM=block,
        BN=block,
        BD=_pow2(D, 16),
        BDV=_pow2(v.shape[-1], 16),
        CM1=cm[0],
        CN1=cm[0],
        CM2=cm[1],
        CN2=cm[1],
        CM3=cm[2],
        CN3=cm[2],
        ACC=tl.float64 if v.dtype == torch.float64 else tl.float32,
    )
    km = key_mask.to(torch.int8) if key_mask is not None else v.new_empty(1, dtype=torch.int8)
    return dict(lengths=lengths, D=D, const=const, km=km)


def triton_hkt_attention(
    q,
    k,
    v: Tensor,
    lam: Tensor,
    stride: int,
    causal: bool,
    key_padding_mask: Tensor | None,
    scale: float,
    dropout_p: float,
    block: int | None = None,
) -> Tensor:
    """Registered as ``impl="fused_triton"``; the contract of the other implementations.

    Raises:
        RuntimeError: when Triton is not installed, or the tensors are on the CPU without
            ``TRITON_INTERPRET=1``.
        ValueError: for ``dropout_p > 0``, a stride that is not a power of two, more than four
            levels, or a bad ``block``.
    """
    return blockwise_attention(
        TRITON_BACKEND, q, k, v, lam, stride, causal, key_padding_mask, scale, dropout_p, block
    )
