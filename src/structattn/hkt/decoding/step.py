"""The decoding step of a causal :class:`~structattn.hkt.HKTAttention` layer: the prefill that
fills an :class:`~.cache.HKTLayerCache` from the prompt's forward pass, and one token per
sequence at a time after it, each output equal to the full forward pass's at that position.

Two steps compute the same updates and sums: the PyTorch step (:func:`step`, the path with
gradients and the reference) and the compiled step (``kernels/csrc/hkt_decode.cpp``,
:func:`step_cpp`), which runs for steps without gradients or dropout with every sequence at one
position, on CPU float32 / float64 tensors, unless the layer was built with
``cpp_decode=False`` or the call runs inside ``use_compiled_step(False)``.

Shapes as in :mod:`.cache`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..downsample import level_input
from ..kernels.extension import cpu_kernel_for
from .cache import (
    DecodeWeights,
    HKTLayerCache,
    check_made_for,
    decode_attention,
    grow,
    one_length,
    prompt_lengths,
)

#: What the functions below take as ``layer``: an :class:`~structattn.hkt.HKTAttention` (not
#: imported: the layer imports this module).
HKTAttention = nn.Module

__all__ = ["decode", "decode_weights", "prefill", "step", "step_cpp", "use_compiled_step"]

_COMPILED = contextvars.ContextVar("structattn_hkt_compiled_step", default=True)


@contextlib.contextmanager
def use_compiled_step(enabled: bool) -> Iterator[None]:
    """Within the block, decoding steps may run the compiled step (``enabled=True``, the
    default outside any block) or always run the PyTorch step (``False``: the reference the
    compiled one is tested against). Layers built with ``cpp_decode=False`` never run it."""
    token = _COMPILED.set(bool(enabled))
    try:
        yield
    finally:
        _COMPILED.reset(token)


def _decode_kernel(layer: HKTAttention, x: Tensor):
    """The compiled decoding step for ``x``'s device and dtype (CPU, float32 or float64), or
    None: then the PyTorch step runs (and always when the layer's ``cpp_decode`` is False or
    inside ``use_compiled_step(False)``)."""
    if not (layer.cpp_decode and _COMPILED.get()):
        return None
    return cpu_kernel_for(x)


def _tail(x: Tensor, lengths: Tensor, width: int) -> Tensor:
    """Rows ``lengths[b] - width .. lengths[b] - 1`` of ``x[b]`` (zeros before row 0):
    ``x (B, T, D) -> (B, width, D)``."""
    B, T, D = x.shape
    idx = lengths[:, None] - width + torch.arange(width, device=x.device)  # (B, width)
    rows = x.gather(1, idx.clamp(0, max(T - 1, 0))[..., None].expand(B, width, D))
    return rows.masked_fill((idx < 0)[..., None], 0.0)


def _depthwise_last(inputs: Tensor, conv: nn.Conv1d) -> Tensor:
    """The causal depthwise convolution's output for the last of ``inputs (B, k, D)``, which
    hold the inputs ``t - k + 1 .. t`` it reads: ``(B, D)``."""
    w = conv.weight[:, 0, :].transpose(0, 1)  # (k, D)
    out = (inputs * w).sum(1)
    out = out if conv.bias is None else out + conv.bias
    return out.to(inputs.dtype)  # as the full pass: computed in the weights' dtype, cast back


def prefill(
    layer: HKTAttention,
    xs: list[Tensor],
    q: list[Tensor],
    k: list[Tensor],
    v_flat: Tensor,
    key_padding_mask: Tensor | None,
) -> HKTLayerCache:
    """The cache after the prompt: rows past each sequence's length are left as computed
    (they are never read before being overwritten)."""
    cfg = layer.config
    B, T, D = v_flat.shape
    s = cfg.stride
    lengths = prompt_lengths(key_padding_mask, B, T, v_flat.device)
    bidx = torch.arange(B, device=v_flat.device)
    queries, windows = [], []
    for l in range(cfg.n_levels):
        last_block = (lengths - 1) // s**l  # (B,) the current block of level l
        queries.append(q[l][bidx, :, last_block])  # (B, H, d)
        if l < cfg.n_levels - 1:  # inputs c*s - k + 1 .. c*s - 1 of level l+1's next token
            window = _tail(xs[l], -(-lengths // s**l), cfg.downsample_kernel - 1)
            windows.append(window.to(layer.v_proj.weight.dtype))  # autocast's copy, widened
    conv_window = _tail(v_flat, lengths, cfg.conv_kernel - 1) if cfg.hybrid else None
    return HKTLayerCache(
        keys=[t.clone(memory_format=torch.contiguous_format) for t in k],
        queries=queries,
        windows=windows,
        values=layer._heads(v_flat).clone(memory_format=torch.contiguous_format),
        conv_window=conv_window,
        lengths=lengths.clone(),
        scores=[None] * cfg.n_levels,
        stride=s,
        made_for=(layer.v_proj.weight.dtype, layer.v_proj.weight.device),
    )


def decode(layer: HKTAttention, x: Tensor, cache: HKTLayerCache) -> Tensor:
    """The next ``T`` tokens of every sequence, one at a time: ``x (B, T, D)``."""
    check_made_for(cache.made_for, layer.v_proj.weight)
    if x.shape[0] != cache.lengths.shape[0]:
        raise ValueError(
            f"the cache holds {cache.lengths.shape[0]} sequences, got a batch of {x.shape[0]}"
        )
    outs = [step(layer, x[:, t], cache) for t in range(x.shape[1])]
    if not outs:
        return x.new_zeros(x.shape)
    return torch.stack(outs, dim=1)


def step(layer: HKTAttention, x: Tensor, cache: HKTLayerCache) -> Tensor:
    """One token per sequence at positions ``cache.lengths``: ``x (B, D) -> (B, D)``.

    Level ``l`` gets a new coarse token where ``pos % s^l == 0``; its query then replaces
    the block's query and its key is written at row ``pos // s^l``."""
    cfg = layer.config
    B, D = x.shape
    H, d, s, L = cfg.n_heads, cfg.head_dim, cfg.stride, cfg.n_levels
    pos = cache.lengths  # (B,) index of the new token
    n = pos + 1
    n_max = int(n.max())
    # Read keys 0 .. T0 - 1 with T0 a multiple of s^(L-1): every level then holds exactly
    # T0 / s^l rows and the coarse-to-fine sum is a reshape (rows past n are masked).
    span = s ** (L - 1)
    T0 = -(-n_max // span) * span
    params = _step_weights(layer, x, cache)
    qkv = F.linear(x, params.weight, params.bias)  # level 0's Q, K, V: one GEMM
    aligned = one_length(n, n_max)
    # the compiled step computes in one dtype: not under autocast, whose GEMM made qkv bfloat16
    one_dtype = qkv.dtype == x.dtype
    if aligned and one_dtype and not torch.is_grad_enabled() and layer.attn_drop_p() == 0:
        kernel = _decode_kernel(layer, x)
        if kernel is not None:
            return step_cpp(layer, kernel, x, qkv, cache, n, n_max - 1, T0, params)
    coarse, w, beta = params.coarse, params.w, params.beta
    q0, k0, v = qkv.split(D, dim=-1)
    tok = level_input(x)  # the level path's input, rounded under autocast as in the full pass
    values = grow(cache.values, T0)
    if aligned:
        p = n_max - 1
        top = _new_coarse_tokens_aligned(layer, tok, q0, k0, cache, p, T0, coarse)
        values[:, :, p] = v.view(B, H, d)
        n_used: Tensor | int = n_max  # one length: rows past it are sliced off, not masked
    else:
        top = _new_coarse_tokens(layer, tok, q0, k0, cache, pos, T0, coarse)
        values[torch.arange(B, device=x.device), :, pos] = v.view(B, H, d)
        n_used = n
    cache.values = values

    acc = _step_scores(cache, w, top, T0, s, L)
    o = decode_attention(acc, n_used, cache.values[:, :, :T0], layer.attn_drop_p())
    o = o.reshape(B, D)

    if cfg.hybrid:
        o = _step_hybrid(layer, cache, v, o, beta)
    cache.lengths = n
    return layer.out_dropout(layer.o_proj(o))


def _step_weights(layer: HKTAttention, x: Tensor, cache: HKTLayerCache) -> DecodeWeights:
    """The concatenated weights for a step: made once per cache (the keys it holds were made
    with these parameters too), and every step while a gradient may flow to them."""
    live = torch.is_grad_enabled() and any(p.requires_grad for p in layer.parameters())
    params = cache.params
    if live or params is None or params.weight.dtype != x.dtype:
        params = decode_weights(layer, x.dtype)
        cache.params = None if live else params
    return params


def _step_scores(cache: HKTLayerCache, w: Tensor, top: int, T0: int, s: int, L: int) -> Tensor:
    """Scores ``(B, H, T0)`` of the new queries against keys 0 .. T0 - 1, levels summed coarse
    to fine, reusing (and updating) the cached sums of the levels that kept their query."""
    # acc_l[c] = lambda_l q_l . K_l[c] + acc_{l+1}[c // s], S[j] = acc_0[j]; lambda and the
    # scale (w) go on the queries (d numbers each instead of T). Levels above ``top`` kept
    # their query and keys since the last step, so their acc_l is the cached one: a step
    # reads level l's keys once per s^l tokens, not every token.
    acc = None
    for l in reversed(range(L)):
        kept = cache.scores[l]
        if l > top and kept is not None and kept.shape[-1] == T0 // s**l:
            acc = kept
            continue
        q_l = (cache.queries[l] * w[:, l, None])[:, :, None, :]  # (B, H, 1, d)
        s_l = (q_l @ cache.keys[l][:, :, : T0 // s**l].transpose(-1, -2)).squeeze(-2)
        if acc is not None:  # (B, H, T_l) += upsampled (B, H, T_l / s), in place
            s_l.unflatten(-1, (-1, s)).add_(acc[..., None])
        if l > 0:
            cache.scores[l] = s_l
        acc = s_l
    return acc


def _step_hybrid(
    layer: HKTAttention, cache: HKTLayerCache, v: Tensor, o: Tensor, beta: Tensor
) -> Tensor:
    """The hybrid head's mix of attention ``o (B, D)`` and the causal convolution of the values,
    whose window in ``cache`` moves on by the new value ``v (B, D)``."""
    inputs = torch.cat([cache.conv_window, v[:, None]], dim=1)  # (B, k_conv, D)
    cache.conv_window = inputs[:, 1:]
    conv = _depthwise_last(inputs, layer.conv.conv)
    return torch.lerp(conv, o, beta.to(o.dtype))


def step_cpp(
    layer: HKTAttention,
    kernel,
    x: Tensor,
    qkv: Tensor,
    cache: HKTLayerCache,
    n: Tensor,
    pos: int,
    T0: int,
    params: DecodeWeights,
) -> Tensor:
    """:func:`step` for sequences at one position, without gradients or dropout, as one
    call of the compiled step (``kernels/csrc/hkt_decode.cpp``, the same updates and sums)."""
    cfg = layer.config
    L, s = cfg.n_levels, cfg.stride
    if params.kernel_args is None:  # first compiled step with these weights: once
        params.kernel_args = _kernel_args(layer, params.coarse, x.dtype)
    coarse_w, coarse_b, down_w, down_b, ln_w, ln_b, eps, conv_w, conv_b, empty = params.kernel_args
    cache.values = grow(cache.values, T0)
    cache.keys = [grow(t, T0 // s**l) for l, t in enumerate(cache.keys)]
    hybrid = cache.conv_window is not None
    out = kernel.decode_step(
        x,
        qkv,
        pos,
        T0,
        s,
        cache.keys,
        cache.queries,
        cache.windows,
        cache.values,
        cache.conv_window if hybrid else empty,
        [empty if t is None else t for t in cache.scores],
        coarse_w,
        coarse_b,
        down_w,
        down_b,
        ln_w,
        ln_b,
        eps,
        params.w,
        params.beta if hybrid else empty,
        conv_w,
        conv_b,
    )
    cache.queries = out[1 : 1 + L]
    cache.windows = out[1 + L : 2 * L]
    if hybrid:
        cache.conv_window = out[2 * L]
    cache.scores = [None, *out[2 * L + 2 :]]
    cache.lengths = n
    return layer.out_dropout(layer.o_proj(out[0]))


def decode_weights(layer: HKTAttention, dtype: torch.dtype) -> DecodeWeights:
    """Level 0's Q, K, V weights and biases concatenated, every coarse level's Q and K
    weights and biases concatenated, the level weights times the score scale ``(H, L)``
    and beta per channel ``(D,)``."""
    cfg = layer.config

    def fused(group: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
        weight = torch.cat([m.weight for m in group]).to(dtype)
        if group[0].bias is None:
            return weight, None
        return weight, torch.cat([m.bias for m in group]).to(dtype)

    weight, bias = fused([layer.q_proj[0], layer.k_proj[0], layer.v_proj])
    coarse = [fused([layer.q_proj[l], layer.k_proj[l]]) for l in range(1, cfg.n_levels)]
    w = layer.level_weights().to(dtype) * (1.0 / math.sqrt(cfg.head_dim))
    beta = layer.beta().to(dtype).repeat_interleave(cfg.head_dim)
    return DecodeWeights(weight, bias, coarse, w, beta)


def _kernel_args(
    layer: HKTAttention, coarse: list[tuple[Tensor, Tensor | None]], dtype: torch.dtype
):
    """The compiled step's arguments beyond :func:`decode_weights`: the coarse weights and
    biases as lists, per downsampling level its conv weight ``(D, k)``, conv bias,
    LayerNorm weight, bias and eps, then the hybrid head's conv weight ``(D, k)`` and bias,
    and an empty tensor (which stands for every absent one)."""
    hybrid = layer.config.hybrid
    empty = torch.empty(0, dtype=dtype, device=layer.v_proj.weight.device)

    def vector(t: Tensor | None) -> Tensor:
        return empty if t is None else t.detach().to(dtype).contiguous()

    def conv_weight(conv: nn.Conv1d) -> Tensor:
        return conv.weight.detach()[:, 0, :].to(dtype).contiguous()  # (D, k)

    downs = list(layer.downsample)
    return (
        [c[0] for c in coarse],
        [empty if c[1] is None else c[1] for c in coarse],
        [conv_weight(m.conv.conv) for m in downs],
        [vector(m.conv.conv.bias) for m in downs],
        [vector(m.norm.weight) for m in downs],
        [vector(m.norm.bias) for m in downs],
        [float(m.norm.eps) for m in downs],
        conv_weight(layer.conv.conv) if hybrid else empty,
        vector(layer.conv.conv.bias) if hybrid else empty,
        empty,
    )


def _new_coarse_tokens(
    layer: HKTAttention,
    x: Tensor,
    q0: Tensor,
    k0: Tensor,
    cache: HKTLayerCache,
    pos: Tensor,
    T0: int,
    coarse: list[tuple[Tensor, Tensor | None]],
) -> int:
    """Queries, keys and windows of every level for tokens at positions ``pos (B,)``:
    level ``l`` gets a coarse token where ``pos % s^l == 0`` (per sequence). Returns the
    highest level where some sequence got a new query."""
    cfg = layer.config
    B, _ = x.shape
    H, d, s, L = cfg.n_heads, cfg.head_dim, cfg.stride, cfg.n_levels
    bidx = torch.arange(B, device=x.device)
    tok, new = x, torch.ones(B, dtype=torch.bool, device=x.device)
    for l in range(L):
        if l > 0:
            down = layer.downsample[l - 1]
            inputs = torch.cat([cache.windows[l - 1], tok[:, None]], dim=1)  # (B, k, D)
            keep = new[:, None, None]
            cache.windows[l - 1] = torch.where(keep, inputs[:, 1:], cache.windows[l - 1])
            new = new & (pos % s**l == 0)
            if not bool(new.any()):
                for m in range(l, L):  # no new coarse token: only make room
                    cache.keys[m] = grow(cache.keys[m], T0 // s**m)
                return l - 1
            tok = _depthwise_last(inputs, down.conv.conv)  # (B, D)
            tok = F.gelu(down.norm(tok))
        if l > 0:
            q_l, k_l = F.linear(tok, *coarse[l - 1]).chunk(2, dim=-1)
        else:
            q_l, k_l = q0, k0
        q_l, k_l = q_l.reshape(B, H, d), k_l.reshape(B, H, d)
        keys = grow(cache.keys[l], T0 // s**l)
        rows = pos // s**l
        keys[bidx, :, rows] = torch.where(new[:, None, None], k_l, keys[bidx, :, rows])
        cache.keys[l] = keys
        cache.queries[l] = torch.where(new[:, None, None], q_l, cache.queries[l])
    return L - 1


def _new_coarse_tokens_aligned(
    layer: HKTAttention,
    x: Tensor,
    q0: Tensor,
    k0: Tensor,
    cache: HKTLayerCache,
    pos: int,
    T0: int,
    coarse: list[tuple[Tensor, Tensor | None]],
) -> int:
    """:func:`_new_coarse_tokens` when every sequence is at the same position ``pos``
    (batch of one, or equal prompt lengths): the same updates without per-row selects."""
    cfg = layer.config
    B, _ = x.shape
    H, d, s, L = cfg.n_heads, cfg.head_dim, cfg.stride, cfg.n_levels
    tok = x
    for l in range(L):
        if l > 0:
            down = layer.downsample[l - 1]
            inputs = torch.cat([cache.windows[l - 1], tok[:, None]], dim=1)  # (B, k, D)
            cache.windows[l - 1] = inputs[:, 1:]
            if pos % s**l:  # no new coarse token from here up: only make room
                for m in range(l, L):
                    cache.keys[m] = grow(cache.keys[m], T0 // s**m)
                return l - 1
            tok = F.gelu(down.norm(_depthwise_last(inputs, down.conv.conv)))  # (B, D)
        q_l, k_l = (q0, k0) if l == 0 else F.linear(tok, *coarse[l - 1]).chunk(2, dim=-1)
        keys = grow(cache.keys[l], T0 // s**l)
        keys[:, :, pos // s**l] = k_l.reshape(B, H, d)
        cache.keys[l] = keys
        cache.queries[l] = q_l.reshape(B, H, d)
    return L - 1
