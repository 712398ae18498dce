"""The supervised agent: torch's ``LocalElasticAgent`` with thin hooks into its private methods.

This module is the one home of torch's private elastic-agent API in the package: the methods
:class:`SupervisedAgent` overrides (``_monitor_workers``, ``_start_workers``,
``_setup_local_watchdog``, ``_stop_workers``, ``_shutdown``, ``_rendezvous``,
``_log_watchdog_event``, ``_restart_workers``), the attributes it reads of torch's agent
(``_remaining_restarts``, ``_pcontext``, ``_worker_group``, ``_worker_watchdog``,
``_health_check_server``, ``_shutdown_timeout``), the hang watchdog's ``_reap_worker`` and the
launcher's ``_get_addr_and_port``. ``tests/unit/test_agent_pins.py`` pins every one of them and
fails naming what a torch release changed.

Each hook only delegates: the restart ledger (:class:`.restarts.RestartLedger`: terminal
failures, back-off, refunds), liveness (:class:`.liveness.NodeLiveness`), warm start
(:class:`.warm.WarmStart`) and the journal (:class:`.journal.Journal`: events and metrics) are
passed in when the agent is built, and each is tested without a rendezvous. What stays here is the
order torch's calls need: the workers stop before the hang watchdog, a lost node restarts the
group at once.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import signal
import time

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.timer.file_based_local_timer import FileTimerServer
from torch.distributed.launcher import api as launcher_api

from . import policy
from .journal import Journal
from .liveness import NodeLiveness
from .restarts import RestartLedger
from .warm import WarmStart

logger = logging.getLogger(__name__)

TAKES_SHUTDOWN_TIMEOUT = "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters
"""Whether torch's agent takes ``shutdown_timeout`` (torch >= 2.12). torch 2.11's constructor has
no such argument and its ``_shutdown(death_sig)`` closes the workers with the process context's
default grace: :class:`SupervisedAgent` keeps the timeout and closes them with it itself."""


def master_address(params) -> tuple[str | None, int | None]:
    """``(master_addr, master_port)`` for the worker spec from torch's ``RendezvousParameters``,
    as torchrun computes them."""
    return launcher_api._get_addr_and_port(params)


class AgentSafeFileTimerServer(FileTimerServer):
    """torch's ``FileTimerServer`` that reaps expired workers but never its own process.

    torch (2.13) SIGKILLs the process hosting the server after reaping a hung worker; here
    that is the supervisor, whose death takes every worker with it (``PR_SET_PDEATHSIG``) and
    turns one hung rank into a dead node. The agent instead sees the reaped worker fail and
    restarts the group."""

    def _reap_worker(self, worker_pid: int, signal: int) -> bool:
        if worker_pid == os.getpid():
            logger.warning("hang watchdog: reaped a hung worker; the agent restarts the group")
            return True
        return super()._reap_worker(worker_pid, signal)


class SupervisedAgent(LocalElasticAgent):
    """LocalElasticAgent that records each restart (reason, exit codes, failing ranks from torch's
    ``@record`` error files), backs off between failure restarts, restarts the group when a node
    goes silent, starts workers warm, and stops the workers before the hang watchdog."""

    def __init__(
        self,
        spec,
        *,
        journal: Journal,
        ledger: RestartLedger,
        liveness: NodeLiveness,
        warm: WarmStart,
        shutdown_timeout: int = 30,
        **kwargs,
    ):
        if TAKES_SHUTDOWN_TIMEOUT:
            super().__init__(spec, shutdown_timeout=shutdown_timeout, **kwargs)
        else:  # torch 2.11: the timeout is ours to keep
            super().__init__(spec, **kwargs)
            self._shutdown_timeout = shutdown_timeout
        self._journal, self._ledger, self._liveness, self._warm = journal, ledger, liveness, warm
        self._last_result: RunResult | None = None  # of the last monitor pass

    # ------------------------------------------------------------------ for the launcher
    def workers_running(self) -> bool:
        """The worker group is healthy (running its workers)."""
        return self._worker_group.state == WorkerState.HEALTHY

    def kill_workers(self) -> list[int]:
        """SIGKILL this node's workers at once; the pids signalled."""
        return self._signal_workers(signal.SIGKILL)

    def worker_exit_codes(self) -> list[int | None]:
        """Exit codes of the worker processes once they stopped (torch's SubprocessContext)."""
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        out = []
        for h in handlers.values():
            proc = getattr(h, "proc", None)
            out.append(proc.poll() if proc is not None else None)
        return out

    # ------------------------------------------------------------------ torch's hooks
    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        self._last_result = result
        found = None if self._ledger.workers_ending() else self._liveness.check(result.state)
        if found is not None:
            # A membership change torch's loop would only see at the next rendezvous
            return self._membership_change(worker_group, self._liveness.restarting(found))
        if result.is_failed() and policy.ends_round(_codes(result)) == "regroup":
            # A node was excluded (its workers exit 69): re-form without it, not a failure.
            return self._membership_change(worker_group, self._liveness.regrouping(worker_group.group_world_size - 1))
        if result.is_failed() and self._remaining_restarts > 0 and self._ledger.stop_code(result.failures) is not None:
            self._remaining_restarts = 0  # non-finite stop / fenced / storage full: restarting would repeat it
        return result

    def _membership_change(self, worker_group, change) -> RunResult:
        """Restart the workers here, inside ``change`` (the liveness collaborator's context for
        it), without using up a restart; torch's loop then finds the new group healthy."""
        with change:
            self._last_result = RunResult(state=WorkerState.HEALTHY)
            self._restart_workers(worker_group)
        return RunResult(state=worker_group.state)

    def _rendezvous(self, worker_group):
        t0 = time.monotonic()
        super()._rendezvous(worker_group)
        self._liveness.rejoined()
        self._journal.rendezvous(
            group_rank=worker_group.group_rank,
            nodes=worker_group.group_world_size,
            world_size=_world_size(worker_group),
            seconds=time.monotonic() - t0,
        )

    def _start_workers(self, worker_group):
        self._liveness.wait_for_fence()
        return self._warm.start(functools.partial(super()._start_workers, worker_group))

    def _restart_workers(self, worker_group):
        failed = _failed(self._last_result)
        restart = self._ledger.begin(
            failed=failed,
            failures=self._last_result.failures if failed and self._last_result is not None else {},
            restart_count=worker_group.spec.max_restarts - self._remaining_restarts,
            remaining=self._remaining_restarts,
        )
        nodes_before, world_before = worker_group.group_world_size, _world_size(worker_group)
        super()._restart_workers(worker_group)
        if self._ledger.end(
            restart,
            nodes=(nodes_before, worker_group.group_world_size),
            world_sizes=(world_before, _world_size(worker_group)),
            remaining=self._remaining_restarts,
        ):
            self._remaining_restarts += 1

    def _stop_workers(self, worker_group):
        """Stop the group before a restart. A healthy group (membership change) gets the
        preemption grace to commit a checkpoint; a failed one is broken (its collectives cannot
        complete), so it gets a short grace. SIGCONT first: a SIGSTOPped worker cannot act on
        SIGTERM and would hold the restart for the whole grace."""
        if self._liveness.node_lost is not None:  # blocked in a collective with a silent peer: no grace helps
            self._shutdown(death_sig=signal.SIGKILL, timeout=policy.FAILED_STOP_GRACE_SECONDS)
            return
        failed = _failed(self._last_result)
        self._signal_workers(signal.SIGCONT)
        self._shutdown(timeout=policy.stop_grace_seconds(failed=failed, preempt_shutdown=self._shutdown_timeout))

    def _shutdown(self, death_sig=signal.SIGTERM, timeout=None):
        """Stop the workers first, the hang watchdog after them.

        torch stops the file-timer watchdog (and deletes its FIFO) *before* signalling the
        workers; a worker that is finishing its step or writing its preemption checkpoint inside
        a watchdog scope then fails with ``BrokenPipeError`` instead of committing. A second
        signal interrupts this wait (``SignalException``); the watchdog is then left to the
        agent's next ``_shutdown``, which waits for the workers again."""
        timeout = self._shutdown_timeout if timeout is None else timeout
        watchdog, self._worker_watchdog = self._worker_watchdog, None
        try:
            if TAKES_SHUTDOWN_TIMEOUT:
                super()._shutdown(death_sig, timeout)
            else:  # torch 2.11's _shutdown(death_sig), with the timeout
                if self._health_check_server is not None:
                    self._health_check_server.stop()
                    self._health_check_server = None
                if self._pcontext:
                    self._pcontext.close(death_sig, timeout)
        except BaseException:
            self._worker_watchdog = watchdog
            raise
        if watchdog is not None:
            watchdog.stop()

    def _setup_local_watchdog(self, envs):
        super()._setup_local_watchdog(envs)
        if self._worker_watchdog is not None:
            self._worker_watchdog.__class__ = AgentSafeFileTimerServer

    def _log_watchdog_event(self, name, request):
        super()._log_watchdog_event(name, request)
        if name == "kill worker process":
            self._journal.hang_detected()

    # ------------------------------------------------------------------
    def _signal_workers(self, sig: int) -> list[int]:
        """Send ``sig`` to this node's workers; the pids. Also called from the liveness thread:
        the process context is read once."""
        pcontext = self._pcontext
        pids = sorted(pcontext.pids().values()) if pcontext is not None else []
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids


def excluded(result: RunResult) -> bool:
    """Whether ``result`` (the agent's run's) ended with this node excluded from the job."""
    return result.is_failed() and policy.ends_round(_codes(result)) == "leave"


def _codes(result: RunResult) -> list[int | None]:
    return [getattr(f, "exitcode", None) for f in result.failures.values()]


def _failed(result: RunResult | None) -> bool:
    return result is not None and result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)


def _world_size(worker_group) -> int | None:
    return worker_group.workers[0].world_size if worker_group.workers else None
