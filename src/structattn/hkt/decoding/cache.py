"""Decoding caches for causal HKT and multi-head-attention language models.

HKT is causal by construction: the coarse token ``c`` of level ``l`` reads fine positions up to
``c * s^l`` only, so a decoder can emit one token at a time. Per layer the HKT cache holds

* for every level ``l``, the keys of every coarse token so far, ``(B, H, ceil(n / s^l), d)``,
  and the query of the current block, ``(B, H, d)``;
* for every level below the top, the last ``k - 1`` inputs of the causal downsampling
  convolution that makes the next level (its zero left padding at the start);
* the values at full resolution, ``(B, H, n, d)``, and the last ``k - 1`` value vectors of the
  hybrid head's causal convolution;
* for every level ``l >= 1``, the scores of the current block queries against that level's
  keys, summed over levels ``l .. L-1`` (``(B, H, T0 / s^l)``): they change only when the
  level's query does (every ``s^l`` tokens), so a step recomputes level 0 and reuses the rest;
* ``lengths (B,)``: real tokens seen per sequence. Sequences are stored left-aligned (token
  ``i`` of a sequence at row ``i``), whatever padding the prompt batch had, so every sequence
  keeps its own block boundaries at multiples of ``s^l``.

A new coarse token at level ``l`` is computed exactly when a sequence's position reaches a
multiple of ``s^l``. The cache grows by doubling its capacity (amortised O(1) per token) and
holds ``(1 + sum_l 1/s^l)`` times the key rows of a multi-head-attention cache, plus ``V``.

Shapes: ``B`` batch, ``H`` heads, ``d`` head dim, ``D = H d`` model width, ``n`` tokens so far.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ..levels import is_right_padded

__all__ = [
    "DecodeWeights",
    "HKTLayerCache",
    "KVLayerCache",
    "LMCache",
    "check_made_for",
    "decode_attention",
    "grow",
    "one_length",
    "prompt_lengths",
]


def grow(buf: Tensor, needed: int, dim: int = 2) -> Tensor:
    """``buf`` with at least ``needed`` rows along ``dim`` (capacity doubled; new rows zero),
    to be written in place next. Under autograd a buffer that is part of the graph is copied
    first, so that the steps before keep the values their backward reads."""
    have = buf.shape[dim]
    if needed <= have:
        return buf.clone() if torch.is_grad_enabled() and buf.requires_grad else buf
    new = max(needed, 2 * have, 16)
    shape = list(buf.shape)
    shape[dim] = new - have
    return torch.cat([buf, buf.new_zeros(shape)], dim=dim)


def decode_attention(
    scores: Tensor, n: Tensor | int, values: Tensor, dropout_p: float = 0.0
) -> Tensor:
    """One query per sequence over its cached keys: ``scores (B, H, T)`` (already scaled),
    ``n`` keys in use per sequence, ``(B,)`` (later rows are masked) or one int for every
    sequence (later rows are sliced off), ``values (B, H, T, d)``; returns ``(B, H, d)``.
    Shared by the HKT and multi-head-attention caches, so that decoding speed compares the
    attention, not the kernels."""
    if isinstance(n, int):
        probs = torch.softmax(scores[..., :n], dim=-1)
        values = values[:, :, :n]
    else:
        T = scores.shape[-1]
        future = torch.arange(T, device=scores.device)[None, :] >= n[:, None]  # (B, T)
        probs = torch.softmax(scores.masked_fill(future[:, None], float("-inf")), dim=-1)
    if dropout_p > 0:
        probs = torch.nn.functional.dropout(probs, p=dropout_p)
    return (probs[:, :, None, :] @ values).squeeze(-2)


def one_length(n: Tensor, n_max: int) -> bool:
    """Whether every sequence holds ``n_max`` tokens (batch of one, or equal lengths): the
    decoding steps then write one row and slice instead of masking."""
    return n.shape[0] == 1 or bool((n == n_max).all())


def prompt_lengths(mask: Tensor | None, B: int, T: int, device) -> Tensor:
    """Real tokens per row of a right-padded prompt, ``(B,)``; refuses empty rows and padding
    that is not on the right."""
    if mask is None:
        lengths = torch.full((B,), T, dtype=torch.long, device=device)
    else:
        if not is_right_padded(mask):
            raise ValueError(
                "a prefill needs right-padded prompts (each row real tokens, then padding)"
            )
        lengths = mask.sum(1)
    if T == 0 or bool((lengths == 0).any()):
        raise ValueError("cannot prefill a cache with an empty prompt (a row without tokens)")
    return lengths


def check_made_for(made_for: tuple[torch.dtype, torch.device] | None, weight: Tensor) -> None:
    """Refuse a layer cache made when the layer's parameters (``weight``) had another dtype
    or device (``made_for``: theirs at the prefill; None: not recorded)."""
    if made_for is not None and made_for != (weight.dtype, weight.device):
        dtype, device = made_for
        raise ValueError(
            f"this decoding cache was made for {dtype} on {device}, but the model is now "
            f"{weight.dtype} on {weight.device}: start a new cache (model.new_cache()) and run "
            "the prompt again"
        )


class LayerCache(Protocol):
    """What :class:`LMCache` needs of one layer's cache, whatever attention made it: the real
    tokens per sequence, keeping (and repeating) sequences, and the bytes in use."""

    lengths: Tensor  # (B,) long

    def select(self, index: Tensor) -> None: ...

    def used_bytes(self) -> int: ...


@dataclass
class KVLayerCache:
    """Keys and values of one multi-head-attention layer, ``(B, H, capacity, d)``, rows
    ``0 .. lengths[b] - 1`` valid for sequence ``b``."""

    keys: Tensor
    values: Tensor
    lengths: Tensor  # (B,) long
    # the layer's parameter dtype and device at the prefill (a cache is for those only)
    made_for: tuple[torch.dtype, torch.device] | None = None

    def select(self, index: Tensor) -> None:
        self.keys = self.keys.index_select(0, index)
        self.values = self.values.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)

    def used_bytes(self) -> int:
        """Bytes of the rows in use (keys and values up to the longest sequence)."""
        n = int(self.lengths.max()) if self.lengths.numel() else 0
        B, H, _, d = self.keys.shape
        return 2 * B * H * n * d * self.keys.element_size()


@dataclass
class DecodeWeights:
    """An HKT layer's weights in the form its decoding step uses, made from its parameters."""

    weight: Tensor  # (3D, D) level 0's Q, K, V weights concatenated
    bias: Tensor | None  # (3D,) their biases (None: no bias)
    coarse: list[tuple[Tensor, Tensor | None]]  # per level >= 1: its Q and K (weight, bias)
    w: Tensor  # (H, L) level weights times the score scale
    beta: Tensor  # (D,) attention share of the hybrid head per channel
    kernel_args: tuple | None = None  # the compiled step's further arguments, made at its first


@dataclass
class HKTLayerCache:
    """Everything one causal :class:`~structattn.hkt.HKTAttention` layer needs to decode the next
    token exactly (see the module docstring)."""

    keys: list[Tensor]  # per level (B, H, capacity_l, d)
    queries: list[Tensor]  # per level (B, H, d): the current block's query
    windows: list[Tensor]  # per level < L - 1: (B, k_down - 1, D) downsampling inputs
    values: Tensor  # (B, H, capacity, d)
    conv_window: Tensor | None  # (B, k_conv - 1, D) hybrid head's conv inputs (None: no hybrid)
    lengths: Tensor  # (B,) long
    # per level: scores of levels l .. L-1 summed, (B, H, T0 / s^l); None = to recompute
    # (level 0 always is; filled by the decoding steps)
    scores: list[Tensor | None]
    stride: int  # the layer's downsampling stride s
    # the layer's concatenated decoding weights, made from its parameters at the first step
    params: DecodeWeights | None = None
    # the layer's parameter dtype and device at the prefill (a cache is for those only)
    made_for: tuple[torch.dtype, torch.device] | None = None

    def select(self, index: Tensor) -> None:
        pick = lambda t: t.index_select(0, index)  # noqa: E731
        self.keys = [pick(t) for t in self.keys]
        self.queries = [pick(t) for t in self.queries]
        self.windows = [pick(t) for t in self.windows]
        self.values = pick(self.values)
        if self.conv_window is not None:
            self.conv_window = pick(self.conv_window)
        self.scores = [None if t is None else pick(t) for t in self.scores]
        self.lengths = pick(self.lengths)

    def used_bytes(self) -> int:
        """Bytes of the rows in use: coarse keys up to ``ceil(n / s^l)``, values up to ``n``,
        the current queries and the convolution windows."""
        n = int(self.lengths.max()) if self.lengths.numel() else 0
        B, H, _, d = self.values.shape
        size = self.values.element_size()
        rows = sum(-(-n // self.stride**l) for l in range(len(self.keys))) + n
        total = B * H * rows * d * size
        total += sum(t.numel() * t.element_size() for t in self.queries)
        total += sum(t.numel() * t.element_size() for t in self.windows)
        if self.conv_window is not None:
            total += self.conv_window.numel() * self.conv_window.element_size()
        total += sum(t.numel() * t.element_size() for t in self.scores if t is not None)
        return total


class LMCache:
    """The decoding cache of a whole model: one layer cache per block.

    Created empty by the model (``model.new_cache()`` or ``forward(..., use_cache=True)``),
    filled by the prompt's forward pass (the prefill) and extended by each decoding step. It
    remembers the model configuration it belongs to, so a cache from another model is refused.

    ``reorder_cache(index)`` keeps the sequences ``index`` (beam search); ``get_seq_length()``
    is the longest sequence; ``nbytes()`` the bytes in use.
    """

    def __init__(self, signature: tuple, n_layers: int):
        self.signature = signature
        self.layers: list[LayerCache | None] = [None] * n_layers

    @property
    def is_empty(self) -> bool:
        return self.layers[0] is None

    @property
    def lengths(self) -> Tensor | None:
        """Real tokens seen per sequence, ``(B,)``; None before the prefill."""
        return None if self.is_empty else self.layers[0].lengths

    def get_seq_length(self, layer_idx: int = 0) -> int:
        lengths = self.lengths
        return 0 if lengths is None or lengths.numel() == 0 else int(lengths.max())

    def __len__(self) -> int:
        return len(self.layers)

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Keep (and repeat) the sequences ``beam_idx``, in that order, in every layer."""
        for layer in self.layers:
            if layer is not None:
                layer.select(beam_idx.to(layer.lengths.device))

    def nbytes(self) -> int:
        """Bytes of the cache rows in use, summed over layers."""
        return sum(layer.used_bytes() for layer in self.layers if layer is not None)

    def __repr__(self) -> str:
        state = "empty" if self.is_empty else f"lengths={self.lengths.tolist()}"
        return f"LMCache(layers={len(self.layers)}, {state})"
