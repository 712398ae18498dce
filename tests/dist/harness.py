"""Run a function on W real processes joined in a gloo process group (no elastic agent).

``run_ranks(fn, world, *args)`` starts ``world`` processes, each initialising the default
group from a TCPStore on a free 127.0.0.1 port, calls ``fn(rank, world, *args)`` and returns
the list of return values (rank order). Bounded by ``timeout``; stragglers are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import traceback


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _entry(fn, rank, world, port, args, queue, environ):
    os.environ.clear()  # the caller's environment now, not the fork server's at its start
    os.environ.update(environ)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
        }
    )
    import torch.distributed as dist

    try:
        import io

        import torch

        # The fork server imported torch before OMP_NUM_THREADS=1 was set here: its thread pool
        # would be the machine's size, and two ranks would run 2 × cores compute threads
        # (torchrun exports the variable before a worker imports torch; the zygote sets it too).
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        # A fresh interpreter seeds torch's and numpy's global generators at random; a fork would
        # share the server's. (Python's random reseeds itself in a forked child.)
        torch.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        dist.init_process_group("gloo", rank=rank, world_size=world)
        value = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(value, buf)  # plain bytes: tensors must not travel as shared-memory handles
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context():
    """Ranks are forked from one fork server per test session that has imported torch and the
    parts of it every rank uses (once: a fresh interpreter importing them costs seconds per
    rank). The server only imports, so each rank is still a process that has run nothing of
    torch's before (no threads, no process group), as under ``spawn``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "torch",
            "torch.distributed",
            "torch.distributed.tensor",
            "torch.distributed.fsdp",
            "torch.distributed.checkpoint",
            "torch._dynamo",
        ]
    )
    return ctx


class _PortTaken(AssertionError):
    """Rank 0's store could not listen on the port chosen for it: another process took it
    between the choice and the bind (no rank got past ``init_process_group``)."""


def run_ranks(fn, world: int, *args, timeout: float = 120.0, daemon: bool = True):
    """``daemon=False`` lets the ranks start processes of their own (PROCESS-mode ``async_save``).
    A port taken by another process between its choice and rank 0's bind is chosen again (up to
    3 times): that race is the test machine's, not the code's under test."""
    for _ in range(2):
        try:
            return _run_ranks_once(fn, world, *args, timeout=timeout, daemon=daemon)
        except _PortTaken:
            pass
    return _run_ranks_once(fn, world, *args, timeout=timeout, daemon=daemon)


def _run_ranks_once(fn, world: int, *args, timeout: float, daemon: bool):
    ctx = _context()
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, args, queue, dict(os.environ)), daemon=daemon)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world):
            rank, ok, value = queue.get(timeout=timeout)
            if ok:
                import io

                import torch

                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        text = "\n".join(errors)
        if "EADDRINUSE" in text and "init_process_group" in text:
            raise _PortTaken(text)
        raise AssertionError(text)
    return [results[r] for r in range(world)]
