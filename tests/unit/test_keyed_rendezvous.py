"""The package's own rendezvous (``elastic.rdzv_backend = "elastic-trainer"``,
elastic_trainer/supervisor/rendezvous.py), driven as torch's agent drives a handler, on a real
``TCPStore``: nodes are threads, each with its own store client and handler."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from elastic_trainer.supervisor import rendezvous
from elastic_trainer.supervisor.rendezvous import KeyedRendezvousHandler


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield server
    del server


def handlers(store, n: int, lo: int, hi: int, **kw) -> list[KeyedRendezvousHandler]:
    kw = {
        "keep_alive_interval": 0.05,
        "keep_alive_max_attempt": 4,
        "last_call_timeout": 0.3,
        "poll_seconds": 0.02,
        **kw,
    }
    out = []
    for i in range(n):
        client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
        out.append(KeyedRendezvousHandler(client, "job", lo, hi, local_addr=f"127.0.0.{i + 1}", **kw))
    return out


def join(hs: list[KeyedRendezvousHandler]) -> list:
    with ThreadPoolExecutor(len(hs)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous(), hs))


def wait_for(predicate, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        time.sleep(0.01)
    return time.monotonic() - t0


def stop(hs) -> None:
    for h in hs:
        h._stop_beating()


def test_a_full_round_forms_at_once_with_distinct_ranks_and_one_worker_store(store):
    hs = handlers(store, 4, 2, 4, last_call_timeout=30)  # max reached: no last call
    t0 = time.monotonic()
    infos = join(hs)
    assert time.monotonic() - t0 < 5
    assert sorted(i.rank for i in infos) == [0, 1, 2, 3] and {i.world_size for i in infos} == {4}
    addrs = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    assert len(addrs) == 1 and next(iter(addrs))[0] == hs[[i.rank for i in infos].index(0)]._addr
    infos[0].store.set("x", "1")  # the round's store is shared by the round's nodes
    assert all(i.store.get("x") == b"1" for i in infos)
    assert all(h.num_nodes_waiting() == 0 and h.poll() == frozenset() for h in hs)
    stop(hs)


def test_the_first_round_below_max_closes_after_the_last_call(store):
    hs = handlers(store, 2, 2, 4, last_call_timeout=0.5)
    t0 = time.monotonic()
    infos = join(hs)
    assert 0.5 <= time.monotonic() - t0 < 5 and {i.world_size for i in infos} == {2}
    stop(hs)


def test_a_newcomer_waits_and_the_next_round_takes_everyone(store):
    hs = handlers(store, 3, 1, 3)
    first = join(hs[:2])
    assert {i.world_size for i in first} == {2}
    with ThreadPoolExecutor(3) as pool:
        newcomer = pool.submit(hs[2].next_rendezvous)
        wait_for(lambda: hs[0].num_nodes_waiting() > 0)  # torch's agent restarts on this
        rejoined = [pool.submit(h.next_rendezvous) for h in hs[:2]]
        infos = [f.result(timeout=20) for f in [*rejoined, newcomer]]
    assert sorted(i.rank for i in infos) == [0, 1, 2] and {i.world_size for i in infos} == {3}
    assert len({h.round for h in hs}) == 1
    stop(hs)


def test_a_silent_node_is_found_by_its_ring_neighbour_and_the_survivors_reform_without_a_last_call(store):
    hs = handlers(store, 4, 2, 4, last_call_timeout=30)
    infos = join(hs)
    silent = hs[[i.rank for i in infos].index(2)]
    silent._stop_beating()
    survivors = [h for h in hs if h is not silent]
    bound = silent.bound_seconds
    seconds = wait_for(lambda: all([silent.node in h.poll() for h in survivors]))  # every node polls on its own
    assert seconds < bound + 1.0
    t0 = time.monotonic()
    again = join(survivors)  # the last call is 30 s: a round that closes sooner did not wait for it
    assert time.monotonic() - t0 < 5
    assert sorted(i.rank for i in again) == [0, 1, 2] and {i.world_size for i in again} == {3}
    assert all(h.poll() == frozenset() for h in survivors)  # the new round has nobody lost
    stop(hs)


def test_a_live_node_is_not_dropped_and_a_node_that_leaves_is_named_at_once(store):
    hs = handlers(store, 3, 1, 3)
    join(hs)
    time.sleep(hs[0].bound_seconds * 2)
    assert all(h.poll() == frozenset() for h in hs)  # heartbeats keep every live node in
    hs[1].leave()
    wait_for(lambda: hs[0].poll() == {hs[1].node} and hs[2].poll() == {hs[1].node}, timeout=1)
    stop(hs)


def test_a_node_the_others_named_lost_sees_itself_out(store):
    hs = handlers(store, 2, 1, 2)
    join(hs)
    hs[0]._store.append(f"r{hs[0].round}/lost", f"{hs[1].node}\n")
    assert wait_for(lambda: hs[1].node in hs[1].poll(), timeout=1) < 1
    stop(hs)


def test_shutdown_closes_the_rendezvous_for_every_node(store):
    hs = handlers(store, 2, 1, 2)
    join(hs)
    assert hs[0].shutdown() and hs[1].is_closed()
    with pytest.raises(RendezvousClosedError):
        hs[1].next_rendezvous()
    stop(hs)


def test_torchs_registry_makes_the_handler_from_rdzv_conf(store):
    rendezvous.register()
    rendezvous.register()  # idempotent
    params = RendezvousParameters(
        backend=rendezvous.BACKEND,
        endpoint=f"127.0.0.1:{store.port}",
        run_id="job",
        min_nodes=1,
        max_nodes=3,
        is_host="false",
        keep_alive_interval="0.5",
        keep_alive_max_attempt="6",
        last_call_timeout="2",
    )
    h = rendezvous_handler_registry.create_handler(params)
    assert isinstance(h, KeyedRendezvousHandler) and h.get_backend() == "elastic-trainer"
    assert (h.keep_alive_interval, h.bound_seconds, h.get_run_id()) == (0.5, 3.0, "job")


def test_the_supervisor_s_liveness_reads_the_own_rendezvous(store, tmp_path):
    """NodeLiveness (the agent's collaborator) on this handler: a peer its ring neighbour named
    lost → peer_lost with its name and the event; this node named lost → isolated; the liveness
    bound, the fence and the last store contact come from the handler."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    from elastic_trainer.events import EventLog, read_events
    from elastic_trainer.supervisor import liveness
    from elastic_trainer.supervisor.journal import Journal

    hs = handlers(store, 3, 1, 3)
    join(hs)
    watched = liveness.NodeLiveness(hs[0], Journal(EventLog(str(tmp_path / "e.jsonl")), node="n0"), watch=True)
    watched.rejoined()
    assert watched.check(WorkerState.HEALTHY) is None
    assert liveness.bound_seconds(hs[0]) == pytest.approx(0.2) and liveness.fence_seconds(hs[0]) > 0.1
    assert time.monotonic() - liveness.last_contact(hs[0]) < 1
    hs[1].leave()
    found = wait_for(lambda: watched.check(WorkerState.HEALTHY), timeout=2) < 2
    assert found and watched.check(WorkerState.HEALTHY) == liveness.Verdict(liveness.PEER_LOST, (hs[1].node,))
    [event] = [e for e in read_events(str(tmp_path / "e.jsonl")) if e["event"] == "node_lost"][:1]
    assert event["reason"] == "peer_lost" and event["lost"] == [hs[1].node]
    hs[2]._append(f"r{hs[2].round}/lost", hs[0].node)  # the others named this node lost
    assert wait_for(lambda: liveness.own_verdict(hs[0]) == liveness.Verdict(liveness.ISOLATED), timeout=2) < 2
    stop(hs)
