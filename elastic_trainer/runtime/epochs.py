"""A :class:`~.sampler.GlobalBatchSampler` read in epochs, for loops that a framework drives
(``for epoch in ...: for batch in loader``, ``len(loader)``), such as a Hugging Face Accelerate
script: the same seeded global order, constant global batch and checkpointed cursor, but each
iteration of the loader ends at the end of the current epoch.

An epoch is ``len(dataset) // global_batch_size`` steps of the global order; ``len()`` counts its
micro-batches on this rank (the same at every world size when the micro-batches per step are).
An iteration started mid-epoch (after a resume) yields the rest of that epoch only.
"""

from __future__ import annotations

from collections import deque

from .sampler import GlobalBatchSampler


class EpochBatchSampler(GlobalBatchSampler):
    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.order.n // self.global_batch_size)

    def __len__(self) -> int:
        return self.steps_per_epoch * self.per_step

    def _span(self) -> int:
        return self.steps_per_epoch * self.global_batch_size

    @property
    def offset(self) -> int:
        """Micro-batches of the current epoch already taken (the cursor's place in its epoch)."""
        return (self.cursor % self._span()) // self.global_batch_size * self.per_step

    def __iter__(self):
        self._weights = deque()
        position = self.cursor
        end = (position // self._span() + 1) * self._span()
        while position < end:
            for mb in self.at(position):
                self._weights.append(mb.weight)
                yield mb.indices
            position += self.global_batch_size
