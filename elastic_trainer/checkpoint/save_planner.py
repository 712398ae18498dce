"""DCP's save-plan caching, scoped to one checkpoint manager.

``DefaultSavePlanner(enable_plan_caching=True)`` lets a rank whose local plan is unchanged
since the previous save send an empty plan to the coordinator, and the coordinator scatter an
empty delta back: the planning gather/scatter of the save then moves almost nothing, and the
coordinator does not rebuild the global plan and metadata. A rank whose plan changed (a tensor
whose local shard has another shape, a new or missing key) sends its full plan and DCP merges
it into the cache (``_compare_save_plans`` compares every item's key, size and chunk).

DCP keeps the cache in *class-level* dicts keyed by the planner's class name, i.e. shared by
every save in the process. Two saves that should not share it would then merge plans of
different worlds (``_merge_delta_local_plans`` zips the cached plans with the new ones and
silently drops the extra ranks) or different state. :func:`new_key` gives each manager its own
key instead, and :func:`forget` drops a manager's entries when it closes.

Relies on ``DefaultSavePlanner._cached_plans_key`` and the ``SavePlanner._cached_*`` dicts
(tests/dist/test_plan_cache.py fails loudly if a torch release changes them).
"""

from __future__ import annotations

import itertools
import os

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

_CACHES = (
    "_cached_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
    "_cached_final_save_plan",
)
_counter = itertools.count()


def new_key() -> str:
    """A cache key unique in this process (and across forks: the pid is part of it)."""
    return f"elastic_trainer.{os.getpid()}.{next(_counter)}"


class CachingSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` with plan caching under ``key`` (one key per manager)."""

    def __init__(self, key: str):
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = key

    def create_global_plan(self, all_plans):
        """Coordinator. Refuses (fails the save, never writes a wrong ``.metadata``) when the
        ranks' caches are out of step: a rank sent "unchanged" but the coordinator has nothing
        cached for it (e.g. the coordinator dropped its cache after a failed save that another
        rank did not see fail), or the cached plans are for another world size."""
        cached = SavePlanner._cached_all_plans.get(self._cached_plans_key)
        unchanged = any(not p.usable for p in all_plans)
        if (cached is None and unchanged) or (cached is not None and len(cached) != len(all_plans)):
            forget(self._cached_plans_key)
            raise ValueError("save plan cache out of step between ranks; the next save plans from scratch")
        return super().create_global_plan(all_plans)


def make(key: str) -> DefaultSavePlanner:
    """The planner for one save of the manager owning ``key``."""
    return CachingSavePlanner(key)


def cached_keys() -> set[str]:
    """Keys that currently hold cached plans in this process (for tests)."""
    out: set[str] = set()
    for name in _CACHES:
        out |= set(getattr(SavePlanner, name))
    return out


def forget(key: str) -> None:
    """Drop every cached plan of ``key`` (its next save plans from scratch)."""
    for name in _CACHES:
        getattr(SavePlanner, name).pop(key, None)
