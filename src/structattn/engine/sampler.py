"""Training batches as a pure function of the step (so a resumed run sees the same data)."""

from __future__ import annotations

import torch
from torch.utils.data import Sampler

from structattn.errors import RunError

__all__ = ["StepBatchSampler"]


class StepBatchSampler(Sampler[list[int]]):
    """Index batches for steps ``start .. stop - 1``, a pure function of the step.

    Epoch ``e`` shuffles with ``torch.randperm(n, seed + e)``; step ``s`` takes slice
    ``s mod steps_per_epoch`` of it (incomplete tail dropped), and process ``rank`` of ``world``
    its own ``batch_size`` part. Restarting at any step reproduces the same batches.
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        seed: int,
        start: int,
        stop: int,
        rank: int = 0,
        world: int = 1,
    ):
        if n < 1:
            raise RunError("the training set is empty")
        self.n, self.seed, self.start, self.stop = n, seed, start, stop
        self.rank, self.world = rank, world
        self.batch_size = min(batch_size, max(1, n // world))
        self.per_epoch = max(1, n // (self.batch_size * world))

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __iter__(self):
        epoch, perm = None, None
        global_bs = self.batch_size * self.world
        for step in range(self.start, self.stop):
            e, offset = divmod(step, self.per_epoch)
            if e != epoch:
                epoch = e
                perm = torch.randperm(
                    self.n, generator=torch.Generator().manual_seed(self.seed + e)
                )
            lo = offset * global_bs + self.rank * self.batch_size
            yield perm[lo : lo + self.batch_size].tolist()
