"""The rendezvous store as a process of its own: ``elastic-trainer store --host H --port P``.

torch's c10d rendezvous keeps its state in a ``TCPStore``. By default the first agent to start
hosts it, so losing that one node kills every other agent (``RendezvousConnectionError``):
the job is only as available as its first node. Running the store in a tiny process that
holds no training state and outlives any single agent removes that single point of failure;
agents then join with ``is_host=false`` (the default ``elastic.rdzv_conf``).

The store keeps no durable state. If *it* dies, the agents fail their next rendezvous
operation; restart it and the job's supervisors (restarted by the scheduler) resume from the
last committed checkpoint. Give each job its own ``--rdzv-id`` (a finished job's rendezvous
is closed in the store and a later job with the same id would exit at once).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int

    @classmethod
    def parse(cls, endpoint: str, default_port: int = 29400) -> StoreAddress:
        """``HOST[:PORT]`` → address. Raises ValueError naming the endpoint."""
        host, sep, port = endpoint.rpartition(":")
        if not sep:
            host, port = endpoint, str(default_port)
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected HOST:PORT, got {endpoint!r}")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def serve(addr: StoreAddress, stop: threading.Event | None = None, on_ready=None) -> int:
    """Host a ``TCPStore`` at ``addr`` until SIGTERM/SIGINT (or ``stop`` is set). Returns 0.

    ``wait_for_workers=False``: the store does not know how many agents will come and go."""
    from torch.distributed import TCPStore

    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, lambda *_: stop.set())
    store = TCPStore(addr.host, addr.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    logger.info("rendezvous store serving on %s (port %d)", addr, store.port)
    if on_ready is not None:
        on_ready(store.port)
    stop.wait()
    logger.info("rendezvous store on %s stopping", addr)
    del store
    return 0


def reachable(addr: StoreAddress, timeout_seconds: float = 5.0) -> bool:
    """True when something accepts TCP connections at ``addr`` within ``timeout_seconds``
    (a plain connect: quiet and quick, enough to catch a store that was never started)."""
    import socket

    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            with socket.create_connection((addr.host, addr.port), timeout=max(0.1, deadline - time.monotonic())):
                return True
        except OSError as e:
            if time.monotonic() >= deadline:
                logger.debug("no store at %s: %s", addr, e)
                return False
            time.sleep(0.2)
