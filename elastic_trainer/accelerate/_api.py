"""Every use of Accelerate beyond its documented public API, in one place.

tests/unit/test_accelerate_api.py fails loudly when an Accelerate release changes any of them:

* ``AcceleratedOptimizer.optimizer`` / ``AcceleratedScheduler.scheduler``: the wrapped torch
  objects (their ``state_dict`` is what the checkpoint holds);
* ``AcceleratedScheduler.split_batches`` / ``step_with_optimizer`` / ``gradient_state``: with
  ``split_batches`` set, one ``scheduler.step()`` steps the wrapped scheduler once (else
  ``num_processes`` times: a schedule that changed with the world size);
* ``DataLoaderShard(dataset, device=, batch_sampler=, _non_blocking=, **DataLoader kwargs)`` and
  its ``__iter__``: the training loader is built as one directly, around our batch sampler (which
  already gives each rank its share), and runs the step boundary before each batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from accelerate.data_loader import DataLoaderShard
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler


def inner_optimizer(opt: Any) -> torch.optim.Optimizer:
    return opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt


def inner_scheduler(sched: Any) -> Any:
    return sched.scheduler if isinstance(sched, AcceleratedScheduler) else sched


def step_per_global_batch(sched: Any, times: int) -> None:
    """``sched.step()`` steps the wrapped scheduler ``times`` times per optimizer step (the first
    launch's process count, kept in the checkpoint), whatever the world size is now."""
    if not isinstance(sched, AcceleratedScheduler) or not sched.step_with_optimizer:
        return
    sched.split_batches = True
    once = sched.step

    def step(*args: Any, **kwargs: Any) -> None:
        for _ in range(times if sched.gradient_state.sync_gradients else 1):
            once(*args, **kwargs)

    sched.step = step


class _TrainLoader(DataLoaderShard):
    """Accelerate's loader (device placement, the end-of-epoch state ``accumulate`` reads) over a
    loader whose batch sampler already gives this rank its share; ``before_batch`` runs before each
    batch the loop receives (a step boundary)."""

    def __init__(self, *args: Any, before_batch: Callable[[], None], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._before_batch = before_batch

    def __iter__(self):
        for batch in super().__iter__():
            self._before_batch()
            yield batch


def train_loader(
    loader: torch.utils.data.DataLoader,
    device: torch.device | None,
    non_blocking: bool,
    before_batch: Callable[[], None],
) -> DataLoaderShard:
    """``loader`` (its dataset, batch sampler, workers, collate function, ...) as a DataLoaderShard."""
    kw = {
        k: getattr(loader, k)
        for k in (
            "num_workers",
            "collate_fn",
            "pin_memory",
            "timeout",
            "worker_init_fn",
            "multiprocessing_context",
            "generator",
            "persistent_workers",
            "pin_memory_device",
        )
    }
    if loader.num_workers:
        kw["prefetch_factor"] = loader.prefetch_factor
    return _TrainLoader(
        loader.dataset,
        device=device,
        batch_sampler=loader.batch_sampler,
        _non_blocking=non_blocking,
        before_batch=before_batch,
        **kw,
    )
