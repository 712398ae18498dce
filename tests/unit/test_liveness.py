"""Silent node loss from torch's rendezvous keep-alives (elastic_trainer/supervisor/liveness.py).

The decisions are table-tested; the private torch state they read is checked against a real
``DynamicRendezvousHandler`` on a real ``TCPStore``, so a torch upgrade that changes it fails
here, loudly, instead of silently disabling the detection."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.agent.server.api import WorkerState

from elastic_trainer.events import EventLog, read_events
from elastic_trainer.supervisor import liveness
from elastic_trainer.supervisor.journal import Journal
from elastic_trainer.supervisor.liveness import ISOLATED, PEER_LOST, Membership, Verdict

M = Membership


pytestmark = pytest.mark.timing  # a wall-clock bound: run alone, not beside other tests


@pytest.mark.parametrize(
    "joined, now, expected",
    [
        (None, M(1, frozenset("ab"), "a"), None),  # not a dynamic rendezvous
        (M(1, frozenset("ab"), "a"), None, None),
        (M(1, frozenset("ab"), "a"), M(1, frozenset("ab"), "a"), None),  # intact
        (M(1, frozenset("ab"), "a"), M(1, frozenset("a"), "a"), Verdict(PEER_LOST, ("b",))),  # b's heartbeat went stale
        (M(1, frozenset("abc"), "a"), M(1, frozenset("a"), "a"), Verdict(PEER_LOST, ("b", "c"))),
        # b left to re-rendezvous (its own failure restart): it waits for the next round, not lost
        (M(1, frozenset("ab"), "a"), M(1, frozenset("a"), "a", waiting=frozenset("b")), None),
        # a newcomer: torch's own path
        (M(1, frozenset("ab"), "a"), M(1, frozenset("ab"), "a", waiting=frozenset("c")), None),
        (M(1, frozenset("ab"), "a"), M(1, frozenset("b"), "a"), Verdict(ISOLATED)),  # the others dropped this node
        (M(1, frozenset("ab"), "a"), M(2, frozenset("ab"), "a"), Verdict(ISOLATED)),  # a round formed without it
    ],
)
def test_verdict(joined, now, expected):
    assert liveness.verdict(joined, now) == expected


@pytest.mark.parametrize(
    "last, now, bound, expected",
    [(None, 100.0, 3.0, False), (97.5, 100.0, 3.0, False), (97.0, 100.0, 3.0, False), (96.9, 100.0, 3.0, True)],
)
def test_out_of_contact(last, now, bound, expected):
    assert liveness.out_of_contact(last, now, bound) is expected


def test_not_a_dynamic_handler():
    class Static:
        pass

    assert (
        liveness.membership(Static()) is None
        and liveness.last_contact(Static()) is None
        and liveness.bound_seconds(Static()) is None
    )


def _handler(store_port: int, run_id: str, interval: int = 1, attempts: int = 3, nodes=(1, 2), last_call: int = 1):
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{store_port}",
        run_id=run_id,
        min_nodes=nodes[0],
        max_nodes=nodes[1],
        local_addr="127.0.0.1",
        is_host="false",
        last_call_timeout=str(last_call),
        keep_alive_interval=str(interval),
        keep_alive_max_attempt=str(attempts),
    )
    return registry.get_rendezvous_handler(params)


def test_torch_private_rendezvous_state():
    """What liveness reads from torch (2.13): the handler's state holder, its node, the state's
    round/participants/wait_list/redundancy_list/last_heartbeats, the holder's last sync time, the
    keep-alive settings; and that torch's own sync drops a participant whose heartbeat is stale
    beyond ``keep_alive_interval × keep_alive_max_attempt``."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    h = _handler(server.port, "liveness-private-api")
    try:
        assert liveness.bound_seconds(h) == 3.0
        assert liveness.last_contact(h) is None  # no sync yet
        t0 = time.monotonic()
        h.next_rendezvous()
        joined = liveness.membership(h)
        assert joined is not None and joined.me in joined.participants and len(joined.participants) == 1, joined
        assert joined.me.startswith("127.0.0.1_"), joined.me
        assert t0 <= liveness.last_contact(h) <= time.monotonic()

        # A second participant whose heartbeat stopped 10 s ago, written through torch's own holder.
        holder = h._state_holder
        state = holder.state
        ghost = type(h._this_node)("198.51.100.9", 1, 0)
        state.participants[ghost] = 1
        state.last_heartbeats[ghost] = datetime.now(UTC) - timedelta(seconds=10)
        assert isinstance(state.wait_list, set) and isinstance(state.redundancy_list, set)
        holder.mark_dirty()
        holder.sync()  # writes; torch's sanitize on the state it got back drops the stale ghost
        time.sleep(1.1)  # past the holder's read cache
        assert h.num_nodes_waiting() == 0  # a real read of the store
        now = liveness.membership(h)
        assert now.round == joined.round and now.participants == joined.participants, now
        assert liveness.verdict(M(joined.round, joined.participants | {repr(ghost)}, joined.me), now) == Verdict(
            PEER_LOST, (repr(ghost),)
        )
    finally:
        h.shutdown()
        del server


def _in_threads(fns) -> list:
    """Run ``fns`` at once, one thread each; their results (an exception is re-raised)."""
    with ThreadPoolExecutor(len(fns)) as pool:
        return [f.result(60) for f in [pool.submit(fn) for fn in fns]]


def test_survivors_of_a_peer_loss_heartbeat_in_fractions_of_a_second_and_rejoin_without_the_last_call():
    """Three real c10d handlers (2:3 nodes, a 10 s last call) heartbeating every 0.25 s
    (``set_keep_alive_interval``; torch's parameters take whole seconds), bound 0.25 × 8 = 2 s.
    One stops heartbeating: torch drops it within ~2 s, not the 8 s of its whole-second interval;
    the two survivors re-form inside ``rejoin_of(handler, 2)`` well before the last call would
    have ended the round, and ``max_nodes`` is back to 3 afterwards."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    hs = [_handler(server.port, "liveness-rejoin", attempts=8, nodes=(2, 3), last_call=10) for _ in range(3)]
    try:
        for h in hs:
            liveness.set_keep_alive_interval(h, 0.25)
            assert liveness.bound_seconds(h) == 2.0
        _in_threads([h.next_rendezvous for h in hs])  # 3 = max_nodes: complete at once
        joined = [liveness.membership(h) for h in hs[:2]]
        assert all(len(m.participants) == 3 for m in joined), joined
        stopped = time.monotonic()
        hs[2]._stop_heartbeats()  # silent from now on
        while any(len(liveness.membership(h).participants) == 3 for h in hs[:2]):
            assert time.monotonic() - stopped < 6, "the silent node was not dropped within 6 s"
            for h in hs[:2]:
                h.num_nodes_waiting()  # a sync: torch's sanitize drops stale heartbeats
            time.sleep(0.05)
        dropped = time.monotonic() - stopped
        found = [liveness.verdict(j, liveness.membership(h)) for j, h in zip(joined, hs[:2], strict=True)]
        assert found[0] == Verdict(PEER_LOST, (repr(hs[2]._this_node),)), found

        def rejoin(h):
            t0 = time.monotonic()
            with liveness.rejoin_of(h, 2):
                assert h._settings.max_nodes == 2
                info = h.next_rendezvous()
            return time.monotonic() - t0, info.world_size

        took = _in_threads([lambda h=h: rejoin(h) for h in hs[:2]])
        assert [w for _, w in took] == [2, 2], took
        assert max(s for s, _ in took) < 5, f"re-formed after {took} s: the last call (10 s) ended the round"
        assert dropped < 4, f"dropped {dropped:.2f} s after its last heartbeat (bound 2 s)"
        assert [h._settings.max_nodes for h in hs] == [3, 3, 3]
    finally:
        for h in hs:
            h._stop_heartbeats()
        del server


def test_a_node_that_leaves_is_out_of_the_next_round_at_once_and_the_rendezvous_stays_open():
    """Two real c10d handlers (1:2 nodes, a 10 s last call, a 30 s liveness bound). One
    :func:`leave` s (torch's exit op, heartbeats stopped): the other re-forms alone inside
    ``rejoin_of(handler, 1)`` in well under the bound or the last call, and the rendezvous is
    still open to newcomers (``shutdown`` would have closed it to every node)."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    hs = [_handler(server.port, "liveness-leave", attempts=30, nodes=(1, 2), last_call=10) for _ in range(2)]
    try:
        _in_threads([h.next_rendezvous for h in hs])  # 2 = max_nodes: complete at once
        liveness.leave(hs[1])
        t0 = time.monotonic()
        with liveness.rejoin_of(hs[0], 1):
            info = hs[0].next_rendezvous()
        took = time.monotonic() - t0
        assert info.world_size == 1 and took < 5, (info.world_size, took)
        assert not hs[0]._state_holder.state.closed
    finally:
        for h in hs:
            h._stop_heartbeats()
        del server


def test_no_rejoin_shortcut_outside_min_and_max_nodes():
    h = _fake_handler("a", {"a", "b", "c"})
    for survivors in (1, 3, 4):  # below min_nodes (2), or no fewer than max_nodes (3)
        with liveness.rejoin_of(h, survivors):
            assert h._settings.max_nodes == 3
    with liveness.rejoin_of(object(), 2):  # not torch's dynamic handler
        pass


# ---------------------------------------------------------------------- the agent's collaborator
def _fake_handler(me: str, participants: set[str], bound_seconds: float = 0.2):
    """What liveness reads of torch's ``DynamicRendezvousHandler`` (pinned above on a real one)."""
    state = SimpleNamespace(
        round=1, participants=dict.fromkeys(participants, 1), wait_list=set(), redundancy_list=set()
    )
    return SimpleNamespace(
        _this_node=me,
        _state_holder=SimpleNamespace(state=state, _last_sync_time=time.monotonic()),
        _settings=SimpleNamespace(
            keep_alive_interval=timedelta(seconds=bound_seconds), keep_alive_max_attempt=1, min_nodes=2, max_nodes=3
        ),
    )


def _drop(handler, node: str) -> None:
    """torch dropped ``node`` (its heartbeat went stale)."""
    del handler._state_holder.state.participants[node]


def _lose_contact(handler, seconds: float) -> None:
    """This node has not reached the store for ``seconds``."""
    handler._state_holder._last_sync_time -= seconds


def _node_lost(journal: Journal) -> list[dict]:
    return [e for e in read_events(journal.events.path) if e["event"] == "node_lost"]


@pytest.fixture
def journal(tmp_path):
    return Journal(EventLog(str(tmp_path / "events.jsonl")), node="n0")


@pytest.mark.parametrize("watch", [True, False])
def test_a_dropped_peer_is_found_only_while_watching_a_healthy_group(journal, watch):
    handler = _fake_handler("a", {"a", "b"})
    node = liveness.NodeLiveness(handler, journal, watch=watch)
    node.rejoined()
    assert node.check(WorkerState.HEALTHY) is None  # intact
    _drop(handler, "b")
    assert node.check(WorkerState.FAILED) is None  # torch's own failure path
    found = node.check(WorkerState.HEALTHY)
    assert found == (Verdict(PEER_LOST, (repr("b"),)) if watch else None)
    assert [(e["reason"], e["lost"], e["node"]) for e in _node_lost(journal)] == (
        [(PEER_LOST, [repr("b")], "n0")] if watch else []
    )


def test_node_lost_is_set_only_while_the_group_restarts(journal):
    node = liveness.NodeLiveness(_fake_handler("a", {"a"}), journal, watch=True)
    found = Verdict(PEER_LOST, ("b",))
    with pytest.raises(RuntimeError), node.restarting(found):
        assert node.node_lost is found
        raise RuntimeError("the restart failed")
    assert node.node_lost is None


@pytest.mark.parametrize(
    "found, max_nodes",
    [(Verdict(PEER_LOST, (repr("c"),)), 2), (Verdict(PEER_LOST, (repr("b"), repr("c"))), 3), (Verdict(ISOLATED), 3)],
)
def test_a_restart_after_a_peer_loss_completes_its_round_once_the_survivors_joined(journal, found, max_nodes):
    """a, b, c joined (2:3 nodes): c lost → the round completes at 2; b and c lost → 1 survivor is
    below min_nodes, torch's rendezvous as it is; this node isolated → who is left is unknown."""
    handler = _fake_handler("a", {"a", "b", "c"})
    node = liveness.NodeLiveness(handler, journal, watch=True)
    node.rejoined()
    with pytest.raises(RuntimeError), node.restarting(found):
        assert handler._settings.max_nodes == max_nodes
        raise RuntimeError("the restart failed")
    assert handler._settings.max_nodes == 3


def test_a_node_out_of_contact_kills_its_workers_and_is_isolated_until_it_rejoins(journal):
    handler = _fake_handler("a", {"a", "b"})
    node = liveness.NodeLiveness(handler, journal, watch=True)
    node.rejoined()
    killed = threading.Event()

    def kill_workers() -> list[int]:
        killed.set()
        return [11, 12]

    node.start(running=lambda: True, kill_workers=kill_workers)
    try:
        _lose_contact(handler, 1.0)  # the bound is 0.2 s
        assert killed.wait(10)
    finally:
        node.stop()
    for t in _contact_threads():
        t.join(10)  # it reports after the kill
    (event,) = _node_lost(journal)
    assert (event["reason"], event["killed"], event["no_contact_seconds"] >= 1.0) == (ISOLATED, [11, 12], True)
    assert node.check(WorkerState.FAILED) == node.check(WorkerState.HEALTHY) == Verdict(ISOLATED)
    assert node.check(WorkerState.SUCCEEDED) is None  # the workers finished first
    node.rejoined()
    assert node.check(WorkerState.FAILED) is None


@pytest.mark.parametrize("found, waits", [(Verdict(PEER_LOST, (repr("c"),)), True), (Verdict(ISOLATED), False)])
def test_after_a_peer_loss_new_workers_wait_until_the_lost_node_fenced_itself(journal, found, waits):
    """Keep-alive every 0.2 s: a cut-off node's last contact came at most 0.4 s after its last
    heartbeat landed, and its watch fires within 0.1 s of the bound; the survivors' new workers
    start no sooner than that after the verdict. This node isolated: nothing to wait for."""
    handler = _fake_handler("a", {"a", "b", "c"}, bound_seconds=0.2)
    node = liveness.NodeLiveness(handler, journal, watch=True)
    node.rejoined()
    assert liveness.fence_seconds(handler) == pytest.approx(0.5)
    t0 = time.monotonic()
    with node.restarting(found):
        node.wait_for_fence()
        waited = time.monotonic() - t0
    assert (waited >= 0.5) is waits and waited < 5, waited
    t0 = time.monotonic()
    node.wait_for_fence()  # no restart under way
    assert time.monotonic() - t0 < 0.1
    assert liveness.fence_seconds(object()) == 0.0


def _contact_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "liveness-contact"}


def test_a_single_node_runs_no_contact_watch(journal):
    handler = _fake_handler("a", {"a"})
    _lose_contact(handler, 1.0)  # a watch would fire at once
    before = _contact_threads()
    node = liveness.NodeLiveness(handler, journal, watch=False)
    node.start(running=lambda: True, kill_workers=lambda: pytest.fail("nothing to watch"))
    assert _contact_threads() <= before
    node.stop()
