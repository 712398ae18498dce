"""Warm worker starts (``elastic.warm_start``): the supervisor's side of the zygote.

:class:`Zygote` starts ``python -m elastic_trainer.worker.zygote`` ahead of the first
rendezvous, or forks it from the supervisor once that imported torch (it imports the trainer
while the supervisor does its own set-up), and asks it to fork each worker.
:class:`WarmStart` is the supervised agent's collaborator that starts each worker group through it.
:class:`ZygoteProcess` is the ``subprocess.Popen`` stand-in that torch's ``SubprocessContext``
then polls, waits for and signals (``pid``, ``poll``, ``wait``, ``returncode``); the exit
statuses come from the zygote, which reaps its children.

The one private torch seam is here (:func:`warm_handlers`): during the agent's
``_start_workers`` torch's ``SubprocessContext`` builds its handlers with a
``SubprocessHandler`` whose ``_popen`` asks the zygote instead of ``Popen``. Everything else
(environment, ``@record`` error files, log redirects, tee, the hang watchdog, stopping the group
with ``killpg``) is torch's own code, unchanged. ``tests/unit/test_warm.py`` fails loudly if torch
moves the seam. Anything the zygote cannot do falls back to torch's cold ``Popen`` with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from .. import contract
from ..errors import ConfigError
from .journal import Journal

logger = logging.getLogger(__name__)

READY_TIMEOUT_SECONDS = 300.0
REPLY_TIMEOUT_SECONDS = 30.0


class ZygoteError(RuntimeError):
    pass


class Zygote:
    """A pre-imported interpreter, child of the supervisor, that forks fresh worker processes."""

    def __init__(
        self, python: str = sys.executable, ready_timeout: float = READY_TIMEOUT_SECONDS, preload: tuple[str, ...] = ()
    ):
        self.python = python
        self.preload = tuple(preload)  # empty: the zygote's own list (torch and the trainer); see preload_for
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | ForkedChild | None = None
        self.sock: socket.socket | None = None
        self.info: dict | None = None
        self.exits: dict[int, int] = {}
        self._replies: dict[int, dict] = {}
        self._next_id = 0
        self._lock = threading.RLock()
        self._dead = False
        self._unusable = ""  # set once it timed out: later workers do not wait again

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, fork=None) -> Zygote:
        """Start the zygote; returns at once (it imports in the background).

        ``fork``: ``elastic_trainer.worker.zygote.fork``, from an entry point that imported torch
        and may fork itself: the zygote is then this process's child without an interpreter start
        or a torch import of its own. Without it, or when this process cannot fork safely, the
        zygote is a new interpreter."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = fork(theirs.fileno(), self.preload) if fork is not None else None
        if pid is not None:
            self.proc = ForkedChild(pid, [contract.ZYGOTE_MODULE, *self.preload])
        else:
            self.proc = subprocess.Popen(
                [self.python, "-m", contract.ZYGOTE_MODULE, str(theirs.fileno()), *self.preload],
                pass_fds=[theirs.fileno()],
                env={**os.environ, contract.SUPERVISOR_PID_ENV: str(os.getpid())},  # it checks its parent
                start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor, which stops the workers itself
            )
        theirs.close()
        self.sock = ours
        self._dead = False
        return self

    @property
    def forked(self) -> bool:
        """Forked from this process (else a new interpreter)."""
        return isinstance(self.proc, ForkedChild)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def wait_ready(self) -> dict:
        """Block until the zygote has imported everything; raises :class:`ZygoteError` if it
        cannot be used (died, timed out, or has more than one thread: forking it is unsafe)."""
        with self._lock:
            deadline = time.monotonic() + self.ready_timeout
            while self.info is None:
                if self._unusable:
                    raise ZygoteError(self._unusable)
                self._pump(max(0.0, deadline - time.monotonic()))
                if self._dead:
                    raise ZygoteError(
                        "the warm-start zygote exited (code "
                        f"{self.proc.poll() if self.proc else None}) before it was ready"
                    )
                if self.info is None and time.monotonic() >= deadline:
                    self._unusable = f"the warm-start zygote was not ready after {self.ready_timeout:.0f}s"
                    raise ZygoteError(self._unusable)
            if self.info.get("threads", 1) != 1:
                raise ZygoteError(
                    f"the warm-start zygote has {self.info['threads']} threads after its imports; forking it is unsafe"
                )
            for what in ("cuda", "process_group"):
                if self.info.get(what):
                    raise ZygoteError(
                        f"the warm-start zygote's imports initialised {what.replace('_', ' ')}; forking it is unsafe"
                    )
            return self.info

    @property
    def alive(self) -> bool:
        return not self._dead and self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        """Close the socket (the zygote exits on end of file) and reap it."""
        with self._lock:
            if self.sock is not None:
                self.sock.close()
                self.sock = None
            self._dead = True
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    # -- workers -----------------------------------------------------------------------
    def spawn(self, argv: list[str], env: dict[str, str], stdout=None, stderr=None) -> ZygoteProcess:
        """Fork one worker running ``argv`` (``python -u -m MODULE ...``) with exactly ``env``."""
        self.wait_ready()
        names, fds = [], []
        for name, f in zip(contract.ZYGOTE_STREAMS, (stdout, stderr), strict=True):
            if f is not None:
                names.append(name)
                fds.append(f.fileno())
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            msg = json.dumps(
                {"id": rid, "argv": [str(a) for a in argv], "env": dict(env), "cwd": os.getcwd(), "fds": names}
            ).encode()
            assert self.sock is not None  # started
            try:
                socket.send_fds(self.sock, [msg], fds)
            except OSError as e:
                if e.errno == errno.EMSGSIZE:  # one packet: the environment exceeds the socket buffer
                    raise ZygoteError(
                        f"the worker's start request ({len(msg)} bytes) does not fit one packet"
                    ) from None
                self._dead = True
                raise ZygoteError(f"the warm-start zygote is gone: {e}") from None
            deadline = time.monotonic() + REPLY_TIMEOUT_SECONDS
            while rid not in self._replies:
                if self._dead or time.monotonic() >= deadline:
                    raise ZygoteError("the warm-start zygote did not answer a start request")
                self._pump(deadline - time.monotonic())
            reply = self._replies.pop(rid)
        if "error" in reply:
            raise ZygoteError(reply["error"])
        return ZygoteProcess(self, reply["pid"], argv)

    def exitcode(self, pid: int, timeout: float = 0.0) -> int | None:
        """The exit code of worker ``pid`` once the zygote reaped it; waits up to ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                self._pump(0.0)
                if pid in self.exits:
                    return self.exits[pid]
                if self._dead:  # the zygote is gone; its children got PR_SET_PDEATHSIG (SIGKILL)
                    return self.exits.setdefault(pid, -signal.SIGKILL)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._pump(min(left, 1.0))

    def _pump(self, timeout: float) -> None:
        """Read every message already queued; wait up to ``timeout`` for the first one."""
        if self.sock is None:
            self._dead = True
            return
        wait = max(0.0, timeout)
        while True:
            try:
                ready, _, _ = select.select([self.sock], [], [], wait)
            except InterruptedError:
                continue
            if not ready:
                return
            try:
                data = self.sock.recv(contract.ZYGOTE_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                self._dead = True
                return
            msg = json.loads(data)
            if "exit" in msg:
                self.exits[msg["exit"]] = msg["code"]
            elif "ready" in msg:
                self.info = msg
                if msg.get("missing"):
                    logger.info("warm-start zygote: optional modules not preloaded: %s", ", ".join(msg["missing"]))
            else:
                self._replies[msg.get("id")] = msg
            wait = 0.0


class ForkedChild:
    """What :class:`Zygote` needs of a ``subprocess.Popen`` (``pid``, ``poll``, ``wait``, ``kill``)
    for a zygote forked from this process."""

    def __init__(self, pid: int, args):
        self.pid, self.args = pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = -signal.SIGKILL
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                assert timeout is not None  # a deadline comes from it
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        assert self.returncode is not None  # poll() set it
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


class ZygoteProcess:
    """What torch's ``SubprocessContext`` needs of a ``subprocess.Popen``, for a forked worker."""

    def __init__(self, zygote: Zygote, pid: int, args):
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exitcode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.exitcode(self.pid, timeout=1e9 if timeout is None else timeout)
        if self.returncode is None:
            # typeshed types TimeoutExpired's timeout as a float; None says "no timeout", as passed
            raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it exited (and the zygote reaped it) since the poll
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def trainer_preload(backend: tuple[str, ...] = ()) -> tuple[str, ...]:
    """What a zygote for ``launch``'s trainer imports: ``()``, its own list (torch and the
    trainer), plus ``backend``, the checkpoint storage's filesystem module (:func:`..storage.fs.backend_modules`)."""
    return _unique((contract.ZYGOTE_PRELOAD_TRAINER, *backend)) if backend else ()


def preload_for(
    cmd, cmd_args, trainer_module: str, extra: tuple[str, ...] = (), backend: tuple[str, ...] = ()
) -> tuple[str, ...] | None:
    """What a zygote for this entry point imports (pure), or None when it cannot start it warm.

    ``python [-u] -m trainer_module``: :func:`trainer_preload` (torch, the trainer, ``backend``).
    ``python [-u] -m MODULE`` / ``python [-u] SCRIPT.py`` (``run``): torch and elastic_trainer's
    public API (``@script``), the script's own top-level imports of installed packages
    (:func:`script_imports`), ``backend``, then ``extra`` (``run --preload MODULE``). Anything
    else (torchrun's ``--no-python``, ``--run-path``, other interpreter options) is started cold.
    ``backend``: the checkpoint storage's filesystem module (``s3fs``), which every worker imports
    when it opens ``checkpoint.dir``. Raises ConfigError for an ``extra`` name that is not a
    dotted module name, or one followed by ``:NAME,...``."""
    for name in extra:
        module, colon, attrs = name.partition(":")
        parts = module.split(".") + (attrs.split(",") if colon else [])
        if not all(part.isidentifier() for part in parts):
            raise ConfigError(
                "--preload",
                "expected a module name such as 'transformers' or 'mypkg.model', or names taken from "
                f"one such as 'transformers:AutoModelForCausalLM', got {name!r}",
            )
    if not isinstance(cmd, str) or not os.path.basename(cmd).startswith("python"):
        return None
    rest = [str(a) for a in cmd_args]
    while rest and rest[0] == "-u":
        rest.pop(0)
    if len(rest) >= 2 and rest[0] == "-m":
        if rest[1] == trainer_module and not extra:
            return trainer_preload(backend)
        return _unique((contract.ZYGOTE_PRELOAD_SCRIPT, *backend, *extra))
    if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
        return _unique((contract.ZYGOTE_PRELOAD_SCRIPT, *script_imports(rest[0]), *backend, *extra))
    return None


def script_imports(path: str) -> list[str]:
    """The modules ``path`` imports at its top level (``import a.b``; ``from a.b import c, d`` as
    ``a.b:c,d``, whose names the zygote takes as the import does) that are not its own: a module
    found next to the script (a file or a package in its directory) is left out, since it may
    read the rank's environment when imported. An unreadable or unparsable script gives []: the
    worker reports it the cold way."""
    import ast

    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    here = os.path.dirname(os.path.abspath(path))
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module not in (None, "__future__"):
            taken = ",".join(a.name for a in node.names if a.name != "*")  # zygote.preload resolves them
            names.append(f"{node.module}:{taken}" if taken else node.module)

    def own(top: str) -> bool:
        return os.path.exists(os.path.join(here, top + ".py")) or os.path.isdir(os.path.join(here, top))

    return [n for n in _unique(names) if not own(n.partition(":")[0].split(".")[0])]


def _unique(names) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def _handler_class(zygote: Zygote, on_fallback):
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    class WarmSubprocessHandler(SubprocessHandler):
        """torch's handler; the process comes from the zygote instead of ``Popen``."""

        def _popen(self, args, env):
            try:
                return zygote.spawn(list(args), env, stdout=self._stdout, stderr=self._stderr)
            except ZygoteError as e:
                on_fallback(str(e))
                return super()._popen(args, env)

        def close(self, death_sig=None) -> None:
            try:
                super().close(death_sig)
            except ProcessLookupError:
                # No process group: the zygote reaps a worker the moment it exits, so a group
                # whose members all exited is gone (a Popen child stays a zombie, and its group,
                # until waited for); or the worker was forked a moment ago and has not made its
                # own group yet (the zygote blocks the signal until it can act on it). Signal the
                # worker itself unless the zygote reported its exit. torch's close would raise.
                self.proc.send_signal(death_sig or signal.SIGTERM)
                for f in (self._stdout, self._stderr):
                    if f:
                        f.close()

    return WarmSubprocessHandler


@contextlib.contextmanager
def warm_handlers(zygote: Zygote, on_fallback=lambda reason: None):
    """While active, torch's ``SubprocessContext`` starts workers through ``zygote``."""
    from torch.distributed.elastic.multiprocessing import api

    original = api.get_subprocess_handler
    cls = _handler_class(zygote, on_fallback)

    def get_subprocess_handler(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options=None):
        return cls(
            entrypoint=entrypoint,
            args=args,
            env=env,
            stdout=stdout,
            stderr=stderr,
            local_rank_id=local_rank_id,
            numa_options=numa_options,
        )

    api.get_subprocess_handler = get_subprocess_handler
    try:
        yield
    finally:
        api.get_subprocess_handler = original


class WarmStart:
    """The supervised agent's warm-start collaborator: starts each worker group through
    ``zygote`` (None: cold, as torch does), records ``workers_started``, and when the zygote could
    not start a worker (that one was started cold) replaces a dead zygote ``zygote_restarts``
    times, in the background of the generation, and otherwise stops using it."""

    def __init__(self, zygote: Zygote | None, journal: Journal, zygote_restarts: int = 1) -> None:
        self.zygote, self._journal, self._restarts = zygote, journal, zygote_restarts

    def start(self, start_workers: Callable[[], dict[int, int]]) -> dict[int, int]:
        """Run ``start_workers()`` (torch's: local rank -> pid) through the zygote; its pids."""
        t0 = time.monotonic()
        zygote = self.zygote
        fallbacks: list[str] = []
        if zygote is None:
            pids = start_workers()
        else:
            with warm_handlers(zygote, on_fallback=fallbacks.append):
                pids = start_workers()
        self._journal.events.emit(
            "workers_started",
            warm=zygote is not None and not fallbacks,
            pids=sorted(pids.values()),
            zygote_pid=zygote.pid if zygote is not None else None,
            zygote_forked=zygote.forked if zygote is not None else None,
            zygote_threads=(zygote.info or {}).get("threads") if zygote is not None else None,
            seconds=round(time.monotonic() - t0, 4),
            node=self._journal.node,
            mono=time.monotonic(),
        )
        if fallbacks:
            self._fallback(fallbacks[0])
        return pids

    def close(self) -> None:
        """Close the zygote in use, if any (the job ended)."""
        if self.zygote is not None:
            self.zygote.close()

    def _fallback(self, reason: str) -> None:
        old, self.zygote = self.zygote, None
        assert old is not None  # only called when a zygote was in use
        restart = not old.alive and self._restarts > 0
        old.close()
        if restart:
            self._restarts -= 1
            self.zygote = Zygote(preload=old.preload).start()
        logger.warning(
            "warm start unavailable (%s): workers were started cold%s",
            reason,
            "; a new zygote is starting" if restart else "",
        )
        self._journal.events.emit("warm_start_unavailable", reason=reason[:500], zygote_restarted=restart)
