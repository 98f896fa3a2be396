"""Hierarchical Kernel Transformer (arXiv 2604.08829): multi-resolution attention."""

from .attention import HKTAttention, HKTConfig
from .cache import LMCache
from .downsample import CausalDepthwiseConv, CausalDownsample
from .functional import (
    ATTENTION_IMPLS,
    HKTCost,
    hkt_attention,
    hkt_cost,
    hkt_scores,
    level_lengths,
    masked_sdpa,
    resolve_impl,
    upsample_levels,
)
from .model import (
    CausalLM,
    ModelConfig,
    MultiHeadAttention,
    SequenceClassifier,
    count_parameters,
)

__all__ = [
    "ATTENTION_IMPLS",
    "CausalDepthwiseConv",
    "CausalDownsample",
    "CausalLM",
    "ModelConfig",
    "MultiHeadAttention",
    "SequenceClassifier",
    "count_parameters",
    "HKTAttention",
    "HKTConfig",
    "LMCache",
    "HKTCost",
    "hkt_attention",
    "hkt_cost",
    "hkt_scores",
    "level_lengths",
    "masked_sdpa",
    "resolve_impl",
    "upsample_levels",
]
