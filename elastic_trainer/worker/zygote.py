"""Warm worker starts (``elastic.warm_start``): a pre-imported interpreter that forks fresh workers.

The supervisor starts ``python -m elastic_trainer.worker.zygote FD [MODULE ...]`` once, ahead of
the first rendezvous, or forks it from itself once it imported torch (:func:`fork`). It imports
torch, torch.distributed, DCP and the trainer's modules (or the MODULEs given; ``@trainer`` and
``@script`` stand for the built-in lists of ``launch``'s trainer and of a user's script under
``run``), and then only waits on the Unix socket ``FD`` (its end of a ``socketpair`` with the supervisor). For every
worker the agent starts it forks one child, which becomes exactly what ``python -u -m MODULE``
(or ``python -u SCRIPT``) would be: its own session, the agent's environment and stdout/stderr,
``sys.argv`` of the module, then ``runpy`` runs the module (the script) as ``__main__``. Nothing
else carries over: the zygote never trains, never initialises a process group or CUDA (it
reports whether its imports did, and its thread count; the supervisor refuses a zygote that
initialised either or has more than one thread, and starts workers the cold way). So a
replacement worker pays neither the interpreter start nor the torch import on the critical path,
and is still a fresh process of its own (new PID, no state of the group it replaces).

Protocol (one JSON message per ``SOCK_SEQPACKET`` packet; its names and sizes are ``contract.ZYGOTE_*``):

* zygote → supervisor at start: ``{"ready": pid, "threads": n, "preload_seconds": s, "missing": [...],
  "cuda": bool, "process_group": bool}``
* supervisor → zygote: ``{"id": i, "argv": [...], "env": {...}, "cwd": dir}`` with the worker's
  ``"fds": ["stdout", "stderr"]`` naming the file descriptors passed with it (``SCM_RIGHTS``;
  a stream not named is inherited from the zygote, i.e. the supervisor's)
* zygote → supervisor: ``{"id": i, "pid": p}`` (or ``{"id": i, "error": msg}``), and for every
  child that ends ``{"exit": p, "code": c}`` (``Popen.returncode`` convention: ``-N`` = signal N)

The zygote dies with the supervisor (``PR_SET_PDEATHSIG``), and its children die with it; an
end of file on the socket (the supervisor closed it) ends the zygote too.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time

from .. import contract, exit_codes, lifeline, log

# What every worker needs, whatever it runs: torch, its distributed pieces and DCP.
TORCH_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.elastic.multiprocessing.errors",
    "torch.distributed.elastic.timer",
    # imported lazily by the first meta-device init (torch._refs) and the first FSDP step
    "torch._dynamo",
    "torch._decomp.decompositions_for_rng",
    "numpy.random",
    "fsspec.implementations.local",
    "fsspec.implementations.chained",
    "torch.profiler",
    "torch.utils._sympy.reference",
    "torch.utils.serialization",
    "statistics",
)
# ``launch``'s trainer (the default list).
PRELOAD = (
    *TORCH_PRELOAD,
    "elastic_trainer.worker.main",
    "elastic_trainer.worker.parallel",
    "elastic_trainer.worker.train_loop",
    "elastic_trainer.worker.sources",
    "elastic_trainer.worker.model_factory",
    "elastic_trainer.checkpoint.manager",
    "elastic_trainer.checkpoint.state",
    "elastic_trainer.models.pretrained",
    "elastic_trainer.storage.fs",
    "elastic_trainer.metrics.factory",
)
# A user's script under ``run``: torch and elastic_trainer's public API (``import elastic_trainer as et``).
SCRIPT_PRELOAD = (
    *TORCH_PRELOAD,
    "elastic_trainer.runtime.session",
    "elastic_trainer.runtime.checkpointer",
    "elastic_trainer.runtime.step",
    "elastic_trainer.runtime.sampler",
    "elastic_trainer.checkpoint.manager",
    "elastic_trainer.checkpoint.state",
    "elastic_trainer.storage.fs",
    "elastic_trainer.metrics.factory",
)


# Native threads a fork may copy the process over: their library's own pthread_atfork handlers
# take its locks across the fork and the child starts the thread again when it needs it.
# jemalloc's background purging thread (pyarrow's allocator: `import datasets`, and so
# `import transformers` where datasets is installed, starts it).
FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})


def thread_count() -> int:
    """Threads of this process as the kernel sees them (torch's pools included), but for those
    of :data:`FORK_SAFE_THREADS`."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return threading.active_count()
    names = [_thread_name(t) for t in tasks]
    return sum(1 for name in names if name is not None and name not in FORK_SAFE_THREADS)


def _thread_name(task: str) -> str | None:
    """The thread's name (its ``comm``), or None once it has ended."""
    try:
        with open(f"/proc/self/task/{task}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def settle_threads() -> int:
    """Thread count once library thread pools that stop themselves at ``fork`` have done so.

    numpy's OpenBLAS starts its pool at import and shuts it down in a ``pthread_atfork``
    handler (it restarts on the next BLAS call, which the zygote never makes): one throwaway
    fork leaves the zygote single-threaded, so no lock of another thread is copied into a worker."""
    if thread_count() > 1:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    return thread_count()


LISTS = {contract.ZYGOTE_PRELOAD_TRAINER: PRELOAD, contract.ZYGOTE_PRELOAD_SCRIPT: SCRIPT_PRELOAD}


def preload(modules=PRELOAD) -> list[str]:
    """Import ``modules`` (``@trainer`` / ``@script`` stand for those lists); returns the ones
    that could not be imported (optional extras, a user's module that is not installed).

    ``MODULE:a,b`` does what ``from MODULE import a, b`` does: each name is the module's
    attribute or else its submodule. A package that loads its classes lazily on first access
    (``transformers``) is imported cheaply; its models load only when a name is taken from it."""
    missing = []
    for entry in [m for n in modules for m in LISTS.get(n, (n,))]:
        name, _, attrs = entry.partition(":")
        taken = [a for a in attrs.split(",") if a]
        try:
            module = importlib.__import__(name, fromlist=taken)  # as the import statement does it
        except Exception:  # noqa: BLE001 - not preloaded; the worker imports it (and reports its error) itself
            missing.append(name)
            continue
        missing += [f"{name}.{a}" for a in taken if not hasattr(module, a)]
    return missing


def _initialised() -> dict[str, bool]:
    """Whether the imports initialised CUDA or a process group: a fork would share them, so the
    supervisor refuses such a zygote (a user's module may do either at import)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {"cuda": False, "process_group": False}
    dist = sys.modules.get("torch.distributed")
    return {
        "cuda": bool(torch.cuda.is_initialized()),
        "process_group": bool(dist is not None and dist.is_available() and dist.is_initialized()),
    }


def _send(sock: socket.socket, msg: dict) -> None:
    sock.send(json.dumps(msg).encode())


def _forwarded() -> set[signal.Signals]:
    return {getattr(signal, name) for name in contract.FORWARDED_SIGNALS}


def _child(req: dict, fds: list[int], keep_closed: list[int], zygote_pid: int, mask) -> None:
    """In the forked child: become ``python -u -m MODULE`` with the request's env; never returns.
    ``mask``: the signal mask to restore once the forwarded signals have their default actions."""
    code = 1
    try:
        os.setsid()  # like torch's SubprocessHandler (start_new_session): the agent signals the group
        lifeline.die_with_parent(zygote_pid, code=1)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for name in contract.FORWARDED_SIGNALS:  # a fresh interpreter's dispositions
            signal.signal(getattr(signal, name), signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal sent since the fork acts now
        for fd in keep_closed:
            os.close(fd)
        for name, fd in zip(req.get("fds", []), fds, strict=True):
            os.dup2(fd, contract.ZYGOTE_STREAMS[name])
            os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ[contract.PARENT_PID_ENV] = str(zygote_pid)  # die_with_supervisor checks its parent
        os.chdir(req["cwd"])
        # -u: unbuffered binary stdout/stderr, as the cold start has
        sys.stdout = _unbuffered(1, sys.stdout)
        sys.stderr = _unbuffered(2, sys.stderr)
        kind, target, args = _target_of(req["argv"])
        lifeline.prctl(lifeline.PR_SET_NAME, f"et-worker-{os.environ.get(contract.LOCAL_RANK_ENV, '')}".encode()[:15])
        threads = os.environ.get(contract.OMP_THREADS_ENV)
        if threads and threads.isdigit():  # read by OpenMP at library load, i.e. in the zygote
            import torch

            torch.set_num_threads(int(threads))
        _reseed()
        import runpy

        if kind == "-m":
            sys.argv = [target, *args]
            sys.modules.pop(target, None)  # as with 'python -m': the module runs once, as __main__
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:  # as 'python SCRIPT': its directory first on sys.path, its path in argv[0]
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            sys.argv = [target, *args]
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException as e:  # noqa: BLE001 - report like the interpreter would, then exit
        # as the interpreter records an uncaught exception: atexit handlers tell an exception's
        # end by it (an Accelerate script's end starts no collective then)
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
        if sys.version_info >= (3, 12):
            setattr(sys, "last_exc", e)  # noqa: B010 - absent from this Python's stubs below 3.12
        sys.excepthook(*sys.exc_info())  # the module's own hook, if it installed one (elastic_trainer's Session does)
        code = 1
    finally:
        exit_codes.exit_now(code)  # a script's own atexit handlers run, as the interpreter's exit would


def _unbuffered(fd: int, like):
    import io

    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(
        raw, encoding=getattr(like, "encoding", None), errors=getattr(like, "errors", None), write_through=True
    )


def _target_of(argv: list[str]) -> tuple[str, str, list[str]]:
    """``[python, -u, -m, MODULE, *args]`` → ``("-m", MODULE, args)``, ``[python, -u, SCRIPT,
    *args]`` → ``("path", SCRIPT, args)``; any other interpreter option is refused."""
    rest = list(argv[1:])
    while rest and rest[0] == "-u":
        rest.pop(0)
    if len(rest) >= 2 and rest[0] == "-m":
        return "-m", rest[1], rest[2:]
    if rest and not rest[0].startswith("-"):
        return "path", rest[0], rest[1:]
    raise ValueError(f"the zygote starts only 'python -u -m MODULE ...' or 'python -u SCRIPT ...', got {argv!r}")


def _reseed() -> None:
    """A forked child shares its parent's global RNG states; a fresh interpreter would not.
    (Python's ``random`` reseeds itself after fork; the trainer seeds its own streams.)"""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def serve(sock: socket.socket) -> int:
    zygote_pid = os.getpid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    while True:
        watched: list[socket.socket | int] = [sock, wake_r]
        try:
            ready, _, _ = select.select(watched, [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            try:
                while os.read(wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if sock in ready:
            msg, fds, _, _ = socket.recv_fds(sock, contract.ZYGOTE_MAX_MESSAGE, len(contract.ZYGOTE_STREAMS))
            if not msg:  # the supervisor closed its end
                return 0
            req = json.loads(msg)
            try:
                _target_of(req["argv"])
            except ValueError as e:
                for fd in fds:
                    os.close(fd)
                _send(sock, {"id": req.get("id"), "error": str(e)})
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            # Signalled before it resets the zygote's dispositions (ignore), the child would lose
            # the signal: blocked, it stays pending until the child can act on it.
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, _forwarded())
            pid = os.fork()
            if pid == 0:
                _child(req, fds, [sock.fileno(), wake_r, wake_w], zygote_pid, mask)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for fd in fds:
                os.close(fd)
            _send(sock, {"id": req.get("id"), "pid": pid})


def may_fork() -> bool:
    """Whether this process runs no thread besides this one (after :func:`settle_threads`)."""
    return threading.active_count() == 1 and settle_threads() == 1


def fork(fd: int, modules: tuple[str, ...] = ()) -> int | None:
    """Become the zygote in a child forked from this process (the supervisor, once it imported
    torch): no second interpreter start and no second torch import, which on a node short of
    cores delay the supervisor itself. ``fd``: the zygote's end of the socket pair; ``modules``
    as for :func:`preload` (empty: :data:`PRELOAD`). Returns the child's PID, or None when this
    process runs a thread besides this one (forking it would copy that thread's locks): start
    the zygote as its own interpreter then.

    The child is what ``python -m elastic_trainer.worker.zygote`` would be: its own session,
    no file descriptor but 0, 1, 2 and ``fd``, the entry point's logging set-up undone, the
    working directory first on ``sys.path``."""
    if not may_fork():
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        # Objects of the supervisor's that are garbage already are never collected here: one that
        # owns a descriptor closed below would otherwise close whatever reuses that number.
        gc.freeze()
        os.setsid()
        for name in os.listdir("/proc/self/fd"):
            if int(name) not in (0, 1, 2, fd):
                try:
                    os.close(int(name))
                except OSError:  # the listing's own descriptor, closed already
                    pass
        log.forget_setup()
        sys.path[0] = os.getcwd()  # as 'python -m' has it
        code = _run(fd, modules or PRELOAD, parent)
    except BaseException:  # noqa: BLE001 - report like the interpreter would; the supervisor sees the exit
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(fd: int, modules, parent: int) -> int:
    """The zygote's life: preload, report ready, serve start requests until the supervisor
    closes the socket. Returns the exit code."""
    # A scheduler that signals every process of the job (SLURM's scancel, a time limit) must not
    # kill the zygote: its death would SIGKILL the workers (PR_SET_PDEATHSIG) mid-checkpoint.
    for name in contract.FORWARDED_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    lifeline.prctl(lifeline.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the supervisor died before the call
        return 1
    lifeline.prctl(lifeline.PR_SET_NAME, contract.ZYGOTE_NAME.encode())
    sock = socket.socket(fileno=fd)
    t0 = time.monotonic()
    missing = preload(modules)
    try:
        _send(
            sock,
            {
                "ready": os.getpid(),
                "threads": settle_threads(),
                "preload_seconds": round(time.monotonic() - t0, 3),
                "missing": missing,
                **_initialised(),
            },
        )
        return serve(sock)
    except (ConnectionResetError, BrokenPipeError):  # the supervisor left (e.g. it refused a config): so do we
        return 0


def main() -> int:
    expected = os.environ.get(contract.SUPERVISOR_PID_ENV)
    code = _run(int(sys.argv[1]), sys.argv[2:] or PRELOAD, int(expected) if expected else os.getppid())
    # Nothing of the zygote's needs tearing down (its workers are reaped, it holds no files of
    # the job): skip the interpreter's shutdown of torch, which takes about a second.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
