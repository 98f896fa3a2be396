"""Hierarchical Kernel Transformer (arXiv 2604.08829): multi-resolution attention."""

from .attention import HKTAttention, HKTConfig
from .downsample import CausalDepthwiseConv, CausalDownsample
from .functional import (
    ATTENTION_IMPLS,
    HKTCost,
    hkt_attention,
    hkt_cost,
    hkt_scores,
    level_lengths,
    upsample_levels,
)

__all__ = [
    "ATTENTION_IMPLS",
    "CausalDepthwiseConv",
    "CausalDownsample",
    "HKTAttention",
    "HKTConfig",
    "HKTCost",
    "hkt_attention",
    "hkt_cost",
    "hkt_scores",
    "level_lengths",
    "upsample_levels",
]
