"""Set-up of one training process: process groups, event log, metrics, preemption, watchdog.

:func:`init` works under ``elastic-trainer run``/``launch`` (the supervisor passes the resolved
config in ``ELASTIC_TRAINER_CONFIG_JSON``), under plain ``torchrun``, ``accelerate launch`` and
without any launcher, as a world of one (config from ``ELASTIC_TRAINER_CONFIG`` and
``ELASTIC_TRAINER_SET``, the script's arguments, or the defaults). It must be called on every
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
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .. import contract, exit_codes, log
from ..config import (
    Config,
    EnvSettings,
    TrainConfig,
    apply_overrides,
    config_from_dict,
    read_toml,
    run_name,
    with_paths,
)
from ..errors import CheckpointStopError, ConfigError, FencedError
from ..events import EventLog, write_record
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


def _flushed_exit(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def failed(exc: BaseException, *, rank: int, run_dir: str, run: Any = None, show: Any = None) -> NoReturn:
    """The one exception path of a rank — a script's ``sys.excepthook`` and the built-in
    trainer's worker alike. It starts no checkpoint and no collective.

    A stop that a restart would only repeat (:func:`exit_code_for`: exit 2 or 73) prints its
    message, without a traceback, on rank 0 (73 also as rank 0's ``fenced`` event) and ends the
    process with its code. Anything else: the traceback (``show``, else logged), this rank's
    ``failure`` event and torchelastic's error file; then, if a save of ``run`` is still uploading
    after the bounded drain, leave at once with exit 1 instead of waiting in the interpreter's exit
    for the upload thread while the other ranks block in a collective; else exit 1 after the
    ``atexit`` handlers, without the interpreter's teardown (collecting torch's objects takes a
    second or more on a loaded machine, while the restart waits for this process to be gone)."""
    events = EventLog(os.path.join(run_dir, contract.EVENTS_FILE))
    code = exit_code_for(exc)
    if code != exit_codes.FAILED:
        if rank == 0:
            print(f"elastic_trainer: {exc}", file=sys.stderr)
            if code == exit_codes.FENCED:
                events.emit("fenced", step=None, error=str(exc))
        logger.error("rank %d: stopping with exit code %d (%s)", rank, code, type(exc).__name__)
        _flushed_exit(code)
    if show is not None:
        show()
    else:
        logger.error("rank %d failed: %s", rank, "".join(traceback.format_exception(exc)))
    with contextlib.suppress(Exception):  # run.dir unwritable: the exit code still tells
        restarts = int(os.environ.get(contract.RESTART_COUNT_ENV, "0"))
        events.emit("failure", rank=rank, error=f"{type(exc).__name__}: {exc}"[:2000], restart_count=restarts)
    if run is not None and not run.hooks.drain_after_failure():
        logger.error(
            "rank %d: a save is still uploading after the failure; "
            "exiting without it (the previous commit stays the latest)",
            rank,
        )
        _flushed_exit(exit_codes.FAILED)
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
    exit_codes.exit_now(exit_codes.FAILED)


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
_PATH_KEYS = tuple(f"{section}.{key}" for section, key in SUPERVISED_KEYS)


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


def _keys(data: dict[str, Any]) -> set[str]:
    return {f"{s}.{k}" for s, values in data.items() if isinstance(values, dict) for k in values}


@dataclass(frozen=True)
class Resolved:
    """A rank's configuration, and the checkpoint roots another launcher or front end would have
    taken by default for the same script (``others``; empty when the command line, the
    environment or the script set ``run.dir`` or ``checkpoint.dir``): see :func:`check_other_roots`."""

    cfg: Config
    others: tuple[str, ...] = ()
    explicit: frozenset[str] = frozenset()  # the keys the command line (or environment) or the script set


@dataclass(frozen=True)
class _Launcher:
    """What the launcher's command line set: the supervisor's config and keys under
    ``launch``/``run``, else ``ELASTIC_TRAINER_CONFIG`` and ``ELASTIC_TRAINER_SET``."""

    base: dict[str, Any]
    on_command_line: set[str]
    supervised: bool
    name: str | None
    whose: str
    hint: str

    @classmethod
    def from_env(cls) -> _Launcher:
        raw = os.environ.get(contract.CONFIG_ENV)
        if raw:  # under the supervisor (launch/run): its config, its command line's keys
            keys = set(json.loads(os.environ.get(contract.CONFIG_SET_ENV) or "[]"))
            hint = "set it on the supervisor's command line (--set {k}={v}) or in its --config, not in the script"
            return cls(json.loads(raw), keys, True, None, "its supervisor (elastic-trainer run/launch) uses", hint)
        # Any other launcher (python, torchrun, accelerate launch): ELASTIC_TRAINER_CONFIG and
        # ELASTIC_TRAINER_SET are its command line; paths are named as `run` names them.
        env = EnvSettings.from_env()
        base = env.data()
        argv0 = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else None
        whose = f"{contract.CONFIG_FILE_ENV}/{contract.OVERRIDES_ENV} set"
        hint = f"set it there ({contract.OVERRIDES_ENV}={{k}}={{v}}), not in the script"
        return cls(base, _keys(base), False, run_name(env.path) or run_name(argv0), whose, hint)

    def check_paths(self, mine: dict[str, Any]) -> None:
        """A script may not move a path the launcher set (the supervisor's, always)."""
        for section, key in SUPERVISED_KEYS:
            want = (mine.get(section) or {}).get(key)
            have = (self.base.get(section) or {}).get(key)
            if not (self.supervised or f"{section}.{key}" in self.on_command_line) or want is None or have is None:
                continue
            if _same_place(str(want)) != _same_place(str(have)):
                raise ConfigError(
                    f"{section}.{key}",
                    f"the script asks for {want!r}, {self.whose} {have!r}: "
                    + self.hint.format(k=f"{section}.{key}", v=want),
                )

    def merge(self, mine: dict[str, Any]) -> dict[str, Any]:
        """One rule: the launcher's command line > the script's own settings (> a front end's
        defaults > the built-in defaults). A key the command line set is never replaced; that the
        script's value lost is logged."""
        base, lost = self.base, []
        for section, values in mine.items():
            for key, value in (values if isinstance(values, dict) else {}).items():
                if f"{section}.{key}" in self.on_command_line:
                    if value != base[section][key]:
                        lost.append(f"{section}.{key}={value!r} (the command line's: {base[section][key]!r})")
                    continue
                base.setdefault(section, {})[key] = value
        if lost and os.environ.get(contract.RANK_ENV, "0") == "0":
            logger.warning("the launcher's command line set these, the script's own values are not used: %s", lost)
        return base


def _script_settings(config: str | os.PathLike | Config | dict | None, overrides) -> dict[str, Any]:
    if isinstance(config, Config):
        mine = _set_in(config)
    elif isinstance(config, dict):
        mine = copy.deepcopy(config)
    else:
        mine = read_toml(config)
    return apply_overrides(mine, overrides)


def resolve(
    config: str | os.PathLike | Config | dict | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    defaults: list[str] | tuple[str, ...] = (),
) -> Resolved:
    """The rank's config (see :func:`resolve_config`) and the other default checkpoint roots.
    ``defaults``: a front end's own ``section.key=value`` defaults, below the script's settings
    (the Accelerate integration's ``project_dir`` paths); its paths apply without a supervisor
    only, and only when nothing else sets ``run.dir`` or ``checkpoint.dir``."""
    mine = _script_settings(config, overrides)
    front = apply_overrides({}, defaults)
    launcher = _Launcher.from_env()
    launcher.check_paths(mine)
    base = launcher.merge(mine)
    on_command_line = launcher.on_command_line
    paths_set = on_command_line & set(_PATH_KEYS) if launcher.supervised else _keys(base) & set(_PATH_KEYS)
    for dotted in sorted(_keys(front) - _keys(base)):
        section, key = dotted.split(".", 1)
        # a front end's paths: never under a supervisor; its checkpoint.dir only with its run.dir
        if dotted not in _PATH_KEYS or not (launcher.supervised or (dotted == "checkpoint.dir" and paths_set)):
            base.setdefault(section, {})[key] = front[section][key]
    cfg = config_from_dict(base, name=launcher.name)
    explicit = frozenset(on_command_line | _keys(mine))
    if paths_set:
        return Resolved(cfg, explicit=explicit)
    # Where nothing set the paths: the defaults another launcher or an earlier release took.
    script_path = None if isinstance(config, (Config, dict)) else config
    script_default = with_paths({}, run_name(script_path)) if script_path else {}  # et.init(TOML) named the run
    candidates = [
        with_paths({}, launcher.name)["checkpoint"].get("dir") if not launcher.supervised else None,  # `run`'s
        (front.get("checkpoint") or {}).get("dir"),
        (script_default.get("checkpoint") or {}).get("dir"),
    ]
    here = _same_place(cfg.checkpoint.dir)
    others = tuple(dict.fromkeys(str(c) for c in candidates if c and _same_place(str(c)) != here))
    return Resolved(cfg, others, explicit)


def resolve_config(
    config: str | os.PathLike | Config | dict | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """The rank's config. ``config`` is a TOML path, a dict of sections, or a :class:`Config` (whose
    values other than the defaults count as set), with ``overrides`` (``section.key=value``) on top.

    One rule decides every key: **the launcher's command line > the script's own settings > the
    defaults**. Under the supervisor (``launch``/``run``) the command line is its ``--config`` and
    ``--set`` (the whole resolved config arrives in ``ELASTIC_TRAINER_CONFIG_JSON``); under any
    other launcher (``python``, ``torchrun``, ``accelerate launch``) it is the environment:
    ``ELASTIC_TRAINER_CONFIG`` (a TOML file, as ``run --config`` takes) and ``ELASTIC_TRAINER_SET``
    (``section.key=value`` items, one per line or separated by ``;``). A key the command line set
    keeps its value (rank 0 logs the script's that was not used); a script whose ``run.dir`` or
    ``checkpoint.dir`` disagrees with the command line's (under the supervisor: with the
    supervisor's, which writes the event log, fences and watches commits there) stops with
    ConfigError naming the key. The paths nothing sets are ``runs/<name>`` and
    ``runs/<name>/checkpoints``, ``<name>`` the command line's config file's stem, else the
    script's: the same under every launcher."""
    return resolve(config, overrides).cfg


def holds_commits(root: str, cfg: Config) -> bool:
    """Whether checkpoint root ``root`` lists a committed checkpoint (by name; nothing is read)."""
    from ..checkpoint.catalog import Catalog
    from ..storage.fs import open_storage

    c = cfg.checkpoint
    storage = open_storage(root, c.s3_endpoint_url, c.storage_timeout_seconds, c.storage_retries)
    return Catalog(storage).names()[1] is not None


def check_other_roots(resolved: Resolved) -> None:
    """Refuse (ConfigError, exit 2) a start whose default checkpoint root holds no commit while
    another default root of this script — another launcher's (``elastic-trainer run``'s
    ``runs/<script>/checkpoints``, Accelerate's ``project_dir/checkpoints``) or an earlier
    release's — does: switching launchers must not silently start over. Every rank checks
    (local listings), so every rank stops."""
    cfg = resolved.cfg
    held = [r for r in resolved.others if "://" not in r and os.path.isdir(r) and holds_commits(r, cfg)]
    if not held or holds_commits(cfg.checkpoint.dir, cfg):
        return
    raise ConfigError(
        "checkpoint.dir",
        f"this start's checkpoint root {cfg.checkpoint.dir} holds no commit, but {held[0]} (the default of "
        "another launcher or front end for this script) does: set checkpoint.dir to one of them explicitly "
        f"(--set checkpoint.dir=... under elastic-trainer run, else {contract.OVERRIDES_ENV}=checkpoint.dir=...) "
        f"to resume from {held[0]} or to start afresh in {cfg.checkpoint.dir}",
    )


def write_resolved_config(cfg: Config) -> str:
    """``run.dir/config.json``: the resolved config of this start, for the record (rank 0 of every
    run, whatever the front end). Returns the path, or why there is none."""
    path = os.path.join(cfg.run.dir, contract.RESOLVED_CONFIG_FILE)
    return path if write_record(path, cfg.to_dict(), "the resolved config") else "no file: run.dir not writable"


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
    run: Any = None  # the Run made on this session (runtime.run), if any
    explicit: frozenset[str] = frozenset()  # ``section.key`` the launcher's command line or the script set
    _watchdog: bool = False

    def excepthook(self, previous, exc_type, exc, tb) -> None:
        """``sys.excepthook`` of a script: :func:`failed` (the traceback by the previous hook).
        A KeyboardInterrupt that is not a stop of ours ends as the interpreter ends it."""
        if exc is not None and exit_code_for(exc) == exit_codes.FAILED and issubclass(exc_type, KeyboardInterrupt):
            previous(exc_type, exc, tb)
            return
        failed(exc, rank=self.rank, run_dir=self.cfg.run.dir, run=self.run, show=lambda: previous(exc_type, exc, tb))

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
    config: str | os.PathLike | Config | dict | None = None,
    *,
    overrides: list[str] | tuple[str, ...] = (),
    defaults: list[str] | tuple[str, ...] = (),
) -> Session:
    """Set up this rank: process groups (the training group and a separate gloo group for
    checkpoints), the rank-0 event log (``run.dir/events.jsonl``), the metrics sink (the node's
    Prometheus exporter under the supervisor), the preemption flag (SIGTERM/SIGUSR1) and the
    hang-watchdog client (under the supervisor), and the ``elastic_trainer`` logger (stderr with a
    ``[node/rank - step N]`` prefix, level ``ELASTIC_TRAINER_LOG_LEVEL``, default INFO; left alone
    if the program gave that logger a handler). Call on every rank, first.

    The configuration: :func:`resolve_config` (under any launcher, ``ELASTIC_TRAINER_CONFIG`` and
    ``ELASTIC_TRAINER_SET`` are read where no supervisor passed its config); ``defaults``: a front
    end's own defaults, below the script's settings (see :func:`resolve`). A bad configuration, or a
    default checkpoint root without commits while another launcher's default root for this script
    has some (:func:`check_other_roots`), stops the process with exit 2 before anything starts.
    Rank 0 writes the resolved config to ``run.dir/config.json``."""
    t0 = time.monotonic()
    log.setup_logging()
    try:
        resolved = resolve(config, overrides, defaults)
        check_other_roots(resolved)
        cfg, explicit = resolved.cfg, resolved.explicit
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
    if d.rank == 0:
        logger.debug("config (also in %s): %s", write_resolved_config(cfg), cfg.to_json())
    metrics = metrics_factory.worker_sink(cfg, rank=d.rank)
    metrics.gauge("elastic_trainer_world_size", d.world_size)
    timer_file = os.environ.get(contract.TIMER_FILE_ENV)
    made = time.monotonic() - t0
    watched = bool(timer_file)
    session = Session(cfg, d, events, metrics, preempt, init_seconds=made, explicit=explicit, _watchdog=watched)
    sys.excepthook = functools.partial(session.excepthook, sys.excepthook)
    if timer_file:
        from torch.distributed.elastic import timer

        timer.configure(timer.FileTimerClient(timer_file))
    return session
