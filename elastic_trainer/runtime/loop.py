"""The data side of :meth:`Checkpointer.steps`: a user's ``DataLoader`` made world-size invariant,
and the per-step bookkeeping of micro-batches and their loss weights.

A ``DataLoader`` over a map-style dataset is rebuilt with the same dataset, ``collate_fn``, worker
processes, ``pin_memory`` and the rest, but with a :class:`~.sampler.GlobalBatchSampler` as its
``batch_sampler``: a seeded global order, a constant global batch (``train.global_batch_size``) split
across ranks, micro-batches of at most the loader's own ``batch_size``, the same number of them on
every rank, zero-weight padding where a rank has fewer samples, and a cursor that is checkpointed
and reshards. Each micro-batch's loss counts with weight ``n / global_batch`` (``n`` its real
samples), so the gradient summed over ranks is that of the global mean, at any world size. A loader
with a sampler or batch sampler of its own (other than a ``GlobalBatchSampler``) is refused: the
loop would have to replace it.

Any other iterable (an ``IterableDataset``, a streaming loader) is read as it comes, one batch per
step, each weighted ``1 / world_size``; it is not world-size invariant, and it resumes exactly
only if it is ``Stateful`` (e.g. torchdata's ``StatefulDataLoader``, saved per rank).

A :class:`SampledData` (the built-in trainer's token windows) is read by hand: each step's
micro-batches from its ``GlobalBatchSampler``, each one built by its ``fetch``.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator, Sized
from typing import Any, cast

import torch
from torch.distributed.checkpoint.stateful import Stateful

from .. import lifeline
from ..config import Config, TrainConfig
from ..errors import ConfigError
from .sampler import GlobalBatchSampler, MicroBatchIndices, micro_steps


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (nested in lists, tuples, dicts) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(to_device(v, device) for v in batch)
    if isinstance(batch, tuple):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    return batch


class SampledData:
    """Data read by hand from a :class:`~.sampler.GlobalBatchSampler` (``sampler``, which may be
    set late, before the first step): :meth:`fetch` builds the batch of one micro-batch's
    indices. ``state``: what the checkpoint holds of it (default: the sampler)."""

    sampler: GlobalBatchSampler | None = None

    @property
    def state(self) -> Any:
        return self.sampler

    def fetch(self, mb: MicroBatchIndices) -> Any:
        raise NotImplementedError


def resumed_global_batch(recorded: int, train: TrainConfig, allowed: list[str], batch_set: bool) -> int:
    """The global batch a resume runs with: the one its checkpoint recorded (the first launch's),
    or a ``train.global_batch_size`` set now (``batch_set``) when ``checkpoint.allow_changes``
    names it; set to another value without that: exit 2 naming both."""
    key = "train.global_batch_size"
    if not batch_set or train.global_batch_size == recorded:
        return recorded
    if key not in allowed:
        raise ConfigError(
            key,
            f"{train.global_batch_size}, but this run's checkpoint records {recorded} (the global batch it "
            "started with): leave the key out, or name it in checkpoint.allow_changes",
        )
    return train.global_batch_size


class StepData:
    """The batches of each step, with the weight of each micro-batch's loss."""

    @classmethod
    def for_train(
        cls, data: Any, train: TrainConfig, rank: int, world_size: int, device: torch.device, *, batch_set: bool = True
    ) -> StepData:
        """``data`` under ``train``'s seed. A ``DataLoader`` over a map-style dataset: its
        ``batch_size`` is the micro-batch at every world size; the global batch is
        ``train.global_batch_size`` where it was set (``batch_set``), else the first launch's
        micro-batch × processes, and a resume takes the one its checkpoint recorded. A
        ``train.micro_batch_size`` set to other than the loader's ``batch_size`` is refused."""
        made = cls(
            data, global_batch=train.global_batch_size, seed=train.seed, rank=rank, world_size=world_size, device=device
        )
        sampler = made.sampler
        if sampler is not None and made.source is None and made.loader is not data:  # the sampler is ours
            if train.micro_batch_size not in (sampler.micro_batch_size, TrainConfig.micro_batch_size):
                raise ConfigError(
                    "train.micro_batch_size",
                    f"{train.micro_batch_size}, but the DataLoader's batch_size ({sampler.micro_batch_size}) is "
                    f"this loop's micro-batch: make them agree (DataLoader(batch_size={train.micro_batch_size})) "
                    "or leave the key out",
                )
            sampler.unrecorded_global_batch = train.global_batch_size  # what a checkpoint from before ran with
            if not batch_set:
                sampler.resize(sampler.micro_batch_size * world_size)
        return made

    def __init__(
        self,
        data: Any,
        *,
        global_batch: int,
        seed: int,
        rank: int,
        world_size: int,
        device: torch.device,
    ):
        from torch.utils.data import DataLoader, IterableDataset

        self.device = device
        self.world_size = world_size
        self.source = data if isinstance(data, SampledData) else None
        self._sampler: GlobalBatchSampler | None = None
        if self.source is not None:
            self.loader = None
        elif isinstance(data, DataLoader) and isinstance(data.batch_sampler, GlobalBatchSampler):
            self._sampler, self.loader = data.batch_sampler, data
        elif isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset):
            self._sampler = GlobalBatchSampler(
                len(cast(Sized, data.dataset)),  # a map-style dataset
                global_batch,
                micro_batch_of(data),
                seed=seed,
                rank=rank,
                world_size=world_size,
                shuffle=shuffled(data),
            )
            self.loader = _rebuilt(data, self._sampler, seed + rank)
        else:
            self.loader = data
        if isinstance(self.loader, DataLoader) and not isinstance(self.loader.worker_init_fn, WorkerInit):
            self.loader.worker_init_fn = WorkerInit(self.loader.worker_init_fn)  # before its first iterator
        self._it: Iterator | None = None

    def resumed(self, cfg: Config, batch_set: bool) -> None:
        """After a resume: the run's global batch (:func:`resumed_global_batch`) for a sampler
        whose state the checkpoint holds."""
        sampler = self.sampler
        if sampler is not None and self.state is sampler:
            allowed = cfg.checkpoint.allow_changes
            sampler.resize(resumed_global_batch(sampler.global_batch_size, cfg.train, allowed, batch_set))

    @property
    def sampler(self) -> GlobalBatchSampler | None:
        """The sampler whose cursor is the data's position (None: an iterable read as it comes)."""
        return self.source.sampler if self.source is not None else self._sampler

    @property
    def per_step(self) -> int:
        """Micro-batches per step on this rank (the same on every rank)."""
        s = self.sampler
        return micro_steps(s.global_batch_size, self.world_size, s.micro_batch_size) if s is not None else 1

    @property
    def state(self) -> Any:
        """What the checkpoint holds of the data: the sampler, or a ``Stateful`` loader (per rank)."""
        from ..checkpoint.state import PerRank

        if self.source is not None:
            return self.source.state
        if self.sampler is not None:
            return self.sampler
        return (
            PerRank(self.loader)
            if hasattr(self.loader, "state_dict") and hasattr(self.loader, "load_state_dict")
            else None
        )

    def restart(self) -> None:
        """Read again from the (restored or rolled back) data state. Dropping the iterator ends its
        worker processes (a DataLoader iterator shuts its workers down when it is collected)."""
        self._it = None

    def step_batches(self) -> Iterator[tuple[Any, float]]:
        """This rank's micro-batches of the next step (on the device), each with the weight of its
        loss (its share of the global batch: 0 for padding), read as they are needed."""
        if self.source is None:
            for _ in range(self.per_step):
                yield self.next_batch()
            return
        sampler = self.source.sampler
        assert sampler is not None  # set before the first step
        for mb in sampler.micro_batches():
            yield to_device(self.source.fetch(mb), self.device), mb.weight / sampler.global_batch_size

    def next_batch(self) -> tuple[Any, float]:
        """This rank's next micro-batch (on the device) and the weight of its loss."""
        if self._it is None:
            assert self.loader is not None  # data not read by hand
            self._it = iter(self.loader)
        batch = to_device(next(self._it), self.device)
        if self.sampler is None:
            return batch, 1.0 / self.world_size
        return batch, self.sampler.pop_weight() / self.sampler.global_batch_size


def shuffled(loader) -> bool:
    """Whether a map-style ``DataLoader`` reads in a random order (``shuffle=True``, or a sampler
    that says ``shuffle``, as ``DistributedSampler`` does); else its dataset's own order is kept."""
    from torch.utils.data import RandomSampler

    sampler = loader.sampler
    return bool(getattr(sampler, "shuffle", isinstance(sampler, RandomSampler)))


def micro_batch_of(loader) -> int:
    """The micro-batch of a user's map-style ``DataLoader``: its ``batch_size``. A loader that
    samples its own way (``sampler=``, ``batch_sampler=``, ``batch_size=None``) is refused rather
    than silently re-sampled."""
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        raise ConfigError(
            "Checkpointer(data=)",
            "the DataLoader needs a batch_size (the micro-batch) and no batch_sampler of its own: the loop "
            "samples with a GlobalBatchSampler (or pass one as batch_sampler=)",
        )
    if type(loader.sampler) not in (SequentialSampler, RandomSampler):
        raise ConfigError(
            "Checkpointer(data=)",
            f"DataLoader(sampler={type(loader.sampler).__name__}): the loop samples every rank's share "
            "itself (a seeded global order, train.seed): drop the sampler",
        )
    return loader.batch_size


def _rebuilt(loader, sampler: GlobalBatchSampler, seed: int):
    """``loader`` with ``sampler`` as its batch sampler and everything else kept. Without a
    ``generator`` of its own it gets one (seeded per rank): every new iterator of a DataLoader
    draws its workers' base seed from that generator, else from the global one, and a resume
    (which starts a new iterator) would shift this rank's restored random stream (dropout)."""
    from torch.utils.data import DataLoader

    generator = loader.generator if loader.generator is not None else torch.Generator().manual_seed(seed)
    kw: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers:
        kw["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, batch_sampler=sampler, **kw)


class WorkerInit:
    """The ``worker_init_fn`` every ``DataLoader`` given to the loop gets (rebuilt or not, map-style
    or iterable), wrapping the user's: a worker leaves preemption to its rank. A launcher signals the rank's whole
    process group (SIGTERM on preemption; torch's agent uses ``killpg``): a worker that died then
    would break a batch the rank is still receiving (its shared-memory descriptor is handed over
    by the worker) before the rank commits its final step. So the worker moves to a process group
    of its own and keeps serving; it ends with the rank's iterator (torch's sentinel), when the
    rank dies (torch's watchdog), or on a signal sent to it alone (a scheduler that signals every
    process of the job, ``terminate()`` at the rank's exit): then quietly (exit 0, which torch
    does not count as a failure; a worker *killed* by a signal would fail the rank). Ignoring the
    signals would be worse: the interpreter's exit terminates daemonic workers with SIGTERM and
    joins them. A worker dies with its rank (``PR_SET_PDEATHSIG``): it holds copies of the rank's
    sockets (forked after the process group was made), and while it lives a peer blocked in a
    collective with the dead rank sees no error (torch's own check of the parent runs every 5 s).
    Then the user's ``worker_init_fn`` runs."""

    def __init__(self, user: Any = None):
        self.user = user

    def __call__(self, worker_id: int) -> None:
        lifeline.die_with_parent(os.getppid())
        os.setpgid(0, 0)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, _quiet_exit)
        if self.user is not None:
            self.user(worker_id)


def _quiet_exit(signum, frame) -> None:
    os._exit(0)


_at_fork_installed = False


def die_with_parent_at_fork() -> None:
    """From now on, every process this one's main thread forks dies with it: the workers of any
    ``DataLoader``, handed to the loop or not (a lower-level loop, a framework's own loader),
    hold copies of the rank's sockets like those :class:`WorkerInit` makes die with their rank.
    A child forked by another thread is left alone (Linux ties the signal to the forking
    thread's life). Once per process (a rank calls it when its process groups exist)."""
    global _at_fork_installed
    if _at_fork_installed or not sys.platform.startswith("linux"):
        return
    _at_fork_installed = True
    import threading

    prctl = lifeline.libc_prctl()
    forking: dict[str, int | None] = {"parent": None}

    def before() -> None:
        forking["parent"] = os.getpid() if threading.current_thread() is threading.main_thread() else None

    def after_in_child() -> None:
        if forking["parent"] is not None:
            lifeline.die_with_parent(forking["parent"], fn=prctl)

    os.register_at_fork(before=before, after_in_child=after_in_child)


class Accumulator:
    """One step's backward passes: each micro-batch's loss scaled by its weight, summed.
    ``divisor``: the losses are sums over counted items (e.g. target tokens), each divided by the
    step's global count first (their weight is then 1, or 0 for padding)."""

    def __init__(self, device: torch.device, divisor: float | None = None):
        self.count = 0
        self.divisor = divisor
        self.loss = torch.zeros((), dtype=torch.float64, device=device)

    def backward(self, loss: torch.Tensor, weight: float) -> None:
        if self.divisor is not None:
            loss, weight = loss / self.divisor, float(weight > 0)
        (loss * weight).backward()
        self.loss += loss.detach().to(torch.float64) * weight
        self.count += 1


def loop_data(
    session: Any, data: Any, extra: dict[str, Stateful], identity: dict[str, Any] | None
) -> tuple[StepData | None, dict[str, Stateful], dict[str, Any] | None]:
    """The loop's data (its state among the run's states) and the run identity it implies by
    default: the seed, which fixes the sample order, and the global batch where it was set on the
    launcher's command line or by the script (else the checkpoint records the first launch's)."""
    if data is None:
        return None, extra, identity
    t, s = session.cfg.train, session
    batch_set = "train.global_batch_size" in getattr(session, "explicit", ())
    made = StepData.for_train(data, t, s.rank, s.world_size, s.device, batch_set=batch_set)
    if made.state is not None:
        extra = {"sampler": made.state, **extra}
    if made.sampler is not None and identity is None:
        identity = {"train.seed": t.seed, **({"train.global_batch_size": t.global_batch_size} if batch_set else {})}
    return made, extra, identity
