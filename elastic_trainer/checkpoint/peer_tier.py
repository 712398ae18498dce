"""The peer tier (``checkpoint.peer_replicas``): every local-tier copy, replicated to other nodes'
holders, and a load from any mix of nodes' copies at any world size.

**Replication.** Once a rank's local copy of a step is committed (its signed manifest written;
:class:`PeerSaver` is the local saver with this step added), :class:`Replicator` sends the
copy's files and then its manifest (``SEAL``) to the holders (:mod:`..storage.peer`) of
``peer_replicas`` other nodes: a ring over the node ranks of the current rendezvous round
(node ``g`` sends to ``g+1 .. g+k``), never the source's own node. One sender thread per rank,
never the training thread; a newer step supersedes one still queued or being sent. Each
node's holder also serves that node's own copies from ``checkpoint.local_dir``
(:class:`NodeCopies`), so a copy is reachable while its node or one of its replicas lives.

**Load** (:meth:`PeerTier.load`, every rank, when the own-copy local load is not possible): each
rank lists what it can reach (its node's disk, and every live holder's copies: each holder is
asked for its inventory by its own node's first rank and the answers are gathered, one request per
holder and load), keeping only
copies whose manifest is sealed and signed, of this launch epoch and model, descending from the
remote checkpoint the catalog chose, at that step or newer. The ranks agree on the newest step
(and lineage, and the world size W it was saved at) for which *every* rank reaches a copy of
every source rank 0..W-1. Each rank then loads it through DCP with the resharding load planner,
over a private directory where each source rank ``r`` is ``r<r>/`` (its node-local directory, or
files fetched from a holder on first use, once per node, each checked against the source's manifest) and one
``.metadata`` merges the W sources' metadata (each source's read by one rank, verified before it is
unpickled, and gathered: read once per load, not once per node).
Every item DCP reads is checked against its source manifest's checksums. Any gap, unreachable
holder or bad byte on any rank: every rank falls back to checkpoint.dir (never a partial load),
and a source copy whose bytes failed their check is dropped where it was held (one a holder did not
serve is kept: a failed request is no bad byte).

The merge relies on DCP's storage items (``Metadata.storage_data`` values) being dataclasses with a
``relative_path``, as :mod:`.integrity` does; tests/unit/test_peer_holder.py's merged-metadata
test fails loudly if a torch release changes that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import pickle
import re
import shutil
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from .. import contract, faults
from ..errors import CheckpointIntegrityError
from ..events import EventLog
from ..metrics.sink import MetricsSink
from ..storage.peer import Client, PeerError, xxh3
from . import compat, integrity, layout
from .agreement import Agreement
from .load_planner import load_planner
from .local_tier import LocalTier, job_key
from .resume import LocalLoad
from .save import Save, SaveContext
from .savers import LocalSaver, Started
from .state import PerRank

logger = logging.getLogger(__name__)

_RANK_DIR_RE = re.compile(r"^rank-(\d+)-of-(\d+)$")
_SOURCE_RE = re.compile(r"\br(\d+)/")
DISK = "disk"  # a location: this node's checkpoint.local_dir (else a holder's address)
_SHARE = ".peer-load-"  # + a load's attempt: what the ranks of a node fetch once, under the job's local dir


def ring_targets(nodes: list[int], me: int, replicas: int) -> list[int]:
    """The nodes that hold ``me``'s copies: the next ``replicas`` in the sorted ring, never ``me``."""
    ring = sorted(set(nodes))
    if me not in ring:
        return []
    i = ring.index(me)
    return [ring[(i + k) % len(ring)] for k in range(1, min(replicas, len(ring) - 1) + 1)]


# ------------------------------------------------------------------------------ node's own copies
class NodeCopies:
    """This node's committed local-tier copies of one job (``<local_dir>/<job>``), as a holder
    serves them (:class:`..storage.peer.Served`) and as a rank of this node reads them."""

    def __init__(self, root: str):
        self.root = root

    def _dirs(self):
        try:
            epochs = os.listdir(self.root)
        except FileNotFoundError:
            return
        for e in epochs:
            base = os.path.join(self.root, e)
            for s in _listdir(base):
                step = layout.parse_step_dir(s)
                for r in _listdir(os.path.join(base, s)) if step is not None else ():
                    m = _RANK_DIR_RE.match(r)
                    if m:
                        yield os.path.join(base, s, r), step, int(m.group(1)), int(m.group(2))

    def inventory(self) -> list[dict[str, Any]]:
        out = []
        for d, step, src, world in self._dirs():
            try:
                with open(os.path.join(d, layout.MANIFEST)) as f:
                    text = f.read()
                epoch = json.loads(text).get("epoch", "")
            except (OSError, ValueError, AttributeError):
                continue  # uncommitted or unreadable: not offered
            out.append({"epoch": epoch, "step": step, "src": src, "world": world, "manifest": text})
        return out

    def path(self, epoch: str, step: int, src: int, world: int) -> str:
        return LocalTier.copy_dir(self.root, epoch, step, src, world)

    def read(self, epoch: str, step: int, src: int, world: int, name: str, offset: int, length: int):
        if os.path.basename(name) != name or name in ("", ".", ".."):
            return None
        try:
            with open(os.path.join(self.path(epoch, step, src, world), name), "rb") as f:
                f.seek(offset)
                return f.read(length), os.fstat(f.fileno()).st_size
        except OSError:
            return None

    def drop(self, epoch: str, step: int, src: int, world: int) -> None:
        shutil.rmtree(self.path(epoch, step, src, world), ignore_errors=True)


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []


# ------------------------------------------------------------------------------ replication
@dataclass
class _Job:
    epoch: str
    step: int
    path: str  # the committed copy's directory (its manifest.json lists what to send)


class Replicator:
    """This rank's sender: :meth:`submit` a committed copy's directory; a background thread sends
    its files and then its manifest to ``targets`` (holder addresses). Counts bytes and seconds
    in the metrics sink; never raises."""

    def __init__(self, job: str, key: bytes, rank: int, targets: list[str], metrics: MetricsSink):
        self.job, self.key, self.rank = job, key, rank
        self.targets = targets
        self.metrics = metrics
        self._cv = threading.Condition()
        self._next: _Job | None = None
        self._active = False  # a job is being sent
        self._closed = False
        self._clients: dict[str, Client] = {}
        self._failing: set[str] = set()  # targets whose last send failed (logged once until one works)
        self.sent: list[int] = []  # steps sent to every target (tests)
        self._thread = threading.Thread(target=self._run, name=f"et-peer-send-{rank}", daemon=True)
        self._thread.start()

    def submit(self, epoch: str, step: int, path: str) -> None:
        with self._cv:
            self._next = _Job(epoch, step, path)
            self._cv.notify_all()

    def _superseded(self, job: _Job) -> bool:
        with self._cv:
            return self._closed or (self._next is not None and self._next.step != job.step)

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._next is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job, self._next, self._active = self._next, None, True
                assert job is not None  # the wait above ends with a job unless closed
            ok = all([self._send(job, t) for t in self.targets])
            with self._cv:
                if ok:
                    self.sent.append(job.step)
                self._active = False
                self._cv.notify_all()

    def _send(self, job: _Job, target: str) -> bool:
        t0 = time.monotonic()
        sent = 0
        client = self._clients.setdefault(target, Client(target, self.job, self.key))
        try:
            with open(os.path.join(job.path, layout.MANIFEST), "rb") as f:
                raw = f.read()
            manifest = json.loads(raw)
            world, files = int(manifest["world_size"]), manifest["files"]
            listing = {n: [n, int(f["size"]), int(f["xxh3"])] for n, f in sorted(files.items())}
            for name in sorted(files):
                if self._superseded(job):
                    return False
                path = os.path.join(job.path, name)
                if faults.corrupting_replicas() and name.endswith(".distcp"):  # tests only
                    with open(path, "rb") as f:
                        data = faults.maybe_corrupt_replica(job.step, f.read())
                    client.put(job.epoch, job.step, self.rank, world, name, data)
                    n, listing[name][2] = len(data), xxh3(data)
                else:
                    n = client.put_file(
                        job.epoch, job.step, self.rank, world, name, path, lambda: self._superseded(job)
                    )
                if n < 0:
                    return False
                sent += n
            client.seal(job.epoch, job.step, self.rank, world, list(listing.values()), raw)
        except (OSError, KeyError, TypeError, ValueError) as e:
            self.metrics.counter("elastic_trainer_checkpoint_peer_send_failures_total")
            if target not in self._failing:
                self._failing.add(target)
                logger.warning("replica of step %d to %s failed: %s", job.step, target, e)
            return False
        finally:
            self.metrics.counter("elastic_trainer_checkpoint_peer_sent_bytes_total", sent)
            self.metrics.counter("elastic_trainer_checkpoint_peer_send_seconds_total", time.monotonic() - t0)
        self._failing.discard(target)
        return True

    def idle(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until nothing is queued or being sent (tests)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._next is None and not self._active, timeout)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)
        for c in self._clients.values():
            c.close()


# ------------------------------------------------------------------------------ load
@dataclass(frozen=True)
class PeerCopy:
    """What a peer load loaded (``manifest``: source rank 0's)."""

    step: int
    name: str
    manifest: dict[str, Any]
    tiers: list[str]  # per rank: "peer" (read bytes from another node's holder) or "local" (its node's only)


class PeerTier:
    """The peer tier of one rank. ``holder``: its node's holder address (the supervisor's
    ``ELASTIC_TRAINER_PEER_HOLDER``; None: this node holds nothing for others and serves nothing,
    e.g. a process group without a supervisor)."""

    def __init__(
        self,
        tier: LocalTier,
        ckpt_dir: str,
        *,
        key: bytes,
        replicas: int,
        holder: str | None,
        node: int,
        metrics: MetricsSink,
        events: EventLog,
    ):
        self.tier, self.job, self.key = tier, job_key(ckpt_dir), key
        self.replicas, self.holder, self.node = replicas, holder, node
        self.metrics, self.events = metrics, events
        self.disk = NodeCopies(tier.root)
        self.holders: dict[int, str] | None = None  # node rank -> holder address, learnt at connect
        self.leader = False  # the first rank of its node (asks its node's holder), learnt at connect
        self.replicator: Replicator | None = None  # None: nowhere to replicate to

    def connect(self, agreement: Agreement) -> None:
        """Collective, once per process: learn every node's holder; start this rank's sender."""
        if self.holders is not None:
            return
        views = agreement.gather((self.node, self.holder))
        self.holders = {n: a for n, a in views if a}
        self.leader = all(n != self.node for n, _ in views[: self.tier.rank])  # its node's first rank
        targets = [self.holders[n] for n in ring_targets(list(self.holders), self.node, self.replicas)]
        if targets:
            self.replicator = Replicator(self.job, self.key, self.tier.rank, targets, self.metrics)
        elif self.tier.rank == 0:
            logger.info("peer tier: no other node's holder to replicate to (%d node(s) hold copies)", len(self.holders))

    def replicate(self, epoch: str, step: int) -> None:
        """After this rank's local copy of ``step`` committed (any thread): send it in the background."""
        if self.replicator is not None:
            self.replicator.submit(epoch, step, self.tier.rank_dir(epoch, step))

    def close(self) -> None:
        if self.replicator is not None:
            self.replicator.close()

    # -------------------------------------------------------------------- what is reachable
    def _usable(self, m: Any, *, src: int, world: int, step: int, epoch: str, remote: str | None, fp: str) -> bool:
        return (
            isinstance(m, dict)
            and layout.format_problem(m) is None
            and layout.seal_problem(m, self.key) is None
            and "hmac" in m
            and m.get("step") == step
            and m.get("rank") == src
            and m.get("world_size") == world
            and m.get("epoch") == epoch
            and m.get("config_fingerprint") == fp
            and (remote or "") in (m.get("remote_chain") or [])
            and layout.METADATA in (m.get("files") or {})
        )

    def reachable(
        self, agreement: Agreement, epoch: str, *, min_step: int, remote: str | None, fingerprint: str
    ) -> dict[tuple, dict]:
        """Collective. ``{(step, lineage, W): {src: (location, manifest)}}`` this rank can read: its
        node's disk first, then every holder's copies (its own node's first). Each holder is asked
        for its inventory once, by the first rank of its own node, and the usable entries are
        gathered: one inventory per node and load, not one per pair of nodes."""
        want: dict[str, Any] = {"epoch": epoch, "min_step": min_step, "remote": remote, "fp": fingerprint}
        disk, held = [], None
        try:
            disk = self._entries(self.disk.inventory(), **want)
            if self.leader and self.holder:
                held = self._inventory(self.holder, want)
        except OSError as e:
            logger.warning("peer tier unreadable: %s", e)
        answers = agreement.gather((self.node, self.holder, held) if held is not None else None)
        held_by = sorted({(n, a): e for n, a, e in filter(None, answers)}.items(), key=lambda kv: kv[0][0] != self.node)
        out: dict[tuple, dict[int, tuple[str, dict]]] = {}
        for location, entries in [(DISK, disk), *(((a, e) for (_, a), e in held_by))]:
            for step, src, world, m in entries:
                out.setdefault((step, m.get("lineage"), world), {}).setdefault(src, (location, m))
        return out

    def _entries(self, entries: list[dict], *, epoch: str, min_step: int, remote: str | None, fp: str) -> list:
        """The usable ones of an inventory's ``entries``: ``[step, src, world, manifest]``."""
        out = []
        for e in entries:
            try:
                m = json.loads(e["manifest"])
                step, src, world = int(e["step"]), int(e["src"]), int(e["world"])
            except (KeyError, TypeError, ValueError):
                continue
            if step >= min_step and self._usable(m, src=src, world=world, step=step, epoch=epoch, remote=remote, fp=fp):
                out.append([step, src, world, m])
        return out

    def _inventory(self, address: str, want: dict) -> list | None:
        """This node's holder's usable copies (None: unreachable). Entries are checked (sealed,
        signed, this launch) before they go to the other ranks."""
        try:
            client = Client(address, self.job, self.key, timeout=10.0)
            try:
                return self._entries(client.inventory(), **want)
            finally:
                client.close()
        except (PeerError, ValueError) as e:
            logger.warning("peer holder %s unreachable: %s", address, e)
            return None

    # -------------------------------------------------------------------- load
    def load(
        self,
        states: dict[str, Stateful],
        agreement: Agreement,
        *,
        epoch: str,
        remote: str | None,
        min_step: int,
        fingerprint: str,
        skipped: list[tuple[int, str]],
        attempt: str,
    ) -> PeerCopy | LocalLoad:
        """Every rank: the newest step every rank can assemble from the nodes' copies, loaded
        (see the module docstring); NONE (no such step) or FAILED (a load failed somewhere: the
        state may be partly overwritten; every rank must load checkpoint.dir). ``attempt``: names
        this load, the same on every rank (what the ranks of a node fetch once goes there)."""
        rank = self.tier.rank
        share = os.path.join(self.tier.root, f"{_SHARE}{attempt}")
        try:
            for n in os.listdir(self.tier.root):  # an interrupted load's leftovers
                if n.startswith(_SHARE) and n != os.path.basename(share):
                    shutil.rmtree(os.path.join(self.tier.root, n), ignore_errors=True)
            os.makedirs(share, exist_ok=True)
        except OSError as e:
            logger.warning("peer tier unreadable: %s", e)
        mine = self.reachable(agreement, epoch, min_step=min_step, remote=remote, fingerprint=fingerprint)
        complete = {k for k, srcs in mine.items() if set(srcs) >= set(range(k[2]))}
        views = agreement.gather(sorted(complete, key=_order))
        common = set.intersection(*(set(map(tuple, v)) for v in views))
        if not common:
            shutil.rmtree(share, ignore_errors=True)  # nothing was fetched into it
            if rank == 0 and any(views):
                self.events.emit(
                    "checkpoint_peer_skipped",
                    step=max(k[0] for v in views for k in v),
                    reason="no step whose every shard every rank can reach",
                    remote_step=min_step,
                )
            return LocalLoad.NONE
        best = max(common, key=_order)
        step, _, world = best
        sources = mine[best]
        error, held, bad = "", False, None
        reader: _SourcesReader | None = None
        try:
            reader = _SourcesReader(share, rank, self.tier.root, sources, self.job, self.key, epoch, step, world)
            own: dict[int, bytes | tuple[str, str]] | str = reader.metadata_of(range(rank, world, agreement.world_size))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must reach the gather
            own = compat.one_line(e, 2000)
        gathered = agreement.gather(own)  # each source's .metadata read once in the job, not once per node
        try:
            if reader is None:
                raise RuntimeError(f"could not start the peer load: {own}")
            reader.merge(gathered)
            for s in states.values():
                if isinstance(s, PerRank):
                    s.expect_world(world)
            integrity.load(states, reader, planner=load_planner(states), no_dist=True)
            held = reader.from_holders
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed and handled below
            error = compat.one_line(e, 2000)
            bad = _bad_source(e) if compat.is_integrity(e) else None
        results = agreement.gather((error, held))
        shutil.rmtree(share, ignore_errors=True)  # every rank of the node has read what it needs
        if any(err for err, _ in results):
            if bad is not None and bad in sources:
                self._drop(sources[bad][0], epoch, step, bad, world)
            reason = next(f"rank {r}: {err}" for r, (err, _) in enumerate(results) if err)
            logger.error("peer load of step %d failed: %s", step, error or "on another rank")
            if rank == 0:
                self.events.emit(
                    "checkpoint_peer_skipped", step=step, reason=f"load failed: {reason}"[:2000], remote_step=min_step
                )
            skipped.append((step, f"peer copy: load failed: {reason}"[:2000]))
            return LocalLoad.FAILED
        self.metrics.counter("elastic_trainer_checkpoint_peer_resumes_total")
        tiers = ["peer" if f else "local" for _, f in results]
        return PeerCopy(step, f"peer:step-{step:08d}/world-{world}", sources[0][1], tiers)

    def _drop(self, location: str, epoch: str, step: int, src: int, world: int) -> None:
        logger.warning(
            "dropping the copy of rank %d of %d at step %d (%s): a byte failed its check", src, world, step, location
        )
        try:
            if location == DISK:
                self.disk.drop(epoch, step, src, world)
            else:
                c = Client(location, self.job, self.key, timeout=10.0)
                try:
                    c.drop(epoch, step, src, world)
                finally:
                    c.close()
        except (OSError, PeerError) as e:
            logger.warning("could not drop it: %s", e)


def _bad_source(e: BaseException) -> int | None:
    """The source rank whose bytes an integrity failure names (``r<src>/...``), if any; not one
    whose holder did not serve them (:class:`PeerError`: a request that failed is no bad byte)."""
    for cause in compat.root_causes(e):
        if isinstance(cause, PeerError) or isinstance(cause.__cause__, PeerError):
            continue
        m = _SOURCE_RE.search(str(cause))
        if m:
            return int(m.group(1))
    return None


def _order(k: tuple) -> tuple:
    step, lineage, world = k
    return (step, str(lineage or ""), world)


class _SourcesReader(integrity.VerifyingFileSystemReader):
    """A verifying DCP reader over ``<share>/rank-<rank>/``: ``r<src>/`` is each source rank's
    copy, a link to its node-local directory under ``root``, or to ``<share>/r<src>/`` where the
    files fetched from a holder go, once per node (the first rank of the node to need a file
    fetches and verifies it under a lock; the others read it); ``.metadata`` the merge of theirs."""

    def __init__(
        self, share: str, rank: int, root: str, sources: dict, job: str, key: bytes, epoch: str, step: int, world: int
    ):
        work = os.path.join(share, f"rank-{rank}")
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        self._work = work
        self._sources = sources
        self._where = (job, key, epoch, step, world)
        self._clients: dict[str, Client] = {}
        for src in range(world):
            d = os.path.join(work, f"r{src}")
            if sources[src][0] == DISK:
                os.symlink(LocalTier.copy_dir(root, epoch, step, src, world), d)
            else:
                os.makedirs(os.path.join(share, f"r{src}"), exist_ok=True)
                os.symlink(os.path.join(share, f"r{src}"), d)
        super().__init__(work)

    @property
    def from_holders(self) -> bool:
        """Whether this rank read bytes another node's holder served: at least a source's
        ``.metadata``, which every rank merges."""
        return any(location != DISK for location, _ in self._sources.values())

    def metadata_of(self, srcs: Iterable[int]) -> dict[int, bytes | tuple[str, str]]:
        """The verified ``.metadata`` of each source in ``srcs`` (this rank's share of them), or
        why it could not be read: ``("unreachable", why)`` (its holder did not serve it) or
        ``("integrity", why)`` (bad or missing bytes)."""
        out: dict[int, bytes | tuple[str, str]] = {}
        for src in srcs:
            try:
                out[src] = self._read(src, layout.METADATA)
            except CheckpointIntegrityError as e:
                out[src] = ("integrity", str(e))
            except PeerError as e:
                out[src] = ("unreachable", str(e))
            except OSError as e:
                out[src] = ("integrity", str(_source_error(src, f"{layout.METADATA}: {e}")))
        return out

    def merge(self, gathered: list[dict[int, bytes | tuple[str, str]] | str]) -> None:
        """Every rank's :meth:`metadata_of` (each source read by one rank of the job), checked
        against the sources' manifests again and merged into this rank's ``.metadata``."""
        raw: dict[int, bytes | tuple[str, str]] = {}
        for part in gathered:
            if isinstance(part, str):
                raise RuntimeError(f"another rank could not start its peer load: {part}")
            raw.update(part)
        items: dict[tuple[str, int], tuple[int, int]] = {}
        merged: Metadata | None = None
        for src in range(self._where[4]):
            data = raw.get(src, ("unreachable", f"r{src}/ (source rank {src}): no rank read its metadata"))
            if isinstance(data, tuple):
                kind, why = data
                raise CheckpointIntegrityError(why) if kind == "integrity" else PeerError(why)
            self._check(src, layout.METADATA, data)
            checks = layout.Checks.from_manifest(self._sources[src][1])
            items.update({(f"r{src}/{f}", off): v for (f, off), v in checks.items.items()})
            merged = _merge(merged, pickle.loads(data), src)  # noqa: S301 - verified against the signed manifest
        assert merged is not None  # at least one source rank
        _check_coverage(merged)
        self._items = merged.storage_data
        data = pickle.dumps(merged)
        with open(os.path.join(self._work, layout.METADATA), "wb") as f:
            f.write(data)
        self.checks = layout.Checks((len(data), layout.digest(data)), items)

    def _ensure(self, src: int, name: str) -> None:
        """Source ``src``'s file ``name`` under ``r<src>/``: fetched from its holder when it is not
        there, and then checked whole against the source's manifest (every item DCP reads from
        it is checked again by the verifying reader)."""
        path = os.path.join(self._work, f"r{src}", name)
        location, manifest = self._sources[src]
        if location == DISK and os.path.exists(path):
            return
        want = (manifest.get("files") or {}).get(name)
        if location == DISK or not isinstance(want, dict):
            raise _source_error(src, f"{name} is missing")
        with _locked(path):  # through the link: one lock per file and node
            if os.path.exists(path):
                return  # fetched and verified by this node's first rank to need it
            job, key, epoch, step, world = self._where
            part = path + ".part"
            try:
                client = self._clients.get(location) or self._clients.setdefault(location, Client(location, job, key))
                with open(part, "wb") as f:
                    out = _Hashing(f)
                    n = client.get(epoch, step, src, world, name, out=out)
                    got = out.hasher.intdigest()
            except PeerError as e:  # not served: no byte of it was bad (the copy is kept)
                raise PeerError(f"r{src}/ (source rank {src}): {e}") from e
            if n != int(want["size"]) or got != int(want["xxh3"]):
                raise _source_error(src, f"{name}: size or checksum does not match its manifest")
            os.rename(part, path)

    def _read(self, src: int, name: str) -> bytes:
        """A small file of source ``src`` (its ``.metadata``), checked whole against its manifest."""
        self._ensure(src, name)
        with open(os.path.join(self._work, f"r{src}", name), "rb") as f:
            data = f.read()
        self._check(src, name, data)
        return data

    def _check(self, src: int, name: str, data: bytes) -> None:
        want = (self._sources[src][1].get("files") or {}).get(name) or {}
        if len(data) != int(want.get("size", -1)) or xxh3(data) != int(want.get("xxh3", -1)):
            raise _source_error(src, f"{name}: size or checksum does not match its manifest")

    def read_data(self, plan, planner):
        try:
            for rel in sorted({self._items[i.storage_index].relative_path for i in plan.items}):
                src_dir, _, name = rel.partition("/")
                self._ensure(int(src_dir[1:]), name)
            return super().read_data(plan, planner)
        finally:
            for c in self._clients.values():
                c.close()


@contextlib.contextmanager
def _locked(path: str):
    """``path``'s lock file (``<path>.lock``), held exclusively: one rank of the node at a time."""
    fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class _Hashing:
    """A binary file that hashes (XXH3) what is written to it."""

    def __init__(self, f):
        self.f = f
        self.hasher = xxhash.xxh3_64()

    def write(self, data) -> None:
        self.f.write(data)
        self.hasher.update(data)


def _source_error(src: int, why: str) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(f"r{src}/ (source rank {src}): {why}")


def _merge(into: Metadata | None, m: Metadata, src: int) -> Metadata:
    """Source ``src``'s metadata merged into ``into``: its chunks and items, paths under ``r<src>/``;
    an item another source already has (replicated state) is kept once."""
    if into is None:
        into = Metadata(state_dict_metadata={}, planner_data={}, storage_data={})
    for fqn, md in m.state_dict_metadata.items():
        have = into.state_dict_metadata.get(fqn)
        if have is None:
            into.state_dict_metadata[fqn] = (
                dataclasses.replace(md, chunks=list(md.chunks)) if isinstance(md, TensorStorageMetadata) else md
            )
        elif isinstance(md, TensorStorageMetadata):
            if not isinstance(have, TensorStorageMetadata) or have.size != md.size:
                raise _source_error(src, f"{fqn}: another shape than the other sources'")
            known = {tuple(c.offsets) for c in have.chunks}
            have.chunks += [c for c in md.chunks if tuple(c.offsets) not in known]
    for idx, info in (m.storage_data or {}).items():
        if idx not in into.storage_data:
            into.storage_data[idx] = dataclasses.replace(info, relative_path=f"r{src}/{info.relative_path}")
    if isinstance(m.planner_data, dict):
        for k, v in m.planner_data.items():
            into.planner_data.setdefault(k, v)
    return into


def _check_coverage(m: Metadata) -> None:
    """Every tensor's chunks cover it whole: no source is silently missing."""
    for fqn, md in m.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        whole = 1
        for n in md.size:
            whole *= n
        have = 0
        for c in md.chunks:
            v = 1
            for n in c.sizes:
                v *= n
            have += v
        if have != whole:
            raise CheckpointIntegrityError(f"{fqn}: the sources hold {have} of its {whole} elements")


class PeerSaver:
    """A :class:`~.savers.Saver`: the local saver, each copy it commits then replicated to other
    nodes by ``peer`` (in the background; the save's ``done`` is the local copy's)."""

    def __init__(self, local: LocalSaver, peer: PeerTier):
        self.local, self.peer, self.tier = local, peer, local.tier

    def start(self, save: Save, states: dict[str, Stateful], manifest: dict[str, Any]) -> Started:
        started = self.local.start(save, states, manifest)

        def replicate(f: Future) -> None:
            if f.result():
                self.peer.replicate(save.epoch, save.step)

        started.done.add_done_callback(replicate)
        return started

    def healthy(self) -> bool:
        return self.local.healthy()

    def reset(self) -> None:
        self.local.reset()

    def close(self) -> None:
        self.local.close()
        self.peer.close()


def with_peers(local: LocalSaver, cfg, ckpt_dir: str, ctx: SaveContext) -> LocalSaver | PeerSaver:
    """The local saver, with the peer tier per ``checkpoint.peer_replicas`` and the supervisor's
    environment (:func:`from_env`) when it is on."""
    peer = from_env(cfg, local.tier, ckpt_dir, key=local.tier.key, metrics=ctx.metrics, events=ctx.events)
    return local if peer is None else PeerSaver(local, peer)


def from_env(
    cfg, tier: LocalTier | None, ckpt_dir: str, *, key: bytes | None, metrics: MetricsSink, events: EventLog
) -> PeerTier | None:
    """This rank's peer tier per ``checkpoint.peer_replicas`` and the supervisor's environment, or
    None (off: no local tier, ``peer_replicas = 0``, or no checkpoint key — said once)."""
    if tier is None or cfg.peer_replicas <= 0:
        return None
    if not key:
        if tier.rank == 0:
            logger.warning(
                "checkpoint.peer_replicas = %d but %s is not set: peer transfer is off (holders authenticate "
                "every request with that key)",
                cfg.peer_replicas,
                contract.CHECKPOINT_KEY_ENV,
            )
        return None
    return PeerTier(
        tier,
        ckpt_dir,
        key=key,
        replicas=cfg.peer_replicas,
        holder=os.environ.get(contract.PEER_HOLDER_ENV) or None,
        node=int(os.environ.get(contract.GROUP_RANK_ENV, "0") or 0),
        metrics=metrics,
        events=events,
    )
