"""The supervised agent's restart ledger: which failures end the job instead of restarting it, how
long a failure restart backs off, which restarts are given back, and the events and metrics of
each restart. The decisions are :mod:`.policy`'s pure functions; the ledger keeps what they need
between restarts (the failure streak, the time of the last restart, the commit watch's evidence)
and never touches torch's agent: the agent hands it torch's restart count and applies its answers."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import policy
from .journal import Journal
from .progress import CommitWatch


@dataclass(frozen=True)
class Restart:
    """One restart under way: from :meth:`RestartLedger.begin` to :meth:`RestartLedger.end`."""

    started: float  # monotonic
    failed: bool  # a worker failure (else a membership change)


class RestartLedger:
    """``commits``: the evidence of progress that resets the back-off (None: by time alone);
    ``marker``: the path of this node's marker (how its workers ended), read to tell a terminal failure
    and removed once the incarnation that wrote it is replaced. ``clock``/``sleep``: monotonic
    time and the back-off's wait (tests replace them). Called from the agent's thread only."""

    def __init__(
        self,
        journal: Journal,
        commits: CommitWatch | None = None,
        marker: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._journal, self._commits, self._marker = journal, commits, marker
        self._clock, self._sleep = clock, sleep
        self.failure_streak = 0  # policy.failure_streak's index of the last failure restart
        self._last_restart = float("-inf")

    def stop_code(self, failures: dict) -> int | None:
        """The terminal exit code when the workers' ``failures`` (torch's ProcessFailure by local
        rank) say a restart would only repeat them (non-finite stop, fenced, storage full), after
        recording ``job_stopped``; None when the group may be restarted."""
        code = policy.terminal_code([f.exitcode for f in failures.values()], self._read_marker())
        if code is not None:
            self._journal.events.emit("job_stopped", exit_code=code, failures=policy.describe_failures(failures))
        return code

    def begin(self, *, failed: bool, failures: dict, restart_count: int, remaining: int) -> Restart:
        """Record a restart about to stop the group (``failed``: after a worker failure, with
        torch's ``failures``; else a membership change) and wait out its back-off."""
        t0 = self._clock()
        self._journal.metrics.counter("elastic_trainer_restarts_total")
        progressed = None  # a commit newer than after the previous failure restart (None: not read)
        if failed:
            healthy = self._clock() - self._last_restart
            if self._commits is not None and policy.backoff_may_apply(self.failure_streak, healthy):
                progressed = self._commits.progressed()  # its read counts towards the back-off
            self.failure_streak = policy.failure_streak(self.failure_streak, healthy, bool(progressed))
        self._last_restart = self._clock()
        delay = policy.restart_backoff(self.failure_streak) if failed else 0.0
        self._journal.events.emit(
            "restart",
            reason="worker_failure" if failed else "membership_change",
            restart_count=restart_count,
            remaining_restarts=remaining,
            failures=policy.describe_failures(failures) if failed else [],
            backoff_seconds=delay,
            progressed=progressed,
            node=self._journal.node,
            mono=self._clock(),
        )
        if delay:
            self._sleep(max(0.0, delay - (self._clock() - t0)))
        return Restart(t0, failed)

    def end(
        self, restart: Restart, *, nodes: tuple[int, int], world_sizes: tuple[int | None, int | None], remaining: int
    ) -> bool:
        """The group of ``restart`` runs again, ``nodes`` and ``world_sizes`` (before, after).
        True when the restart is given back (a failure that lost a node: a membership change);
        the agent then adds it to torch's ``remaining`` count."""
        if restart.failed and self._commits is not None:
            self._commits.note()  # the baseline: read once the failed generation is stopped
        remove_marker(self._marker)  # written by the incarnation just replaced
        refund = False
        if nodes[1] != nodes[0]:
            refund = policy.refund_restart(failed=restart.failed, nodes_before=nodes[0], nodes_after=nodes[1])
            if refund:
                self.failure_streak = max(0, self.failure_streak - 1)
            self._journal.events.emit(
                "membership_change",
                from_nodes=nodes[0],
                to_nodes=nodes[1],
                from_world_size=world_sizes[0],
                to_world_size=world_sizes[1],
                restart_refunded=refund,
                remaining_restarts=remaining + refund,
                node=self._journal.node,
            )
        self._journal.metrics.histogram("elastic_trainer_recovery_seconds", self._clock() - restart.started)
        return refund

    def workers_ending(self) -> bool:
        """Whether this node's workers are leaving with a code (74, 75, 76: their marker is
        written): a peer node that left first ended the same way, and restarting the workers for
        its loss would turn their code into a failure."""
        return self._read_marker() is not None

    def _read_marker(self) -> dict | None:
        """This node's marker (how its workers are ending; its first worker writes it), or None."""
        return read_marker(self._marker)


def remove_marker(path: str | None) -> None:
    """Remove the marker at ``path`` if there is one; on a run.dir shared by the nodes another
    node's supervisor may remove it first."""
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def read_marker(path: str | None) -> dict | None:
    """The marker at ``path`` (written atomically), or None: none there, or another node's
    supervisor removed it a moment ago (a run.dir shared by the nodes)."""
    if path is None:
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (TypeError, OSError, ValueError):
        return None
