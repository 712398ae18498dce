"""``elastic.rdzv_poll_seconds`` (elastic_trainer/supervisor/round_poll.py): a training node sees a
node waiting to join within the poll, not torch's one second, checked on real c10d handlers over
a real TCPStore; and the private torch code it relies on, so a torch upgrade that changes it fails
here, loudly."""

from __future__ import annotations

import inspect
import threading
import time
from datetime import timedelta

import pytest

from elastic_trainer.supervisor import round_poll
from tests.unit.test_liveness import _handler as liveness_handler

pytestmark = pytest.mark.timing  # a wall-clock bound: run alone, not beside other tests


@pytest.fixture
def torch_delay():
    """torch's own ``_delay``, put back after the test (install() replaces it process-wide)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    own = getattr(dynamic_rendezvous._delay, "torch_delay", dynamic_rendezvous._delay)
    yield own
    dynamic_rendezvous._delay = own


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield server.port
    del server


def _handler(store_port: int, run_id: str):
    """A c10d handler (1:2 nodes) whose keep-alives (every 5 s) do not read the state during the test."""
    return liveness_handler(store_port, run_id, interval=5)


def test_torch_private_rendezvous_polling(store, torch_delay):
    """torch (2.13): the state holder serves reads from memory for ``_cache_duration`` (1) seconds;
    the wait loop sleeps the module-level ``_delay(seconds=1)`` between reads of a forming round
    (and ``_delay(seconds=(0, 0.3))`` before a node's first join)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    loop = inspect.getsource(dynamic_rendezvous._DistributedRendezvousOpExecutor.run)
    assert "if action == _Action.SYNC:" in loop and "_delay(seconds=1)" in loop, loop
    assert "_delay(seconds=(0, 0.3))" in inspect.getsource(dynamic_rendezvous.DynamicRendezvousHandler.next_rendezvous)
    h = _handler(store, "round-poll-private")
    try:
        assert h._state_holder._cache_duration == round_poll.TORCH_POLL_SECONDS
        round_poll.install(h, 0.2)
        round_poll.install(h, 0.2)  # idempotent: one layer over torch's own
        assert h._state_holder._cache_duration == 0.2
        assert dynamic_rendezvous._delay.torch_delay is torch_delay
        t0 = time.monotonic()
        dynamic_rendezvous._delay(seconds=1)
        assert 0.15 <= time.monotonic() - t0 < 0.8
    finally:
        h.shutdown()


def test_training_node_sees_a_waiting_node_within_the_poll(store, torch_delay):
    """Node a trains alone (its round complete); b then asks to join. torch's read cache would
    show b to a's checks at the earliest a second after a's last read; with a 0.2 s poll a sees
    it within b's own join (its first-join skew ≤ 0.3 s) plus the poll."""
    a, b = _handler(store, "round-poll"), _handler(store, "round-poll")
    round_poll.install(a, 0.2)
    round_poll.install(b, 0.2)
    joining = threading.Thread(target=_join_until_closed, args=(b,), daemon=True)
    try:
        a.next_rendezvous()
        time.sleep(1.05)  # past torch's read cache too, so that the read below is a real one
        assert a.num_nodes_waiting() == 0
        t0 = time.monotonic()
        joining.start()  # b waits for the next round
        while a.num_nodes_waiting() == 0:
            assert time.monotonic() - t0 < 10, "a never saw b waiting"
            time.sleep(0.02)
        assert time.monotonic() - t0 < 0.85  # torch's cache alone: >= 1 s
    finally:
        a.shutdown()  # closes the rendezvous: b's join ends
        if joining.is_alive():
            joining.join(10)
        b.shutdown()


def _join_until_closed(handler) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    try:
        handler.next_rendezvous()
    except RendezvousClosedError:
        pass


def test_a_node_that_joined_once_rejoins_without_torch_s_first_join_skew(store, torch_delay):
    """torch delays a node's join by a random 0-0.3 s while the job is in round 0: meant for the
    job's first join, it also delayed every job's first restart (a re-join in round 0)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous, registry

    h = registry.get_rendezvous_handler(
        RendezvousParameters(
            backend="c10d",
            endpoint=f"127.0.0.1:{store}",
            run_id="round-poll-skew",
            min_nodes=1,
            max_nodes=1,
            local_addr="127.0.0.1",
            is_host="false",
        )
    )
    asked: list = []
    dynamic_rendezvous._delay = asked.append  # records what torch asks for; the fixture restores it
    try:
        round_poll.install(h, 0.2)
        h.next_rendezvous()
        assert asked == [round_poll.FIRST_JOIN_SKEW_SECONDS], asked  # the first join keeps torch's skew
        assert h._state_holder.state.round == 0  # so torch asks for the skew again below
        asked.clear()
        h.next_rendezvous()  # the first restart
        # No delay asked at all: every delay torch asks for (the skew, its one-second poll) goes
        # through ``_delay`` and is recorded here, never slept. No wall-clock bound: torch's own
        # store start (a TCPStore server per first join) now and then takes seconds by itself.
        assert asked == [], asked
    finally:
        h.shutdown()
