"""Decoding of causal HKT and multi-head-attention models: the caches (:mod:`.cache`) and the
HKT layer's prefill and decoding step (:mod:`.step`)."""

from .cache import DecodeWeights, HKTLayerCache, KVLayerCache, LMCache
from .step import use_compiled_step

__all__ = ["DecodeWeights", "HKTLayerCache", "KVLayerCache", "LMCache", "use_compiled_step"]
