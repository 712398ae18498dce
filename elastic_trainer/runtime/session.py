"""Set-up of one training process: process groups, event log, metrics, preemption, watchdog.

:func:`init` works under ``elastic-trainer run``/``launch`` (the supervisor passes the resolved
config in ``ELASTIC_TRAINER_CONFIG_JSON``), under plain ``torchrun`` and without any launcher, as
a world of one (config from a file, the arguments, or the defaults). It must be called on every
rank, before anything else collective.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import functools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .. import contract, exit_codes, log
from ..config import Config, TrainConfig, apply_overrides, config_from_dict, read_toml, run_name
from ..errors import CheckpointStopError, ConfigError, FencedError
from ..events import EventLog
from ..metrics import factory as metrics_factory
from ..metrics.sink import MetricsSink
from . import loop

logger = logging.getLogger(__name__)


class PreemptionFlag:
    """Set from a signal handler (SIGTERM, SIGUSR1, SIGINT); read at step boundaries. A first
    SIGINT (Ctrl-C) is a preemption like SIGTERM (final commit within the grace budget, exit
    75/76); a second one interrupts at once (``KeyboardInterrupt``)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.received_at: float | None = None

    def install(self, signals=(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)) -> None:
        for s in signals:
            signal.signal(s, self._handler)

    def _handler(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signal_name is not None:
            raise KeyboardInterrupt
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self.received_at = time.monotonic()

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


def exit_code_for(exc: BaseException) -> int:
    """The exit code a rank ends with when ``exc`` reached the top of its program: 2 for bad
    input that a restart would only repeat (configuration, a checkpoint the code cannot take,
    committed checkpoints none of which loads), 73 when a newer launch owns the checkpoint root,
    else 1. The supervisor restarts a group for 1 only."""
    if isinstance(exc, (ConfigError, CheckpointStopError)):
        return exit_codes.CONFIG
    if isinstance(exc, FencedError):
        return exit_codes.FENCED
    return exit_codes.FAILED


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    ckpt_group: dist.ProcessGroup  # gloo, for checkpoint collectives only


def pick_device(train: TrainConfig, local_rank: int) -> torch.device:
    if train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device", "cuda requested but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def group_store(timeout: timedelta) -> dist.Store | None:
    """The store the training group is built on; None: torch's ``env://`` default is right.

    * No launcher at all (no ``RANK``/``WORLD_SIZE``, e.g. ``python train.py``): a process-local
      store, so a script runs as a world of one without any port.
    * Under torchrun's agent store: the agent's store, its keys prefixed by this attempt.
      torchrun's default (static) rendezvous, and ``--standalone`` whose store is shared across
      rounds, keep one store for all restarts of the group without an attempt prefix, so a
      restarted group read the dead group's gloo addresses (connection refused, then a hang).
    """
    if contract.RANK_ENV not in os.environ and contract.WORLD_SIZE_ENV not in os.environ:
        return dist.HashStore()
    if os.environ.get(contract.USE_AGENT_STORE_ENV) != str(True):
        return None
    base = dist.TCPStore(
        os.environ[contract.MASTER_ADDR_ENV],
        int(os.environ[contract.MASTER_PORT_ENV]),
        int(os.environ[contract.WORLD_SIZE_ENV]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"elastic_trainer/attempt_{os.environ.get(contract.RESTART_COUNT_ENV, '0')}", base)


def init_distributed(train: TrainConfig, timeout_seconds: float, ckpt_timeout_seconds: float | None = None) -> Dist:
    """Initialise the training group (NCCL on CUDA, gloo on CPU) and a separate gloo group for
    checkpoints. Must be called on all ranks. ``timeout_seconds`` bounds every training
    collective; ``ckpt_timeout_seconds`` (default: the same) the checkpoint group's, whose
    collectives wait for storage: slow storage must not time the group out and break every
    later save."""
    local_rank = int(os.environ.get(contract.LOCAL_RANK_ENV, "0"))
    device = pick_device(train, local_rank)
    timeout = timedelta(seconds=timeout_seconds)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        store = group_store(timeout)
        kw: dict[str, Any] = (
            {
                "store": store,
                "rank": int(os.environ.get(contract.RANK_ENV, "0")),
                "world_size": int(os.environ.get(contract.WORLD_SIZE_ENV, "1")),
            }
            if store is not None
            else {}
        )
        dist.init_process_group(
            backend=backend, timeout=timeout, device_id=device if device.type == "cuda" else None, **kw
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    ckpt_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=ckpt_timeout_seconds or timeout_seconds))
    loop.die_with_parent_at_fork()  # the sockets exist: a forked copy must not outlive the rank
    return Dist(rank, world, local_rank, device, mesh, ckpt_group)


SUPERVISED_KEYS = (("run", "dir"), ("checkpoint", "dir"))  # what the supervisor itself uses of the script's config


def _set_in(cfg: Config) -> dict[str, dict[str, Any]]:
    """The sections of ``cfg`` with only the values that differ from the defaults."""
    default = Config().to_dict()
    return {
        section: {k: v for k, v in values.items() if default[section].get(k) != v}
        for section, values in cfg.to_dict().items()
    }


def _same_place(path: str) -> str:
    """A path compared as a place: local paths absolute (a URI with a scheme as it is)."""
    return path if "://" in path else os.path.abspath(path)


def resolve_config(
    config: str | os.PathLike | Config | dict | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """The rank's config. ``config`` is a TOML path, a dict of sections, or a :class:`Config` (whose
    values other than the defaults count as set), with ``overrides`` (``section.key=value``) on top.
    Without a supervisor: that, over the defaults; the paths it does not set are
    ``runs/<script name>`` and ``runs/<script name>/checkpoints`` (as ``elastic-trainer run``
    derives them). Under the supervisor (``launch``/``run``): the supervisor's config, then the
    script's on top, except for the keys the supervisor's command line set (``--config``,
    ``--set``): those keep the command line's value (the script's is logged, not used);
    ``run.dir`` and ``checkpoint.dir`` must agree with the supervisor's (it writes the event log,
    fences and watches commits there): a script that asks for others stops with ConfigError
    before its first step."""
    if isinstance(config, Config):
        mine = _set_in(config)
    elif isinstance(config, dict):
        mine = copy.deepcopy(config)
    else:
        mine = read_toml(config)
    mine = apply_overrides(mine, overrides)
    raw = os.environ.get(contract.CONFIG_ENV)
    if not raw:
        path = config if not isinstance(config, (Config, dict)) else None
        return config_from_dict(
            mine,
            name=run_name(path) or run_name(sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else None),
        )
    base = json.loads(raw)
    for section, key in SUPERVISED_KEYS:
        want = (mine.get(section) or {}).get(key)
        have = base[section][key]
        if want is not None and _same_place(str(want)) != _same_place(str(have)):
            raise ConfigError(
                f"{section}.{key}",
                f"the script asks for {want!r}, its supervisor (elastic-trainer run/launch) uses {have!r}: "
                "set it on the supervisor's command line (--set "
                f"{section}.{key}={want}) or in its --config, not in the script",
            )
    # One rule: the supervisor's command line (--config, --set) > the script's own settings > the
    # defaults. A key the command line set is never replaced; that the script's value lost is logged.
    on_command_line = set(json.loads(os.environ.get(contract.CONFIG_SET_ENV) or "[]"))
    lost = []
    for section, values in mine.items():
        for key, value in (values if isinstance(values, dict) else {}).items():
            have = base.setdefault(section, {}).get(key)
            if f"{section}.{key}" in on_command_line:
                if value != have:
                    lost.append(f"{section}.{key}={value!r} (the command line's: {have!r})")
                continue
            base[section][key] = value
    if lost and os.environ.get(contract.RANK_ENV, "0") == "0":
        logger.warning("the supervisor's command line set these, the script's own values are not used: %s", lost)
    return config_from_dict(base)


@dataclass
class Session:
    """Everything one rank trains with besides the model: see :func:`init`."""

    cfg: Config
    dist: Dist
    events: EventLog
    metrics: MetricsSink
    preempt: PreemptionFlag
    started: float = field(default_factory=time.monotonic)
    init_seconds: float = 0.0  # what init() took to make this session (process groups, event log, metrics)
    ready: float = field(default_factory=time.monotonic)  # when init() made it (``started`` may be set earlier)
    checkpointer: Any = None  # the Checkpointer made on this session, if any
    _watchdog: bool = False

    def _uncaught(self, previous, exc_type, exc, tb) -> None:
        """``sys.excepthook`` of a script. A stop that a restart would only repeat (see
        :func:`exit_code_for`: exit 2 or 73) prints its message, without a traceback, on rank 0
        and ends the process with its code. Otherwise the traceback as usual; then, if a save is
        still uploading after the bounded drain, leave at once with exit 1 instead of waiting in
        the interpreter's exit for the upload thread while the other ranks block in a collective
        (the job must exit, or restart, within seconds); else exit 1 after the ``atexit``
        handlers, without the interpreter's teardown."""
        code = exit_code_for(exc) if exc is not None else exit_codes.FAILED
        if code != exit_codes.FAILED:
            if self.rank == 0:
                print(f"elastic_trainer: {exc}", file=sys.stderr)
            logger.error("rank %d: stopping with exit code %d (%s)", self.rank, code, type(exc).__name__)
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)
        previous(exc_type, exc, tb)
        if issubclass(exc_type, KeyboardInterrupt):
            return
        ck = self.checkpointer
        if ck is not None and not ck.drain_after_failure():
            logger.error(
                "rank %d: a save is still uploading after the failure; "
                "exiting without it (the previous commit stays the latest)",
                self.rank,
            )
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(exit_codes.FAILED)
        # Not through the interpreter's teardown: collecting torch's objects takes a second or
        # more on a loaded machine, while the restart waits for this process to be gone.
        exit_codes.exit_now(exit_codes.FAILED)

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def mesh(self) -> DeviceMesh:
        return self.dist.mesh

    @contextlib.contextmanager
    def watchdog(self, scope: str) -> Iterator[None]:
        """Scope the supervisor's hang watchdog (a no-op outside the supervisor): a rank that
        stays inside longer than ``elastic.hang_timeout_seconds`` is killed and the group restarted."""
        if not self._watchdog:
            yield
            return
        from torch.distributed.elastic import timer

        with timer.expires(after=self.cfg.elastic.hang_timeout_seconds, scope=scope):
            yield

    def shard(self, model: torch.nn.Module, block_types: tuple[type, ...] | list[type]) -> torch.nn.Module:
        """``fully_shard`` every module of ``block_types`` (bottom-up), then the root, over this
        session's mesh with the configured mixed precision, reducing gradients as a SUM: normalise
        the loss by the *global* batch and the gradient is the same at any world size."""
        from .sharding import mixed_precision_policy, shard_model

        return shard_model(model, self.mesh, mixed_precision_policy(self.cfg.train, self.device), list(block_types))

    def step(self, step: int, *, checkpointer: Any = None):
        """A :class:`~elastic_trainer.runtime.step.StepContext` for ``step`` (see there)."""
        from .step import StepContext

        return StepContext(self, step, checkpointer)

    def close(self) -> None:
        """Tear down the process groups (call last, on every rank)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def init(
    config: str | os.PathLike | Config | dict | None = None, *, overrides: list[str] | tuple[str, ...] = ()
) -> Session:
    """Set up this rank: process groups (the training group and a separate gloo group for
    checkpoints), the rank-0 event log (``run.dir/events.jsonl``), the metrics sink (the node's
    Prometheus exporter under the supervisor), the preemption flag (SIGTERM/SIGUSR1) and the
    hang-watchdog client (under the supervisor), and the ``elastic_trainer`` logger (stderr with a
    ``[node/rank - step N]`` prefix, level ``ELASTIC_TRAINER_LOG_LEVEL``, default INFO; left alone
    if the program gave that logger a handler). Call on every rank, first."""
    t0 = time.monotonic()
    log.setup_logging()
    try:
        cfg = resolve_config(config, overrides)
    except ConfigError as e:  # bad input, before anything started: exit 2 (the supervisor does not restart it)
        print(f"elastic_trainer: {e}", file=sys.stderr, flush=True)
        raise SystemExit(exit_codes.CONFIG) from None
    if not faulthandler.is_enabled():  # a native crash (SIGSEGV/SIGABRT) leaves every thread's Python stack
        faulthandler.enable(all_threads=True)
    preempt = PreemptionFlag()
    preempt.install()
    # Storage time is bounded by checkpoint.save_timeout_seconds, never by the hang timeout.
    ckpt_timeout = max(cfg.elastic.hang_timeout_seconds, cfg.checkpoint.save_timeout_seconds)
    d = init_distributed(cfg.train, timeout_seconds=cfg.elastic.hang_timeout_seconds, ckpt_timeout_seconds=ckpt_timeout)
    events = EventLog(os.path.join(cfg.run.dir, contract.EVENTS_FILE), enabled=d.rank == 0)
    metrics = metrics_factory.worker_sink(cfg, rank=d.rank)
    metrics.gauge("elastic_trainer_world_size", d.world_size)
    timer_file = os.environ.get(contract.TIMER_FILE_ENV)
    session = Session(cfg, d, events, metrics, preempt, init_seconds=time.monotonic() - t0, _watchdog=bool(timer_file))
    sys.excepthook = functools.partial(session._uncaught, sys.excepthook)  # noqa: SLF001 - init installs the Session's own hook
    if timer_file:
        from torch.distributed.elastic import timer

        timer.configure(timer.FileTimerClient(timer_file))
    return session
