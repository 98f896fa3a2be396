"""Peak memory of tensors created by PyTorch operators, on any device (CPU included).

PyTorch has no public peak-memory counter for the CPU allocator. :class:`TensorMemoryTracker`
is a ``TorchDispatchMode`` that sees every tensor an ATen operator returns, counts the bytes of
each new storage while it is alive (a weakref finalizer subtracts them when it is freed) and
records the peak. It counts what a computation allocates (activations, saved tensors, gradients,
any materialised T x T matrix); it does not see scratch buffers private to one fused kernel
(for example a flash-attention kernel's per-thread tiles) nor tensors created before entering.
"""

from __future__ import annotations

import weakref

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["TensorMemoryTracker"]


class TensorMemoryTracker(TorchDispatchMode):
    """Track live and peak bytes of storages allocated by operators inside the ``with`` block.

    Example::

        with TensorMemoryTracker() as mem:
            loss = model(x).sum()
            loss.backward()
        print(mem.peak_bytes)
    """

    def __init__(self) -> None:
        super().__init__()
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, int] = {}

    def _release(self, key: int) -> None:
        self.current_bytes -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            nbytes = storage.nbytes()
            if key in self._live or nbytes == 0:
                continue
            self._live[key] = nbytes
            self.current_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
            weakref.finalize(storage, self._release, key)
        return out
