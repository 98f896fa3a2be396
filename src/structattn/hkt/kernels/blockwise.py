"""One interface for the blockwise HKT kernels (in the style of flash-attention's interface).

A :class:`Backend` supplies three functions:

* ``prepare(q, v, stride, tiles) -> (work_dtype, tiles)``: checks that it can run here (device,
  build, supported stride / levels) and picks its tile sizes;
* ``forward(q, k, v, lam, key_mask, causal, stride, scale, tiles) -> (out, lse)``;
* ``backward(q, k, v, lam, key_mask, causal, stride, scale, tiles, out, lse, grad_out)
  -> (dq, dk, dv, dlam)``.

:func:`blockwise_attention` does everything else once, for every backend: the dropout refusal,
the dtype the kernel computes in, contiguous inputs, the attendable-key mask, levels that cannot
change the result (see below), and a single autograd Function (:class:`_BlockwiseHKT`) that saves
``out`` and the log-sum-exp for the backward pass.

Constant levels. A coarse level of length 1 (``stride^l >= T``) adds the same score
``lambda_l q^l_0 . k^l_0`` to every key of a query's row: softmax ignores it, and its gradients
are exactly 0 (``sum_j dS_ij = 0`` for every row). Such levels are not sent to the kernel, which
would otherwise need tiles that are multiples of ``stride^(L-1)`` however short ``T`` is; they
still receive their (zero) gradients, and NaN in them still reaches the output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..levels import attendable_keys, effective_levels

__all__ = ["Backend", "blockwise_attention"]


@dataclass(frozen=True)
class Backend:
    """A blockwise kernel: its name (the ``impl``) and its three functions. ``strided``: it
    reads q, k, v and the output gradient through their strides (rows must be contiguous), so
    a ``(B, T, H, d)`` projection seen as ``(B, H, T, d)`` is never copied; its outputs and
    gradients then come back in the layout of their inputs."""

    name: str
    prepare: Callable[..., tuple[torch.dtype, Any]]
    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[list[Tensor], list[Tensor], Tensor, Tensor]]
    strided: bool = False

    def layout(self, x: Tensor) -> Tensor:
        """``x`` as this backend reads it: as it is when strided and its rows are contiguous,
        else a contiguous copy."""
        if (
            self.strided
            and (x.shape[-1] <= 1 or x.stride(-1) == 1)
            and x.stride(-2) >= x.shape[-1]
            and min(x.stride()) >= 0
        ):
            return x
        return x.contiguous()


class _BlockwiseHKT(torch.autograd.Function):
    """The autograd Function of every blockwise backend."""

    @staticmethod
    def forward(ctx, backend, tiles, lam, v, key_mask, causal, stride, scale, *qk):
        L = len(qk) // 2
        q, k = list(qk[:L]), list(qk[L:])
        out, lse = backend.forward(q, k, v, lam, key_mask, causal, stride, scale, tiles)
        ctx.save_for_backward(lam, v, out, lse, *q, *k)
        ctx.args = (backend, tiles, key_mask, causal, stride, scale, L)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        lam, v, out, lse, *qk = ctx.saved_tensors
        backend, tiles, key_mask, causal, stride, scale, L = ctx.args
        q, k = list(qk[:L]), list(qk[L:])
        dq, dk, dv, dlam = backend.backward(
            q, k, v, lam, key_mask, causal, stride, scale, tiles, out, lse, backend.layout(grad_out)
        )
        return (None, None, dlam, dv, None, None, None, None, *dq, *dk)


def blockwise_attention(
    backend: Backend,
    q: list[Tensor],
    k: list[Tensor],
    v: Tensor,
    lam: Tensor,
    stride: int,
    causal: bool,
    key_padding_mask: Tensor | None,
    scale: float,
    dropout_p: float,
    tiles: Any = None,
) -> Tensor:
    """HKT attention by ``backend`` (inputs already validated by ``hkt_attention``)."""
    if dropout_p > 0:
        raise ValueError(
            f"impl={backend.name!r} does not implement attention dropout; use impl='sdpa'"
        )
    T = v.shape[-2]
    n = effective_levels(T, len(q), stride)
    work, tiles = backend.prepare(q[:n], v, stride, tiles)
    dtype = v.dtype
    qk = [backend.layout(x.to(work)) for x in (*q[:n], *k[:n])]
    lam_dtype = torch.float64 if work == torch.float64 else torch.float32  # weights in full
    out = _BlockwiseHKT.apply(
        backend,
        tiles,
        lam[:, :n].to(lam_dtype).contiguous(),
        backend.layout(v.to(work)),
        attendable_keys(key_padding_mask),
        causal,
        stride,
        float(scale),
        *qk,
    ).to(dtype)
    if n < len(q):  # constant levels: no effect on the output, exact zero gradients
        dropped = [x.sum() for x in (*q[n:], *k[n:])] + [lam[:, n:].sum()]
        out = out + 0.0 * torch.stack(dropped).sum().to(dtype)
    return out
