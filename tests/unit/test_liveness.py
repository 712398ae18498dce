"""Silent node loss from torch's rendezvous keep-alives (elastic_trainer/supervisor/liveness.py).

The decisions are table-tested; the private torch state they read is checked against a real
``DynamicRendezvousHandler`` on a real ``TCPStore``, so a torch upgrade that changes it fails
here, loudly, instead of silently disabling the detection."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from elastic_trainer.supervisor import liveness
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
