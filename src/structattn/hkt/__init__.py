"""Hierarchical Kernel Transformer (arXiv 2604.08829): multi-resolution attention.

Layers, bottom up (each imports only those above it in this list): :mod:`.levels` (level
geometry), :mod:`.kernels` (the exact implementations and the one C++ extension loader),
:mod:`.reference`, :mod:`.interface` (:func:`hkt_attention`, :func:`resolve_impl`),
:mod:`.cost`, :mod:`.decoding` (caches and the decoding step), :mod:`.downsample` and
:mod:`.attention` (the layer), :mod:`.model` (the sequence models), :mod:`.hf` and
:mod:`.diagnostics`.
"""

from .attention import HKTAttention, HKTConfig
from .cost import HKTCost, hkt_cost
from .decoding import LMCache, use_compiled_step
from .downsample import CausalDepthwiseConv, CausalDownsample
from .interface import ATTENTION_IMPLS, hkt_attention, resolve_impl
from .kernels.sdpa import masked_sdpa
from .levels import level_lengths, upsample_levels
from .model import (
    CausalLM,
    ModelConfig,
    MultiHeadAttention,
    SequenceClassifier,
    count_parameters,
)
from .reference import hkt_scores

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
    "use_compiled_step",
]
