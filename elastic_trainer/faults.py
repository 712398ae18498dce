"""Fault injection by (kind, rank, step, restart) for the chaos suite and tests.

Enabled only through ``ELASTIC_TRAINER_INJECT_FAULT``, a comma-separated list of
``KIND@rank=R,step=S[,restart=N][,committed=N]`` entries separated by ``;``. Kinds:

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
* ``corrupt_peer`` — from step S on, rank R's replicas (``checkpoint.peer_replicas``) reach the
  holders with 64 bytes of each shard flipped (same size; the signed manifest keeps the true
  checksum): what a holder whose memory went bad serves;
* ``bitflip`` — one bit of one element of rank R's model state flips right after the optimizer
  step of step S (the built-in trainer), once per process: a low mantissa bit of the first element
  of the first floating-point parameter shard the rank holds, so the value stays finite and close
  (silent data corruption: no guard sees it; ``ckpt audit`` finds it); ``bit=N`` flips bit N of
  its bit pattern instead (0 the lowest: ``bitflip@rank=1,step=13,bit=30`` flips a float32's top
  exponent bit); ``param=NAME`` picks the first parameter whose name contains NAME;
* ``slow`` — rank R sleeps ``seconds=X`` (default 0.2) at the start of every step from S on (a
  straggler: ``slow@rank=1,step=1,seconds=0.3``).

``restart`` defaults to 0 (only the first incarnation). ``committed=N`` (``raise``, ``kill``,
``hang``): the fault waits, at most :data:`COMMITTED_WAIT_SECONDS`, until the commit of step N is
in checkpoint.dir before it fires, so a test that kills a worker after a save resumes from that
save on any machine, however slow its background upload. Never set this in production.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from . import contract

logger = logging.getLogger(__name__)

KINDS = (
    "raise",
    "kill",
    "hang",
    "kill_in_save",
    "kill_before_commit",
    "kill_in_load",
    "nan",
    "bitflip",
    "slow",
    "lose_local",
    "corrupt_local",
    "corrupt_peer",
)
COMMITTED_WAIT_SECONDS = 30.0  # ``committed=N``: the longest wait for that commit before firing
ONE_SHOT = ("nan", "bitflip")  # fire once per process (a rollback redoes the step without them)
BITFLIP_BITS = {8: 20, 4: 10, 2: 2}  # element size -> the mantissa bit ``bitflip`` flips


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    restart: int = 0
    seconds: float = 0.2
    committed: int | None = None  # fire only once the commit of this step is in checkpoint.dir
    bit: int | None = None  # bitflip: the bit to flip (default: a low mantissa bit, BITFLIP_BITS)
    param: str = ""  # bitflip: the first parameter whose name contains this (default: the first)


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        kind, _, rest = item.partition("@")
        if kind not in KINDS:
            raise ValueError(f"{contract.INJECT_FAULT_ENV}: unknown fault kind {kind!r} (known: {', '.join(KINDS)})")
        kv = dict(p.split("=", 1) for p in rest.split(",") if p)
        if not 0 <= int(kv.get("bit", 0)) < 64:
            raise ValueError(f"{contract.INJECT_FAULT_ENV}: bit={kv['bit']} is not a bit of an element (0-63)")
        faults.append(
            Fault(
                kind,
                int(kv.get("rank", 0)),
                int(kv.get("step", 0)),
                int(kv.get("restart", 0)),
                float(kv.get("seconds", 0.2)),
                int(kv["committed"]) if "committed" in kv else None,
                int(kv["bit"]) if "bit" in kv else None,
                kv.get("param", ""),
            )
        )
    return faults


def _active() -> list[Fault]:
    spec = os.environ.get(contract.INJECT_FAULT_ENV, "")
    return parse(spec) if spec else []


_FIRED: set[Fault] = set()  # one-shot faults (ONE_SHOT) that already fired in this process


def _match(kind: str, step: int) -> Fault | None:
    """The fault of ``kind`` configured at ``step`` for this rank and incarnation, if any."""
    faults = _active()
    if not faults:
        return None
    rank = int(os.environ.get(contract.RANK_ENV, "0"))
    restart = int(os.environ.get(contract.RESTART_COUNT_ENV, "0"))
    for f in faults:
        if f.kind == kind and f.rank == rank and f.step == step and f.restart == restart and f not in _FIRED:
            if kind in ONE_SHOT:
                _FIRED.add(f)
            return f
    return None


def active(kind: str, step: int) -> bool:
    """Whether a fault of ``kind`` is configured at ``step`` for this rank and incarnation."""
    return _match(kind, step) is not None


def maybe_flip_bit(step: int, named_parameters: Iterable[tuple[str, Any]]) -> str | None:
    """``bitflip`` at ``step``: flip one bit (a low mantissa bit, or the fault's ``bit``) of the
    first element of the first floating-point parameter shard this rank holds (a DTensor's local
    shard; the first whose name contains the fault's ``param``), in place, after the optimizer
    step. Returns the parameter's name when it fired, else None."""
    fault = _match("bitflip", step)
    if fault is None:
        return None
    import torch

    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}
    for name, p in named_parameters:
        local = p.to_local() if hasattr(p, "to_local") else p
        if fault.param in name and local.numel() and local.is_floating_point() and local.element_size() in ints:
            with torch.no_grad():
                flat = local.detach().view(-1)[:1].view(ints[local.element_size()])
                bit = BITFLIP_BITS[local.element_size()] if fault.bit is None else fault.bit
                flat.bitwise_xor_(1 << bit if bit < 8 * local.element_size() - 1 else -(1 << bit))
            logger.warning("injected bit flip in %s at step %d", name, step)
            return name
    return None


def _wait_committed(f: Fault, committed: Callable[[int], bool] | None) -> None:
    """``committed=N``: wait (bounded) until ``committed(N)`` says step N's commit is in storage."""
    if f.committed is None or committed is None:
        return
    deadline = time.monotonic() + COMMITTED_WAIT_SECONDS
    while not committed(f.committed):
        if time.monotonic() >= deadline:
            logger.warning("fault %s fires without the commit of step %d it waited for", f.kind, f.committed)
            return
        time.sleep(0.05)


def maybe_inject(kind: str, step: int, committed: Callable[[int], bool] | None = None) -> None:
    """Trigger a configured fault of ``kind`` at ``step`` for this rank and incarnation.
    ``committed(N)``: whether step N's commit is in checkpoint.dir (for ``committed=N``)."""
    if kind == "slow":
        rank = int(os.environ.get(contract.RANK_ENV, "0"))
        restart = int(os.environ.get(contract.RESTART_COUNT_ENV, "0"))
        for slow in _active():
            if slow.kind == "slow" and slow.rank == rank and slow.step <= step and slow.restart == restart:
                time.sleep(slow.seconds)
        return
    f = _match(kind, step)
    if f is None:
        return
    _wait_committed(f, committed)
    if kind == "raise":
        raise RuntimeError(f"injected failure on rank {os.environ.get(contract.RANK_ENV, '0')} at step {step}")
    if kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_damage_local(step: int, list_copies, settle: Callable[[], None]) -> None:
    """``lose_local`` / ``corrupt_local`` at ``step``: ``settle()`` first lets the save in flight
    land (a copy still being written when its directory is removed could finish into it before the
    kill: the damage would depend on timing), then ``list_copies()`` gives this rank's local copy
    directories, newest first (both called only when such a fault fires)."""
    if not (active("lose_local", step) or active("corrupt_local", step)):
        return
    settle()
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


def maybe_corrupt_replica(step: int, data: bytes) -> bytes:
    """``corrupt_peer``: ``data`` (a shard being replicated at ``step``) with 64 bytes flipped in
    its middle when the fault is configured for this rank at ``step`` or before, else ``data``."""
    rank = int(os.environ.get(contract.RANK_ENV, "0"))
    restart = int(os.environ.get(contract.RESTART_COUNT_ENV, "0"))
    if any(f.kind == "corrupt_peer" and f.rank == rank and f.step <= step and f.restart == restart for f in _active()):
        mid = len(data) // 2
        return data[:mid] + bytes(b ^ 0xFF for b in data[mid : mid + 64]) + data[mid + 64 :]
    return data


def corrupting_replicas() -> bool:
    """Whether any ``corrupt_peer`` fault is configured (the sender then reads shards whole)."""
    return any(f.kind == "corrupt_peer" for f in _active())
