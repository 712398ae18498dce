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
import ctypes, os, sys, time
import torch
from torch.utils.data import DataLoader
if sys.argv[1] == "rank":
    from elastic_trainer.config import TrainConfig
    from elastic_trainer.runtime.session import init_distributed
    init_distributed(TrainConfig(device="cpu"), timeout_seconds=30)

def report(worker_id):  # the worker's parent-death signal, as the kernel has it (PR_GET_PDEATHSIG)
    sig = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(sig), 0, 0, 0)
    print(f"pdeathsig {sig.value}", flush=True)

it = iter(DataLoader(range(64), num_workers=1, worker_init_fn=report))  # a loader the loop never sees
next(it)
print(" ".join(str(w.pid) for w in it._workers), flush=True)
time.sleep(120)
"""


def _worker_after_rank_killed(mode: str, wait: float) -> tuple[int, int, float | None]:
    """Start the script, SIGKILL it once its loader's worker runs: the worker's pid, its
    parent-death signal, and the seconds until it is gone (None: still alive after ``wait``)."""
    env = runs.env_for_tests(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    )
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE, text=True, env=env)
    try:
        lines = [proc.stdout.readline().split() for _ in range(2)]
        (deathsig,) = (int(w[1]) for w in lines if w[0] == "pdeathsig")
        (worker,) = (int(w[0]) for w in lines if w[0] != "pdeathsig")
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(10)
        while time.monotonic() - killed < wait:
            if not runs.alive(worker):
                return worker, deathsig, time.monotonic() - killed
            time.sleep(0.005)
        return worker, deathsig, None
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_loader_the_loop_never_saw_loses_its_workers_with_the_rank():
    worker, deathsig, gone = _worker_after_rank_killed("rank", wait=1.0)
    assert deathsig == signal.SIGKILL, f"the rank's DataLoader worker has parent-death signal {deathsig}"
    assert gone is not None, f"the rank's DataLoader worker {worker} outlived it by more than 1 s"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_process_without_process_groups_leaves_its_forks_alone():
    """The control: the hook is the rank's, installed with its process groups; a plain process's
    loader workers keep torch's behaviour (no parent-death signal)."""
    worker, deathsig, _ = _worker_after_rank_killed("plain", wait=0.0)
    try:
        assert deathsig == 0, deathsig
    finally:
        if runs.alive(worker):
            os.kill(worker, signal.SIGKILL)
