"""Test-session setup.

Triton's interpreter (which runs the Triton HKT kernels on CPU tensors) must be switched on
before anything imports triton: transformers, peft and torch may import it on their own, after
which ``TRITON_INTERPRET`` is no longer read for triton's own library functions. Without a CUDA
device the whole session therefore runs Triton interpreted; with one, the kernels compile for
the GPU (tests/test_hkt_gpu.py).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
