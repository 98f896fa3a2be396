"""Level geometry of HKT attention: level lengths, nearest upsampling, tile rounding, and the
padding layout every implementation reads. A leaf module: it imports nothing from structattn.

Shapes: ``T_0 = T``, ``T_l = ceil(T_{l-1} / s)`` for levels ``l = 1 .. L-1``; a padding mask is
``(B, T)`` bool, True = real token.
"""

from __future__ import annotations

from torch import Tensor

__all__ = [
    "attendable_keys",
    "check_levels",
    "effective_levels",
    "is_right_padded",
    "level_lengths",
    "round_tile",
    "upsample_levels",
]


def check_levels(n_levels: int, stride: int) -> None:
    """A ``ValueError`` unless there is at least one level and each is at least 2x shorter."""
    if n_levels < 1:
        raise ValueError(f"n_levels must be >= 1, got {n_levels}")
    if stride < 2:
        raise ValueError(f"stride must be >= 2, got {stride}")


def level_lengths(seq_len: int, n_levels: int, stride: int) -> list[int]:
    """Level lengths: ``T_0 = seq_len``, ``T_l = ceil(T_{l-1} / stride)`` for ``l < n_levels``."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    check_levels(n_levels, stride)
    lengths = [seq_len]
    for _ in range(1, n_levels):
        lengths.append(-(-lengths[-1] // stride))
    return lengths


def effective_levels(T: int, n_levels: int, stride: int) -> int:
    """Level 0 and the coarse levels longer than one token: a level of length 1 adds the same
    score to every key of a row, which softmax ignores (see :mod:`.kernels.blockwise`)."""
    return 1 + sum(1 for t in level_lengths(T, n_levels, stride)[1:] if t > 1)


def round_tile(tile: int, n_levels: int, stride: int) -> int:
    """``tile`` rounded up to a positive multiple of ``stride^(L-1)``, so that no coarse block
    straddles two tiles (shared by the blockwise implementations)."""
    block = stride ** (n_levels - 1)
    return max(block, (tile + block - 1) // block * block)


def upsample_levels(x: Tensor, factor: int, seq_len: int) -> Tensor:
    """Nearest upsampling along dim -2: row ``i`` of the result is row ``i // factor`` of ``x``.

    Shapes: ``x (..., T_l, d) -> (..., seq_len, d)`` with ``T_l * factor >= seq_len``.
    """
    if factor == 1:
        return x[..., :seq_len, :]
    return x.repeat_interleave(factor, dim=-2)[..., :seq_len, :]


def is_right_padded(key_padding_mask: Tensor) -> bool:
    """True when every row is a block of real tokens followed by padding (one host
    synchronisation: the answer picks the code path)."""
    return not bool((key_padding_mask[:, 1:] & ~key_padding_mask[:, :-1]).any())


def attendable_keys(key_padding_mask: Tensor | None) -> Tensor | None:
    """The keys a query may attend: the real ones, or every key of a sequence without a real
    token (its softmax stays finite and its outputs are zeroed by the caller)."""
    if key_padding_mask is None:
        return None
    return (key_padding_mask | ~key_padding_mask.any(-1, keepdim=True)).contiguous()
