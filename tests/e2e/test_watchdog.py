"""Hang watchdog: a worker stopped from outside (SIGSTOP, at whatever point it happens to be)
must be detected within ``elastic.hang_timeout_seconds``, the group torn down and restarted,
and the job finish; the supervisor itself must survive the reap (torch's watchdog would
SIGKILL it). The self-inflicted SIGSTOP at a step boundary, with losses checked against a
reference, is the ``sigstop_hang`` row of the chaos table."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests import runs

pytestmark = pytest.mark.timing  # a tight wall-clock bound: run alone (scripts/pytest.sh)

HANG_TIMEOUT = 8.0


# Soak: test_own_script hangs a rank under `run` (the same supervisor, watchdog and step context
# as `launch`), checks the detection bound and the bitwise resume in every run.
@pytest.mark.soak
def test_sigstopped_worker_is_reaped_and_the_group_restarts(token_file, tmp_path):
    run_dir = tmp_path / "run"
    cfg = runs.write_config(
        tmp_path / "hang.toml",
        token_file,
        run_dir,
        train={"steps": 40},
        checkpoint={"interval_steps": 5},
        elastic={"max_restarts": 2, "hang_timeout_seconds": HANG_TIMEOUT},
    )
    proc = runs.start_launch(cfg)
    try:
        runs.wait_event(run_dir, "checkpoint_committed", 180, proc, where=lambda r: r["step"] >= 5)
        victim = runs.worker_pids(proc.pid)[-1]
        stopped_at = time.time()
        os.kill(victim, signal.SIGSTOP)
        restart = runs.wait_event(run_dir, "restart", HANG_TIMEOUT + 30, proc)
        detect = restart["time"] - stopped_at
        assert detect <= HANG_TIMEOUT + 5, f"hang detected after {detect:.1f}s (timeout {HANG_TIMEOUT}s)"
        assert restart["reason"] == "worker_failure"
        assert not os.path.exists(f"/proc/{victim}") or open(f"/proc/{victim}/stat").read().split()[2] == "Z"
        assert proc.wait(240) == 0, (tmp_path / "hang.log").read_text()[-3000:]
    finally:
        runs.stop(proc)
    events = runs.read_events(run_dir)
    assert [e["step"] for e in events if e["event"] == "finished"] == [40]
    resumes = [e for e in events if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] >= 5, resumes
    print(
        f"\nwatchdog: SIGSTOP → restart in {detect:.2f}s (hang_timeout "
        f"{HANG_TIMEOUT}s), resumed from step {resumes[0]['step']}"
    )
