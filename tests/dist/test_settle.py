"""A rank whose part of a save is done waits for the others without timing out.

Two real gloo ranks, the real manager (thread writer, checksummed DCP save, rank 0's commit).
Rank 0's commit is held for longer than the training group's collective timeout (a manifest
write on slow storage, retention on a slow object store). Rank 1's part is written at once, so it
reaches the agreement about the save long before rank 0 does. It must wait with rank 0 (the
ranks agree every ``SETTLE_POLL_SECONDS``) instead of sitting in one all-reduce until the
training group's timeout kills it: storage time is never hang time, also when it is one rank's.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import run_ranks
from tests.dist.workloads import Tensors as _Tensors

pytestmark = pytest.mark.timeout(300)

CONTROL_TIMEOUT_SECONDS = 3.0  # the training group's collective timeout in this test
COMMIT_HELD_SECONDS = 7.0  # rank 0's commit, held past it


def _scenario(rank, world, root):
    from elastic_trainer.config import config_from_dict
    from tests.dist.workloads import TINY, one_state_manager

    cfg = config_from_dict({**TINY, "checkpoint": {"dir": root, "mode": "async", "keep_last": 10}})
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_SECONDS))
    group = dist.new_group(backend="gloo")
    holder = _Tensors({"w": torch.arange(64, dtype=torch.float32) + rank})
    mgr = one_state_manager(cfg.checkpoint, root, holder, rank, world, group, control_group=control)
    mgr.load()
    released = threading.Event()
    if rank == 0:  # the commit thread waits here, past the training group's timeout
        commit = mgr.catalog.commit

        def held_commit(*args, **kwargs):
            released.wait(COMMIT_HELD_SECONDS)
            return commit(*args, **kwargs)

        mgr.catalog.commit = held_commit
    out = {}
    mgr.save(1)
    mgr.wait_for_staging()
    t0 = time.monotonic()
    out["first"] = mgr.finish(timeout=120)  # rank 1 is done at once; rank 0 commits ~7 s later
    out["waited"] = time.monotonic() - t0
    released.set()
    holder.t = {"w": holder.t["w"] + 100}
    mgr.save(2)  # and the ranks go on together
    mgr.wait_for_staging()
    out["second"] = mgr.finish(timeout=120)
    out["committed"] = mgr.verdicts.committed_everywhere(2)
    mgr.close()
    return out


def test_a_rank_done_with_its_part_waits_for_a_slow_commit_without_timing_out(tmp_path):
    root = str(tmp_path / "ckpt")
    os.makedirs(root)
    results = run_ranks(_scenario, 2, root, timeout=240)
    for r in results:
        assert r["first"] and r["second"] and r["committed"], r
        # both ranks waited for rank 0's commit, longer than the training group's timeout
        assert r["waited"] > CONTROL_TIMEOUT_SECONDS + 1, r
    steps = sorted(d for d in os.listdir(root) if d.startswith("step-"))
    assert len(steps) == 2 and all(os.path.exists(os.path.join(root, d, "manifest.json")) for d in steps), steps
