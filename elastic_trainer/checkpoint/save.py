"""One checkpoint save as an explicit state machine, advanced by one owner under one lock.

::

    STAGING ──staged──▶ WRITING ──written, rank 0 (checkpoint.dir)──▶ COMMITTING ──committed──▶ COMMITTED
       │                   │    ──written, other ranks──────────────▶ WRITTEN         ├──failed───▶ FAILED
       │                   │    ──local copy committed (local-only)─▶ COMMITTED       └──fenced───▶ FENCED
       └──────failed───────┴───▶ FAILED
    STAGING | WRITING ──abandon()──▶ ABANDONED

* STAGING: the state is being copied out of the training tensors (async saves); a synchronous
  save starts in WRITING.
* WRITING: this rank's shards are being written (to checkpoint.dir and/or its local copy).
* COMMITTING: rank 0 only: every rank's shards are written; the catalog proves them complete
  and writes the manifest.
* Terminal: COMMITTED (rank 0's commit in checkpoint.dir, or this rank's local copy of a
  local-only save), WRITTEN (a rank other than 0: its shards are written, rank 0 commits),
  FAILED, FENCED (a newer launch owns the checkpoint root), ABANDONED (a rollback or the end of
  the run gave up on a save still writing: it is never committed).

:class:`Save` is the only writer of its state: each transition is checked against the diagram
under the save's lock, so a callback on an upload thread and the main thread can never both
move it (e.g. a commit after :meth:`Save.abandon` is refused). A best-effort local copy that
goes with a checkpoint.dir save is tracked beside the state (:attr:`Save.local`): the save is
:attr:`~Save.settled` once the state is terminal and that copy is done too.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from ..events import EventLog
from ..metrics.sink import MetricsSink

logger = logging.getLogger(__name__)


class SaveState(enum.Enum):
    STAGING = "staging"
    WRITING = "writing"
    COMMITTING = "committing"
    COMMITTED = "committed"
    WRITTEN = "written"
    FAILED = "failed"
    FENCED = "fenced"
    ABANDONED = "abandoned"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({SaveState.COMMITTED, SaveState.WRITTEN, SaveState.FAILED, SaveState.FENCED, SaveState.ABANDONED})
_MOVES: dict[SaveState, frozenset[SaveState]] = {
    SaveState.STAGING: frozenset({SaveState.WRITING, SaveState.FAILED, SaveState.ABANDONED}),
    SaveState.WRITING: frozenset(
        {SaveState.COMMITTING, SaveState.WRITTEN, SaveState.COMMITTED, SaveState.FAILED, SaveState.ABANDONED}
    ),
    SaveState.COMMITTING: frozenset({SaveState.COMMITTED, SaveState.FAILED, SaveState.FENCED}),
}


class Save:
    """One save of ``step`` (all ranks build one per save). ``name``: its checkpoint.dir
    directory, None for a save to the local tier only; ``epoch``: the launch epoch that names its
    local copy."""

    def __init__(
        self, step: int, name: str | None, *, started: float, deadline: float, staged: bool = False, epoch: str = ""
    ):
        self.step = step
        self.name = name
        self.epoch = epoch
        self.started = started
        self.deadline = deadline  # time.monotonic() past which nobody waits for it
        self._cond = threading.Condition(threading.Lock())
        self._state = SaveState.WRITING if staged else SaveState.STAGING
        self.error = ""  # why it FAILED / was FENCED / ABANDONED
        self.permanent = False  # it FAILED for a cause a restart cannot change (checkpoint.failure.permanent)
        self.manifest: dict[str, Any] | None = None  # rank 0, once COMMITTED to checkpoint.dir
        self.local: Future | None = None  # the local copy beside a checkpoint.dir save (best effort) -> bool
        self.stagings: list[Future | None] = []  # the savers' "state copied out" futures
        self.written: Future | None = None  # this rank's checkpoint.dir bytes written
        self.history: list[SaveState] = [self._state]

    def __repr__(self) -> str:
        return f"Save(step={self.step}, name={self.name!r}, state={self._state.value})"

    @property
    def state(self) -> SaveState:
        with self._cond:
            return self._state

    @property
    def settled(self) -> bool:
        with self._cond:
            return self._settled()

    @property
    def writing(self) -> bool:
        """This rank's bytes are still being staged or written (rank-local)."""
        with self._cond:
            return self._state in (SaveState.STAGING, SaveState.WRITING) or (
                self.local is not None and not self.local.done()
            )

    def _settled(self) -> bool:
        return self._state.terminal and (self.local is None or self.local.done())

    def advance(self, to: SaveState, error: str = "", manifest: dict[str, Any] | None = None) -> bool:
        """Move to ``to`` if the diagram allows it from the current state; False (and no change)
        when it does not (e.g. the upload of an abandoned save ends)."""
        with self._cond:
            if to not in _MOVES.get(self._state, frozenset()):
                return False
            self._state = to
            self.history.append(to)
            if error:
                self.error = error
            if manifest is not None:
                self.manifest = manifest
            self._cond.notify_all()
            return True

    def abandon(self, why: str) -> bool:
        """Give up on a save still staging or writing: it is never committed. False when it is
        past that (committing, or ended)."""
        return self.advance(SaveState.ABANDONED, error=why)

    def staged(self) -> bool:
        return self.advance(SaveState.WRITING)

    def wait_for_staging(self) -> float | None:
        """Block until every saver has copied the state out (then WRITING). Returns the seconds
        waited (None: it was not STAGING)."""
        if self.state is not SaveState.STAGING:
            return None
        t0 = time.monotonic()
        for staging in self.stagings:
            try:
                if staging is not None:
                    staging.result()
            except (Exception, CheckpointException):  # the upload future carries the same failure
                logger.exception("staging of step %d failed", self.step)
        self.staged()
        return time.monotonic() - t0

    def local_only_ended(self, committed: bool) -> None:
        """A save to the local tier only: its local copy was ``committed``, or failed."""
        self.staged()
        self.advance(
            SaveState.COMMITTED if committed else SaveState.FAILED, error="" if committed else "local copy failed"
        )

    def track_local(self, done: Future) -> None:
        """The best-effort local copy of a checkpoint.dir save: part of :attr:`settled`."""
        self.local = done
        done.add_done_callback(self._notify)

    def _notify(self, _f: Future | None = None) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait(self, deadline: float | None) -> SaveState:
        """Until the save is settled or ``deadline`` (``time.monotonic()``; None: no limit) has
        passed. Returns the state then (not terminal: still running)."""
        with self._cond:
            while not self._settled():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            return self._state if self._settled() else _running(self._state)


def _running(state: SaveState) -> SaveState:
    """A terminal state whose local copy is still being written reads as WRITING."""
    return SaveState.WRITING if state.terminal else state


@dataclass
class SaveStats:
    """Per-save timings (seconds) measured on this rank."""

    step: int
    wait_previous: float = 0.0
    call: float = 0.0  # time async_save (or save) blocked the caller
    staging_wait: float = 0.0  # time wait_for_staging blocked the caller
    skipped: str = ""  # why no save was started ("" when one was)
    remote: bool = False  # it goes to checkpoint.dir (with a local tier, also to the local tier)

    @property
    def stall(self) -> float:
        return self.wait_previous + self.call + self.staging_wait


@dataclass(frozen=True)
class SaveContext:
    """Who saves, and where it is reported: this ``rank`` of ``world_size``, the ``mesh_shape``
    and model ``fingerprint`` every manifest records, and the run's ``events`` (emitted on rank 0
    only where a rank's event would repeat) and ``metrics``."""

    rank: int
    world_size: int
    mesh_shape: list[int]
    fingerprint: str
    events: EventLog
    metrics: MetricsSink
