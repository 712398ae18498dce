"""Fault injection by (kind, rank, step, restart) for the chaos suite and tests.

Enabled only through ``ELASTIC_TRAINER_INJECT_FAULT``, a comma-separated list of
``KIND@rank=R,step=S[,restart=N]`` entries separated by ``;``. Kinds:

* ``raise``   — raise RuntimeError at the start of step S on rank R;
* ``kill``    — SIGKILL this worker at the start of step S;
* ``hang``    — SIGSTOP this worker at the start of step S (a silent hang);
* ``kill_in_save`` — SIGKILL rank R right after it starts the async save of step S;
* ``kill_before_commit`` — SIGKILL rank 0 after every shard of step S is written but before
  the manifest is (the commit thread);
* ``kill_in_load`` — SIGKILL rank R while it loads a checkpoint (before ``dcp.load`` returns);
* ``nan``     — make rank R's loss (and so its gradients) NaN at step S (non-finite guard tests),
  once per process: a rollback retries step S with other samples, which are finite (as after a
  real bad batch); two entries (steps S and S+1) make a second event before the next save;
* ``lose_local`` — rank R's node-local checkpoint copies (``checkpoint.local_dir``) vanish and
  the worker is SIGKILLed at the start of step S (a node lost with its local storage);
* ``corrupt_local`` — 64 bytes in the middle of the shard of every committed local copy of rank R
  are overwritten (same size) and the worker is SIGKILLed at the start of step S;
* ``slow`` — rank R sleeps ``seconds=X`` (default 0.2) at the start of every step from S on (a
  straggler: ``slow@rank=1,step=1,seconds=0.3``).

``restart`` defaults to 0 (only the first incarnation). Never set this in production.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from dataclasses import dataclass

from . import contract

KINDS = (
    "raise",
    "kill",
    "hang",
    "kill_in_save",
    "kill_before_commit",
    "kill_in_load",
    "nan",
    "slow",
    "lose_local",
    "corrupt_local",
)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    restart: int = 0
    seconds: float = 0.2


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        kind, _, rest = item.partition("@")
        if kind not in KINDS:
            raise ValueError(f"{contract.INJECT_FAULT_ENV}: unknown fault kind {kind!r} (known: {', '.join(KINDS)})")
        kv = dict(p.split("=", 1) for p in rest.split(",") if p)
        faults.append(
            Fault(
                kind,
                int(kv.get("rank", 0)),
                int(kv.get("step", 0)),
                int(kv.get("restart", 0)),
                float(kv.get("seconds", 0.2)),
            )
        )
    return faults


def _active() -> list[Fault]:
    spec = os.environ.get(contract.INJECT_FAULT_ENV, "")
    return parse(spec) if spec else []


_FIRED: set[Fault] = set()  # one-shot faults (``nan``) that already fired in this process


def active(kind: str, step: int) -> bool:
    """Whether a fault of ``kind`` is configured at ``step`` for this rank and incarnation."""
    faults = _active()
    if not faults:
        return False
    rank = int(os.environ.get(contract.RANK_ENV, "0"))
    restart = int(os.environ.get(contract.RESTART_COUNT_ENV, "0"))
    for f in faults:
        if f.kind == kind and f.rank == rank and f.step == step and f.restart == restart and f not in _FIRED:
            if kind == "nan":
                _FIRED.add(f)
            return True
    return False


def maybe_inject(kind: str, step: int) -> None:
    """Trigger a configured fault of ``kind`` at ``step`` for this rank and incarnation."""
    if kind == "slow":
        rank = int(os.environ.get(contract.RANK_ENV, "0"))
        restart = int(os.environ.get(contract.RESTART_COUNT_ENV, "0"))
        for f in _active():
            if f.kind == "slow" and f.rank == rank and f.step <= step and f.restart == restart:
                time.sleep(f.seconds)
        return
    if not active(kind, step):
        return
    if kind == "raise":
        raise RuntimeError(f"injected failure on rank {os.environ.get(contract.RANK_ENV, '0')} at step {step}")
    if kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_damage_local(step: int, list_copies) -> None:
    """``lose_local`` / ``corrupt_local`` at ``step``: ``list_copies()`` gives this rank's local
    copy directories, newest first (listed only when such a fault fires)."""
    if active("lose_local", step):
        for d in list_copies():
            shutil.rmtree(d, ignore_errors=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if active("corrupt_local", step):
        for d in list_copies():
            shards = sorted(n for n in os.listdir(d) if n.endswith(".distcp"))
            if shards and os.path.exists(os.path.join(d, "manifest.json")):  # every committed copy
                path = os.path.join(d, shards[0])
                with open(path, "r+b") as f:
                    f.seek(os.path.getsize(path) // 2)
                    f.write(b"\xa5" * 64)
                    f.flush()
                    os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
