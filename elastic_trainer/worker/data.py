"""World-size-invariant data: a memory-mapped token file (:mod:`.tokens`), a seeded global sample order, and a
global sample cursor.

A *sample* ``i`` is the window ``tokens[i*L : i*L + L + 1]`` (inputs are the first L, targets
the last L). Epoch ``e`` visits samples in ``randperm(n, seed=(seed, e))`` order. Step ``s``
consumes global positions ``cursor .. cursor + G - 1``; rank ``r`` of ``W`` takes a contiguous
balanced slice of that range; every rank runs the same number of micro-batches, padding with
zero-weight micro-batches (all targets ``-100``) where it has fewer samples. So the set of
samples in a step, and the global mean loss over them, never depend on ``W``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.sampler import GlobalOrder, micro_steps, rank_slice
from .tokens import TokenFile

IGNORE_INDEX = -100


@dataclass
class MicroBatch:
    inputs: torch.Tensor  # [b, L] int64
    targets: torch.Tensor  # [b, L] int64, IGNORE_INDEX where not counted
    n_samples: int  # real samples in it (0 for a padding micro-batch)


class StepBatches:
    """Produces the micro-batches of one rank for the step that starts at a global cursor."""

    def __init__(self, source: TokenFile | None, seed: int, global_batch: int, micro_batch: int, world: int, rank: int):
        self.seed = seed
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.world = world
        self.rank = rank
        self.n_micro = micro_steps(global_batch, world, micro_batch)
        if source is not None:
            self.open(source)

    def open(self, source: TokenFile) -> None:
        """Read from ``source`` (a worker opens it once it knows the run's data view)."""
        self.source = source
        self.order = GlobalOrder(source.n_samples, self.seed)

    def for_cursor(self, cursor: int) -> list[MicroBatch]:
        start, count = rank_slice(self.global_batch, self.world, self.rank)
        ids = [self.order[cursor + start + j] for j in range(count)]
        out = []
        for m in range(self.n_micro):
            chunk = ids[m * self.micro_batch : (m + 1) * self.micro_batch]
            if chunk:
                xs, ys = zip(*(self.source.sample(i) for i in chunk), strict=True)
                out.append(MicroBatch(torch.stack(xs), torch.stack(ys), len(chunk)))
            else:
                x, _ = self.source.sample(self.order[cursor])
                out.append(MicroBatch(x[None], torch.full_like(x[None], IGNORE_INDEX), 0))
        return out
