"""Trainable causal downsampling between HKT resolution levels.

    X^l = GELU(LayerNorm(DWConv_l(X^{l-1}))),   T_l = ceil(T_{l-1} / s)

``DWConv_l`` is a depthwise ``Conv1d`` with kernel ``k``, stride ``s`` and ``k - 1`` zeros of
left padding. Output ``c`` then reads input positions ``c*s - k + 1 ... c*s``, so the coarse token
``c`` at level ``l`` depends only on fine positions ``<= c * s^l``: broadcast back to the fine
positions ``c*s^l ... (c+1)*s^l - 1`` it never sees the future.

Shapes: ``(B, T, D) -> (B, ceil(T / s), D)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .kernels.extension import cpu_kernel_for

__all__ = ["CausalDownsample", "CausalDepthwiseConv", "autocast_copy", "level_input"]


def _conv_kernel(x: Tensor):
    """The compiled convolution for ``x`` (CPU, float32 or float64 -- bfloat16 / float16 are
    computed in float32 --, not under tracing or compilation, :attr:`CausalDepthwiseConv.cpp`
    True), or None."""
    if not CausalDepthwiseConv.cpp or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return None
    if x.dtype in (torch.bfloat16, torch.float16):
        return cpu_kernel_for(x.new_empty(0, dtype=torch.float32))
    return cpu_kernel_for(x)


class _CompiledCausalConv(torch.autograd.Function):
    """``(B, T, D) -> (B, ceil(T / s), D)`` through ``kernels/csrc/hkt_conv.cpp`` (first
    derivatives)."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, kernel):
        # ``x`` may be bfloat16 / float16: the kernel computes in ``weight``'s dtype (float32),
        # and the input is saved as given and widened again in backward -- the widening is
        # exact, so the gradients are those of a float32 copy without keeping one alive.
        D, _, K = weight.shape
        w = weight.detach().reshape(D, K).contiguous()
        b = bias.detach() if bias is not None else w.new_empty(0)
        if x.shape[2] > 1 and x.stride(2) != 1:
            x = x.contiguous()
        ctx.save_for_backward(x, w)
        ctx.stride, ctx.kernel, ctx.has_bias = stride, kernel, bias is not None
        return kernel.causal_dwconv_forward(x.to(w.dtype), w, b, stride)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gx, gw, gb = ctx.kernel.causal_dwconv_backward(x.to(w.dtype), w, grad, ctx.stride)
        gx = gx.to(x.dtype)
        return gx, gw.view(w.shape[0], 1, w.shape[1]), gb if ctx.has_bias else None, None, None


def _bias(bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if bias is None else bias.to(dtype)


def _autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The reduced dtype autocast gives a float32 ``x``'s matrix products, or None."""
    kind = x.device.type
    if x.dtype != torch.float32 or not torch.amp.is_autocast_available(kind):
        return None
    if not torch.is_autocast_enabled(kind):
        return None
    dtype = torch.get_autocast_dtype(kind)
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


class _Fork(torch.autograd.Function):
    """One reduced-precision copy of ``x`` read by two consumers: two outputs over one storage,
    whose gradients are summed in ``x``'s dtype (autograd would sum them in the copy's)."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = x.dtype
        low = x.to(dtype)
        return low, low.view_as(low)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_a, grad_b):
        parts = [g.to(ctx.dtype) for g in (grad_a, grad_b) if g is not None]
        return (parts[0] + parts[1] if len(parts) == 2 else parts[0]), None


def autocast_copy(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(for_projections, for_levels)``: under autocast, one bfloat16 / float16 copy of a
    float32 ``x`` shared by the layer's projections (autocast would make the same copy) and
    its level path, so that no float32 ``x`` stays alive for backward; else ``(x, x)``."""
    dtype = _autocast_dtype(x)
    if dtype is None:
        return x, x
    if torch.is_grad_enabled() and x.requires_grad:
        return _Fork.apply(x, dtype)
    low = x.to(dtype)
    return low, low


def level_input(x: Tensor) -> Tensor:
    """What the level path reads of ``x`` in :func:`autocast_copy`, in ``x``'s dtype (the
    rounding is exact to widen): decoding rounds each new token as the full pass does."""
    dtype = _autocast_dtype(x)
    return x if dtype is None else x.to(dtype).to(x.dtype)


class CausalDepthwiseConv(nn.Module):
    """Depthwise ``Conv1d`` over time with ``kernel_size - 1`` left zeros: output ``t`` reads
    inputs ``t*stride - kernel_size + 1 ... t*stride`` only.

    Args:
        channels: ``D``, one filter per channel.
        kernel_size: ``k >= 1``.
        stride: ``1`` keeps the length, ``s`` gives ``ceil(T / s)`` outputs.
        bias: learn a per-channel bias (default True).

    Shapes: ``(B, T, D) -> (B, ceil(T / stride), D)``.
    """

    def __init__(self, channels: int, kernel_size: int, stride: int = 1, bias: bool = True):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        self.kernel_size = kernel_size
        self.stride = stride
        self.conv = nn.Conv1d(
            channels, channels, kernel_size, stride=stride, groups=channels, bias=bias
        )

    #: On the CPU in float32 / float64, run the compiled convolution
    #: (``kernels/csrc/hkt_conv.cpp``, one pass over the (B, T, D) layout forward and
    #: backward); False: always ``conv2d`` (the reference it is tested against; also the path
    #: for double backward).
    cpp: bool = True

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[1] == 0:  # no time steps: no outputs (conv2d refuses an empty input)
            return x.new_zeros(x.shape[0], 0, x.shape[2])
        kernel = _conv_kernel(x)
        if kernel is not None:
            dtype = x.dtype  # a reduced dtype (bfloat16 autocast) is computed in float32
            work = dtype if dtype in (torch.float32, torch.float64) else torch.float32
            y = _CompiledCausalConv.apply(
                x, self.conv.weight.to(work), _bias(self.conv.bias, work), self.stride, kernel
            )
            return y.to(dtype)
        B, T, D = x.shape
        K, s = self.kernel_size, self.stride
        # (B, T, D) memory is (B, D, 1, T) in channels-last layout: the depthwise kernel reads it
        # in place (no transposed copies in or out). Padding K - 1 on both sides and keeping the
        # first ceil(T / s) outputs is the causal convolution (output c reads inputs
        # c*s - K + 1 ... c*s); the outputs past them are never used.
        xc = x.unsqueeze(1).permute(0, 3, 1, 2)  # (B, D, 1, T), channels-last strides
        w = self.conv.weight.view(D, 1, 1, K)
        y = F.conv2d(xc, w, self.conv.bias, stride=(1, s), padding=(0, K - 1), groups=D)
        return y[..., : -(-T // s)].squeeze(2).transpose(1, 2)  # (B, ceil(T / s), D)


class CausalDownsample(nn.Module):
    """One level step of HKT: causal depthwise strided conv, LayerNorm, GELU.

    Args:
        d_model: ``D``.
        kernel_size: depthwise kernel ``k`` (default 3).
        stride: ``s >= 2`` (default 2).
    """

    def __init__(self, d_model: int, kernel_size: int = 3, stride: int = 2):
        super().__init__()
        if stride < 2:
            raise ValueError(f"stride must be >= 2, got {stride}")
        self.conv = CausalDepthwiseConv(d_model, kernel_size, stride)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.norm(self.conv(x)))  # (B, ceil(T / s), D)
