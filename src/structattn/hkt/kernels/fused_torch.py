"""Blockwise ("flash") HKT attention: coarse scores computed once per block, no upsampled copies.

For a query tile and a key tile the fused scores are the fine scores plus, for every coarse
level ``l``, the tile's coarse scores ``lambda_l Q^l K^l^T`` (computed at coarse resolution, a
``1/s^(2l)`` share of the work) broadcast over their ``s^l x s^l`` blocks. Softmax is taken
online (running max and sum), ``A V`` uses the unpadded ``V``, and the backward pass recomputes
each tile from the saved log-sum-exp (:mod:`.blockwise` holds the autograd Function): the
gradient of a coarse score is the block sum of the fine score gradient. Memory is O(T) plus one
tile.

Shapes as in :mod:`structattn.hkt.interface`. Tiles are multiples of ``s^(L-1)`` so coarse
blocks never straddle a tile boundary. This readable tile loop (``impl="fused_torch"``, batched
over B and H) is the specification of the compiled kernels: ``csrc/hkt_cpu.cpp``
(``impl="fused_cpp"``, :mod:`.fused_cpp`) and ``_triton_hkt.py`` (``impl="fused_triton"``,
:mod:`.fused_triton`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..levels import round_tile
from .blockwise import Backend, blockwise_attention

__all__ = ["TORCH_BACKEND", "fused_hkt_attention"]

DEFAULT_TILE = 256


def _acc_dtype(x: Tensor) -> torch.dtype:
    """float64 stays float64; everything else accumulates in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _tile_size(T: int, n_levels: int, stride: int, tile: int) -> int:
    return round_tile(min(tile, T), n_levels, stride)


def _expand(coarse: Tensor, factor: int, rows: int, cols: int) -> Tensor:
    """``(..., r, c) -> (..., rows, cols)`` by repeating each entry ``factor`` times per axis."""
    if factor == 1:
        return coarse[..., :rows, :cols]
    out = coarse.repeat_interleave(factor, dim=-2).repeat_interleave(factor, dim=-1)
    return out[..., :rows, :cols]


def _block_sum(fine: Tensor, factor: int, rows: int, cols: int) -> Tensor:
    """Adjoint of :func:`_expand`: sum ``fine (..., R, C)`` over ``factor x factor`` blocks."""
    if factor == 1:
        return fine
    R, C = fine.shape[-2:]
    pad_r, pad_c = rows * factor - R, cols * factor - C
    fine = torch.nn.functional.pad(fine, (0, pad_c, 0, pad_r))
    return fine.unflatten(-1, (cols, factor)).unflatten(-3, (rows, factor)).sum((-1, -3))


def _tile_scores(q, k, lam, scale, i0, i1, j0, j1, stride):
    """Fused scores of query rows ``i0:i1`` and key columns ``j0:j1`` ``(B, H, ni, nj)``, the fine
    scores and the per-level coarse score tiles (the last two for the backward pass)."""
    fine = (q[0][:, :, i0:i1] @ k[0][:, :, j0:j1].transpose(-1, -2)) * scale
    s = lam[:, 0].view(1, -1, 1, 1) * fine
    coarse = []
    for l in range(1, len(q)):
        f = stride**l
        ci0, ci1 = i0 // f, (i1 - 1) // f + 1
        cj0, cj1 = j0 // f, (j1 - 1) // f + 1
        c = (q[l][:, :, ci0:ci1] @ k[l][:, :, cj0:cj1].transpose(-1, -2)) * scale
        coarse.append(c)
        weighted = lam[:, l].view(1, -1, 1, 1) * c
        ni, nj = i1 - i0, j1 - j0
        if ni % f == 0 and nj % f == 0:  # add by broadcasting over the blocks, no expanded copy
            B, H = s.shape[:2]
            s.view(B, H, ni // f, f, nj // f, f).add_(weighted[:, :, :, None, :, None])
        else:  # the ragged last tile
            s = s + _expand(weighted, f, ni, nj)
    return s, fine, coarse


def _tile_mask(i0, i1, j0, j1, causal, key_mask, device):
    """``(B or 1, 1, ni, nj)`` bool of allowed pairs, or None when all are allowed."""
    allowed = None
    if causal and j1 - 1 > i0:
        rows = torch.arange(i0, i1, device=device)[:, None]
        cols = torch.arange(j0, j1, device=device)[None, :]
        allowed = (cols <= rows)[None, None]
    if key_mask is not None:
        km = key_mask[:, None, None, j0:j1]
        allowed = km if allowed is None else allowed & km
    return allowed


def _torch_prepare(q, v, stride, tile):
    tile = DEFAULT_TILE if tile is None else tile
    return v.dtype, _tile_size(v.shape[-2], len(q), stride, tile)


def _torch_forward(q, k, v, lam, key_mask, causal, stride, scale, tile):
    """Online softmax over (query tile, key tile) pairs; returns ``(out, lse)``."""
    B, H, T, dv = v.shape
    acc_dtype = _acc_dtype(v)
    out = torch.zeros_like(v)
    lse = torch.empty(B, H, T, dtype=acc_dtype, device=v.device)
    for i0 in range(0, T, tile):
        i1 = min(i0 + tile, T)
        m = torch.full((B, H, i1 - i0, 1), -math.inf, dtype=acc_dtype, device=v.device)
        denom = torch.zeros_like(m)
        acc = torch.zeros(B, H, i1 - i0, dv, dtype=acc_dtype, device=v.device)
        for j0 in range(0, i1 if causal else T, tile):
            j1 = min(j0 + tile, T)
            s, _, _ = _tile_scores(q, k, lam, scale, i0, i1, j0, j1, stride)
            s = s.to(acc_dtype)
            allowed = _tile_mask(i0, i1, j0, j1, causal, key_mask, v.device)
            if allowed is not None:
                s = s.masked_fill(~allowed, -math.inf)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - safe)
            corr = torch.exp(m - safe)
            denom = denom * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + p @ v[:, :, j0:j1].to(acc_dtype)
            m = m_new
        out[:, :, i0:i1] = (acc / denom.clamp_min(1e-30)).to(v.dtype)
        row_lse = m + denom.clamp_min(1e-30).log()
        # rows with no admissible key (padded queries): +inf makes their recomputed P zero
        lse[:, :, i0:i1] = torch.where(denom > 0, row_lse, math.inf).squeeze(-1)
    return out, lse


def _torch_backward(q, k, v, lam, key_mask, causal, stride, scale, tile, out, lse, grad_out):
    """Recomputes each tile's probabilities from ``lse``; returns ``(dq, dk, dv, dlam)``."""
    L = len(q)
    B, H, T, _ = v.shape
    acc = _acc_dtype(v)
    dq = [torch.zeros_like(x, dtype=acc) for x in q]
    dk = [torch.zeros_like(x, dtype=acc) for x in k]
    dv = torch.zeros_like(v, dtype=acc)
    dlam = torch.zeros(H, L, dtype=acc, device=v.device)
    go = grad_out.to(acc)
    delta = (go * out.to(acc)).sum(-1, keepdim=True)  # (B, H, T, 1)
    for i0 in range(0, T, tile):
        i1 = min(i0 + tile, T)
        for j0 in range(0, i1 if causal else T, tile):
            j1 = min(j0 + tile, T)
            s, fine, coarse = _tile_scores(q, k, lam, scale, i0, i1, j0, j1, stride)
            s = s.to(acc)
            allowed = _tile_mask(i0, i1, j0, j1, causal, key_mask, v.device)
            if allowed is not None:
                s = s.masked_fill(~allowed, -math.inf)
            p = torch.exp(s - lse[:, :, i0:i1, None])  # (B, H, ni, nj)
            dv[:, :, j0:j1] += p.transpose(-1, -2) @ go[:, :, i0:i1]
            dp = go[:, :, i0:i1] @ v[:, :, j0:j1].to(acc).transpose(-1, -2)
            ds = p * (dp - delta[:, :, i0:i1])  # d(loss)/d(fused score)
            dlam[:, 0] += (ds * fine.to(acc)).sum((0, 2, 3))
            ds0 = ds * lam[:, 0].view(1, -1, 1, 1).to(acc) * scale
            dq[0][:, :, i0:i1] += ds0 @ k[0][:, :, j0:j1].to(acc)
            dk[0][:, :, j0:j1] += ds0.transpose(-1, -2) @ q[0][:, :, i0:i1].to(acc)
            for l in range(1, L):
                f = stride**l
                c = coarse[l - 1]
                dc = _block_sum(ds, f, c.shape[-2], c.shape[-1])  # d/d(coarse score)
                dlam[:, l] += (dc * c.to(acc)).sum((0, 2, 3))
                dc = dc * lam[:, l].view(1, -1, 1, 1).to(acc) * scale
                ri = slice(i0 // f, i0 // f + c.shape[-2])
                rj = slice(j0 // f, j0 // f + c.shape[-1])
                dq[l][:, :, ri] += dc @ k[l][:, :, rj].to(acc)
                dk[l][:, :, rj] += dc.transpose(-1, -2) @ q[l][:, :, ri].to(acc)
    dq = [g.to(x.dtype) for g, x in zip(dq, q)]
    dk = [g.to(x.dtype) for g, x in zip(dk, k)]
    return dq, dk, dv.to(v.dtype), dlam.to(lam.dtype)


#: The PyTorch tile loop as a blockwise backend (the readable specification of the kernels).
TORCH_BACKEND = Backend("fused_torch", _torch_prepare, _torch_forward, _torch_backward)


def fused_hkt_attention(
    q, k, v, lam, stride, causal, key_padding_mask, scale, dropout_p, tile: int = DEFAULT_TILE
):
    """Registered as ``impl="fused_torch"``; same contract as the other implementations."""
    return blockwise_attention(
        TORCH_BACKEND, q, k, v, lam, stride, causal, key_padding_mask, scale, dropout_p, tile
    )
