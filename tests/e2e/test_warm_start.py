"""Warm restarts (elastic.warm_start, the default for 'launch'): workers are forked from the
supervisor's pre-imported zygote, and a SIGKILLed group's replacements are fresh processes (new
PIDs, children of the zygote, which never trained and is single-threaded when it forks); with
warm_start = false the workers are the supervisor's own 'python -m' children, as torchrun starts them."""

from __future__ import annotations

import os
import signal
import time

from tests import runs


def _ppid(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def test_sigkilled_group_is_replaced_by_fresh_processes_forked_from_the_zygote(token_file, tmp_path):
    run = tmp_path / "run"
    cfg = runs.write_config(tmp_path / "c.toml", token_file, run, train={"steps": 12}, elastic={"max_restarts": 1})
    proc = runs.start_launch(cfg)
    try:
        runs.wait_event(run, "checkpoint_committed", 240, proc, where=lambda r: r["step"] >= 5)
        runs.wait_event(run, "step", 120, proc, where=lambda r: r["step"] >= 6)
        zygote = runs.zygote_pid(proc.pid)
        workers = runs.worker_pids(proc.pid)
        assert zygote is not None and _ppid(zygote) == proc.pid
        assert len(workers) == 2 and all(_ppid(w) == zygote for w in workers), "workers are the zygote's children"
        killed_at = time.time()
        os.kill(workers[-1], signal.SIGKILL)
        runs.wait_event(run, "resume", 240, proc, where=lambda r: r["time"] > killed_at)
        assert proc.wait(240) == 0, cfg.with_suffix(".log").read_text()[-4000:]
    finally:
        runs.stop(proc)
    started = runs.read_events(run, "workers_started")
    assert [w["warm"] for w in started] == [True, True], started
    assert {w["zygote_pid"] for w in started} == {zygote} and {w["zygote_threads"] for w in started} == {1}
    first, second = set(started[0]["pids"]), set(started[1]["pids"])
    assert first == set(workers) and len(second) == 2 and not first & second and zygote not in second
    starts = runs.read_events(run, "start")  # rank 0 writes the event log
    assert len(starts) == 2 and [s["pid"] in g for s, g in zip(starts, (first, second), strict=True)] == [True, True]
    (restart,) = runs.read_events(run, "restart")
    assert restart["reason"] == "worker_failure" and any(f["exit_code"] == -signal.SIGKILL for f in restart["failures"])
    (resume,) = runs.read_events(run, "resume")
    assert resume["step"] == 5 and resume["world_size"] == 2
    assert not runs.read_events(run, "warm_start_unavailable")
    assert not os.path.exists(f"/proc/{zygote}"), "the zygote ends with its supervisor"


def test_warm_start_false_starts_workers_cold(token_file, tmp_path):
    run = tmp_path / "run"
    cfg = runs.write_config(tmp_path / "c.toml", token_file, run, train={"steps": 3}, elastic={"warm_start": False})
    proc = runs.start_launch(cfg)
    try:
        runs.wait_event(run, "step", 240, proc)
        assert runs.zygote_pid(proc.pid) is None
        workers = runs.worker_pids(proc.pid)
        assert len(workers) == 2 and all(_ppid(w) == proc.pid for w in workers)
        assert proc.wait(240) == 0, cfg.with_suffix(".log").read_text()[-4000:]
    finally:
        runs.stop(proc)
    (started,) = runs.read_events(run, "workers_started")
    assert started["warm"] is False and started["zygote_pid"] is None and set(started["pids"]) == set(workers)
