"""DCP save-plan caching through the checkpoint manager (checkpoint/save_planner.py).

Real gloo ranks, the real manager (sync saves, checksummed writer, catalog commit). The state's
local shard shapes change between saves (a reshard: 8 → 12 rows over 2 ranks); every
checkpoint must load back exactly. The same scenario with a planner whose cache never notices a
change (stale) must fail, so the check can tell a stale cache from a correct one.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import run_ranks


class _Tensors:
    """A Stateful holding a dict of DTensors (the shapes are what the test changes)."""

    def __init__(self):
        self.t: dict = {}

    def state_dict(self):
        return dict(self.t)

    def load_state_dict(self, sd):
        for k, v in sd.items():
            self.t[k].copy_(v)


def _state(mesh, rows: int, base: float, zero: bool = False) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + base
    if zero:
        full = torch.zeros_like(full)
    return {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "b": distribute_tensor(full[:, 0].contiguous() * 2, mesh, [Shard(0)]),
    }


def _scenario(rank, world, root, stale):
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_trainer.checkpoint import save_planner
    from elastic_trainer.config import config_from_dict
    from tests.dist.workloads import TINY, one_state_manager

    if stale:

        class StalePlanner(save_planner.CachingSavePlanner):
            def create_local_plan(self):
                plan = super().create_local_plan()
                if self._cached_plans_key in SavePlanner._cached_save_plan:
                    return SavePlan([], usable=False)  # "unchanged", whatever changed
                return plan

        save_planner.make = StalePlanner

    mesh = init_device_mesh("cpu", (world,))
    cfg = config_from_dict(TINY)
    ccfg = dataclasses.replace(cfg.checkpoint, dir=root, mode="sync", keep_last=10)
    holder = _Tensors()
    group = dist.new_group(backend="gloo")
    mgr = one_state_manager(ccfg, root, holder, rank, world, group)
    mgr.load()
    plan = [(1, 8, 0.0), (2, 8, 100.0), (3, 12, 1000.0), (4, 12, 5000.0)]
    cached = []
    for step, rows, base in plan:
        holder.t = _state(mesh, rows, base)
        mgr.save(step, blocking=True)
        cached.append(SavePlanner._cached_save_plan.get(mgr.remote._plan_key))
    # the cache is used (same local plan object kept when nothing changed) and replaced on a change
    reuse = [cached[1] is cached[0], cached[2] is cached[1], cached[3] is cached[2]]
    key = mgr.remote._plan_key
    mgr.close()
    forgotten = key not in save_planner.cached_keys()

    loaded = {}
    for step, rows, base in plan:
        holder.t = _state(mesh, rows, 0.0, zero=True)
        m = one_state_manager(ccfg, root, holder, rank, world, group)
        try:
            res = m.load(resume=str(step))
            want = _state(mesh, rows, base)
            ok = (
                res is not None
                and res.step == step
                and all(torch.equal(holder.t[k].full_tensor(), want[k].full_tensor()) for k in want)
            )
        except Exception as e:  # noqa: BLE001 - a stale checkpoint may fail to load at all
            ok = f"{type(e).__name__}: {e}"[:200]
        finally:
            m.close()
        loaded[step] = ok
    return {"reuse": reuse, "forgotten": forgotten, "loaded": loaded}


def test_plan_cache_reused_and_invalidated_by_a_reshard(tmp_path):
    out = run_ranks(_scenario, 2, str(tmp_path / "ckpt"), False, timeout=180)
    for r in out:
        assert r["reuse"] == [True, False, True], r  # hit, invalidated by the new shapes, hit again
        assert r["forgotten"]
        assert r["loaded"] == {1: True, 2: True, 3: True, 4: True}, r["loaded"]


def test_a_stale_plan_cache_is_caught_by_the_same_check(tmp_path):
    out = run_ranks(_scenario, 2, str(tmp_path / "ckpt"), True, timeout=180)
    loaded = out[0]["loaded"]
    assert loaded[1] is True and loaded[2] is True  # same shapes: a stale cache is still right
    assert loaded[3] is not True and loaded[4] is not True, loaded  # new shapes under the old plan


def test_cache_keys_are_per_manager_and_forgotten():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlanner

    from elastic_trainer.checkpoint import save_planner

    a, b = save_planner.new_key(), save_planner.new_key()
    assert a != b
    p = save_planner.make(a)
    # the torch internals this module relies on (fails loudly if a release changes them)
    assert isinstance(p, DefaultSavePlanner) and p._cached_plans_key == a and p._enable_plan_caching
    for name in save_planner._CACHES:
        assert isinstance(getattr(SavePlanner, name), dict)
    SavePlanner._cached_all_plans[a] = []
    assert a in save_planner.cached_keys()
    save_planner.forget(a)
    assert a not in save_planner.cached_keys()


@pytest.mark.parametrize(
    "cached_len, usable, refused",
    [(None, [True, True], False), (None, [True, False], True), (2, [False, False], False), (3, [False, False], True)],
)
def test_coordinator_refuses_caches_out_of_step(cached_len, usable, refused):
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

    from elastic_trainer.checkpoint import save_planner

    key = save_planner.new_key()
    if cached_len is not None:
        SavePlanner._cached_all_plans[key] = [SavePlan([])] * cached_len
        SavePlanner._cached_global_plan[key] = [SavePlan([])] * cached_len
        SavePlanner._cached_metadata[key] = object()
    p = save_planner.make(key)
    plans = [SavePlan([], usable=u, planner_data={}) for u in usable]
    try:
        if refused:
            with pytest.raises(ValueError, match="out of step"):
                p.create_global_plan(plans)
            assert key not in save_planner.cached_keys()
        else:
            p.create_global_plan(plans)
    finally:
        save_planner.forget(key)
