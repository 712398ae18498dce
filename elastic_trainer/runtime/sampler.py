"""World-size-invariant sampling of any map-style dataset: a seeded global order, a global
sample cursor, a constant global batch split across ranks (uneven splits allowed), the same number
of micro-batches on every rank, and a ``state_dict`` that reshards.

Step ``s`` consumes global positions ``cursor .. cursor + G - 1`` of the order; rank ``r`` of
``W`` takes a contiguous balanced slice of that range; every rank runs the same number of
micro-batches, padding with zero-weight ones where it has fewer samples. So the set of samples in
a step, and the global mean loss over them, never depend on ``W`` — resume at any world size and
the loss curve continues (torchtitan refuses a data-parallel degree change instead).
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from ..checkpoint.state import past_skipped


def rank_slice(global_batch: int, world: int, rank: int) -> tuple[int, int]:
    """(start, count) of ``rank``'s contiguous share of a global batch; first ``G % W`` ranks get one more."""
    base, extra = divmod(global_batch, world)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def micro_steps(global_batch: int, world: int, micro_batch: int) -> int:
    """Forward/backward passes per step; the same on every rank."""
    most = -(-global_batch // world)
    return -(-most // micro_batch)


class GlobalOrder:
    """Deterministic global order of sample ids, a function of (seed, position) only: a seeded
    permutation per epoch, or (``shuffle`` False) the dataset's own order, epoch after epoch."""

    def __init__(self, n_samples: int, seed: int, shuffle: bool = True):
        self.n = n_samples
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = -1
        self._perm: torch.Tensor | None = None

    def __getitem__(self, position: int) -> int:
        epoch, offset = divmod(position, self.n)
        if not self.shuffle:
            return offset
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.n, generator=g)
            self._epoch = epoch
        assert self._perm is not None  # drawn for the first epoch above
        return int(self._perm[offset])


@dataclass
class Progress:
    """Where a sampler stands: the global sample cursor and the ranges a rollback skipped."""

    cursor: int = 0
    skipped: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class MicroBatchIndices:
    """Dataset indices of one micro-batch; ``weight`` 0 marks a padding micro-batch (its indices
    are real samples so the forward pass runs, but its loss must count zero)."""

    indices: list[int]
    weight: int  # number of real samples (0 for padding)


class GlobalBatchSampler(Stateful):
    """The sampler of a user's map-style dataset. Register it with the checkpointer
    (``extra={"sampler": sampler}``, or pass a ``DataLoader`` as ``data=``): its cursor is saved
    and restored, at any world size.

    Two ways to read it. As a ``DataLoader``'s ``batch_sampler`` (worker processes, ``pin_memory``
    and any ``collate_fn`` apply): iterating yields this rank's micro-batches (index lists), step
    after step from the cursor; the cursor itself moves only with :meth:`advance`, so a loader that
    prefetches ahead loses nothing, and the weight of each yielded micro-batch is queued for
    :meth:`pop_weight`. Or by hand: ``for mb in sampler.micro_batches(): ...`` then
    ``sampler.advance()`` after the optimizer step. Either way normalise the loss by the *global*
    number of counted samples or tokens so the loss is independent of the world size."""

    optional_on_load = ("global_batch_size",)  # a checkpoint written before it was recorded lacks it

    def __init__(
        self,
        dataset_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        *,
        seed: int,
        rank: int,
        world_size: int,
        progress: Any = None,
        shuffle: bool = True,
    ):
        """``progress``: an object whose ``cursor`` and ``skipped`` attributes hold where the sampler
        stands (e.g. the built-in trainer's :class:`~elastic_trainer.checkpoint.state.TrainState`,
        checkpointed as such); by default the sampler holds them and is the ``Stateful`` of them.
        ``shuffle`` False: the dataset's own order (a ``DataLoader(shuffle=False)``), split and
        checkpointed the same way."""
        if dataset_len < 1:
            raise ValueError(f"dataset_len must be >= 1, got {dataset_len}")
        if global_batch_size < 1 or micro_batch_size < 1:
            raise ValueError(f"global batch {global_batch_size} and micro-batch {micro_batch_size} must be >= 1")
        self.order = GlobalOrder(dataset_len, seed, shuffle)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank, self.world_size = rank, world_size
        # the cursor, and the global ranges [start, end) a non-finite rollback skipped
        self.progress = progress if progress is not None else Progress()
        self._weights: deque[int] = deque()  # real samples of each micro-batch iteration yielded, in order
        # the global batch of a checkpoint that does not record one (written before it was recorded)
        self.unrecorded_global_batch = global_batch_size

    @property
    def cursor(self) -> int:
        return self.progress.cursor

    @cursor.setter
    def cursor(self, value: int) -> None:
        self.progress.cursor = value

    @property
    def skipped(self) -> list[list[int]]:
        return self.progress.skipped

    @skipped.setter
    def skipped(self, value: list[list[int]]) -> None:
        self.progress.skipped = value

    def skip(self, sample_range: list[int]) -> None:
        """Never use the global positions ``[start, end)`` (kept in the state: resumes skip them too)."""
        self.skipped.append([int(sample_range[0]), int(sample_range[1])])

    def micro_batches(self) -> list[MicroBatchIndices]:
        """This rank's micro-batches of the current step (the same count on every rank)."""
        self.cursor = past_skipped(self.cursor, self.skipped)
        return self.at(self.cursor)

    def at(self, position: int) -> list[MicroBatchIndices]:
        """This rank's micro-batches of the step that starts at global ``position``."""
        start, count = rank_slice(self.global_batch_size, self.world_size, self.rank)
        ids = [self.order[position + start + j] for j in range(count)]
        out = []
        for m in range(micro_steps(self.global_batch_size, self.world_size, self.micro_batch_size)):
            chunk = ids[m * self.micro_batch_size : (m + 1) * self.micro_batch_size]
            out.append(MicroBatchIndices(chunk, len(chunk)) if chunk else MicroBatchIndices([self.order[position]], 0))
        return out

    def __iter__(self):
        """As a ``batch_sampler``: the index lists of this rank's micro-batches, step after step
        from the cursor (skipped ranges left out), without end."""
        self._weights = deque()
        position = self.cursor
        while True:
            position = past_skipped(position, self.skipped)
            for mb in self.at(position):
                self._weights.append(mb.weight)
                yield mb.indices
            position += self.global_batch_size

    def pop_weight(self) -> int:
        """Real samples of the oldest micro-batch the iteration yielded and nobody took yet (0: padding)."""
        return self._weights.popleft()

    def advance(self) -> None:
        self.cursor += self.global_batch_size

    @property
    def per_step(self) -> int:
        """Micro-batches per step on this rank (the same on every rank) at this world size."""
        return micro_steps(self.global_batch_size, self.world_size, self.micro_batch_size)

    def resize(self, global_batch_size: int) -> None:
        """The global batch of the run's first launch (from its checkpoint): the micro-batch stays,
        the micro-batches per step follow."""
        self.global_batch_size = global_batch_size

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursor": torch.tensor(self.cursor, dtype=torch.int64),
            "skipped": json.dumps(self.skipped),
            "global_batch_size": torch.tensor(self.global_batch_size, dtype=torch.int64),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The position, and the global batch the run started with (it is fixed at the first launch)."""
        self.cursor = int(state_dict["cursor"])
        self.skipped = [list(map(int, r)) for r in json.loads(state_dict.get("skipped") or "[]")]
        recorded = state_dict.get("global_batch_size")
        self.resize(int(recorded) if recorded is not None else self.unrecorded_global_batch)
