"""Any DataLoader's workers die with their rank, not after torch's 5 s check of the parent.

A worker forked after the process groups holds copies of the rank's sockets: while it lives, a
peer blocked in a collective with the dead rank sees no error. A loader handed to the loop gets
:class:`WorkerInit`; every other loader's workers (a lower-level loop, a framework's own) are
covered by the fork hook the rank installs when its process groups exist."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import runs
from tests.fixtures.procs import free_port

SCRIPT = r"""
import os, sys, time
import torch
from torch.utils.data import DataLoader
if sys.argv[1] == "rank":
    from elastic_trainer.config import TrainConfig
    from elastic_trainer.runtime.session import init_distributed
    init_distributed(TrainConfig(device="cpu"), timeout_seconds=30)
it = iter(DataLoader(range(64), num_workers=1))  # a loader the loop never sees
next(it)
print(" ".join(str(w.pid) for w in it._workers), flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def _worker_after_rank_killed(mode: str, wait: float) -> tuple[int, float | None]:
    """Start the script, SIGKILL it once its loader's worker runs; seconds until the worker is
    gone (None: still alive after ``wait``)."""
    env = runs.env_for_tests(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    )
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE, text=True, env=env)
    try:
        (worker,) = (int(p) for p in proc.stdout.readline().split())
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(10)
        while time.monotonic() - killed < wait:
            if not _alive(worker):
                return worker, time.monotonic() - killed
            time.sleep(0.005)
        return worker, None
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_loader_the_loop_never_saw_loses_its_workers_with_the_rank():
    worker, gone = _worker_after_rank_killed("rank", wait=1.0)
    assert gone is not None, f"the rank's DataLoader worker {worker} outlived it by more than 1 s"
    # the control: without the rank's hook, torch's own check of the parent keeps it alive longer
    worker, gone = _worker_after_rank_killed("plain", wait=1.0)
    try:
        assert gone is None, f"a plain process's loader worker died {gone:.2f}s after it: the control proves nothing"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
