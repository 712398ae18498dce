"""The package's own rendezvous (``elastic.rdzv_backend = "elastic-trainer"``) at N simulated
nodes: ``python bench/scale.py --keyed`` runs it (this module is its simulation).

Per N, on one store process (``elastic-trainer store``, as a job runs it): ``--procs`` child
processes each play N / procs nodes, each node with its own ``KeyedRendezvousHandler`` and store
client (its own TCP connection, as a real node's). In each child one thread per node acts as a
node's agent does (joins, polls the handler every poll period, on a lost node rejoins) and one
thread writes the heartbeats of all its nodes, spread evenly over the keep-alive interval (a
node's own heartbeat thread, batched: the simulation's overhead kept down). Phases, each
started through the store:

1. the first round of all N (first call to last return);
2. steady state for ``--keyed-seconds``: every node beats and polls at the cadence; the store's
   CPU (from /proc) and the operations the children made;
3. the node of rank N // 2 goes silent (no heartbeat, no store operation, no exit);
   **detection**: until the first node names it lost (its ring predecessor) and until every
   survivor has seen it; **next round**: from the first survivor seeing the loss to the last
   survivor's return from its next rendezvous, checked to be the N - 1 survivors with distinct
   ranks; **total**: from the silence to that last return.

The children's CPU is the simulation's own (N nodes' client work on shared cores); it is
reported, not part of the store's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIM = "elastic_trainer.sim"  # the orchestration's keys in the store, apart from the rendezvous's
RUN_ID = "scale-keyed"
# A store client and the store look up the name of each new connection's address; with no DNS
# server answering (a machine off the network) each lookup waits the resolver's 5 s, and the
# store serves nobody meanwhile: one try of one second instead, for the store and the nodes.
CHILD_ENV = {"RES_OPTIONS": "timeout:1 attempts:1", "OMP_NUM_THREADS": "1"}


def client(port: int):
    from torch.distributed import PrefixStore, TCPStore

    return PrefixStore(SIM, TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120)))


def wait_key(store, key: str, poll: float = 0.05) -> float:
    while not store.check([key]):
        time.sleep(poll)
    return float(store.get(key))


# ------------------------------------------------------------------------------ child
class Node:
    """One simulated node: its handler and what it recorded."""

    def __init__(self, handler) -> None:
        self.h, self.silent = handler, False
        self.rec: dict = {}


def node_main(node: Node, go: threading.Event, poll_s: float) -> None:
    go.wait()
    node.rec["first_call"] = time.time()
    info = node.h.next_rendezvous()
    node.rec.update(first_return=time.time(), first_rank=info.rank, first_world=info.world_size)
    while True:  # the agent's monitor loop: poll; a lost node → restart the workers and rejoin
        if node.silent:
            return
        if node.h.poll():
            node.rec["seen_lost"] = time.time()
            break
        time.sleep(poll_s)
    info = node.h.next_rendezvous()
    node.rec.update(next_return=time.time(), next_rank=info.rank, next_world=info.world_size)


def beat_main(nodes: list[Node], interval: float, stop: threading.Event, tally: dict) -> None:
    """Every live node's heartbeat once per ``interval``, spread evenly over it."""
    slot = interval / len(nodes)
    t = time.monotonic()
    while not stop.is_set():
        for node in nodes:
            if not node.silent:
                node.h.beat()
                tally["beats"] += 1
            t += slot
            delay = t - time.monotonic()
            if delay > 0:
                time.sleep(delay)


def child(a) -> None:
    from torch.distributed import TCPStore

    from elastic_trainer.supervisor.rendezvous import KeyedRendezvousHandler

    threading.stack_size(256 * 1024)
    conf = json.loads(a.conf)
    sim = client(a.port)
    nodes = []
    for i in range(a.first, a.first + a.count):
        store = TCPStore("127.0.0.1", a.port, is_master=False, timeout=timedelta(seconds=120))
        h = KeyedRendezvousHandler(
            store,
            RUN_ID,
            a.n - 1,
            a.n,
            local_addr=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
            heartbeats=False,
            **conf,
        )
        h.beat()
        nodes.append(Node(h))
    polls = _count_polls(nodes)
    go, stop, tally = threading.Event(), threading.Event(), {"beats": 0}
    threads = [threading.Thread(target=node_main, args=(n, go, conf["poll_seconds"]), daemon=True) for n in nodes]
    for t in threads:
        t.start()
    beater = threading.Thread(target=beat_main, args=(nodes, conf["keep_alive_interval"], stop, tally), daemon=True)
    beater.start()
    sim.add("ready", len(nodes))
    wait_key(sim, "go")
    cpu0 = time.process_time()
    go.set()
    wait_key(sim, "steady")
    counted = (tally["beats"], polls["n"], time.process_time())
    wait_key(sim, "silence")
    ops = {"beats": tally["beats"] - counted[0], "polls": polls["n"] - counted[1]}
    steady_cpu = time.process_time() - counted[2]
    for node in nodes:
        node.silent = node.rec.get("first_rank") == a.n // 2
    for t in threads:
        t.join()
    stop.set()
    out = {"nodes": [n.rec for n in nodes], "ops": ops, "steady_cpu": steady_cpu, "cpu": time.process_time() - cpu0}
    print(json.dumps(out), flush=True)
    wait_key(sim, "done")
    os._exit(0)  # not the interpreter's shutdown: the nodes' store clients are still open in their threads


def _count_polls(nodes: list[Node]) -> dict:
    """Count each node's store reads of the steady state (one ``multi_get`` per poll)."""
    tally = {"n": 0}
    for node in nodes:
        poll = node.h.poll

        def counted(poll=poll, h=node.h):
            # a poll that read the store marks it (a heartbeat moves last_contact too)
            before = h._polled_at  # noqa: SLF001 - the simulation counts the handler's own store reads
            out = poll()
            tally["n"] += h._polled_at != before  # noqa: SLF001 - the same
            return out

        node.h.poll = counted
    return tally


# ------------------------------------------------------------------------------ parent
def keyed_row(n: int, conf: dict, procs: int, steady_s: float, timeout: float) -> dict:
    """One N: the phases above, the children's records aggregated."""
    from bench.scale import StoreProc

    os.environ.update(CHILD_ENV)  # the store process's too
    store = StoreProc()
    sim = client(store.port)
    per = -(-n // procs)
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", "--port", str(store.port), "--n", str(n)]
            + ["--first", str(i), "--count", str(min(per, n - i)), "--conf", json.dumps(conf)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(0, n, per)
    ]
    try:
        return _phases(store, sim, children, n, steady_s, timeout)
    finally:
        sim.set("done", "1")
        for c in children:
            try:
                c.wait(30)
            except subprocess.TimeoutExpired:
                c.kill()
        store.stop()


def _phases(store, sim, children, n: int, steady_s: float, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while sim.add("ready", 0) < n:
        _check(children, deadline, "the nodes to start")
        time.sleep(0.1)
    go = time.time()
    sim.set("go", repr(go))
    rdzv = rendezvous_keys(store.port)
    while not rdzv.check(["r0/size"]):
        _check(children, deadline, "the first round")
        time.sleep(0.1)
    time.sleep(steady_s / 4)  # every node out of its join and polling
    cpu0, t0 = store.cpu_seconds(), time.time()
    sim.set("steady", repr(t0))
    time.sleep(steady_s)
    steady_store = store.cpu_seconds() - cpu0
    silence = time.time()
    sim.set("silence", repr(silence))
    cpu1 = store.cpu_seconds()
    results = [json.loads(c.stdout.readline() or "{}") for c in children]
    window = silence - t0
    return _aggregate(results, n, go, silence, window, steady_store, store.cpu_seconds() - cpu1)


def rendezvous_keys(port: int):
    """The rendezvous's own keys (the handler's prefix), to watch a round close."""
    from torch.distributed import PrefixStore, TCPStore

    from elastic_trainer.supervisor.rendezvous import key_prefix

    return PrefixStore(key_prefix(RUN_ID), TCPStore("127.0.0.1", port, is_master=False))


def _check(children, deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"timed out waiting for {what}")
    for c in children:
        if c.poll() is not None:
            raise RuntimeError(f"a simulation process exited with {c.returncode} while waiting for {what}")


def _aggregate(results, n, go, silence, window, steady_store, after_store) -> dict:
    recs = [r for res in results for r in res["nodes"]]
    survivors = [r for r in recs if r.get("first_rank") != n // 2]
    seen = sorted(r["seen_lost"] for r in survivors if "seen_lost" in r)
    back = [r for r in survivors if "next_return" in r]
    last = max(r["next_return"] for r in back)
    ops = sum(res["ops"]["beats"] + res["ops"]["polls"] for res in results)
    return {
        "n": n,
        "first_round_s": max(r["first_return"] for r in recs) - go,
        "ops_s": ops / window,
        "store_cores": steady_store / window,
        "sim_cores": sum(res["steady_cpu"] for res in results) / window,
        "detection_s": seen[0] - silence,
        "detection_all_s": seen[-1] - silence,
        "next_round_s": last - seen[0],
        "total_s": last - silence,
        "round_store_cpu": after_store,
        # the next round is exactly the survivors, ranked 0..N-2 (live nodes dropped would break it)
        "survivors_ok": sorted(r["next_rank"] for r in back) == list(range(n - 1))
        and {r["next_world"] for r in back} == {n - 1},
    }


# ------------------------------------------------------------------------------ the path
def cadence_for(n: int) -> dict:
    """The settings docs/elasticity.md gives for ``n`` nodes: the package's defaults while their
    store load fits the budget (liveness.OWN_STORE_OPS_PER_SECOND), else a heartbeat and a poll
    every ``p`` seconds (p the budget's minimum, rounded up to half a second) and a bound of 5 p."""
    from elastic_trainer.config import ElasticConfig, parse_rdzv_conf
    from elastic_trainer.supervisor.liveness import scale_warning

    e = ElasticConfig()
    conf = parse_rdzv_conf(e.rdzv_conf)
    if scale_warning("elastic-trainer", n, conf, e.rdzv_poll_seconds) is None:
        interval, attempts = float(conf["keep_alive_interval"]), int(conf["keep_alive_max_attempt"])
        poll = e.rdzv_poll_seconds
    else:
        interval = poll = max(0.5, -(-2 * n // 5000) / 2)
        attempts = 5
    return {
        "keep_alive_interval": interval,
        "keep_alive_max_attempt": attempts,
        "last_call_timeout": 1.0,
        "poll_seconds": poll,
    }


def keyed_rows(nodes: list[int], steady_s: float, procs: int, timeout: float, settings_for: int | None) -> list[dict]:
    """:func:`keyed_row` per N with the settings for N (or for ``settings_for`` nodes, to compare
    N at one cadence); stops after an N that does not complete."""
    rows = []
    for n in nodes:
        conf = cadence_for(settings_for or n)
        try:
            row = keyed_row(n, conf, min(procs, n), steady_s, timeout)
        except (TimeoutError, RuntimeError, ValueError, KeyError) as e:
            print(f"  keyed N={n}: stopped: {type(e).__name__}: {e}; no larger N", flush=True)
            break
        rows.append({**row, **conf})
        print(f"  keyed N={n}: next round {row['next_round_s']:.2f} s, store {row['store_cores']:.2f} cores")
    return rows


def keyed_table(rows: list[dict]) -> str:
    from bench.common import table
    from bench.scale import exponent

    header = ["N", "heartbeat (s)", "poll (s)", "bound (s)", "first round (s)", "store ops/s", "exp.", "store cores"]
    header += ["sim cores", "detection (s)", "all saw it (s)", "next round (s)", "exp.", "loss → new round (s)"]
    header += ["survivors' round", "store CPU in the round (s)"]
    e_ops, e_next = exponent(rows, "ops_s"), exponent(rows, "next_round_s")
    body = [
        [
            f"{r['n']}",
            f"{r['keep_alive_interval']:g}",
            f"{r['poll_seconds']:g}",
            f"{r['keep_alive_interval'] * r['keep_alive_max_attempt']:g}",
            f"{r['first_round_s']:.2f}",
            f"{r['ops_s']:,.0f}",
            e_ops[i],
            f"{r['store_cores']:.3f}",
            f"{r['sim_cores']:.2f}",
            f"{r['detection_s']:.2f}",
            f"{r['detection_all_s']:.2f}",
            f"{r['next_round_s']:.2f}",
            e_next[i],
            f"{r['total_s']:.2f}",
            "exactly the N-1" if r["survivors_ok"] else "NOT the survivors",
            f"{r['round_store_cpu']:.2f}",
        ]
        for i, r in enumerate(rows)
    ]
    return table(header, body)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("--port", type=int)
    p.add_argument("--n", type=int)
    p.add_argument("--first", type=int)
    p.add_argument("--count", type=int)
    p.add_argument("--conf")
    a = p.parse_args()
    child(a)


if __name__ == "__main__":
    main()
