"""checkpoint.writer = "process": saves written by a persistent writer process per rank.

Two real gloo ranks, the real manager (async saves, shared-memory staging, checksummed writer,
rank 0's commit). Checked: a save commits with per-item checksums and loads back exactly through
the verifying reader; the writer process is reused by the next save; a writer that died between
saves is replaced before the next save (agreed by every rank, ``checkpoint_writer_restarted``)
and that save commits; a writer killed while it writes fails that save visibly
(``checkpoint_failed``, ``finish`` → False) and the next save, on fresh writers, commits; a writer
stuck (SIGSTOP) past the save's deadline is stopped on every rank at the next save, which fails the
stuck save and commits. The writers start at the first step's agreement, before any save, and
that save uses them; a start stopped while under way leaves no process behind; a start that
fails on one rank gets every rank's writer replaced before the save, which commits; a save
before the first step starts them itself and that step starts no second one. Also
the private torch seam of ``checkpoint/writer_process.py`` (fails loudly when torch moves it).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import run_ranks
from tests.dist.workloads import Tensors as _Tensors


def _state(mesh, base: float, rows: int = 64) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(rows * 256, dtype=torch.float32).reshape(rows, 256) + base
    return {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "b": distribute_tensor(full[:, 0].contiguous(), mesh, [Shard(0)]),
    }


def _scenario(rank, world, root):
    from torch.distributed.checkpoint import _async_process_executor
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_trainer.checkpoint import writer_process
    from elastic_trainer.config import config_from_dict
    from elastic_trainer.events import EventLog
    from tests.dist.workloads import TINY, one_state_manager

    assert hasattr(_async_process_executor, "_CHECKPOINT_PROCESS"), "torch moved DCP's writer-process slot"
    mesh = init_device_mesh("cpu", (world,))
    cfg = config_from_dict({**TINY, "checkpoint": {"dir": root, "mode": "async", "writer": "process", "keep_last": 10}})
    holder = _Tensors(_state(mesh, 0.0))
    group = dist.new_group(backend="gloo")
    events = EventLog(os.path.join(root, "events.jsonl") if rank == 0 else None)

    def manager():
        return one_state_manager(cfg.checkpoint, root, holder, rank, world, group, events=events)

    mgr = manager()
    mgr.load()
    out = {}

    def save(step: int, kill_writer_of: int | None = None) -> bool:
        holder.t = _state(mesh, float(step))
        mgr.save(step)
        if rank == kill_writer_of:
            proc = _async_process_executor._CHECKPOINT_PROCESS._save_process  # the seam writer_process uses
            os.kill(proc.pid, signal.SIGKILL)
        mgr.wait_for_staging()
        return mgr.finish(timeout=120)

    out["first"] = save(1)
    first_pid = writer_process.pid()
    out["reused"] = save(2) and writer_process.pid() == first_pid and first_pid != os.getpid()
    if rank == 1:  # dies between saves
        os.kill(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while writer_process.healthy() and time.monotonic() < deadline:
            time.sleep(0.05)
    out["after_death"] = save(3)
    out["new_pid"] = writer_process.pid() not in (None, first_pid)
    out["killed_mid_save"] = save(4, kill_writer_of=1)
    out["after_kill"] = save(5)
    # a stuck writer (stopped by SIGSTOP) past the save's deadline: training is not held up, and
    # the next save stops every writer, fails the stuck save and commits on fresh writers
    mgr.cfg = dataclasses.replace(mgr.cfg, save_timeout_seconds=2.0)
    holder.t = _state(mesh, 6.0)
    mgr.save(6)
    mgr.wait_for_staging()
    if rank == 1:
        os.kill(writer_process.pid(), signal.SIGSTOP)
    time.sleep(2.5)  # past the deadline of save 6
    t0 = time.monotonic()
    out["after_stuck"] = save(7)
    out["stuck_handled_in"] = time.monotonic() - t0
    mgr.close()
    out["stopped"] = not writer_process.started()
    # every committed step loads back exactly through the verifying reader
    out["loaded"] = _loaded_back(manager, holder, mesh, (1, 2, 3, 5, 7))
    return out


def _loaded_back(manager, holder: _Tensors, mesh, steps) -> dict[int, bool]:
    """Per step: a new manager resumes it and the state equals what was saved at it."""
    loaded = {}
    for step in steps:
        holder.t = {k: torch.zeros_like(v) for k, v in _state(mesh, 0.0).items()}
        m = manager()
        res = m.load(resume=str(step))
        loaded[step] = (
            res is not None
            and res.step == step
            and all(
                torch.equal(holder.t[k].full_tensor(), v.full_tensor()) for k, v in _state(mesh, float(step)).items()
            )
        )
        m.close()
    return loaded


def _run(scenario, tmp_path) -> tuple[str, list]:
    """``scenario`` on 2 gloo ranks that may start writer processes, in a new checkpoint root."""
    root = str(tmp_path / "ckpt")
    os.makedirs(root)
    return root, run_ranks(scenario, 2, root, timeout=300, daemon=False)


def test_process_writer_commits_checksummed_saves_and_restarts_a_dead_writer(tmp_path):
    root, results = _run(_scenario, tmp_path)
    for r in results:
        assert (
            r["first"]
            and r["reused"]
            and r["after_death"]
            and r["new_pid"]
            and r["after_kill"]
            and r["after_stuck"]
            and r["stopped"]
        ), r
        assert r["killed_mid_save"] is False, "a writer killed while writing fails that save"
        assert r["stuck_handled_in"] < 60, r
        assert r["loaded"] == {1: True, 2: True, 3: True, 5: True, 7: True}
    events = [json.loads(line) for line in open(os.path.join(root, "events.jsonl"))]
    names = [(e["event"], e.get("step")) for e in events if e["event"].startswith("checkpoint_")]
    committed = [s for n, s in names if n == "checkpoint_committed"]
    assert committed == [1, 2, 3, 5, 7], names
    assert [e["step"] for e in events if e["event"] == "checkpoint_failed"] == [4, 6], names
    restarts = [e for e in events if e["event"] == "checkpoint_writer_restarted"]
    assert [r["reason"] for r in restarts] == ["a writer process died or failed a save"] * 2 + [
        "still writing past its deadline"
    ], restarts
    manifest = json.load(
        open(os.path.join(root, sorted(d for d in os.listdir(root) if d.startswith("step-"))[0], "manifest.json"))
    )
    items = [i for f in manifest["files"].values() for i in f.get("items", [])]
    assert items and all(len(i) == 3 for i in items), "per-item checksums written by the writer process"


def _agree(mgr) -> None:
    """What every rank gets from the step's all-reduce (``runtime/step.py``: ``Step.agree``)."""
    from elastic_trainer.checkpoint.agreement import SaveVotes

    t = torch.tensor(mgr.votes().as_list(), dtype=torch.float64)
    dist.all_reduce(t)
    mgr.agreed(SaveVotes.from_list(t.tolist()))


def _writer_children() -> list:
    """This process's writer processes, started or being started (its only children here)."""
    return multiprocessing.active_children()


def _prestart_scenario(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_trainer.checkpoint import writer_process
    from elastic_trainer.config import config_from_dict
    from elastic_trainer.events import EventLog
    from tests.dist.workloads import TINY, one_state_manager

    mesh = init_device_mesh("cpu", (world,))
    cfg = config_from_dict({**TINY, "checkpoint": {"dir": root, "mode": "async", "writer": "process", "keep_last": 10}})
    holder = _Tensors(_state(mesh, 0.0))
    group = dist.new_group(backend="gloo")
    events = EventLog(os.path.join(root, "events.jsonl") if rank == 0 else None)
    out = {}

    def manager():
        m = one_state_manager(cfg.checkpoint, root, holder, rank, world, group, events=events)
        m.load()
        return m

    def save(mgr, step: int) -> bool:
        holder.t = _state(mesh, float(step))
        _agree(mgr)
        mgr.save(step)
        mgr.wait_for_staging()
        return mgr.finish(timeout=120)

    mgr = manager()
    out["none_before_first_step"] = writer_process.pid() is None and not _writer_children()
    _agree(mgr)  # the first step
    writer_process.wait_started(60)
    first_pid = writer_process.pid()
    out["up_before_save"] = first_pid is not None and writer_process.healthy()
    out["first"] = save(mgr, 1)
    out["same_writer"] = writer_process.pid() == first_pid
    mgr.close()
    out["closed"] = not writer_process.started() and not _writer_children()

    mgr = manager()  # a start stopped while under way
    _agree(mgr)
    out["was_starting"] = writer_process.pid() is None
    mgr.close()
    out["cancelled"] = not writer_process.started() and not _writer_children()

    mgr = manager()  # a start that fails on rank 1
    _agree(mgr)
    if rank == 1:
        deadline = time.monotonic() + 30
        while not _writer_children() and time.monotonic() < deadline:
            time.sleep(0.01)
        for p in _writer_children():
            p.kill()
        deadline = time.monotonic() + 30
        while writer_process.healthy() and time.monotonic() < deadline:
            time.sleep(0.05)
        out["start_failed"] = not writer_process.healthy()
    out["after_failed_start"] = save(mgr, 2)
    out["replaced"] = writer_process.pid() not in (None, first_pid)
    # rank 0's start, waiting for a rank-1 writer that never came, was stopped, its process killed
    out["only_the_new_writer"] = [p.pid for p in _writer_children()] == [writer_process.pid()]
    mgr.close()

    mgr = manager()  # a save before the first step starts the writers itself; that step starts none
    holder.t = _state(mesh, 3.0)
    mgr.save(3)
    _agree(mgr)  # while DCP is still starting the writer of save 3
    out["no_second_start"] = writer_process._starting is None
    mgr.wait_for_staging()
    out["saved_before_first_step"] = mgr.finish(timeout=120)
    out["one_writer"] = len(_writer_children()) == 1
    mgr.close()
    out["loaded"] = _loaded_back(
        lambda: one_state_manager(cfg.checkpoint, root, holder, rank, world, group), holder, mesh, (1, 2, 3)
    )
    return out


# Soak: the process writer's commits and the replacement of a dead writer are proven on every run by
# test_process_writer_commits_checksummed_saves_and_restarts_a_dead_writer; this adds its start's edge cases.
@pytest.mark.soak
def test_the_writers_start_at_the_first_step_and_a_failed_or_stopped_start_is_replaced(tmp_path):
    root, results = _run(_prestart_scenario, tmp_path)
    for r in results:
        assert r["none_before_first_step"] and r["up_before_save"] and r["first"] and r["same_writer"], r
        assert r["closed"] and r["was_starting"] and r["cancelled"], r
        assert r["after_failed_start"] and r["replaced"] and r["only_the_new_writer"], r
        assert r["saved_before_first_step"] and r["no_second_start"] and r["one_writer"], r
        assert r["loaded"] == {1: True, 2: True, 3: True}, r
    assert results[1]["start_failed"], results[1]
    events = [json.loads(line) for line in open(os.path.join(root, "events.jsonl"))]
    names = [(e["event"], e.get("step")) for e in events if e["event"].startswith("checkpoint_")]
    assert [s for n, s in names if n == "checkpoint_committed"] == [1, 2, 3], names
    assert not [s for n, s in names if n == "checkpoint_failed"], names
    restarts = [e["reason"] for e in events if e["event"] == "checkpoint_writer_restarted"]
    assert restarts == ["a writer process died or failed a save"], restarts


def _one_rank_out_of_shm_scenario(rank, world, root):
    """Rank 1 cannot stage save 1 in shared memory (torch's error, raised by the copy); rank 0
    stages it and its writer waits in DCP's collectives for rank 1's writer, which never gets the
    request. The next save stops every writer at once (not at save 1's 600 s deadline), every
    rank goes on with the thread writer, and that save commits."""
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_trainer.checkpoint import writer_process
    from elastic_trainer.config import config_from_dict
    from elastic_trainer.events import EventLog
    from tests.dist.workloads import TINY, one_state_manager

    mesh = init_device_mesh("cpu", (world,))
    cfg = config_from_dict({**TINY, "checkpoint": {"dir": root, "mode": "async", "writer": "process", "keep_last": 10}})
    holder = _Tensors(_state(mesh, 0.0))
    group = dist.new_group(backend="gloo")
    events = EventLog(os.path.join(root, "events.jsonl") if rank == 0 else None)
    mgr = one_state_manager(cfg.checkpoint, root, holder, rank, world, group, events=events)
    mgr.load()
    _agree(mgr)  # the first step starts the writers
    writer_process.wait_started(60)
    if rank == 1:
        stager = mgr.remote._stager.get()

        def no_room(state_dict):
            raise RuntimeError("unable to allocate shared memory(shm) for file </torch_0_1>: No space left on device")

        stager._deep.stage = no_room
    out = {}
    holder.t = _state(mesh, 1.0)
    mgr.save(1)
    mgr.wait_for_staging()
    if rank == 1:  # its save failed at staging; rank 0's writer waits for rank 1's
        out["failed_here"] = mgr._inflight.wait(time.monotonic() + 30).name
    _agree(mgr)  # the next step's all-reduce: failed on one rank, still written on another
    t0 = time.monotonic()
    holder.t = _state(mesh, 2.0)
    mgr.save(2)
    out["save_call"] = time.monotonic() - t0
    mgr.wait_for_staging()
    out["second"] = mgr.finish(timeout=120)
    out["thread_writer"] = not mgr.remote.uses_writer_process and not _writer_children()
    mgr.close()
    out["loaded"] = _loaded_back(
        lambda: one_state_manager(cfg.checkpoint, root, holder, rank, world, group), holder, mesh, (2,)
    )
    return out


def test_one_rank_without_shared_memory_stops_every_writer_at_the_next_save(tmp_path):
    root, results = _run(_one_rank_out_of_shm_scenario, tmp_path)
    for r in results:
        assert r["second"] and r["thread_writer"] and r["loaded"] == {2: True}, r
        assert r["save_call"] < 60, r  # not save 1's deadline (600 s)
    assert results[1]["failed_here"] == "FAILED", results[1]
    events = [json.loads(line) for line in open(os.path.join(root, "events.jsonl"))]
    names = [(e["event"], e.get("step")) for e in events if e["event"].startswith("checkpoint_")]
    assert [s for n, s in names if n == "checkpoint_committed"] == [2], names
    assert [s for n, s in names if n == "checkpoint_failed"] == [1], names
    (fallback,) = [e for e in events if e["event"] == "checkpoint_writer_fallback"]
    assert fallback["writer"] == "thread" and "shared memory" in fallback["reason"], fallback
