"""Silent node loss from torch's rendezvous keep-alives (elastic_trainer/supervisor/liveness.py).

The decisions are table-tested; the private torch state they read is checked against a real
``DynamicRendezvousHandler`` on a real ``TCPStore``, so a torch upgrade that changes it fails
here, loudly, instead of silently disabling the detection."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.agent.server.api import WorkerState

from elastic_trainer.events import EventLog, read_events
from elastic_trainer.supervisor import liveness
from elastic_trainer.supervisor.journal import Journal
from elastic_trainer.supervisor.liveness import ISOLATED, PEER_LOST, Membership, Verdict

M = Membership


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


def _handler(store_port: int, run_id: str, interval: int = 1, attempts: int = 3):
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{store_port}",
        run_id=run_id,
        min_nodes=1,
        max_nodes=2,
        local_addr="127.0.0.1",
        is_host="false",
        last_call_timeout="1",
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


# ---------------------------------------------------------------------- the agent's collaborator
def _fake_handler(me: str, participants: set[str], bound_seconds: float = 0.2):
    """What liveness reads of torch's ``DynamicRendezvousHandler`` (pinned above on a real one)."""
    state = SimpleNamespace(
        round=1, participants=dict.fromkeys(participants, 1), wait_list=set(), redundancy_list=set()
    )
    return SimpleNamespace(
        _this_node=me,
        _state_holder=SimpleNamespace(state=state, _last_sync_time=time.monotonic()),
        _settings=SimpleNamespace(keep_alive_interval=timedelta(seconds=bound_seconds), keep_alive_max_attempt=1),
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
