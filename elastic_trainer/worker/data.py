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
from typing import Any

import torch

from ..runtime.loop import SampledData
from ..runtime.sampler import GlobalBatchSampler, MicroBatchIndices
from .tokens import TokenFile

IGNORE_INDEX = -100


@dataclass
class MicroBatch:
    inputs: torch.Tensor  # [b, L] int64
    targets: torch.Tensor  # [b, L] int64, IGNORE_INDEX where not counted
    n_samples: int  # real samples in it (0 for a padding micro-batch)


def target_tokens(mb: MicroBatch) -> int:
    """The target tokens a micro-batch's loss counts."""
    return int((mb.targets != IGNORE_INDEX).sum())


class StepBatches(SampledData):
    """The micro-batches of one rank, step after step, from a :class:`GlobalBatchSampler` over the
    token file's samples. ``progress``: where the sampler stands (the built-in trainer's train
    state, checkpointed as such: the sampler is no ``Stateful`` of its own)."""

    def __init__(
        self,
        source: TokenFile | None,
        seed: int,
        global_batch: int,
        micro_batch: int,
        world: int,
        rank: int,
        progress: Any = None,
    ):
        self.seed = seed
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.world = world
        self.rank = rank
        self.progress = progress
        if source is not None:
            self.open(source)

    @property
    def state(self) -> None:
        return None  # its progress is checkpointed by its owner (the train state)

    def open(self, source: TokenFile) -> None:
        """Read from ``source`` (a worker opens it once it knows the run's data view)."""
        self.source = source
        self.sampler = GlobalBatchSampler(
            source.n_samples,
            self.global_batch,
            self.micro_batch,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world,
            progress=self.progress,
        )

    def fetch(self, mb: MicroBatchIndices) -> MicroBatch:
        """A micro-batch's samples; a padding one (weight 0) with no target counted."""
        if not mb.weight:
            x, _ = self.source.sample(mb.indices[0])
            return MicroBatch(x[None], torch.full_like(x[None], IGNORE_INDEX), 0)
        xs, ys = zip(*(self.source.sample(i) for i in mb.indices), strict=True)
        return MicroBatch(torch.stack(xs), torch.stack(ys), len(mb.indices))
