"""The byte-level language model experiment (HKT against its MHA twin): bits per byte on held-out
text, samples, and a transformers-format model for ``generate``."""

from .config import LMConfig
from .experiment import ByteLM, bits_per_byte, train_lm
from .generate import build_lm, generate_text, load_lm

__all__ = [
    "ByteLM",
    "LMConfig",
    "bits_per_byte",
    "build_lm",
    "generate_text",
    "load_lm",
    "train_lm",
]
