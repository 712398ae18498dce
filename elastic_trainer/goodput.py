"""Goodput accounting from the event log: one implementation for ``elastic-trainer report`` (a
whole log) and the supervisor's live ledger (fed record by record while the job runs).

:class:`Ledger` takes event records in log order (:meth:`Ledger.feed`) and gives the accounting
at any moment (:meth:`Ledger.result`): ``result()`` ends the wall time at the last record (what
``report`` prints); ``result(now=t)`` extends it to ``t`` and puts the time since the last record
in the category the run is in (what the live metrics show). Pure: no I/O, no clocks.

Two views of the same wall time:

* the coarse one ``report`` has always printed — productive, recomputed, interruptions (restart,
  rendezvous, load), startup and other (see :mod:`elastic_trainer.report`);
* :data:`CATEGORIES`, a partition of the wall time (they sum to it exactly):

  - ``productive`` — step time of the steps whose result stands, less the slowdown a background
    save caused them (counted as ``checkpoint_stall``, below);
  - ``recompute`` — step time of steps executed and then rolled back (redone after a resume);
  - ``restart`` — from the end of the last step before a failure, restart, preemption or relaunch
    to the start of the next rendezvous: failure detection, stopping the group, backoff, and the
    time a preempted job waits to be relaunched;
  - ``rendezvous`` — rendezvous rounds (the ``seconds`` of ``rendezvous`` records);
  - ``startup`` — launch to the first rendezvous, and rendezvous to the first step except
    checkpoint loading: process start, ``init_process_group``, building the model;
  - ``checkpoint_load`` — the ``load_seconds`` of ``resume`` records;
  - ``checkpoint_stall`` — what a save costs the training: the time between step N and the next
    step when step N was saved (a ``checkpoint_committed``/``checkpoint_failed`` record of step N,
    or ``checkpoint_local_saved``/``checkpoint_local_failed`` for a save to the local tier only:
    the save call blocking),
    plus, for each step that started while that save was still being written (before its record),
    the step's excess over the median of the recent steps (the slowdown of the steps the
    background write overlaps);
  - ``preemption_save`` — from ``preempt_requested`` to ``preempted``;
  - ``idle`` — the rest: time between steps without a save (logging), and shutdown.

``goodput = productive / wall``.
"""

from __future__ import annotations

import statistics
from array import array
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

CATEGORIES = (
    "productive",
    "recompute",
    "restart",
    "rendezvous",
    "startup",
    "checkpoint_load",
    "checkpoint_stall",
    "preemption_save",
    "idle",
)


@dataclass
class Interruption:
    reason: str  # worker_failure | membership_change | preempted | relaunch | ...
    after_step: int  # last step completed before it
    resumed_step: int | None = None  # first step run after it, minus one (the checkpoint resumed from)
    seconds: float = 0.0
    load_seconds: float = 0.0
    redone_steps: int = 0
    world_size_before: int | None = None
    world_size_after: int | None = None


@dataclass
class Goodput:
    wall_seconds: float = 0.0
    productive_seconds: float = 0.0
    recompute_seconds: float = 0.0
    recompute_steps: int = 0
    interruption_seconds: float = 0.0
    load_seconds: float = 0.0
    startup_seconds: float = 0.0
    other_seconds: float = 0.0
    goodput: float | None = None
    interruptions: list[Interruption] = field(default_factory=list)
    categories: dict[str, float] = field(default_factory=dict)


GAP_MEMORY_STEPS = 4096  # steps whose between-step time a late commit record can still reclassify
REFERENCE_STEPS = 32  # a step's slowdown is its excess over the median of this many recent steps
# (when saves overlap more than half of the steps, e.g. a save every step, the median includes the
# slowdown and under-charges it; the auto cadence measures its save cost apart from this, on steps
# that overlap no save)
MIN_REFERENCE_STEPS = 5  # (at the same world size; with fewer, no slowdown is charged)
OVERLAP_MEMORY_STEPS = 256  # recent steps a late commit record can still charge
# A save of step N was written: to checkpoint.dir (committed or failed) or to the local tier only
SAVE_RECORDS = ("checkpoint_committed", "checkpoint_failed", "checkpoint_local_saved", "checkpoint_local_failed")
_DISRUPTIONS = {"failure": "worker_failure", "preempt_requested": "preempted", "preempted": "preempted"}


def _newest(d: dict, n: int) -> dict:
    """The ``n`` most recently inserted items (pruning in batches keeps each insert O(1))."""
    return dict(list(d.items())[-n:])


class Ledger:
    """Incremental goodput accounting (see the module docstring). Not thread-safe: one feeder.

    Sized for a week-long job: :meth:`result` (each scrape) costs the same at step 10 and at step
    10 million, and memory grows by ~24 bytes per kept step (the kept steps may be rolled back)."""

    def __init__(self) -> None:
        self._kept_steps = array("q")  # steps whose result still stands, with their seconds
        self._kept_secs = array("d")
        self._kept_total = 0.0
        self._lost_steps, self._lost_total = 0, 0.0  # steps executed and then rolled back
        self._t_first: float | None = None
        self._t_last: float | None = None
        self._first_step_start: float | None = None
        self._last_step_end: float | None = None
        self._last_step = 0
        self._world = None
        self._pending: Interruption | None = None
        self._begin = 0.0
        self._launches = 0
        self._interruptions: list[Interruption] = []
        # The partition: time up to ``_cursor`` is attributed; the time after it goes to ``_state``.
        self._cursor: float | None = None
        self._state = "startup"
        self._spent = dict.fromkeys(CATEGORIES, 0.0)
        # Between-step time after step N: idle, or checkpoint stall when step N was saved, which a
        # commit record may say only several steps later. Each entry's seconds are in the total of
        # its current class; only the newest GAP_MEMORY_STEPS..2x entries are kept (older ones' class is final).
        self._gap_after: dict[int, float] = {}
        self._gap_total = {"checkpoint_stall": 0.0, "idle": 0.0}
        self._saved: set[int] = set()
        # Save slowdown: recent step times (the reference), and the recent kept steps not yet found
        # to overlap a save (step -> start); the newest save record's time and step.
        self._reference: deque[float] = deque(maxlen=REFERENCE_STEPS)
        self._uncharged: dict[int, float] = {}
        self._save_record: tuple[float, int] | None = None

    def _upto(self, t: float, category: str | None = None) -> None:
        """Attribute ``[cursor, t]`` to ``category`` (default: the current state)."""
        if self._cursor is None or t <= self._cursor:
            return
        dt, self._cursor = t - self._cursor, t
        cat = category or self._state
        if cat == "between":
            self._add_gap(self._last_step, dt)
        else:
            self._spent[cat] += dt

    def _gap_class(self, step: int) -> str:
        return "checkpoint_stall" if step in self._saved else "idle"

    def _add_gap(self, step: int, dt: float) -> None:
        self._gap_after[step] = self._gap_after.get(step, 0.0) + dt
        self._gap_total[self._gap_class(step)] += dt
        if len(self._gap_after) > 2 * GAP_MEMORY_STEPS:
            self._gap_after = _newest(self._gap_after, GAP_MEMORY_STEPS)

    def _mark_saved(self, step: int) -> None:
        if step not in self._saved:
            moved = self._gap_after.get(step, 0.0)
            self._gap_total["idle"] -= moved
            self._gap_total["checkpoint_stall"] += moved
            self._saved.add(step)

    def _disrupt(self) -> None:
        """A failure/restart/relaunch: the open between-steps time was the failure's."""
        if self._state == "between":
            secs = self._gap_after.pop(self._last_step, 0.0)
            self._gap_total[self._gap_class(self._last_step)] -= secs
            self._spent["restart"] += secs
        self._state = "restart"

    def feed(self, e: dict[str, Any]) -> None:
        t = e.get("time")
        if isinstance(t, (int, float)):
            t = float(t)
            self._t_first = t if self._t_first is None else self._t_first
            self._t_last = t if self._t_last is None else max(self._t_last, t)
            if self._cursor is None:
                self._cursor = t
        else:
            t = None
        ev = e.get("event")
        if ev == "step":
            self._step(e, t)
            return
        if ev == "launch":
            self._launches += 1
        reason = None
        if ev == "restart":
            reason = e.get("reason", "restart")
        elif ev == "launch" and self._launches > 1:
            reason = "relaunch"
        elif ev in _DISRUPTIONS:
            reason = _DISRUPTIONS[ev]
        if reason is not None and self._pending is None and self._last_step_end is not None:
            self._pending = Interruption(reason=reason, after_step=self._last_step, world_size_before=self._world)
            self._begin = self._last_step_end
        if ev == "resume" and self._pending is not None:
            self._pending.load_seconds += float(e.get("load_seconds") or 0.0)
        if t is None:
            return
        self._timeline(ev, e, t)

    def _timeline(self, ev: str | None, e: dict[str, Any], t: float) -> None:
        if ev == "rendezvous":
            secs = float(e.get("seconds") or 0.0)
            self._upto(t - secs)
            self._upto(t, "rendezvous")
            self._state = "startup"
        elif ev == "resume":
            load = float(e.get("load_seconds") or 0.0)
            self._upto(t - load)
            self._upto(t, "checkpoint_load")
        elif ev in SAVE_RECORDS and e.get("step") is not None:
            self._upto(t)
            self._mark_saved(int(e["step"]))
            self._charge_overlap(int(e["step"]), t)
        elif ev == "preempt_requested":
            self._upto(t)
            self._state = "preemption_save"
        elif ev in ("preempted", "failure", "restart", "job_failed"):
            self._upto(t)
            self._disrupt()
        elif ev == "launch":
            self._upto(t)
            if self._launches > 1 and self._last_step_end is not None:  # not another node joining at the start
                self._disrupt()
        elif ev == "finished":
            self._upto(t)
            self._state = "idle"
        else:
            self._upto(t)

    def _step(self, e: dict[str, Any], t: float | None) -> None:
        step = int(e["step"])
        dur = float(e.get("step_time_s") or 0.0)
        end = t if t is not None else (self._last_step_end or 0.0)
        start = end - dur
        if self._first_step_start is None:
            self._first_step_start = start
        rolled_back = 0
        while self._kept_steps and self._kept_steps[-1] >= step:
            self._kept_steps.pop()
            secs = self._kept_secs.pop()
            self._kept_total -= secs
            self._lost_total += secs
            rolled_back += 1
        self._lost_steps += rolled_back
        if self._pending is not None:
            self._pending.resumed_step = step - 1
            self._pending.seconds = max(0.0, start - self._begin)
            self._pending.redone_steps = rolled_back
            self._pending.world_size_after = e.get("world_size")
            self._interruptions.append(self._pending)
            self._pending = None
        if t is not None:
            self._upto(start)
            before = self._cursor
            if self._state == "between" and before is not None and before > start:
                # records written while this step ran (a background commit) moved the cursor into it:
                # that part was this step's time, not the gap's
                back = min(before - start, self._gap_after.get(self._last_step, 0.0))
                self._add_gap(self._last_step, -back)
                before -= back  # (productive is the kept steps' seconds: this step keeps all of its own)
            self._upto(end, "productive")
            dur = max(0.0, end - max(before, start)) if before is not None else dur
        world = e.get("world_size", self._world)
        if world != self._world:
            self._reference.clear()
        overlapped = self._save_record is not None and step > self._save_record[1] and start < self._save_record[0]
        ref = self._reference_seconds() if overlapped else None  # (this step not included)
        self._reference.append(dur)
        self._kept_steps.append(step)
        self._kept_secs.append(dur)
        self._kept_total += dur
        self._last_step_end, self._last_step, self._world = end, step, world
        self._state = "between"
        if overlapped:
            self._charge(len(self._kept_steps) - 1, ref)  # started before the save it follows was written
        else:
            self._uncharged[step] = start
            if len(self._uncharged) > 2 * OVERLAP_MEMORY_STEPS:
                self._uncharged = _newest(self._uncharged, OVERLAP_MEMORY_STEPS)

    def _reference_seconds(self) -> float | None:
        return statistics.median(self._reference) if len(self._reference) >= MIN_REFERENCE_STEPS else None

    def _charge(self, i: int, ref: float | None) -> None:
        """Move kept step ``i``'s excess over ``ref`` from productive to checkpoint stall."""
        self._uncharged.pop(self._kept_steps[i], None)
        excess = self._kept_secs[i] - ref if ref is not None else 0.0
        if excess > 0:
            self._kept_secs[i] -= excess
            self._kept_total -= excess
            self._spent["checkpoint_stall"] += excess

    def _charge_overlap(self, saved: int, t: float) -> None:
        """A save of step ``saved`` was written by ``t``: the kept steps after it that started
        before ``t`` ran beside its background write; so does a later step that started before."""
        if self._save_record is None or t >= self._save_record[0]:
            self._save_record = (t, saved)
        ref = self._reference_seconds()
        if ref is None:
            return
        i = len(self._kept_steps) - 1
        while i >= 0 and self._kept_steps[i] > saved and len(self._kept_steps) - i <= OVERLAP_MEMORY_STEPS:
            start = self._uncharged.get(self._kept_steps[i])
            if start is not None and start < t:
                self._charge(i, ref)
            i -= 1

    def result(self, now: float | None = None) -> Goodput:
        """The accounting so far; wall time ends at ``now`` when given (live), else at the last record."""
        g = Goodput(interruptions=list(self._interruptions))
        if self._t_first is None:
            g.categories = dict.fromkeys(CATEGORIES, 0.0)
            return g
        assert self._t_last is not None and self._cursor is not None  # set with _t_first
        end = self._t_last if now is None else max(self._t_last, now)
        spent = dict(self._spent)
        for cat, secs in self._gap_total.items():
            spent[cat] += max(0.0, secs)  # (a sum of additions and moves: never below 0 but for rounding)
        tail = max(0.0, end - self._cursor)
        state = self._state
        spent[self._gap_class(self._last_step) if state == "between" else state] += tail
        productive = max(0.0, self._kept_total)
        recompute = self._lost_total
        spent["productive"], spent["recompute"] = productive, recompute
        g.categories = spent
        g.wall_seconds = end - self._t_first
        g.productive_seconds = productive
        g.recompute_seconds = recompute
        g.recompute_steps = self._lost_steps
        g.interruption_seconds = sum(i.seconds for i in g.interruptions)
        g.load_seconds = sum(i.load_seconds for i in g.interruptions)
        if self._first_step_start is not None:
            g.startup_seconds = max(0.0, self._first_step_start - self._t_first)
        else:
            g.startup_seconds = g.wall_seconds
        g.other_seconds = (
            g.wall_seconds - g.productive_seconds - g.recompute_seconds - g.interruption_seconds - g.startup_seconds
        )
        g.goodput = g.productive_seconds / g.wall_seconds if g.wall_seconds > 0 else None
        return g


def account(events: Iterable[dict[str, Any]]) -> Goodput:
    """The accounting of a whole log (events in log order, as ``read_events`` yields them)."""
    ledger = Ledger()
    for e in events:
        ledger.feed(e)
    return ledger.result()
