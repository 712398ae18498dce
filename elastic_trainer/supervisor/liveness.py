"""Silent node loss, detected from torch's rendezvous keep-alives instead of a collective timeout.

Every supervisor's c10d rendezvous handler writes a keep-alive heartbeat into the shared
rendezvous state every ``keep_alive_interval`` seconds, and torch itself drops a node whose
heartbeat is older than ``keep_alive_interval × keep_alive_max_attempt`` (the *liveness bound*)
when it reads that state. Torch only acts on it at the next rendezvous, though: a node that goes
silent (power, NIC, switch port: no reset, no FIN) leaves its peers' workers blocked in a
collective until the hang watchdog fires, minutes on a production config.

Here each supervisor compares the group it joined with what torch's handler currently holds:

* a peer of its round has been dropped (heartbeat stale beyond the bound) → **peer lost**: stop
  this node's workers at once (they are blocked in a collective with the silent peer and would
  not return) and re-rendezvous, a membership change that does not use up ``max_restarts``;
* this node is no longer in the current round (the others dropped it while it was cut off) →
  **isolated**: the same;
* this node has not reached the store for longer than the bound (checked from a thread, since
  the agent's own loop blocks in store calls while the store is unreachable) → **isolated**:
  its workers are stopped at once, before the others' new group can commit anything, so a node
  that is cut off cannot commit a checkpoint later (fencing).

The package's own rendezvous (``elastic.rdzv_backend = "elastic-trainer"``, rendezvous.py) keeps
a list of lost nodes itself (a ring of heartbeat checks): :func:`own_verdict` reads it instead,
and the functions below ask that handler for its bound, last contact and keep-alive.

:func:`verdict` decides (pure, table-tested); :class:`NodeLiveness` is the supervised agent's
collaborator that applies it (and runs the :class:`ContactWatch`). Every use of torch's private rendezvous state
lives in :func:`membership`, :func:`last_contact`, :func:`bound_seconds`, :func:`fence_seconds`,
:func:`set_keep_alive_interval`, :func:`rejoin_of` and :func:`leave`;
``tests/unit/test_liveness.py`` fails loudly when torch changes it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

from .. import contract
from .journal import Journal

logger = logging.getLogger(__name__)

PEER_LOST = "peer_lost"
ISOLATED = "isolated"
CONTACT_POLL_SECONDS = 0.1  # how often the ContactWatch reads the time of the last store contact


@dataclass(frozen=True)
class Membership:
    """One node's view of the rendezvous: the round, its participants, the nodes waiting to join
    the next round, this node."""

    round: int
    participants: frozenset[str]
    me: str
    waiting: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Verdict:
    reason: str  # PEER_LOST or ISOLATED
    lost: tuple[str, ...] = ()


def verdict(joined: Membership | None, now: Membership | None) -> Verdict | None:
    """What the group this node joined (``joined``, taken right after its rendezvous) has
    become in the rendezvous state torch holds ``now`` (after it dropped stale heartbeats).
    None: nothing to do (no dynamic rendezvous, or the group is intact)."""
    if joined is None or now is None:
        return None
    if now.round != joined.round or now.me not in now.participants:
        return Verdict(ISOLATED)
    # A peer that left to re-rendezvous (a failure restart) waits for the next round: not lost.
    lost = tuple(sorted(joined.participants - now.participants - now.waiting - {joined.me}))
    return Verdict(PEER_LOST, lost) if lost else None


def out_of_contact(last_contact: float | None, now: float, bound: float) -> bool:
    """True when this node last reached the rendezvous store more than ``bound`` seconds ago
    (monotonic clock): its peers have dropped it, or are about to."""
    return last_contact is not None and now - last_contact > bound


# ---------------------------------------------------------------------- torch's private state
def _holder(handler):
    return getattr(handler, "_state_holder", None)


def _own(handler):
    """``handler`` when it is the package's own rendezvous (one key per node: it keeps its
    liveness itself, elastic_trainer/supervisor/rendezvous.py), else None."""
    from .rendezvous import KeyedRendezvousHandler

    return handler if isinstance(handler, KeyedRendezvousHandler) else None


def own_verdict(handler) -> Verdict | None:
    """The package's own rendezvous: this node named lost by the others → isolated; another
    node named lost (its ring neighbour found its heartbeat stale, or it left) → peer lost."""
    lost = handler.poll()
    if handler.node in lost:
        return Verdict(ISOLATED)
    return Verdict(PEER_LOST, tuple(sorted(lost))) if lost else None


def membership(handler) -> Membership | None:
    """This node's view of the rendezvous in torch's ``DynamicRendezvousHandler`` (c10d/etcd-v2
    backends), or None for other handlers. Reads only what torch's last store sync left in memory
    (no I/O): that sync already dropped nodes whose heartbeat is older than the bound."""
    holder, me = _holder(handler), getattr(handler, "_this_node", None)
    if holder is None or me is None:
        return None
    state = holder.state
    return Membership(
        state.round,
        frozenset(map(repr, state.participants)),
        repr(me),
        frozenset(map(repr, state.wait_list | state.redundancy_list)),
    )


def last_contact(handler) -> float | None:
    """``time.monotonic()`` of this node's last successful sync with the rendezvous store (a
    read or a keep-alive write), or None for other handlers or before the first one."""
    if _own(handler) is not None:
        return handler.last_contact
    t = getattr(_holder(handler), "_last_sync_time", None)
    return t if t is not None and t >= 0 else None


def bound_seconds(handler) -> float | None:
    """torch's liveness bound: ``keep_alive_interval × keep_alive_max_attempt`` seconds."""
    if _own(handler) is not None:
        return handler.bound_seconds
    settings = getattr(handler, "_settings", None)
    if _holder(handler) is None or settings is None:
        return None
    return settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt


# torch's c10d rendezvous keeps every node's heartbeat in one store key, and a keep-alive is a
# compare-and-set of that whole state: a node reads it, re-encodes it with its own heartbeat and
# writes it back only if no other node wrote in between. Heartbeats therefore land one at a time,
# each turn taking about HEARTBEAT_TURN_SECONDS_PER_NODE × N (encoding the state of N nodes:
# 16 ms at 1,024 nodes, 52 ms at 4,096, 128 ms at 10,000 in bench/scale.py), and each node's
# heartbeat lands about every HEARTBEAT_TURN_SECONDS_PER_NODE × N² seconds.
HEARTBEAT_TURN_SECONDS_PER_NODE = 1.3e-5
# torch's own keep-alive when elastic.rdzv_conf sets none
TORCH_KEEP_ALIVE = (5.0, 3)


def heartbeat_period_seconds(nodes: int) -> float:
    """About how often each of ``nodes`` nodes' heartbeats lands in the c10d rendezvous state."""
    return HEARTBEAT_TURN_SECONDS_PER_NODE * nodes * nodes


# The package's own rendezvous costs the store one small operation per heartbeat and per poll of
# each node; bench/scale.py --keyed measured 17-24 us of the store's CPU per operation. This
# budget keeps the steady state near a fifth of a core, leaving the store room for a round.
OWN_STORE_OPS_PER_SECOND = 10_000


def scale_warning(backend: str, max_nodes: int, rdzv_configs: dict, poll_seconds: float = 0.2) -> str | None:
    """Why the rendezvous would not carry ``max_nodes`` nodes with these settings (torchrun's
    ``--rdzv-conf``, ``elastic.rdzv_poll_seconds``): for c10d, a heartbeat period past half the
    liveness bound (live nodes dropped); for the package's own, a steady state past the store's
    budget. None: fine, or another backend, or one node."""
    if max_nodes <= 1:
        return None
    if backend == contract.OWN_RDZV_BACKEND:
        return _own_scale_warning(max_nodes, rdzv_configs, poll_seconds)
    if backend != "c10d":
        return None
    interval = float(rdzv_configs.get("keep_alive_interval", TORCH_KEEP_ALIVE[0]))
    attempts = int(rdzv_configs.get("keep_alive_max_attempt", TORCH_KEEP_ALIVE[1]))
    bound, period = interval * attempts, heartbeat_period_seconds(max_nodes)
    if period <= bound / 2:
        return None
    fits = int((bound / 2 / HEARTBEAT_TURN_SECONDS_PER_NODE) ** 0.5)
    return (
        f"up to {max_nodes} nodes: every node's heartbeat goes into one key of the c10d rendezvous store, "
        f"one node at a time, so each lands only about every {period:.0f} s at {max_nodes} nodes, past half "
        f"the liveness bound of {bound:g} s (keep_alive_interval={interval:g} x keep_alive_max_attempt="
        f"{attempts}): live nodes would be dropped as lost. These settings carry about {fits} nodes; for "
        f"{max_nodes}, set elastic.rdzv_conf so that keep_alive_interval x keep_alive_max_attempt >= "
        f"{2 * period:.0f} s (silent node loss is then detected that late), or elastic.rdzv_backend = "
        f'"{contract.OWN_RDZV_BACKEND}", whose heartbeats do not share a key (docs/elasticity.md, '
        "'How many nodes one rendezvous carries')"
    )


def _own_scale_warning(max_nodes: int, rdzv_configs: dict, poll_seconds: float) -> str | None:
    interval = float(rdzv_configs.get("keep_alive_interval", TORCH_KEEP_ALIVE[0]))
    ops = max_nodes * (1 / interval + 1 / poll_seconds)
    if ops <= OWN_STORE_OPS_PER_SECOND:
        return None
    need = 2 * max_nodes / OWN_STORE_OPS_PER_SECOND
    return (
        f"up to {max_nodes} nodes: each node writes its heartbeat every {interval:g} s (keep_alive_interval) and "
        f"reads the rendezvous every {poll_seconds:g} s (elastic.rdzv_poll_seconds): {ops:,.0f} store operations "
        f"a second, past the {OWN_STORE_OPS_PER_SECOND:,} one store serves with room for a round. For "
        f"{max_nodes} nodes set both to at least {need:.2g} s; the liveness bound (keep_alive_interval x "
        "keep_alive_max_attempt) grows with them (docs/elasticity.md, 'How many nodes one rendezvous carries')"
    )


def fence_seconds(handler) -> float:
    """After a verdict of peer loss, how long until the lost node's own :class:`ContactWatch` has
    stopped its workers, at the latest, if it is alive but cut off: its last contact with the
    store came at most two keep-alive intervals after its last heartbeat landed (torch writes one
    when the previous is an interval old), and its watch fires within one poll of the bound. 0
    for other handlers."""
    if _own(handler) is not None:
        return 2 * handler.keep_alive_interval + CONTACT_POLL_SECONDS
    settings = getattr(handler, "_settings", None)
    if _holder(handler) is None or settings is None:
        return 0.0
    return 2 * settings.keep_alive_interval.total_seconds() + CONTACT_POLL_SECONDS


def set_keep_alive_interval(handler, seconds: float) -> None:
    """Make ``handler`` heartbeat every ``seconds`` (torch's rendezvous parameters take whole
    seconds only; its settings, shared by the handler, its state holder and its op executor, are
    a frozen dataclass). Before the first rendezvous: the keep-alive timer starts with it.
    Nothing for other handlers."""
    if _own(handler) is not None:
        handler.keep_alive_interval = seconds
        return
    settings = getattr(handler, "_settings", None)
    if _holder(handler) is not None and settings is not None:
        object.__setattr__(settings, "keep_alive_interval", timedelta(seconds=seconds))


@contextlib.contextmanager
def rejoin_of(handler, survivors: int) -> Iterator[None]:
    """The rendezvous right after a verdict of peer loss, without torch's last call.

    torch completes a round at ``max_nodes`` at once, or ``last_call_timeout`` after
    ``min_nodes`` joined; after a loss the survivors are fewer than ``max_nodes``, so every loss
    paid the last call although each survivor knows how many are left. Inside this block the
    round completes as soon as ``survivors`` nodes joined; when fewer come, the last call ends
    it as before, and a node that comes after it completed joins through the next round, as it
    would after a last call. ``max_nodes`` is put back on exit. Nothing for other handlers, or
    when ``survivors`` is outside ``[min_nodes, max_nodes)``."""
    settings = getattr(handler, "_settings", None)
    max_nodes = getattr(settings, "max_nodes", None)
    if (
        _holder(handler) is None
        or settings is None
        or max_nodes is None
        or not settings.min_nodes <= survivors < max_nodes
    ):
        yield
        return
    object.__setattr__(settings, "max_nodes", survivors)
    try:
        yield
    finally:
        object.__setattr__(settings, "max_nodes", max_nodes)


def leave(handler, timeout_seconds: float = 30.0) -> None:
    """Take this node out of the rendezvous without closing it (torch's ``shutdown`` closes it
    for every node): stop its heartbeats and remove it from the participants, so that the other
    nodes' next round forms without it at once instead of after the liveness bound. Nothing for
    other handlers."""
    if _own(handler) is not None:
        handler.leave()
        return
    if _holder(handler) is None:
        return
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

    handler._stop_heartbeats()  # noqa: SLF001 - torch has no public leave (its shutdown closes the rendezvous)
    handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + timeout_seconds)  # noqa: SLF001 - the same


class ContactWatch:
    """A thread that calls ``on_isolated()`` once when ``handler`` has not reached the store for
    longer than the liveness bound while ``armed()`` (workers are running). Re-arms after
    :meth:`reset`. The agent's own loop cannot do this: it blocks in the store call."""

    def __init__(
        self,
        handler,
        armed: Callable[[], bool],
        on_isolated: Callable[[float], None],
        poll_seconds: float = CONTACT_POLL_SECONDS,
    ):
        self._handler, self._armed, self._on_isolated, self._poll = handler, armed, on_isolated, poll_seconds
        self._bound = bound_seconds(handler)
        self._stop = threading.Event()
        self._fired = False
        self._thread = threading.Thread(target=self._run, name="liveness-contact", daemon=True)

    def start(self) -> ContactWatch:
        if self._bound is not None:
            self._thread.start()
        return self

    def reset(self) -> None:
        self._fired = False

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            if self._fired or not self._armed():
                continue
            last = last_contact(self._handler)
            now = time.monotonic()
            assert self._bound is not None  # start() runs this thread only with a bound
            if last is not None and out_of_contact(last, now, self._bound):
                self._fired = True
                try:
                    self._on_isolated(now - last)
                except Exception:  # the watch must outlive one failed stop (logged with its traceback)
                    logger.exception("liveness: stopping the isolated node's workers failed")


class NodeLiveness:
    """The supervised agent's liveness collaborator for one rendezvous ``handler``.

    ``watch``: several nodes (a single node has no peer to lose); without it nothing is ever
    found. The agent calls :meth:`rejoined` after each rendezvous, :meth:`check` on each monitor
    pass, and restarts its workers inside :meth:`restarting` when a check finds a lost node
    (:attr:`node_lost` tells its stop to kill at once). :meth:`start` runs the
    :class:`ContactWatch`, which stops the workers of a node cut off from the store."""

    def __init__(self, handler, journal: Journal, watch: bool) -> None:
        self._handler, self._journal, self.watch = handler, journal, watch
        self._joined: Membership | None = None  # right after this node's last rendezvous
        self._isolated: float | None = None  # seconds without store contact when the watch stopped the workers
        self.node_lost: Verdict | None = None  # the verdict of the restart under way
        self._fenced_at = 0.0  # time.monotonic() when a lost node has fenced itself, at the latest
        self._contact: ContactWatch | None = None

    def start(self, running: Callable[[], bool], kill_workers: Callable[[], list[int]]) -> NodeLiveness:
        """Watch the store contact while ``running()`` (the workers are healthy); when it is lost,
        ``kill_workers()`` (returns the pids it signalled). Nothing without :attr:`watch`."""
        if self.watch:
            self._contact = ContactWatch(
                self._handler, armed=running, on_isolated=lambda seconds: self._on_isolated(seconds, kill_workers)
            ).start()
        return self

    def stop(self) -> None:
        if self._contact is not None:
            self._contact.stop()

    def rejoined(self) -> None:
        """This node completed a rendezvous: the group to compare with from now on."""
        self._joined = membership(self._handler) if self.watch else None
        self._isolated = None
        if self._contact is not None:
            self._contact.reset()

    def check(self, state) -> Verdict | None:
        """A silent peer or this node cut off, given the worker group's ``state`` (torch's
        ``WorkerState``), after reporting ``node_lost``; or None."""
        from torch.distributed.elastic.agent.server.api import WorkerState

        if self._isolated is not None:  # the ContactWatch stopped the workers (and said so)
            return Verdict(ISOLATED) if state != WorkerState.SUCCEEDED else None
        if state != WorkerState.HEALTHY:
            return None
        own = _own(self._handler) is not None
        found = own_verdict(self._handler) if own else verdict(self._joined, membership(self._handler))
        if found is not None:
            self._report(found.reason, list(found.lost))
        return found

    @contextlib.contextmanager
    def restarting(self, found: Verdict) -> Iterator[None]:
        """While the agent restarts its workers for ``found``: :attr:`node_lost` is set. After a
        peer loss the survivors re-form through :func:`rejoin_of` and start their new workers
        no sooner than :func:`fence_seconds` after the verdict (:meth:`wait_for_fence`); this
        node isolated: who is left is unknown, torch's rendezvous as it is."""
        self.node_lost = found
        joined = self._joined
        lost = found.reason == PEER_LOST
        self._fenced_at = time.monotonic() + fence_seconds(self._handler) if lost else 0.0
        rejoin = (
            rejoin_of(self._handler, len(joined.participants) - len(found.lost))
            if lost and joined is not None
            else contextlib.nullcontext()
        )
        try:
            with rejoin:
                yield
        finally:
            self.node_lost = None

    @contextlib.contextmanager
    def regrouping(self, survivors: int) -> Iterator[None]:
        """While the agent restarts its workers after a node was excluded: the group re-forms
        through :func:`rejoin_of` with the ``survivors`` (the excluded node left the rendezvous)."""
        with rejoin_of(self._handler, survivors):
            yield

    def wait_for_fence(self) -> None:
        """Before the workers of a restart start: after a peer loss, until the lost node, if it
        is alive but cut off, has stopped its own workers (:func:`fence_seconds` after the
        verdict), so that the old group's workers never run beside the new group's."""
        delay = self._fenced_at - time.monotonic() if self.node_lost is not None else 0.0
        if delay > 0:
            time.sleep(delay)

    def _on_isolated(self, seconds: float, kill_workers: Callable[[], list[int]]) -> None:
        """ContactWatch thread: no store contact beyond the liveness bound. The others drop this
        node now; its workers must stop before their new group can commit (fencing)."""
        self._isolated = seconds
        pids = kill_workers()
        self._report(ISOLATED, [], no_contact_seconds=round(seconds, 3), killed=pids)

    def _report(self, reason: str, lost: list[str], **fields) -> None:
        logger.warning(
            "liveness: %s%s: restarting this node's workers as a membership change",
            reason,
            f" ({', '.join(lost)})" if lost else "",
        )
        self._journal.events.emit(
            "node_lost", reason=reason, lost=lost, node=self._journal.node, mono=time.monotonic(), **fields
        )
