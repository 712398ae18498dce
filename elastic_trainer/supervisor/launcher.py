"""Builds and runs torchrun's elastic agent for the worker module (``launch``) or any script (``run``).

Uses torchrun's own argument parser and ``config_from_args`` (:mod:`.options`) so every option
keeps torchrun's name and meaning; then runs a :class:`SupervisedAgent` (a ``LocalElasticAgent``
that records restarts as events and backs off between failure restarts).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time

from .. import contract, exit_codes
from ..config import Config
from ..events import EventLog
from ..metrics.sink import MetricsSink, NullSink
from . import liveness, options, policy, round_poll

logger = logging.getLogger(__name__)


def node_name() -> str:
    """This node's name in events: ``ELASTIC_TRAINER_NODE`` when set, else the host name."""
    return os.environ.get(contract.NODE_ENV) or os.uname().nodename


def uses_external_store(config) -> bool:
    """True when this agent joins a store it does not host (``is_host=false``)."""
    return str(config.rdzv_configs.get("is_host", "")).lower() in ("false", "0", "no")


def build_launch_config(cfg: Config, args, explicit: set[str], env=None):
    """``(LaunchConfig, cmd, cmd_args)`` from torchrun's parsed options (see :mod:`.options`)
    with the config applied where neither a flag nor ``PET_*`` set a value."""
    args = options.resolve(args, explicit, cfg.elastic, env)
    return options.launch_config(
        args,
        explicit,
        env,
        shutdown_timeout=int(cfg.checkpoint.preempt_grace_seconds + options.SHUTDOWN_MARGIN_SECONDS),
        signals=options.SIGNALS_TO_HANDLE,
    )


def agent_takes_shutdown_timeout() -> bool:
    """Whether torch's agent takes ``shutdown_timeout`` (torch >= 2.12). torch 2.11's constructor has
    no such argument and ``_shutdown(death_sig)`` closes the workers with the process context's
    default grace: the subclass below keeps the timeout and closes them with it itself
    (``tests/unit/test_launcher_seams.py`` pins which torch does what)."""
    import inspect

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    return "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters


def _make_agent_class():
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    takes_timeout = agent_takes_shutdown_timeout()

    class SupervisedAgent(LocalElasticAgent):
        """LocalElasticAgent that records each restart (reason, exit codes, failing ranks from
        torch's ``@record`` error files) and backs off between failure restarts."""

        def __init__(self, *args, shutdown_timeout: int = 30, **kwargs):
            if takes_timeout:
                kwargs["shutdown_timeout"] = shutdown_timeout
            super().__init__(*args, **kwargs)
            self._shutdown_timeout = shutdown_timeout

        events: EventLog = EventLog(None)
        metrics: MetricsSink = NullSink()
        preempt_marker: str | None = None
        zygote = None  # warm.Zygote: workers are forked from it (elastic.warm_start)
        commits = None  # progress.CommitWatch: a generation that committed is not backed off
        _zygote_restarts = 1
        _last_result = None
        _failure_restarts = 0
        _last_restart = float("-inf")
        _joined = None  # liveness.Membership right after this node's last rendezvous
        _node_lost = None  # liveness.Verdict of the restart under way
        _isolated = None  # seconds without store contact when the ContactWatch stopped the workers
        contact_watch = None
        watch_liveness = False  # several nodes: a single node has no peer to lose

        def _monitor_workers(self, worker_group):
            from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

            result = super()._monitor_workers(worker_group)
            self._last_result = result
            found = self._liveness_verdict(result)
            if found is not None:
                # A membership change torch's loop would only see at the next rendezvous: restart
                # here (torch's loop then finds the new group healthy), without using up a restart.
                self._node_lost = found
                try:
                    self._last_result = RunResult(state=WorkerState.HEALTHY)
                    self._restart_workers(worker_group)
                finally:
                    self._node_lost = None
                return RunResult(state=worker_group.state)
            if result.is_failed() and self._remaining_restarts > 0:
                code = policy.terminal_code([f.exitcode for f in result.failures.values()], self._marker())
                if code is not None:  # non-finite stop / fenced / storage full: restarting would only repeat it
                    self.events.emit("job_stopped", exit_code=code, failures=policy.describe_failures(result.failures))
                    self._remaining_restarts = 0
            return result

        def _marker(self) -> dict | None:
            """This node's marker (how the workers are ending; its first worker writes it), or None."""
            try:
                with open(self.preempt_marker) as f:
                    return json.load(f)
            except (TypeError, OSError, ValueError):
                return None

        def _liveness_verdict(self, result):
            """A silent peer or this node cut off (see :mod:`.liveness`), or None."""
            from torch.distributed.elastic.agent.server.api import WorkerState

            if self._isolated is not None:  # the ContactWatch stopped the workers (and said so)
                return liveness.Verdict(liveness.ISOLATED) if result.state != WorkerState.SUCCEEDED else None
            if result.state != WorkerState.HEALTHY:
                return None
            if self._marker() is not None:  # the workers are leaving with a code (74, 75, 76): a peer that
                return None  # left first ended the same way; a restart would turn the code into a failure
            found = liveness.verdict(self._joined, liveness.membership(self._worker_group.spec.rdzv_handler))
            if found is not None:
                self._emit_node_lost(found.reason, list(found.lost))
            return found

        def _emit_node_lost(self, reason: str, lost: list[str], **fields) -> None:
            logger.warning(
                "liveness: %s%s: restarting this node's workers as a membership change",
                reason,
                f" ({', '.join(lost)})" if lost else "",
            )
            self.events.emit("node_lost", reason=reason, lost=lost, node=node_name(), mono=time.monotonic(), **fields)

        def _on_isolated(self, seconds: float) -> None:
            """ContactWatch thread: no store contact beyond the liveness bound. The others drop
            this node now; its workers must stop before their new group can commit (fencing)."""
            self._isolated = seconds
            pcontext = self._pcontext
            pids = sorted(pcontext.pids().values()) if pcontext is not None else []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._emit_node_lost(liveness.ISOLATED, [], no_contact_seconds=round(seconds, 3), killed=pids)

        def _start_workers(self, worker_group):
            from . import warm

            t0 = time.monotonic()
            zygote, fallbacks = self.zygote, []
            if zygote is None:
                pids = super()._start_workers(worker_group)
            else:
                with warm.warm_handlers(zygote, on_fallback=fallbacks.append):
                    pids = super()._start_workers(worker_group)
            warm_started = zygote is not None and not fallbacks
            self.events.emit(
                "workers_started",
                warm=warm_started,
                pids=sorted(pids.values()),
                zygote_pid=zygote.pid if zygote is not None else None,
                zygote_forked=zygote.forked if zygote is not None else None,
                zygote_threads=(zygote.info or {}).get("threads") if zygote is not None else None,
                seconds=round(time.monotonic() - t0, 4),
                node=node_name(),
                mono=time.monotonic(),
            )
            if fallbacks:
                self._warm_fallback(fallbacks[0])
            return pids

        def _warm_fallback(self, reason: str) -> None:
            """The zygote could not start a worker (it was started cold instead): replace a dead
            zygote once, in the background of this generation; otherwise stop using it."""
            from . import warm

            old, self.zygote = self.zygote, None
            restart = not old.alive and self._zygote_restarts > 0
            old.close()
            if restart:
                self._zygote_restarts -= 1
                self.zygote = warm.Zygote(preload=old.preload).start()
            logger.warning(
                "warm start unavailable (%s): workers were started cold%s",
                reason,
                "; a new zygote is starting" if restart else "",
            )
            self.events.emit("warm_start_unavailable", reason=reason[:500], zygote_restarted=restart)

        def _setup_local_watchdog(self, envs):
            super()._setup_local_watchdog(envs)
            if self._worker_watchdog is not None:
                self._worker_watchdog.__class__ = _agent_safe_timer_server()

        def _stop_workers(self, worker_group):
            """Stop the group before a restart. A healthy group (membership change) gets the
            preemption grace to commit a checkpoint; a failed one is broken (its collectives
            cannot complete), so it gets a short grace. SIGCONT first: a SIGSTOPped worker
            cannot act on SIGTERM and would hold the restart for the whole grace."""
            from torch.distributed.elastic.agent.server.api import WorkerState

            if self._node_lost is not None:  # blocked in a collective with a silent peer: no grace helps
                # returns once they are gone
                self._shutdown(death_sig=signal.SIGKILL, timeout=policy.FAILED_STOP_GRACE_SECONDS)
                return
            result = self._last_result
            failed = result is not None and result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
            if self._pcontext is not None:
                for pid in self._pcontext.pids().values():
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
            self._shutdown(timeout=policy.stop_grace_seconds(failed=failed, preempt_shutdown=self._shutdown_timeout))

        def _shutdown(self, death_sig=signal.SIGTERM, timeout=None):
            """Stop the workers first, the hang watchdog after them.

            torch stops the file-timer watchdog (and deletes its FIFO) *before* signalling the
            workers; a worker that is finishing its step or writing its preemption checkpoint
            inside a watchdog scope then fails with ``BrokenPipeError`` instead of committing.
            A second signal interrupts this wait (``SignalException``); the watchdog is then left
            to the agent's next ``_shutdown``, which waits for the workers again."""
            timeout = self._shutdown_timeout if timeout is None else timeout
            watchdog, self._worker_watchdog = self._worker_watchdog, None
            try:
                if takes_timeout:
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

        def _rendezvous(self, worker_group):
            t0 = time.monotonic()
            super()._rendezvous(worker_group)
            self._joined = liveness.membership(worker_group.spec.rdzv_handler) if self.watch_liveness else None
            self._isolated = None
            if self.contact_watch is not None:
                self.contact_watch.reset()
            self.events.emit(
                "rendezvous",
                node=node_name(),
                pid=os.getpid(),
                group_rank=worker_group.group_rank,
                nodes=worker_group.group_world_size,
                world_size=_world_size(worker_group),
                seconds=round(time.monotonic() - t0, 4),
                mono=time.monotonic(),
            )
            self.metrics.counter("elastic_trainer_rendezvous_rounds_total")

        def _log_watchdog_event(self, name, request):
            super()._log_watchdog_event(name, request)
            if name == "kill worker process":
                self.metrics.counter("elastic_trainer_hang_detections_total")

        def _restart_workers(self, worker_group):
            from torch.distributed.elastic.agent.server.api import WorkerState

            t0 = time.monotonic()
            self.metrics.counter("elastic_trainer_restarts_total")
            result = self._last_result
            failed = result is not None and result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
            progressed = None  # a commit newer than after the previous failure restart (None: not read)
            if failed:
                healthy = time.monotonic() - self._last_restart
                if self.commits is not None and policy.backoff_may_apply(self._failure_restarts, healthy):
                    progressed = self.commits.progressed()  # its read counts towards the back-off
                self._failure_restarts = policy.failure_streak(self._failure_restarts, healthy, bool(progressed))
            self._last_restart = time.monotonic()
            delay = policy.restart_backoff(self._failure_restarts) if failed else 0.0
            self.events.emit(
                "restart",
                reason="worker_failure" if failed else "membership_change",
                restart_count=worker_group.spec.max_restarts - self._remaining_restarts,
                remaining_restarts=self._remaining_restarts,
                failures=policy.describe_failures(result.failures) if failed else [],
                backoff_seconds=delay,
                progressed=progressed,
                node=node_name(),
                mono=time.monotonic(),
            )
            if delay:
                time.sleep(max(0.0, delay - (time.monotonic() - t0)))
            nodes_before, world_before = worker_group.group_world_size, _world_size(worker_group)
            super()._restart_workers(worker_group)
            if failed and self.commits is not None:
                self.commits.note()  # the baseline: read once the failed generation is stopped
            if self.preempt_marker and os.path.exists(self.preempt_marker):
                os.remove(self.preempt_marker)  # written by the incarnation just replaced
            nodes_after = worker_group.group_world_size
            if nodes_after != nodes_before:
                refund = policy.refund_restart(failed=failed, nodes_before=nodes_before, nodes_after=nodes_after)
                if refund:
                    self._remaining_restarts += 1
                    self._failure_restarts = max(0, self._failure_restarts - 1)
                self.events.emit(
                    "membership_change",
                    from_nodes=nodes_before,
                    to_nodes=nodes_after,
                    from_world_size=world_before,
                    to_world_size=_world_size(worker_group),
                    restart_refunded=refund,
                    remaining_restarts=self._remaining_restarts,
                    node=node_name(),
                )
            self.metrics.histogram("elastic_trainer_recovery_seconds", time.monotonic() - t0)

    return SupervisedAgent


def _agent_safe_timer_server():
    """torch's ``FileTimerServer`` that reaps expired workers but never its own process.

    torch (2.13) SIGKILLs the process hosting the server after reaping a hung worker; here
    that is the supervisor, whose death takes every worker with it (``PR_SET_PDEATHSIG``) and
    turns one hung rank into a dead node. The agent instead sees the reaped worker fail and
    restarts the group."""
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerServer

    class AgentSafeFileTimerServer(FileTimerServer):
        def _reap_worker(self, worker_pid: int, signal: int) -> bool:
            if worker_pid == os.getpid():
                logger.warning("hang watchdog: reaped a hung worker; the agent restarts the group")
                return True
            return super()._reap_worker(worker_pid, signal)

    return AgentSafeFileTimerServer


def _world_size(worker_group) -> int | None:
    return worker_group.workers[0].world_size if worker_group.workers else None


def run_agent(
    config,
    cmd,
    cmd_args,
    events: EventLog,
    metrics: MetricsSink | None = None,
    preempt_marker: str | None = None,
    zygote=None,
    commits=None,
    rdzv_poll_seconds: float | None = None,
):
    """The essential part of torch's ``launch_agent`` with our agent class.
    ``rdzv_poll_seconds``: how often to read the rendezvous state (None: torch's 1 s)."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.launcher.api import _get_addr_and_port

    if not config.run_id:
        config.run_id = "elastic-trainer"
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(params)
    os.environ[contract.SIGNALS_TO_HANDLE_ENV] = config.signals_to_handle
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=cmd,
        args=tuple(cmd_args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    if rdzv_poll_seconds is not None:
        round_poll.install(spec.rdzv_handler, rdzv_poll_seconds)
    agent_cls = _make_agent_class()
    agent = agent_cls(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,
    )
    agent.events = events
    agent.metrics = metrics or NullSink()
    agent.preempt_marker = preempt_marker
    agent.zygote = zygote
    agent.commits = commits
    agent.watch_liveness = config.max_nodes > 1
    if agent.watch_liveness:
        agent.contact_watch = liveness.ContactWatch(
            spec.rdzv_handler,
            armed=lambda: agent._worker_group.state == WorkerState.HEALTHY,
            on_isolated=agent._on_isolated,  # noqa: SLF001 - our agent
        ).start()
    shutdown_rdzv = True
    try:
        return agent.run()
    except Exception as e:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if isinstance(e, SignalException):
            e.worker_exit_codes = _exit_codes(agent)  # what the workers reported as they stopped
            shutdown_rdzv = False
        raise
    finally:
        if agent.contact_watch is not None:
            agent.contact_watch.stop()
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
        if agent.zygote is not None:
            agent.zygote.close()


def launch(cfg: Config, launch_config, cmd, cmd_args, zygote=None) -> int:
    """Run this node's supervisor until the job ends. Returns the process exit code.

    ``launch_config, cmd, cmd_args``: from :func:`build_launch_config` (the built-in trainer
    for ``launch``, the user's script for ``run``); ``zygote``: the warm-start zygote from
    :func:`start_zygote`, or None (workers start cold). Closed when the job ends."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    os.makedirs(cfg.run.dir, exist_ok=True)
    events = EventLog(os.path.join(cfg.run.dir, contract.EVENTS_FILE))
    marker = os.path.join(cfg.run.dir, contract.PREEMPT_MARKER)
    if os.path.exists(marker):
        os.remove(marker)
    os.environ[contract.CONFIG_ENV] = cfg.to_json()
    os.environ[contract.SUPERVISOR_PID_ENV] = str(os.getpid())
    # Workers get a fresh store per rendezvous round instead of reusing keys of dead workers.
    os.environ.setdefault(contract.SHARE_RDZV_STORE_ENV, "1")
    os.environ.setdefault(contract.ENABLE_FILE_TIMER_ENV, "1")
    os.environ.setdefault(contract.TIMER_FILE_ENV, os.path.join(_runtime_dir(cfg), contract.TIMER_FILE))
    from ..metrics import factory as metrics_factory

    server = metrics_factory.start_supervisor_exporter(cfg)
    metrics = server.sink if server is not None else NullSink()
    config = launch_config
    metrics.gauge("elastic_trainer_world_size_expected", config.max_nodes * config.nproc_per_node)
    history = _start_history(cfg, events.path, metrics)
    if server is not None:
        server.before_collect(history.export)
    if config.max_nodes > 1 and config.rdzv_backend != "static":
        _check_store(config)
    events.emit(
        "launch",
        nnodes=f"{config.min_nodes}:{config.max_nodes}",
        nproc_per_node=config.nproc_per_node,
        max_restarts=config.max_restarts,
        rdzv_endpoint=config.rdzv_endpoint,
        rdzv_backend=config.rdzv_backend,
        entrypoint=" ".join(map(str, [getattr(cmd, "__name__", cmd), *cmd_args]))[:500],
        node=node_name(),
        pid=os.getpid(),
        mono=time.monotonic(),
    )
    os.environ[contract.CHECKPOINT_EPOCH_ENV] = take_epoch(cfg, config.run_id or "elastic-trainer", events)
    os.environ[contract.CHECKPOINT_ROOT_ENV] = cfg.checkpoint.dir
    failed = signalled = False
    worker_codes: list[int | None] = []
    try:
        result = run_agent(
            config,
            cmd,
            cmd_args,
            events,
            metrics,
            preempt_marker=marker,
            zygote=zygote,
            commits=_commit_watch(cfg),
            rdzv_poll_seconds=cfg.elastic.rdzv_poll_seconds,
        )
        failed = result.is_failed()
        if failed:
            worker_codes = [f.exitcode for f in result.failures.values()]
            events.emit("job_failed", failures=policy.describe_failures(result.failures))
    except SignalException as e:
        signalled = True
        worker_codes = list(getattr(e, "worker_exit_codes", []))
        logger.warning("supervisor got %s: workers were asked to checkpoint and stop", e.sigval)
    finally:
        if server is not None:
            server.stop()
        if zygote is not None:
            zygote.close()
    preempt = None
    if os.path.exists(marker):
        with open(marker) as f:
            preempt = json.load(f)
    code = policy.launch_exit_code(
        failed=failed, signalled=signalled, preempt_marker=preempt, worker_exit_codes=worker_codes
    )
    if preempt is None and code in (exit_codes.PREEMPTED, exit_codes.PREEMPTED_UNCOMMITTED):
        # No rank-0 marker (a script under ``run``): the workers' own exit codes said it.
        preempt = {"exit_codes": sorted({c for c in worker_codes if c is not None})}
    events.emit("supervisor_exit", exit_code=code, preempted=preempt, signalled=signalled)
    history.close()
    return code


def start_zygote(cfg: Config, cmd, cmd_args, early=None, preload: tuple[str, ...] = (), fork=None):
    """The warm-start zygote (``elastic.warm_start``) for ``launch``'s trainer or ``run``'s
    script, or None. ``early``: one already started (kept if it preloads what this entry point
    needs, else closed); ``preload``: modules besides its own list (``run --preload``); ``fork``:
    see ``warm.Zygote.start``."""
    from . import warm

    modules = warm.preload_for(cmd, cmd_args, options.WORKER_MODULE, tuple(preload))
    if early is not None and (not cfg.elastic.warm_start or modules != early.preload):
        early.close()
        early = None
    if not cfg.elastic.warm_start or modules is None:
        if preload:
            logger.warning(
                "--preload ignored: %s",
                "elastic.warm_start is off" if modules is not None else "this entry point is started cold",
            )
        return None
    return early if early is not None else warm.Zygote(preload=modules).start(fork=fork)


def _exit_codes(agent) -> list[int | None]:
    """Exit codes of the agent's worker processes once they stopped (torch's SubprocessContext)."""
    handlers = getattr(getattr(agent, "_pcontext", None), "subprocess_handlers", None) or {}
    out = []
    for h in handlers.values():
        proc = getattr(h, "proc", None)
        out.append(proc.poll() if proc is not None else None)
    return out


def take_epoch(cfg: Config, launch_id: str, events: EventLog) -> str:
    """This launch's fencing epoch on the checkpoint root (joined by the other nodes of the same
    launch, which share ``launch_id``): older launches stop committing there."""
    from ..checkpoint.catalog import Catalog
    from ..storage.fs import open_storage

    c = cfg.checkpoint
    storage = open_storage(c.dir, c.s3_endpoint_url, c.storage_timeout_seconds, c.storage_retries)
    epoch = Catalog(storage, events=events).acquire_epoch(launch_id)
    logger.debug("checkpoint root %s: this launch is epoch %s", storage.describe(), epoch)
    return epoch


def _start_history(cfg: Config, events_path: str, metrics: MetricsSink):
    """Follow events.jsonl for the live goodput ledger and mirror it under the checkpoint root."""
    from ..storage.fs import open_storage
    from .history import RunHistory

    c = cfg.checkpoint
    try:
        storage = open_storage(c.dir, c.s3_endpoint_url, c.storage_timeout_seconds, c.storage_retries)
    except Exception as e:  # noqa: BLE001 - the mirror is a side channel; the workers report storage errors
        logger.warning("event log mirror disabled: %s", e)
        storage = None
    return RunHistory(events_path, storage=storage, node=node_name(), metrics=metrics).start()


def _commit_watch(cfg: Config):
    """The restart back-off's evidence of progress (newest commit in ``checkpoint.dir``)."""
    from .progress import CommitWatch, newest_commit_reader

    try:
        return CommitWatch(newest_commit_reader(cfg))
    except Exception as e:  # noqa: BLE001 - without it, failures back off by time alone
        logger.warning("restart back-off will not see commits: %s", e)
        return None


def _check_store(config, timeout_seconds: float = 60.0) -> None:
    """With ``is_host=false``, wait for the external rendezvous store and fail clearly when it
    never answers. Otherwise warn when no store runs yet: the first agent will host it."""
    from ..errors import ConfigError
    from .store import StoreAddress, reachable

    addr = StoreAddress.parse(config.rdzv_endpoint)
    if not uses_external_store(config):
        if reachable(addr, 0.5):
            logger.info("joining the rendezvous store at %s", addr)
        else:
            logger.warning(
                "no rendezvous store runs at %s: the first agent hosts it, and losing that node stops the job; "
                "run 'elastic-trainer store' for a store that outlives any node (docs/elasticity.md)",
                addr,
            )
        return
    if not reachable(addr, timeout_seconds):
        raise ConfigError(
            "elastic.rdzv_endpoint",
            f"no rendezvous store answers at {addr} after {timeout_seconds:.0f}s: start one with "
            f"'elastic-trainer store --host {addr.host} --port {addr.port}', or let the first agent host it "
            "with --rdzv-conf is_host=true (then losing that node stops the job)",
        )


def _runtime_dir(cfg: Config) -> str:
    d = os.path.join(cfg.run.dir, contract.RUNTIME_DIR, str(os.getpid()))
    os.makedirs(d, exist_ok=True)
    return d
