"""Builds and runs torchrun's elastic agent for the worker module (``launch``) or any script (``run``).

Uses torchrun's own argument parser and ``config_from_args`` (:mod:`.options`) so every option
keeps torchrun's name and meaning; then runs a :class:`.agent.SupervisedAgent` (a
``LocalElasticAgent`` that records restarts as events and backs off between failure restarts),
built with its collaborators: the restart ledger, liveness, warm start and the journal.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from .. import contract, exit_codes
from ..config import Config
from ..events import EventLog
from ..metrics.sink import MetricsSink, NullSink
from . import options, policy, round_poll
from .journal import Journal
from .liveness import NodeLiveness, leave, set_keep_alive_interval
from .liveness import scale_warning as liveness_scale_warning
from .restarts import RestartLedger, read_marker, remove_marker
from .warm import WarmStart

if TYPE_CHECKING:
    from ..storage.fs import Storage

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


def rendezvous_scale_warning(config, poll_seconds: float = 0.2) -> str | None:
    """Whether this launch's rendezvous (``config``: :func:`build_launch_config`'s, flags and
    ``PET_*`` applied; ``elastic.rdzv_poll_seconds``) would not carry its maximum node count (see
    :func:`.liveness.scale_warning`)."""
    return liveness_scale_warning(config.rdzv_backend, config.max_nodes, config.rdzv_configs, poll_seconds)


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
    from .agent import SupervisedAgent

    if not config.run_id:
        config.run_id = "elastic-trainer"
    spec = _worker_spec(config, cmd, cmd_args, rdzv_poll_seconds)
    journal = Journal(events, metrics or NullSink(), node_name())
    liveness = NodeLiveness(spec.rdzv_handler, journal, watch=config.max_nodes > 1)
    warm_start = WarmStart(zygote, journal)
    agent = SupervisedAgent(
        spec,
        journal=journal,
        ledger=RestartLedger(journal, commits=commits, marker=preempt_marker),
        liveness=liveness,
        warm=warm_start,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,
    )
    liveness.start(running=agent.workers_running, kill_workers=agent.kill_workers)
    return _run_and_clean_up(agent, spec, liveness, warm_start)


def _worker_spec(config, cmd, cmd_args, rdzv_poll_seconds: float | None):
    """torch's ``WorkerSpec`` for ``config``, its rendezvous handler made (and tuned: a decimal
    keep-alive interval, the poll period) from the rendezvous options."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    from .agent import master_address
    from .rendezvous import register

    register()  # --rdzv-backend elastic-trainer

    # torch's handlers read whole seconds; a decimal keep-alive interval is set on the handler
    keep_alive = config.rdzv_configs.get("keep_alive_interval")
    rdzv_configs = dict(config.rdzv_configs)
    if keep_alive is not None:
        rdzv_configs["keep_alive_interval"] = str(math.ceil(float(keep_alive)))
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **rdzv_configs,
    )
    master_addr, master_port = master_address(params)
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
    if keep_alive is not None:
        set_keep_alive_interval(spec.rdzv_handler, float(keep_alive))
    if rdzv_poll_seconds is not None:
        round_poll.install(spec.rdzv_handler, rdzv_poll_seconds)
    return spec


def _run_and_clean_up(agent, spec, liveness: NodeLiveness, warm_start: WarmStart):
    """``agent.run()``; then stop the liveness watch, shut the rendezvous down (not on a signal,
    nor when this node was excluded: the other nodes' agents still use it; an excluded node
    leaves it) and close the warm start."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from .agent import excluded

    shutdown_rdzv = True
    try:
        result = agent.run()
        if excluded(result):  # the others go on: leave the rendezvous open to them
            shutdown_rdzv = False
            leave(spec.rdzv_handler)
        return result
    except SignalException as e:
        # what the workers reported as they stopped (an attribute of ours on torch's exception)
        cast(Any, e).worker_exit_codes = agent.worker_exit_codes()
        shutdown_rdzv = False
        raise
    finally:
        liveness.stop()
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
        warm_start.close()


def launch(cfg: Config, launch_config, cmd, cmd_args, zygote=None, keys_set: list[str] | None = None) -> int:
    """Run this node's supervisor until the job ends. Returns the process exit code.

    ``launch_config, cmd, cmd_args``: from :func:`build_launch_config` (the built-in trainer
    for ``launch``, the user's script for ``run``); ``zygote``: the warm-start zygote from
    :func:`start_zygote`, or None (workers start cold). Closed when the job ends. ``keys_set``:
    the keys the command line set, which a script's own settings do not replace."""
    os.makedirs(cfg.run.dir, exist_ok=True)
    events_path = os.path.join(cfg.run.dir, contract.EVENTS_FILE)
    events = EventLog(events_path)
    marker = os.path.join(cfg.run.dir, contract.PREEMPT_MARKER)
    remove_marker(marker)
    _export_worker_env(cfg, keys_set)
    from ..metrics import factory as metrics_factory

    server = metrics_factory.start_supervisor_exporter(cfg)
    metrics = server.sink if server is not None else NullSink()
    config = launch_config
    metrics.gauge("elastic_trainer_world_size_expected", config.max_nodes * config.nproc_per_node)
    storage = _checkpoint_root(cfg)  # opened once: the mirror, the epoch, the holder, the commit watch
    history = _start_history(events_path, metrics, storage)
    if server is not None:
        server.before_collect(history.export)
    if config.max_nodes > 1 and config.rdzv_backend != "static":
        _check_store(config)
    why = rendezvous_scale_warning(config, cfg.elastic.rdzv_poll_seconds)
    if why:
        logger.warning("rendezvous: %s", why)
    _emit_launch(events, config, cmd, cmd_args)
    storage = storage if storage is not None else _open_root(cfg)  # raises what it could not open
    os.environ[contract.CHECKPOINT_EPOCH_ENV] = take_epoch(storage, config.run_id or "elastic-trainer", events)
    os.environ[contract.CHECKPOINT_ROOT_ENV] = cfg.checkpoint.dir
    holder = start_holder(cfg, config.local_addr, storage.root)
    try:
        outcome = _supervise(cfg, config, cmd, cmd_args, events, metrics, marker, zygote, storage)
    finally:
        if server is not None:
            server.stop()
        if zygote is not None:
            zygote.close()
        if holder is not None:
            holder.close()
    preempt = read_marker(marker)
    code = policy.launch_exit_code(
        failed=outcome.failed,
        signalled=outcome.signalled,
        preempt_marker=preempt,
        worker_exit_codes=outcome.worker_codes,
    )
    if preempt is None and code in (exit_codes.PREEMPTED, exit_codes.PREEMPTED_UNCOMMITTED):
        # No rank-0 marker (a script under ``run``): the workers' own exit codes said it.
        preempt = {"exit_codes": sorted({c for c in outcome.worker_codes if c is not None})}
    events.emit("supervisor_exit", exit_code=code, preempted=preempt, signalled=outcome.signalled)
    history.close()
    return code


def _export_worker_env(cfg: Config, keys_set: list[str] | None) -> None:
    """The environment the workers (and torch's agent) read: the config, the keys the command line
    set, this supervisor's pid, and torch's per-round store and file timer switched on."""
    os.environ[contract.CONFIG_ENV] = cfg.to_json()
    os.environ[contract.CONFIG_SET_ENV] = json.dumps(keys_set or [])
    os.environ[contract.SUPERVISOR_PID_ENV] = str(os.getpid())
    # A supervisor forked by a zygote (the tests start it so) holds that zygote's pid for its own
    # parent check; its workers check this supervisor (or their own zygote), never that one.
    os.environ.pop(contract.PARENT_PID_ENV, None)
    # Workers get a fresh store per rendezvous round instead of reusing keys of dead workers.
    os.environ.setdefault(contract.SHARE_RDZV_STORE_ENV, "1")
    os.environ.setdefault(contract.ENABLE_FILE_TIMER_ENV, "1")
    os.environ.setdefault(contract.TIMER_FILE_ENV, os.path.join(_runtime_dir(cfg), contract.TIMER_FILE))


def _emit_launch(events: EventLog, config, cmd, cmd_args) -> None:
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


@dataclass(frozen=True)
class _AgentOutcome:
    """How the agent's run ended: ``failed`` (restarts exhausted), ``signalled`` (the supervisor
    got a signal) and the workers' exit codes, as the exit code policy reads them."""

    failed: bool
    signalled: bool
    worker_codes: list[int | None]


def _supervise(
    cfg: Config, config, cmd, cmd_args, events: EventLog, metrics: MetricsSink, marker: str, zygote, storage: Storage
) -> _AgentOutcome:
    """Run the agent until the job ends; record ``job_failed`` when it failed. A signal to the
    supervisor ends it too (the workers were asked to checkpoint and stop); other errors raise."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

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
            commits=_commit_watch(storage),
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
    return _AgentOutcome(failed, signalled, worker_codes)


def start_holder(cfg: Config, local_addr: str | None, root: str):
    """This node's peer holder (``checkpoint.peer_replicas`` with a local tier), listening on the
    address the job uses for its collectives; its address goes to the workers. None when off.
    ``root``: the opened ``checkpoint.dir``'s root (the job's name derives from it)."""
    c = cfg.checkpoint
    if not c.local_dir or c.peer_replicas <= 0:
        return None
    import socket

    from ..checkpoint.catalog import checkpoint_key
    from ..checkpoint.local_tier import job_key
    from ..checkpoint.peer_copies import NodeCopies
    from ..storage.peer import Holder

    key = checkpoint_key()
    if not key:
        logger.warning(
            "checkpoint.peer_replicas = %d but %s is not set: peer transfer is off",
            c.peer_replicas,
            contract.CHECKPOINT_KEY_ENV,
        )
        return None
    job = job_key(root)
    served = NodeCopies(os.path.join(os.path.abspath(c.local_dir), job))
    try:
        holder = Holder(job, key, local_addr or socket.getfqdn(), served=served).start()
    except OSError as e:
        logger.warning("peer holder could not start on %s: %s; peer transfer is off", local_addr, e)
        return None
    os.environ[contract.PEER_HOLDER_ENV] = holder.address
    return holder


def start_zygote(cfg: Config, cmd, cmd_args, early=None, preload: tuple[str, ...] = (), fork=None):
    """The warm-start zygote (``elastic.warm_start``) for ``launch``'s trainer or ``run``'s
    script, or None. ``early``: one already started (kept if it preloads what this entry point
    needs, else closed); ``preload``: modules besides its own list (``run --preload``); ``fork``:
    see ``warm.Zygote.start``."""
    from ..storage.fs import backend_modules
    from . import warm

    backend = backend_modules(cfg.checkpoint.dir)
    modules = warm.preload_for(cmd, cmd_args, options.WORKER_MODULE, tuple(preload), backend)
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


def take_epoch(storage: Storage, launch_id: str, events: EventLog) -> str:
    """This launch's fencing epoch on the checkpoint root ``storage`` (joined by the other nodes of
    the same launch, which share ``launch_id``): older launches stop committing there."""
    from ..checkpoint.catalog import Catalog

    epoch = Catalog(storage, events=events).fence.acquire(launch_id)
    logger.debug("checkpoint root %s: this launch is epoch %s", storage.describe(), epoch)
    return epoch


def _open_root(cfg: Config) -> Storage:
    from ..storage.fs import Storage

    return Storage.for_checkpoint(cfg.checkpoint)


def _checkpoint_root(cfg: Config) -> Storage | None:
    """``checkpoint.dir``, opened (the supervisor's one :class:`..storage.fs.Storage` of it), or None
    when it cannot be: the event log mirror is off, and the epoch says why (it opens it again)."""
    try:
        return _open_root(cfg)
    except Exception as e:  # noqa: BLE001 - the mirror is a side channel; the workers report storage errors
        logger.warning("event log mirror disabled: %s", e)
        return None


def _start_history(events_path: str, metrics: MetricsSink, storage: Storage | None):
    """Follow events.jsonl for the live goodput ledger and mirror it under the checkpoint root
    ``storage`` (None: no mirror)."""
    from .history import RunHistory

    return RunHistory(events_path, storage=storage, node=node_name(), metrics=metrics).start()


def _commit_watch(storage: Storage):
    """The restart back-off's evidence of progress (newest commit in ``checkpoint.dir``, ``storage``)."""
    from .progress import CommitWatch, newest_commit_reader

    try:
        return CommitWatch(newest_commit_reader(storage))
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
    d = contract.runtime_dir(cfg.run.dir, socket.gethostname(), os.getpid())
    os.makedirs(d, exist_ok=True)
    return d
