"""A rendezvous whose steady state costs the store the same per node at any node count:
``elastic.rdzv_backend = "elastic-trainer"``, for jobs of hundreds to thousands of nodes.

torch's c10d rendezvous keeps every node, and every node's heartbeat, in one key of the store;
a heartbeat is a compare-and-set of that whole key and every node reads all of it several times
a second. Its traffic grows as N² and heartbeats land one node at a time, so one store carries
a few hundred nodes (docs/elasticity.md, "How many nodes one rendezvous carries"). This handler
implements torch's ``RendezvousHandler`` interface (the agent drives it as it drives torch's)
over the same store, with every per-node write in a key of its own:

* **heartbeat**: a node writes its wall-clock time into ``hb/<node>`` every keep-alive interval
  (one ``set``);
* **steady state**: a node reads, once per poll, three small keys: the round's ``waiting`` count
  (nodes or rejoining participants asking for a new round: torch's ``num_nodes_waiting``), its
  ``lost`` list, and the heartbeat of the next node of the round (a ring): one ``multi_get``;
* **detection**: a node whose ring successor's heartbeat is older than the liveness bound
  (``keep_alive_interval × keep_alive_max_attempt``) appends it to the round's ``lost`` list;
  every node reads the list on its next poll. Any set of lost nodes short of all of them has a
  live node right before one of them in the ring, so one watched successor per node suffices;
* **a round**: a joining node takes an index from an atomic counter (``add``) and writes its name
  under that index; the round closes (a compare-and-set of its size, so every node reads the same
  size) when ``max_nodes`` joined; or, for the job's first round, ``last_call_timeout`` after
  ``min_nodes`` joined; or, for a later round, as soon as every node of the previous round has
  joined or is lost or silent (no last call after a loss: the survivors are known). Its first
  joiner checks that (one read of the previous round's names and heartbeats per poll); any
  joiner takes over after the liveness bound plus the last call. A node's rank is its index.

The store's operations per second are ``N × (1/keep_alive_interval + 1/poll)``, each a few bytes;
a round moves O(N) bytes in all. torch's ``RendezvousStoreInfo`` hands the workers their own
store address, as torch's handler does with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from .. import contract

logger = logging.getLogger(__name__)

BACKEND = contract.OWN_RDZV_BACKEND
# How long a later round waits for a live node of the previous round that has not come (it may
# still be stopping its workers, which a healthy group gets up to the preemption grace for).
REJOIN_GRACE_SECONDS = 30.0
DEFAULTS = {"keep_alive_interval": 0.25, "keep_alive_max_attempt": 8, "last_call_timeout": 1.0, "join_timeout": 600.0}


def key_prefix(run_id: str) -> str:
    """Where the rendezvous ``run_id`` keeps its keys in the store."""
    return f"elastic_trainer.rdzv.{run_id}"


class KeyedRendezvousHandler(RendezvousHandler):
    """torch's rendezvous interface over a ``store``, one key per node's heartbeat (module doc).

    ``clock``: wall-clock seconds (heartbeats are compared across nodes, as torch compares
    them). ``heartbeats=False`` leaves :meth:`beat` to the caller (a simulation of many nodes in
    one process drives them from one thread); otherwise a thread of this handler beats."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        *,
        local_addr: str | None = None,
        keep_alive_interval: float = DEFAULTS["keep_alive_interval"],
        keep_alive_max_attempt: int = int(DEFAULTS["keep_alive_max_attempt"]),
        last_call_timeout: float = DEFAULTS["last_call_timeout"],
        join_timeout: float = DEFAULTS["join_timeout"],
        poll_seconds: float = 0.2,
        clock: Callable[[], float] = time.time,
        heartbeats: bool = True,
    ):
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"expected 1 <= min_nodes <= max_nodes, got {min_nodes}:{max_nodes}")
        self._base, self._run_id = store, run_id
        self._store = PrefixStore(key_prefix(run_id), store)
        self._min, self._max = min_nodes, max_nodes
        self._addr = local_addr
        # torch's node name is ADDR_PID_N; a simulation runs many nodes in one process
        self.node = f"{local_addr or socket.getfqdn()}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.keep_alive_interval, self._attempts = keep_alive_interval, keep_alive_max_attempt
        self._last_call, self._join_timeout = last_call_timeout, join_timeout
        self.poll_seconds, self._clock = poll_seconds, clock
        self._round: int | None = None  # the round this node is a participant of
        self._rank = self._size = 0
        self._successor: str | None = None
        self._waiting, self._lost = 0, frozenset[str]()
        self._polled_at = -float("inf")
        self.last_contact: float | None = None  # time.monotonic() of the last store reply
        self._beats = heartbeats
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None

    # ------------------------------------------------------------------ torch's interface
    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self._run_id

    def is_closed(self) -> bool:
        return self._store.check(["closed"])

    def set_closed(self) -> None:
        self._store.set("closed", "1")

    def shutdown(self) -> bool:
        self._stop_beating()
        try:
            self.set_closed()
        except (RuntimeError, OSError) as e:  # the store is gone (torch's DistError is a RuntimeError)
            logger.warning("rendezvous: closing %s failed: %s", self._run_id, e)
            return False
        return True

    def num_nodes_waiting(self) -> int:
        self.poll()
        return self._waiting

    def next_rendezvous(self) -> RendezvousInfo:
        self._start_beating()
        deadline = time.monotonic() + self._join_timeout
        r, rank, size = self._join(deadline)
        self._round, self._rank, self._size = r, rank, size
        self._successor = self._get(f"r{r}/node/{(rank + 1) % size}") if size > 1 else None
        self._waiting, self._lost, self._polled_at = 0, frozenset(), -float("inf")
        logger.info("rendezvous %s: node %s joined round %d as rank %d of %d", self._run_id, self.node, r, rank, size)
        store = PrefixStore(f"torch.rendezvous.{self._run_id}.{r}", self._base)
        return RendezvousInfo(store, rank, size, RendezvousStoreInfo.build(rank, store, local_addr=self._addr))

    # ------------------------------------------------------------------ liveness
    @property
    def bound_seconds(self) -> float:
        """A node whose heartbeat is older than this is lost."""
        return self.keep_alive_interval * self._attempts

    @property
    def round(self) -> int | None:
        return self._round

    def poll(self) -> frozenset[str]:
        """Read the round's waiting count and lost list, and the ring successor's heartbeat (at
        most once per ``poll_seconds``); a successor silent beyond the bound is added to the
        lost list. The lost nodes of this node's round."""
        r = self._round
        if r is None or time.monotonic() - self._polled_at < self.poll_seconds:
            return self._lost
        keys = [f"r{r}/waiting", f"r{r}/lost"] + ([f"hb/{self._successor}"] if self._successor else [])
        values = self._store.multi_get(keys)
        self._touched()
        self._polled_at = time.monotonic()
        self._waiting, lost = int(values[0]), frozenset(values[1].decode().split())
        if self._successor and self._successor not in lost and self._stale(values[2]):
            logger.warning(
                "rendezvous %s: node %s silent beyond %g s", self._run_id, self._successor, self.bound_seconds
            )
            self._append(f"r{r}/lost", self._successor)
            lost |= {self._successor}
        self._lost = lost
        return lost

    def leave(self) -> None:
        """Stop heartbeating and name this node lost in its round, so that the others re-form
        without it at once, without closing the rendezvous."""
        self._stop_beating()
        if self._round is not None:
            self._append(f"r{self._round}/lost", self.node)

    def beat(self) -> None:
        """Write this node's heartbeat."""
        self._store.set(f"hb/{self.node}", repr(self._clock()))
        self._touched()

    # ------------------------------------------------------------------ the round
    def _join(self, deadline: float) -> tuple[int, int, int]:
        """Join the round that forms next: the current one while it forms, else the one after
        it (asking the current round's participants to come: ``waiting``)."""
        left = self._round  # a round this node no longer takes part in
        while True:
            if self.is_closed():
                raise RendezvousClosedError
            r = self._store.add("cur", 0)
            if r == left or self._store.check([f"r{r}/size"]):
                self._store.add(f"r{r}/waiting", 1)
                self._store.compare_set("cur", str(r), str(r + 1))
                continue
            index = self._store.add(f"r{r}/joined", 1) - 1
            self._store.set(f"r{r}/node/{index}", self.node)
            self._store.add(f"r{r}/waiting", 0)  # the round's steady-state keys exist before it closes
            self._append(f"r{r}/lost", "")
            size = self._await_size(r, index, deadline)
            if index < size:
                return r, index, size
            left = r  # closed without this node: ask for the next one

    def _await_size(self, r: int, index: int, deadline: float) -> int:
        """Wait for round ``r`` to close (closing it when the rules allow); its size."""
        started, min_at = time.monotonic(), None
        while True:
            size = self._size_of(r)
            if size is not None:
                return size
            now = time.monotonic()
            if now > deadline:
                raise RendezvousTimeoutError(f"round {r} of {self._run_id} did not form within {self._join_timeout} s")
            joined = self._store.add(f"r{r}/joined", 0)
            self._touched()
            min_at = (min_at or now) if joined >= self._min else None
            last_call_over = min_at is not None and now - min_at >= self._last_call
            overdue = now - started > self.bound_seconds + self._last_call + REJOIN_GRACE_SECONDS
            if self._may_close(r, joined, last_call_over, check_previous=index == 0 or overdue, overdue=overdue):
                return int(self._store.compare_set(f"r{r}/size", "", str(min(joined, self._max))))
            time.sleep(self.poll_seconds)

    def _may_close(self, r: int, joined: int, last_call_over: bool, *, check_previous: bool, overdue: bool) -> bool:
        """Round ``r`` may close with ``joined`` nodes (module doc). ``check_previous``: this
        node reads who of the previous round is still to come (its first joiner, or any joiner
        once the round is ``overdue``); an overdue round also closes after the last call, without
        a node of the previous round that is alive but does not come."""
        if joined >= self._max:
            return True
        if joined < self._min:
            return False
        previous = self._size_of(r - 1) if r > 0 else None
        if previous is None:  # the job's first round: torch's last call
            return last_call_over
        return (check_previous and self._previous_all_in(r, joined, previous)) or (overdue and last_call_over)

    def _previous_all_in(self, r: int, joined: int, previous: int) -> bool:
        """Every node of round ``r - 1`` has joined round ``r``, or is lost, or silent."""
        names, came = self._names(r - 1, previous), self._names(r, joined)
        if names is None or came is None:  # a joiner between its index and its name
            return False
        lost = set(self._get(f"r{r - 1}/lost").split())
        came_set = set(came)
        missing = [n for n in names if n not in came_set and n not in lost]
        beats = self._store.multi_get([f"hb/{n}" for n in missing]) if missing else []
        return all(self._stale(b) for b in beats)

    # ------------------------------------------------------------------ helpers
    def _names(self, r: int, count: int) -> list[str] | None:
        """The names of round ``r``'s first ``count`` joiners; None while one is still unwritten."""
        keys = [f"r{r}/node/{i}" for i in range(count)]
        if not keys:
            return []
        if not self._store.check(keys):
            return None
        return [v.decode() for v in self._store.multi_get(keys)]

    def _size_of(self, r: int) -> int | None:
        return int(self._get(f"r{r}/size")) if self._store.check([f"r{r}/size"]) else None

    def _get(self, key: str) -> str:
        return self._store.get(key).decode()

    def _stale(self, beat: bytes) -> bool:
        return self._clock() - float(beat) > self.bound_seconds

    def _append(self, key: str, name: str) -> None:
        """Add ``name`` to the list at ``key`` (created empty by an empty ``name``)."""
        self._store.append(key, f"{name}\n" if name else "")  # type: ignore[attr-defined]  # torch's stubs lack Store.append

    def _touched(self) -> None:
        self.last_contact = time.monotonic()

    def _start_beating(self) -> None:
        self.beat()  # before the first join: a participant always has a heartbeat
        if self._beats and self._beating is None:
            self._stop.clear()
            self._beating = threading.Thread(target=self._beat_loop, name="rendezvous-heartbeat", daemon=True)
            self._beating.start()

    def _stop_beating(self) -> None:
        self._stop.set()
        if self._beating is not None:
            self._beating.join(timeout=self.keep_alive_interval + 5)
            self._beating = None

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.keep_alive_interval):
            try:
                self.beat()
            except (RuntimeError, OSError) as e:  # store unreachable: the liveness watch decides, not this thread
                logger.warning("rendezvous: heartbeat failed: %s", e)


def create_handler(params: RendezvousParameters) -> KeyedRendezvousHandler:
    """torch's registry's creator: the store as torch's c10d backend makes it (``endpoint``,
    ``is_host``, ``read_timeout``), the settings from ``--rdzv-conf``."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    _, store = create_backend(params)
    return KeyedRendezvousHandler(
        store,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        local_addr=params.local_addr,
        keep_alive_interval=float(params.get("keep_alive_interval", DEFAULTS["keep_alive_interval"])),
        keep_alive_max_attempt=int(params.get("keep_alive_max_attempt", DEFAULTS["keep_alive_max_attempt"])),
        last_call_timeout=float(params.get("last_call_timeout", DEFAULTS["last_call_timeout"])),
        join_timeout=float(params.get("join_timeout", DEFAULTS["join_timeout"])),
    )


def register() -> None:
    """Make ``--rdzv-backend elastic-trainer`` known to torch's registry (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_handler)
