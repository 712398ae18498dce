"""The control plane at N simulated nodes: commit, resume decision, rendezvous store traffic.

    python bench/scale.py [--nodes 16,256,1024,4096] [--tensors 16] [--commits 3] [--seconds 2]
                          [--no-s3] [--json-out F] [--round [--round-nodes 8,16,32,64,128]]
                          [--no-keyed] [--keyed-nodes N,...] [--keyed-settings-for N]

Runs the package's own control-plane code with N ranks (one rank per node) that do no
training, and prints, per path and N, the operation's time, the objects or store operations
it takes, the bytes it moves and the growth exponent between successive N
(``log(t2/t1) / log(N2/N1)``: 1 is linear, 2 quadratic):

* **commit**: rank 0's :meth:`Committer.commit` (the proof that every rank's files are in
  storage at the size written, the manifest, then retention) of a save of N ranks' files,
  each named and checksummed the way DCP and ``integrity.ChecksummedWriter`` write them
  (``__R_0.distcp`` of ``--tensors`` items, ``.metadata``, ``.checksums.json``,
  ``.writer.json``), over a root that already holds ``--commits`` - 1 commits (retention,
  keep_last = that, deletes the oldest). On a local directory and on SeaweedFS over S3 (started
  as tests/fixtures/s3.py starts it; skipped with ``--no-s3`` or without the ``weed`` binary).
  Writing the files is set-up, not timed.
* **resume**: a new launch's :func:`resume.decide` (``latest``: epoch, one scan, the lineage
  plan, the chosen commit's ``.metadata`` read and verified) and :func:`resume.from_names` (the
  listing-only plan a local tier allows) over the root the commit left, median of 3.
* **store**: the rendezvous state torch's ``DynamicRendezvousHandler`` keeps in one key of the
  c10d ``TCPStore`` (every node, its rank and its heartbeat, pickled and base64-encoded), in the
  package's store process (``elastic_trainer.supervisor.store.serve``), with the cadence the
  package configures (``elastic.rdzv_conf``'s keep-alive interval, ``elastic.rdzv_poll_seconds``,
  ``elastic.monitor_interval_seconds``). Per N: one node's CPU per keep-alive (torch's own op
  executor and state holder: a compare-and-set of the whole state) and per read, uncontended;
  the keep-alives that land when 4 threads each play N/4 nodes as fast as they can (a closed
  loop on one key: the heartbeat period each node then gets is N / that rate); the store's
  capacity and CPU per operation (from /proc) under 4 raw clients sending the cadence's mix of
  a state of that size, and the cores it would need at the offered load (N × the cadence);
  the package's per-monitor-pass liveness check (:func:`liveness.membership` +
  :func:`liveness.verdict`) on the state of N nodes.
* **round** (``--round``, off by default): torch's own ``DynamicRendezvousHandler`` on the c10d
  backend over the package's store process, N nodes as threads of this one process (each its own
  handler, store client and ``local_addr``; min N-1, max N; the package's keep-alive cadence, a
  last call of ``--round-last-call``). Per N: the first round of all N (first call to last
  return); after one node goes silent (its keep-alive timer stopped, no exit, no FIN) the time
  until a survivor's view drops it (detection) and the survivors' next round (exit then join, as
  the agent does after a peer loss: first call to last return, checked to be the N-1 survivors);
  the store ops, the failed compare-and-sets (those of keep-alive timers apart), the live nodes
  some node's view dropped as dead (their heartbeat older than interval x attempts), this
  process's and the store's CPU. Each phase has ``--round-timeout``; the first N whose phase
  does not complete ends the path. All N nodes share this process's GIL: see the CPU column.

* **keyed** (on unless ``--no-keyed``): the package's own rendezvous (``elastic.rdzv_backend =
  "elastic-trainer"``) at each N, with the settings docs/elasticity.md gives for N: the first
  round, the store's load in the steady state, a silent node's detection and the survivors'
  next round (``bench/scale_keyed.py`` says how the nodes are simulated).

Set-up (files, the state) and the counting are outside the timed spans; the set-up's garbage is
collected before each timed call. The CPU column (the process's) is steadier than the wall time
on shared cores.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_info, parse_with_smoke, table
from bench.scale_keyed import keyed_rows, keyed_table
from elastic_trainer.checkpoint import layout, resume
from elastic_trainer.checkpoint.catalog import Catalog
from elastic_trainer.checkpoint.commit import Committer
from elastic_trainer.checkpoint.save import Save, SaveContext, SaveState
from elastic_trainer.config import ElasticConfig, parse_rdzv_conf
from elastic_trainer.events import EventLog
from elastic_trainer.metrics.sink import NullSink
from elastic_trainer.storage.fs import Storage
from elastic_trainer.supervisor import liveness

ITEM_BYTES = 64  # each item's bytes in a rank's shard: the control plane never reads them
LAUNCH = "scale-bench"
TALLY_LOCK = threading.Lock()  # the store clients' counts (backend_for): += is not atomic across threads


# ------------------------------------------------------------------------------ counting
class Counts:
    """What one timed span asked of a :class:`Storage`: objects read and written (and their
    bytes), listings (and the entries they returned), deletions and, on S3, HTTP requests."""

    def __init__(self) -> None:
        self.reads = self.read_bytes = self.writes = self.write_bytes = 0
        self.listings = self.listed = self.deletes = 0
        self.requests: dict[str, int] = {}
        self.on = False

    def request(self, model=None, **_) -> None:
        if self.on and model is not None:
            self.requests[model.name] = self.requests.get(model.name, 0) + 1

    def summary(self) -> dict:
        return {
            "reads": self.reads,
            "read_bytes": self.read_bytes,
            "writes": self.writes,
            "write_bytes": self.write_bytes,
            "listings": self.listings,
            "listed": self.listed,
            "deletes": self.deletes,
            "requests": sum(self.requests.values()),
            "by_request": dict(sorted(self.requests.items())),
        }


def counted(storage: Storage) -> Counts:
    """Wrap ``storage``'s operations (on the instance) so that they count into the returned
    :class:`Counts` while its ``on`` is set; on S3 every botocore call counts too."""
    c = Counts()
    read, write, find, ls, rm, rm_files = (
        storage.read_bytes,
        storage.write_bytes_atomic,
        storage.list_files,
        storage.list_dirs,
        storage.delete_tree,
        storage.delete_files,
    )

    def read_bytes(path):
        data = read(path)
        c.reads, c.read_bytes = c.reads + c.on, c.read_bytes + len(data) * c.on
        return data

    def write_bytes_atomic(path, data):
        c.writes, c.write_bytes = c.writes + c.on, c.write_bytes + len(data) * c.on
        write(path, data)

    def list_files(path):
        out = find(path)
        c.listings, c.listed = c.listings + c.on, c.listed + len(out) * c.on
        return out

    def list_dirs(path=None):
        out = ls(path)
        c.listings, c.listed = c.listings + c.on, c.listed + len(out) * c.on
        return out

    def delete_tree(path):
        c.deletes += c.on
        rm(path)

    def delete_files(path, names):
        c.deletes += len(names) * c.on
        rm_files(path, names)

    storage.read_bytes, storage.write_bytes_atomic = read_bytes, write_bytes_atomic  # type: ignore[method-assign]
    storage.list_files, storage.list_dirs, storage.delete_tree = list_files, list_dirs, delete_tree  # type: ignore[method-assign]
    storage.delete_files = delete_files  # type: ignore[method-assign]
    if storage.protocol == "s3":
        storage.list_dirs()  # opens the client, whose calls are counted from now on
        storage.fs.s3.meta.events.register("before-call.s3", c.request)
    return c


def exponent(rows: list[dict], key: str) -> list[str]:
    """The growth exponent of ``key`` between each row and the one before (same path)."""
    out, prev = [], None
    for r in rows:
        if prev is None or prev[key] <= 0 or r[key] <= 0 or r["n"] == prev["n"]:
            out.append("")
        else:
            out.append(f"{math.log(r[key] / prev[key]) / math.log(r['n'] / prev['n']):.2f}")
        prev = r
    return out


# ------------------------------------------------------------------------------ a root of N ranks
def metadata_bytes(n: int, tensors: int) -> bytes:
    """DCP's ``.metadata`` of ``tensors`` tensors each sharded over ``n`` ranks on dim 0."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    rows = ITEM_BYTES // 4
    sd, storage_data = {}, {}
    for t in range(tensors):
        fqn = f"model.layers.{t}.weight"
        chunks = [ChunkStorageMetadata(torch.Size([r * rows]), torch.Size([rows])) for r in range(n)]
        sd[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([n * rows]), chunks)
        for r in range(n):
            storage_data[MetadataIndex(fqn, torch.Size([r * rows]))] = _StorageInfo(
                f"__{r}_0.distcp", t * ITEM_BYTES, ITEM_BYTES
            )
    return pickle.dumps(Metadata(state_dict_metadata=sd, storage_data=storage_data))


def save_files(n: int, tensors: int) -> dict[str, bytes]:
    """A save's files as DCP and the checksummed writer leave them (relative name -> bytes)."""
    files, table_ = {}, {}
    for r in range(n):
        data = r.to_bytes(8, "little") * (ITEM_BYTES * tensors // 8)
        item = layout.digest(data[:ITEM_BYTES])  # every item of a rank has the same bytes
        name = f"__{r}_0.distcp"
        files[name] = data
        items = [[t * ITEM_BYTES, ITEM_BYTES, item] for t in range(tensors)]
        table_[name] = {"size": len(data), "xxh3": layout.digest(data), "items": items}
    meta = metadata_bytes(n, tensors)
    files[layout.METADATA] = meta
    table_[layout.METADATA] = {"size": len(meta), "xxh3": layout.digest(meta)}
    files[layout.CHECKSUMS] = json.dumps({"version": 1, "files": table_}, sort_keys=True).encode()
    return files


def fs_path(storage: Storage, *parts: str) -> str:
    """The fsspec path (no protocol) of a path under ``storage``."""
    return storage.join(*parts).removeprefix("s3://")


def build_root(storage: Storage, n: int, tensors: int, commits: int, last_committed: bool) -> tuple[Catalog, str]:
    """``commits`` saves of N ranks under ``storage``, committed by the package's catalog (the
    last one only when ``last_committed``). Returns (rank 0's catalog, the newest save's name)."""
    cat = Catalog(storage, key=None)
    cat.fence.acquire(LAUNCH)
    files = save_files(n, tensors)
    parent = None
    for i in range(commits):
        name = layout.step_dir_name(100 * (i + 1))
        if storage.protocol == "file":
            os.makedirs(fs_path(storage, name), exist_ok=True)
        storage.fs.pipe({fs_path(storage, name, rel): data for rel, data in files.items()})
        cat.mark_writer(name)
        if i < commits - 1 or last_committed:
            cat.commit(name, **manifest_args(n, 100 * (i + 1)), extra={"parent": parent, "seq": i})
        parent = name
    return cat, name


def manifest_args(n: int, step: int) -> dict:
    return {"step": step, "world_size": n, "mesh_shape": [n], "fingerprint": "bench", "torch_version": "bench"}


# ------------------------------------------------------------------------------ commit and resume
def time_commit(storage: Storage, n: int, tensors: int, commits: int) -> dict:
    """Rank 0's commit of the newest of ``commits`` saves (the others committed): the real
    :meth:`Committer.commit`, retention keeping ``commits`` - 1. Returns the row."""
    cat, name = build_root(storage, n, tensors, commits, last_committed=False)
    counts = counted(storage)
    ctx = SaveContext(0, n, [n], "bench", EventLog(None), NullSink())
    committer = Committer(cat, ctx, keep_last=max(1, commits - 1), keep_every=0)
    step = layout.parse_step_dir(name) or 0
    save = Save(step, name, started=time.monotonic(), deadline=math.inf)
    assert save.advance(SaveState.WRITING) and save.advance(SaveState.COMMITTING)
    spans: dict[str, float] = {}
    retention = cat.pruner.retention

    def timed_retention(*args):
        t = time.perf_counter()
        try:
            return retention(*args)
        finally:
            spans["retention"] = time.perf_counter() - t

    cat.pruner.retention = timed_retention  # type: ignore[method-assign]
    counts.on = True
    parent = layout.step_dir_name(100 * (commits - 1)) if commits > 1 else None
    gc.collect()  # the set-up's garbage is not the commit's to collect
    t0, cpu0 = time.perf_counter(), time.process_time()
    committer.commit(save, {"parent": parent, "seq": commits - 1}, committer.generation)
    total, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    counts.on = False
    committer.close()
    if save.state is not SaveState.COMMITTED:
        raise RuntimeError(f"commit of {name} at N={n} failed: {save.state} {save.error}")
    proof = total - spans.get("retention", 0.0)
    return {"n": n, "seconds": total, "cpu": cpu, "proof_s": proof, **counts.summary()}


def time_resume(storage: Storage, n: int, commits: int, repeats: int = 3) -> list[dict]:
    """A new launch's resume decision over the root :func:`time_commit` left (its commits of N
    ranks after retention): :func:`resume.decide` (verified) and :func:`resume.from_names`
    (listing only), ``repeats`` times each (the first takes the launch's epoch, the others join
    it). Returns their rows: the median time, the first call's counts."""
    rows = []
    for kind in ("decide", "from_names"):
        times, cpus, first = [], [], None
        for _ in range(repeats):
            cat = Catalog(storage, key=None)
            counts = counted(storage)
            counts.on = True
            gc.collect()
            t0, cpu0 = time.perf_counter(), time.process_time()
            if kind == "decide":
                d = resume.decide(
                    cat, "latest", frozenset(), clean=False, launch_id=LAUNCH + "-next", events=EventLog(None)
                )
            else:
                d = resume.from_names(cat, LAUNCH + "-next", clean=False)
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - cpu0)
            counts.on = False
            want = layout.step_dir_name(100 * commits)
            if d.refused is not None or d.chosen != want or getattr(d, "unreadable", ""):
                raise RuntimeError(f"resume {kind} at N={n}: {d.refused} {d.message} chose {d.chosen}, not {want}")
            first = first or counts.summary()
        mid = len(times) // 2
        rows.append({"n": n, "kind": kind, "seconds": sorted(times)[mid], "cpu": sorted(cpus)[mid], **(first or {})})
    return rows


def open_root(backend: str, base: str, n: int, what: str) -> Storage:
    return Storage(f"{base}/{what}-{n}")


def storage_paths(backends: dict[str, str], nodes: list[int], a) -> dict[str, list[dict]]:
    """Commit and resume rows per backend, smallest N first."""
    out: dict[str, list[dict]] = {}
    for backend, base in backends.items():
        warm = open_root(backend, base, 2, "warm-up")  # the first call's imports and connections: not timed
        time_commit(warm, 2, a.tensors, a.commits)
        time_resume(warm, 2, a.commits, repeats=1)
        for n in nodes:
            t0 = time.perf_counter()
            storage = open_root(backend, base, n, "root")
            row = time_commit(storage, n, a.tensors, a.commits)
            out.setdefault(f"commit/{backend}", []).append(row)
            for r in time_resume(storage, n, a.commits):
                out.setdefault(f"resume.{r['kind']}/{backend}", []).append(r)
            print(f"  {backend} N={n}: commit {row['seconds']:.3f} s (with set-up {time.perf_counter() - t0:.1f} s)")
    return out


# ------------------------------------------------------------------------------ rendezvous store
def cadence() -> dict[str, float]:
    """The rendezvous cadence the package configures by default (elastic.* in config.py)."""
    e = ElasticConfig()
    conf = parse_rdzv_conf(e.rdzv_conf)
    return {
        "keep_alive_s": float(conf["keep_alive_interval"]),
        "max_attempt": float(conf["keep_alive_max_attempt"]),
        "poll_s": e.rdzv_poll_seconds,
        "monitor_s": e.monitor_interval_seconds,
    }


def rdzv_state(n: int, heartbeat: datetime):
    """torch's rendezvous state of a complete round of ``n`` nodes, all with ``heartbeat``."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    s = _RendezvousState()
    s.round, s.complete = 1, True
    for i in range(n):
        node = _NodeDesc(f"node-{i:05d}.cluster.example", 100000 + i, 0)
        s.participants[node] = i
        s.last_heartbeats[node] = heartbeat
    return s


class StoreProc:
    """The package's rendezvous store (``store.serve``) in a process of its own, and its CPU."""

    def __init__(self) -> None:
        from tests.fixtures.procs import free_ports

        self.port = free_ports(1)[0]
        code = (
            "import sys; from elastic_trainer.supervisor.store import StoreAddress, serve; "
            f"serve(StoreAddress('127.0.0.1', {self.port}))"
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=str(Path(__file__).resolve().parents[1]))
        from elastic_trainer.supervisor.store import StoreAddress, reachable

        if not reachable(StoreAddress("127.0.0.1", self.port), 30):
            raise RuntimeError("the rendezvous store did not start")

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def backend_for(port: int, run_id: str, tally: dict):
    """torch's c10d rendezvous backend on a client of the store, counting its calls into ``tally``."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    backend = C10dRendezvousBackend(store, run_id)
    get, cas = backend.get_state, backend.set_state
    lock = TALLY_LOCK  # one for all clients: several nodes' backends count into one tally

    def get_state():
        out = get()
        with lock:
            tally["gets"] += 1
            tally["get_bytes"] += len(out[1]) if out else 0
        return out

    def set_state(state, token=None):
        out = cas(state, token)
        with lock:
            tally["cas"] += 1
            tally["cas_failed"] += 0 if out and out[2] else 1
            tally["cas_bytes"] += len(token or b"") + 2 * (len(out[1]) if out else 0)
        return out

    backend.get_state, backend.set_state = get_state, set_state  # type: ignore[method-assign]
    return backend


def settings_for(n: int, run_id: str, c: dict):
    """torch's rendezvous settings with the package's keep-alive interval. The attempts before a
    node counts as dead are unbounded here: the simulated nodes cycle through the drivers more
    slowly than real ones beat at large N, and must stay in the state (that is reported)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings, RendezvousTimeout

    return RendezvousSettings(run_id, 1, n, RendezvousTimeout(), timedelta(seconds=c["keep_alive_s"]), 10**9)


def drive(port: int, run_id: str, settings, nodes: list, c: dict, stop: threading.Event, tally: dict) -> None:
    """One driver thread: torch's keep-alive op (its op executor and state holder, as the
    handler's heartbeat timer runs it) of each of ``nodes`` in turn, until ``stop``; CPU time
    into ``tally``."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _BackendRendezvousStateHolder,
        _DistributedRendezvousOpExecutor,
        _RendezvousKeepAliveOp,
    )

    holder = _BackendRendezvousStateHolder(backend_for(port, run_id, tally), settings, cache_duration=c["poll_s"])
    i = 0
    while not stop.is_set():
        before, cpu0 = tally["cas"], time.thread_time()
        node = nodes[i % len(nodes)]
        _DistributedRendezvousOpExecutor(node, holder, settings).run(_RendezvousKeepAliveOp(), time.monotonic() + 60)
        if tally["cas"] == before:  # not due yet: a real node's timer would not fire before
            time.sleep(c["keep_alive_s"] / len(nodes) / 4)
        else:
            tally["client_cpu"] += time.thread_time() - cpu0
        i += 1


def put_state(port: int, n: int, run_id: str) -> tuple[list, int]:
    """The state of N nodes, each due for a keep-alive, into the store. (nodes, its b64 bytes)."""
    c = cadence()
    state = rdzv_state(n, datetime.now(UTC) - timedelta(seconds=c["keep_alive_s"]))
    backend = backend_for(port, run_id, dict.fromkeys(("gets", "get_bytes", "cas", "cas_failed", "cas_bytes"), 0))
    out = backend.set_state(pickle.dumps(state), None)
    assert out is not None and out[2]
    return list(state.participants), len(out[1])


def run_for(workers: list[threading.Thread], stop: threading.Event, seconds: float) -> float:
    """Start ``workers``, let them run ``seconds``, stop and join them; returns the wall time."""
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    return time.perf_counter() - t0


def keepalives(store: StoreProc, n: int, seconds: float, threads: int) -> dict:
    """``threads`` drivers of the real keep-alive op over N nodes for ``seconds``."""
    c = cadence()
    run_id = f"scale-{n}-{threads}"
    nodes, blob = put_state(store.port, n, run_id)
    tally = dict.fromkeys(("gets", "get_bytes", "cas", "cas_failed", "cas_bytes", "client_cpu"), 0)
    settings, stop = settings_for(n, run_id, c), threading.Event()
    workers = [
        threading.Thread(target=drive, args=(store.port, run_id, settings, nodes[i::threads], c, stop, tally))
        for i in range(threads)
    ]
    return {"blob": blob, "wall": run_for(workers, stop, seconds), **tally}


def raw_load(store: StoreProc, n: int, blob: int, seconds: float, threads: int = 4) -> dict:
    """The store alone at the cadence's mix (4 compare-and-sets of the state per 5 reads): raw
    ``TCPStore`` calls of a pre-encoded state of ``blob`` bytes from ``threads`` clients, as
    fast as they go. Returns ops/s and the store's CPU per op."""
    from torch.distributed import TCPStore

    key, value = f"raw-{n}", b"A" * blob
    TCPStore("127.0.0.1", store.port, is_master=False).set(key, value)
    stop, done = threading.Event(), [0] * threads

    def client(i: int) -> None:
        s = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=60))
        while not stop.is_set():
            for _ in range(4):
                s.compare_set(key, value, value)
            for _ in range(5):
                s.get(key)
            done[i] += 9

    workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    cpu0 = store.cpu_seconds()
    wall = run_for(workers, stop, seconds)
    cpu, ops = store.cpu_seconds() - cpu0, sum(done)
    return {"ops_s": ops / wall, "store_ms": cpu / max(1, ops) * 1e3, "store_cpu": cpu / wall}


def read_seconds(store: StoreProc, n: int, seconds: float) -> float:
    """One node's CPU per poll of the state (torch's state holder, its cache expired: a read of
    the state of N nodes, decoded), uncontended."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _BackendRendezvousStateHolder

    run_id = f"scale-read-{n}"
    put_state(store.port, n, run_id)
    tally = dict.fromkeys(("gets", "get_bytes", "cas", "cas_failed", "cas_bytes"), 0)
    holder = _BackendRendezvousStateHolder(
        backend_for(store.port, run_id, tally), settings_for(n, run_id, cadence()), cache_duration=0
    )
    cpu0, t0 = time.thread_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        holder.sync()
    return (time.thread_time() - cpu0) / max(1, tally["gets"])


def liveness_check_seconds(n: int, repeats: int = 20) -> float:
    """The package's per-monitor-pass check of the group (membership + verdict) at N nodes."""
    state = rdzv_state(n, datetime.now(UTC))
    me = next(iter(state.participants))
    handler = SimpleNamespace(_state_holder=SimpleNamespace(state=state), _this_node=me)
    joined = liveness.membership(handler)
    best = math.inf
    for _ in range(3):  # the least of three: the machine is shared
        t0 = time.perf_counter()
        for _ in range(repeats):
            liveness.verdict(joined, liveness.membership(handler))
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


def store_row(store: StoreProc, n: int, seconds: float) -> dict:
    """One N of the store path: one node's CPU per keep-alive (uncontended), the heartbeats that
    succeed when 4 drivers contend, the store's capacity and CPU at the cadence's mix."""
    c = cadence()
    one = keepalives(store, n, seconds, threads=1)
    many = keepalives(store, n, seconds, threads=4)
    raw = raw_load(store, n, one["blob"], seconds)
    offered = n / c["keep_alive_s"] + n / c["poll_s"]
    ok = (many["cas"] - many["cas_failed"]) / many["wall"]
    ka_ms = one["client_cpu"] / max(1, one["cas"]) * 1e3
    check = liveness_check_seconds(n)
    read = read_seconds(store, n, min(1.0, seconds))
    return {
        "n": n,
        "blob": one["blob"],
        "keepalive_ms": ka_ms,
        "read_ms": read * 1e3,
        "node_cpu": ka_ms / 1e3 / c["keep_alive_s"] + read / c["poll_s"] + check / c["monitor_s"],
        "offered": offered,
        "raw_ops_s": raw["ops_s"],
        "store_ms": raw["store_ms"],
        "store_cores": offered * raw["store_ms"] / 1e3,
        "mb_s": (n / c["keep_alive_s"] * 3 + n / c["poll_s"]) * one["blob"] / 1e6,
        "cas_ok": ok,
        "cas_failed": many["cas_failed"] / many["wall"],
        "beat_s": n / ok if ok else math.inf,
        "check_us": check * 1e6,
    }


def store_rows(nodes: list[int], seconds: float) -> list[dict]:
    store = StoreProc()
    rows = []
    try:
        for n in nodes:
            rows.append(store_row(store, n, seconds))
            r = rows[-1]
            print(
                f"  store N={n}: state {r['blob']:,} B, heartbeats {r['cas_ok']:.0f}/s, store {r['raw_ops_s']:.0f} op/s"
            )
    finally:
        store.stop()
    return rows


# ------------------------------------------------------------------------------ rendezvous round
ROUND_ADDR = "node-{:05d}.round.sim"  # each simulated node's local_addr: torch's node is (addr, pid, local id)
HEARTBEAT_FAILED = "has failed to send a keep-alive heartbeat"  # torch's warning when a keep-alive op times out


# torch's handler keeps what the round path reads and stops private: these are its only reads of it
def node_of(handler):
    """The handler's node (torch's ``_NodeDesc``: local_addr, pid, a process-wide id)."""
    return handler._this_node  # noqa: SLF001 - torch's private rendezvous handler


def holder_of(handler):
    """The handler's state holder (its view of the rendezvous state, synced with the store)."""
    return handler._state_holder  # noqa: SLF001 - torch's private rendezvous handler


def synced_state(handler):
    """The handler's view after a sync of its state holder, under its heartbeat lock (as the
    handler's own reads take it; a sync within the holder's cache duration reads nothing)."""
    with handler._heartbeat_lock:  # noqa: SLF001 - torch's private rendezvous handler
        holder_of(handler).sync()
        return holder_of(handler).state


def silence(handler) -> None:
    """Stop the handler's keep-alive timer (torch joins its thread): no heartbeat from now on."""
    handler._stop_heartbeats()  # noqa: SLF001 - torch's private rendezvous handler


class RoundLog(logging.Handler):
    """Counts torch's rendezvous warnings of keep-alives that ran out of their heartbeat timeout,
    instead of printing one line per node (the handler's logger stops propagating meanwhile)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.heartbeats_failed = 0
        self.logger = logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous")

    def emit(self, record: logging.LogRecord) -> None:
        self.heartbeats_failed += HEARTBEAT_FAILED in record.getMessage()

    def __enter__(self) -> RoundLog:
        self.logger.addHandler(self)
        self.logger.propagate = False
        return self

    def __exit__(self, *_) -> None:
        self.logger.removeHandler(self)
        self.logger.propagate = True


def round_backend(port: int, run_id: str, tally: dict):
    """:func:`backend_for` (one store client per node), whose compare-and-sets from a handler's
    keep-alive timer thread (torch names it ``RendezvousKeepAliveTimer_<id>``) also count apart:
    ``ka_cas``, ``ka_failed``. Keep-alives inside a join (while a round forms) count as joins."""
    backend = backend_for(port, run_id, tally)
    cas, lock = backend.set_state, TALLY_LOCK

    def set_state(state, token=None):
        out = cas(state, token)
        if threading.current_thread().name.startswith("RendezvousKeepAliveTimer"):
            with lock:
                tally["ka_cas"] += 1
                tally["ka_failed"] += 0 if out and out[2] else 1
        return out

    backend.set_state = set_state  # type: ignore[method-assign]
    return backend


def watch_drops(handler, drops: dict) -> None:
    """Record into ``drops`` (node -> monotonic time) every node the handler's state holder
    finds dead at a sync: torch's ``_sanitize`` drops a node whose heartbeat in the state is older
    than keep-alive interval x max attempts, from its view and from the state it writes next."""
    holder = holder_of(handler)
    sanitize = holder._sanitize  # noqa: SLF001 - torch's private state holder

    def _sanitize() -> None:
        sanitize()
        for node in holder._dead_nodes:  # noqa: SLF001 - torch's private state holder
            drops.setdefault(node, time.monotonic())

    holder._sanitize = _sanitize  # noqa: SLF001 - torch's private state holder


def round_handlers(port: int, n: int, run_id: str, last_call: float, timeout: float, tally: dict, drops: dict):
    """N of torch's ``DynamicRendezvousHandler``, one per simulated node, built as torch's
    ``create_handler`` builds them (:meth:`DynamicRendezvousHandler.from_backend` on a c10d
    backend over a ``TCPStore`` client of its own): min_nodes N-1, max_nodes N, the package's
    keep-alive interval and attempts (:func:`cadence`; ``from_backend`` takes the interval in
    seconds as is, fractions too), ``last_call`` and a join timeout of ``timeout``."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    c = cadence()
    handlers = []
    for i in range(n):
        backend = round_backend(port, run_id, tally)
        h = DynamicRendezvousHandler.from_backend(
            run_id,
            backend._store,  # noqa: SLF001 - torch's c10d backend's store: the one the round hands out
            backend,
            max(1, n - 1),
            n,
            local_addr=ROUND_ADDR.format(i),
            timeout=RendezvousTimeout(
                join=timedelta(seconds=timeout),
                last_call=timedelta(seconds=last_call),
                close=timedelta(seconds=30),
                heartbeat=timedelta(seconds=5),
            ),
            keep_alive_interval=c["keep_alive_s"],  # type: ignore[arg-type]
            keep_alive_max_attempt=int(c["max_attempt"]),
        )
        watch_drops(h, drops)
        handlers.append(h)
    return handlers


def join_all(handlers: list, timeout: float) -> dict:
    """``next_rendezvous()`` in one thread per handler, all at once. Returns the wall time from
    the first call to the last return (None when not all returned within ``timeout``), how many
    returned, the (rank, world size) each got, the errors and the threads (still running ones
    end at the join timeout torch was given)."""
    out: dict = {"seconds": None, "done": 0, "worlds": {}, "errors": [], "threads": []}
    ends: list[float] = []

    def node(h) -> None:
        try:
            info = h.next_rendezvous()
            out["worlds"][node_of(h)] = (info.rank, info.world_size)
        except Exception as e:  # noqa: BLE001 - the table reports it
            where = traceback.extract_tb(e.__traceback__)[-1]
            out["errors"].append(f"{node_of(h)}: {type(e).__name__}: {e} at {where.name}:{where.lineno}")
        ends.append(time.monotonic())

    out["threads"] = [threading.Thread(target=node, args=(h,), daemon=True) for h in handlers]
    t0 = time.monotonic()
    for t in out["threads"]:
        t.start()
    for t in out["threads"]:
        t.join(max(0.0, t0 + timeout - time.monotonic()))
    out["done"], out["wall"] = len(out["worlds"]), time.monotonic() - t0
    if out["done"] == len(handlers):
        out["seconds"] = max(ends) - t0
    elif out["errors"] and len(ends) == len(handlers):
        out["failed"] = f"{len(out['errors'])} failed ({out['errors'][0].split(': ')[1]}) in {out['wall']:.1f} s"
    return out


def detect(observer, survivors: list, silent, t0: float, timeout: float) -> dict:
    """After ``silent`` stopped beating at ``t0`` (monotonic): the time until ``observer`` (a
    survivor; a sync of its state holder under its heartbeat lock, as the agent reads it) no
    longer has ``silent`` among the participants, then until no survivor's own view (the state its
    last keep-alive left it) has it. Also the oldest survivor's heartbeat the observer saw (s)."""
    out: dict = {"detection_s": None, "detection_all_s": None, "oldest_live_beat_s": 0.0}
    while time.monotonic() - t0 < timeout:
        state = synced_state(observer)
        now = datetime.now(UTC)
        ages = [(now - b).total_seconds() for node, b in list(state.last_heartbeats.items()) if node != silent]
        out["oldest_live_beat_s"] = max([out["oldest_live_beat_s"], *ages])
        if out["detection_s"] is None and silent not in state.participants:
            out["detection_s"] = time.monotonic() - t0
        if out["detection_s"] is not None and all(silent not in holder_of(h).state.participants for h in survivors):
            out["detection_all_s"] = time.monotonic() - t0
            break
        if out["detection_s"] is not None and time.monotonic() - t0 > out["detection_s"] + 10:
            break  # a survivor whose keep-alive no longer runs (dropped itself) keeps its old view
        time.sleep(0.02)
    return out


def close_round(handlers: list, joins: list[dict]) -> None:
    """Stop every handler's keep-alive timer (torch joins its thread), close the rendezvous from
    one handler, wait for the nodes' threads, and drop the store clients."""
    for h in handlers:
        silence(h)
    if handlers:
        try:
            handlers[0].shutdown()
        except Exception as e:  # noqa: BLE001 - clean-up: report, go on
            print(f"  round: shutdown failed: {type(e).__name__}: {e}")
    for j in joins:
        for t in j["threads"]:
            t.join(30)
    handlers.clear()
    gc.collect()


def timed_round(name: str, handlers: list, timeout: float, out: dict) -> dict | None:
    """One round of ``handlers`` (:func:`join_all`) recorded into ``out`` under ``name``
    (``first`` or ``next``); None when it did not complete (``out["stopped"]`` says how far)."""
    joined = join_all(handlers, timeout)
    out["joins"].append(joined)
    out[f"{name}_round_s"], out[f"{name}_errors"] = joined["seconds"], joined["errors"][:3]
    if joined["seconds"] is not None:
        return joined
    out["stopped"] = f"{name} round: {joined['done']}/{len(handlers)} joined in {joined['wall']:.1f} s"
    out["failed"] = joined.get("failed")
    return None


def round_phases(handlers: list, timeout: float, drops: dict, out: dict) -> None:
    """The timed phases of one N (into ``out``): the first round of all N, one node's silence,
    its detection, the survivors' next round; stops at the first phase that does not complete."""
    first = timed_round("first", handlers, timeout, out)
    if first is None:
        return
    out["tally_first"] = dict(out["tally"])
    time.sleep(2 * cadence()["keep_alive_s"])  # every node's keep-alive timer runs
    silent = max(handlers, key=lambda h: first["worlds"][node_of(h)][0])  # the highest rank
    survivors = [h for h in handlers if h is not silent]
    t0 = out["phase_t"]["silence"] = time.monotonic()
    silence(silent)  # no exit op, no FIN: its store client stays open and idle
    out["silent"] = str(node_of(silent))
    out.update(detect(survivors[0], survivors, node_of(silent), t0, timeout))
    out["drops_by_detection"] = len(drops)
    if out["detection_s"] is None:
        out["stopped"] = f"detection: not within {timeout:.0f} s"
        return
    out["tally_detected"] = dict(out["tally"])
    out["phase_t"]["next"] = time.monotonic()
    nxt = timed_round("next", survivors, timeout, out)
    if nxt is None:
        return
    want, ranks = {node_of(h) for h in survivors}, sorted(r for r, _ in nxt["worlds"].values())
    worlds = sorted({w for _, w in nxt["worlds"].values()})
    got = set(holder_of(survivors[0]).state.participants)  # the observer's view as its join returned
    out["next_ok"] = ranks == list(range(len(want))) and worlds == [len(want)]
    out["next_check"] = {"world_sizes": worlds, "distinct_ranks": len(set(ranks)), "view": len(got)}
    out["next_check"].update(view_missing=len(want - got), view_extra=len(got - want))


def round_row(store: StoreProc, n: int, last_call: float, timeout: float) -> dict:
    """One N of the round path (see :func:`round_phases`): the phases' times, the store ops and
    failed compare-and-sets until the next round formed, the live nodes some node's view dropped,
    the CPU of this process (all N nodes) and of the store process, the threads left after."""
    base_threads = threading.active_count()
    tally = dict.fromkeys(("gets", "get_bytes", "cas", "cas_failed", "cas_bytes", "ka_cas", "ka_failed"), 0)
    drops: dict = {}
    out: dict = {"n": n, "last_call_s": last_call, "tally": tally, "joins": [], "stopped": "", "next_ok": False}
    out["phase_t"] = {"first": time.monotonic()}
    out.update(first_round_s=None, detection_s=None, detection_all_s=None, next_round_s=None, oldest_live_beat_s=0.0)
    with RoundLog() as log:
        handlers = round_handlers(store.port, n, f"scale-round-{n}", last_call, timeout, tally, drops)
        gc.collect()  # the set-up's garbage
        cpu0, store0 = time.process_time(), store.cpu_seconds()
        try:
            round_phases(handlers, timeout, drops, out)
        finally:
            out["cpu"], out["store_cpu"] = time.process_time() - cpu0, store.cpu_seconds() - store0
            out["tally_end"] = dict(tally)
            out["live_dropped"] = sorted(str(k) for k in drops if str(k) != out.get("silent"))
            phases = sorted(out.pop("phase_t").items(), key=lambda kv: kv[1])
            live = [t for k, t in drops.items() if str(k) != out.get("silent")]
            ends = [at for _, at in phases[1:]] + [math.inf]
            out["live_dropped_in"] = {
                p: sum(at <= t < e for t in live) for (p, at), e in zip(phases, ends, strict=True)
            }
            out["heartbeats_timed_out"] = log.heartbeats_failed
            close_round(handlers, out["joins"])
    out["threads_left"] = threading.active_count() - base_threads
    end = out.pop("tally_end")
    row = {k: v for k, v in out.items() if k not in ("tally", "joins")}
    row.update(ops=end["gets"] + end["cas"], cas=end["cas"], cas_failed=end["cas_failed"])
    row.update(ka_cas=end["ka_cas"], ka_failed=end["ka_failed"], state_bytes=end["get_bytes"] // max(1, end["gets"]))
    return row


def round_rows(nodes: list[int], last_call: float, timeout: float, event_names: bool = True) -> list[dict]:
    """:func:`round_row` per N, smallest first, on one store process; stops after an N whose
    phase did not complete in ``timeout``. As the package's launcher does, torch's agent store
    is not shared (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): rank 0 opens no store server.

    Without ``event_names``, torch's ``get_method_name`` (two ``inspect.stack()`` per call,
    about 2.4 ms of CPU here, for the name of an event that is then discarded: events go to a
    ``NullHandler``) returns a constant: every op executor step and sync calls it, a cost a real
    node pays on its own cores that N simulated nodes pay on this process's one GIL."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from elastic_trainer import contract

    store, prev = StoreProc(), os.environ.get(contract.SHARE_RDZV_STORE_ENV)
    os.environ[contract.SHARE_RDZV_STORE_ENV] = "1"
    method_name = dynamic_rendezvous.get_method_name
    if not event_names:
        dynamic_rendezvous.get_method_name = lambda depth=2: "scale-bench"
    rows: list[dict] = []
    try:
        for n in nodes:
            rows.append(round_row(store, n, last_call, timeout))
            r = rows[-1]
            times = [r[k] for k in ("first_round_s", "detection_s", "next_round_s")]
            print(f"  round N={n}: " + ", ".join("-" if t is None else f"{t:.2f} s" for t in times), flush=True)
            if r["stopped"]:
                print(f"  round N={n}: {r['stopped']}; no larger N")
                break
    finally:
        dynamic_rendezvous.get_method_name = method_name
        if prev is None:
            os.environ.pop(contract.SHARE_RDZV_STORE_ENV, None)
        else:
            os.environ[contract.SHARE_RDZV_STORE_ENV] = prev
        store.stop()
    return rows


# ------------------------------------------------------------------------------ report
def storage_table(rows: dict[str, list[dict]]) -> str:
    header = ["path", "N", "time (s)", "exp.", "CPU (s)", "exp.", "objects read", "bytes read", "listings"]
    header += ["entries listed", "objects written", "bytes written", "objects deleted", "S3 requests"]
    out = []
    for path, rs in rows.items():
        for r, e, ec in zip(rs, exponent(rs, "seconds"), exponent(rs, "cpu"), strict=True):
            out.append(
                [path, r["n"], f"{r['seconds']:.3f}", e, f"{r['cpu']:.3f}", ec, r["reads"], f"{r['read_bytes']:,}"]
                + [r["listings"]]
                + [f"{r['listed']:,}", r["writes"], f"{r['write_bytes']:,}", r["deletes"], r["requests"] or "-"]
            )
    return table(header, out)


def store_table(rows: list[dict]) -> str:
    header = ["N", "state (B)", "exp.", "node ms/keep-alive", "node ms/read", "node CPU share", "store ops/s offered"]
    header += ["store ops/s max", "store ms/op", "store cores at offered", "MB/s offered", "heartbeats ok/s"]
    header += ["CAS failed/s", "heartbeat period (s)", "exp.", "liveness check (us)", "exp."]
    out = []
    cols = zip(rows, exponent(rows, "blob"), exponent(rows, "beat_s"), exponent(rows, "check_us"), strict=True)
    for r, eb, ep, ec in cols:
        out.append(
            [r["n"], f"{r['blob']:,}", eb, f"{r['keepalive_ms']:.2f}", f"{r['read_ms']:.2f}", f"{r['node_cpu']:.1%}"]
            + [f"{r['offered']:,.0f}"]
            + [f"{r['raw_ops_s']:,.0f}", f"{r['store_ms']:.3f}", f"{r['store_cores']:.2f}", f"{r['mb_s']:,.1f}"]
            + [f"{r['cas_ok']:,.1f}", f"{r['cas_failed']:,.1f}", f"{r['beat_s']:.2f}", ep, f"{r['check_us']:.0f}", ec]
        )
    return table(header, out)


def round_table(rows: list[dict], timeout: float) -> str:
    header = ["N", "first round (s)", "detection (s)", "next round (s)", "exp. (next round)", "store ops"]
    header += ["CAS failed (keep-alive)", "live nodes dropped", "oldest live heartbeat (s)", "CPU (s)", "store CPU (s)"]
    late = f"did not complete in {timeout:.0f} s"

    def s(r: dict, v: float | None, reached: bool) -> str:
        return f"{v:.2f}" if v is not None else ((r.get("failed") or late) if reached else "-")

    out = []
    exps = exponent([{**r, "next_round_s": r["next_round_s"] or 0} for r in rows], "next_round_s")
    for r, e in zip(rows, exps, strict=True):
        first, detected = r["first_round_s"] is not None, r["detection_s"] is not None
        nxt = s(r, r["next_round_s"], detected) + (
            "" if r["next_round_s"] is None or r["next_ok"] else " (wrong members)"
        )
        out.append(
            [r["n"], s(r, r["first_round_s"], True), s(r, r["detection_s"], first), nxt, e, f"{r['ops']:,}"]
            + [f"{r['cas_failed']:,} ({r['ka_failed']:,})", len(r["live_dropped"]), f"{r['oldest_live_beat_s']:.2f}"]
            + [f"{r['cpu']:.1f}", f"{r['store_cpu']:.1f}"]
        )
    return table(header, out)


def s3_backend(root: Path) -> tuple[str, object] | None:
    """SeaweedFS as the S3 tests start it, with a bucket; (base URI, its process) or None."""
    from tests.fixtures import s3 as fx

    if fx.weed_binary() is None:
        return None
    from bench.s3_throughput import start_seaweedfs

    server, proc = start_seaweedfs(root)
    os.environ.update(server.env())
    return f"s3://{server.make_bucket('scale')}", proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="16,256,1024,4096", help="comma-separated N (ranks = nodes)")
    ap.add_argument("--tensors", type=int, default=16, help="items per rank's shard (in .checksums.json)")
    ap.add_argument("--commits", type=int, default=3, help="commits in the root (retention keeps one fewer)")
    ap.add_argument("--seconds", type=float, default=2.0, help="each store phase's length")
    ap.add_argument("--no-s3", action="store_true", help="local directory only")
    ap.add_argument("--json-out")
    ap.add_argument(
        "--round", action="store_true", help="also time torch's rendezvous round after a node's silent loss"
    )
    ap.add_argument("--round-nodes", default="8,16,32,64,128", help="comma-separated N of the round path")
    ap.add_argument("--round-last-call", type=float, default=1.0, help="the round path's last_call timeout (s)")
    ap.add_argument("--round-timeout", type=float, default=120.0, help="each round phase's limit (s)")
    ap.add_argument(
        "--round-no-event-names", action="store_true", help="torch's discarded event names cost no inspect.stack()"
    )
    ap.add_argument(
        "--keyed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the package's own rendezvous (rdzv_backend elastic-trainer) at N nodes (default: on)",
    )
    ap.add_argument("--keyed-nodes", help="comma-separated N of the --keyed path (default: --nodes)")
    ap.add_argument("--keyed-seconds", type=float, default=4.0, help="the --keyed path's steady-state window (s)")
    ap.add_argument("--keyed-procs", type=int, default=4, help="processes playing the --keyed path's nodes")
    ap.add_argument("--keyed-settings-for", type=int, help="every N of --keyed with the settings for this N")
    # the smoke run: the local root, the store and the own rendezvous (S3 is the same code on another storage)
    smoke = ["--nodes", "4,16", "--seconds", "0.2", "--commits", "2", "--no-s3"]
    a = parse_with_smoke(ap, [*smoke, "--keyed-nodes", "8", "--keyed-seconds", "0.5", "--keyed-procs", "2"])
    nodes = sorted({int(x) for x in a.nodes.split(",")})
    round_nodes = sorted({int(x) for x in a.round_nodes.split(",") if int(x) >= 2})
    logging.getLogger("elastic_trainer").setLevel(logging.ERROR)  # SeaweedFS lists deleted dirs: "skipping" lines
    info = machine_info()
    print(f"{info['nproc']} CPU cores, torch {info['torch']}, python {info['python']}, {info['date_utc']} UTC")
    tmp = Path(tempfile.mkdtemp(prefix="scale-"))
    backends: dict[str, str] = {"local": str(tmp / "local")}
    s3 = None if a.no_s3 else s3_backend(tmp / "seaweedfs")
    if s3 is not None:
        backends["s3"] = s3[0]
    elif not a.no_s3:
        print("no SeaweedFS `weed` binary: S3 skipped")
    try:
        paths = storage_paths(backends, nodes, a)
        store = store_rows(nodes, a.seconds)
        names = not a.round_no_event_names
        rounds = round_rows(round_nodes, a.round_last_call, a.round_timeout, names) if a.round else []
        keyed_nodes = sorted({int(x) for x in (a.keyed_nodes or a.nodes).split(",") if int(x) >= 2})
        keyed = (
            keyed_rows(keyed_nodes, a.keyed_seconds, a.keyed_procs, a.round_timeout, a.keyed_settings_for)
            if a.keyed
            else []
        )
    finally:
        if s3 is not None:
            from tests.fixtures.procs import stop_process

            stop_process(s3[1], 10)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\ncommit and resume (--tensors {a.tensors} items per rank, --commits {a.commits}):\n")
    print(storage_table(paths))
    print("\nrendezvous store (one TCPStore, torch's c10d rendezvous state, the package's default cadence):\n")
    print(store_table(store))
    if a.round:
        c = cadence()
        print(
            f"\nrendezvous round after a silent node loss (torch's DynamicRendezvousHandler, N nodes as threads of"
            f" one process, min N-1, max N, keep-alive {c['keep_alive_s']} s x {c['max_attempt']:.0f},"
            f" last_call {a.round_last_call} s, torch's own 1 s poll"
            f"{'' if names else ', event names without inspect.stack()'}):\n"
        )
        print(round_table(rounds, a.round_timeout))
    if a.keyed:
        print(
            "\nthe package's own rendezvous (rdzv_backend elastic-trainer: a store key per node's heartbeat), N nodes"
            f" in {a.keyed_procs} processes, each node its own handler and store client, the settings for N"
            " (docs/elasticity.md), the node of rank N // 2 silenced:\n"
        )
        print(keyed_table(keyed))
    if a.json_out:
        out = {"machine": info, "paths": paths, "store": store, **({"round": rounds} if a.round else {})}
        out.update({"keyed": keyed} if a.keyed else {})
        Path(a.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
