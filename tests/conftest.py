"""Test-session setup.

Triton's interpreter (which runs the Triton HKT kernels on CPU tensors) must be switched on
before anything imports triton: transformers, peft and torch may import it on their own, after
which ``TRITON_INTERPRET`` is no longer read for triton's own library functions. Without a CUDA
device the whole session therefore runs Triton interpreted; with one, the kernels compile for
the GPU (tests/test_hkt_gpu.py).

Fixtures shared by several test modules live here; plain shared functions in helpers.py.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402  (after the Triton setup above)
import pytest  # noqa: E402

#: Python files the code-names tests read as data (one does not even parse): never collected.
collect_ignore_glob = ["data/*"]


@pytest.fixture(scope="session")
def lra_data_dir(tmp_path_factory):
    """A data cache with tiny Fashion-MNIST and aclImdb fixtures (ListOps is generated)."""
    from helpers import write_idx

    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    fm = root / "fashion-mnist"
    fm.mkdir()
    for prefix, n in (("train", 60), ("t10k", 20)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 60, (n, 28, 28)) + 19 * labels[:, None, None]  # learnable
        write_idx(fm / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(fm / f"{prefix}-labels-idx1-ubyte.gz", labels)
    for split in ("train", "test"):
        for sub, word in (("pos", "good"), ("neg", "bad")):
            folder = root / "aclImdb" / split / sub
            folder.mkdir(parents=True)
            for i in range(12):
                (folder / f"{i}_1.txt").write_text(f"{word} " * (3 + i % 5))
    return root
