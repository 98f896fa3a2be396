"""TensorMemoryTracker counts what operators allocate and frees it when storages die."""

from __future__ import annotations

import torch

from structattn.utils import TensorMemoryTracker


def test_counts_allocations_and_frees():
    x = torch.randn(1000, 250)  # 1 MB, created before: not counted
    with TensorMemoryTracker() as mem:
        a = x * 2  # +1 MB
        b = a.exp()  # +1 MB
        view = b[:10]  # a view: no new storage
        assert mem.current_bytes == 2_000_000
        del a
        assert mem.current_bytes == 1_000_000
        c = torch.ones(500, 500)  # +1 MB
        del b, view, c
    assert mem.peak_bytes == 2_000_000
    assert mem.current_bytes == 0


def test_sees_a_materialised_matrix_in_backward():
    q = torch.randn(1, 1, 256, 8, requires_grad=True)
    with TensorMemoryTracker() as mem:
        scores = q @ q.transpose(-1, -2)  # (256, 256) float32 = 256 KiB
        scores.softmax(-1).sum().backward()
    assert mem.peak_bytes >= 2 * 256 * 256 * 4
