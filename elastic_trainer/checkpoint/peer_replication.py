"""Replication for the peer tier: each committed local-tier copy of a rank, sent to the holders of
``checkpoint.peer_replicas`` other nodes.

The holders are a ring over the node ranks of the current rendezvous round (node ``g`` sends to
``g+1 .. g+k``, :func:`ring_targets`), never the source's own node. One sender thread per rank
(:class:`Replicator`), never the training thread; a newer step supersedes one still queued or
being sent. A copy travels through a :class:`~.peer_transport.PeerTransport`: its files, then its
manifest (the seal).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass

from .. import faults
from ..metrics.sink import MetricsSink
from ..storage.peer import xxh3
from . import layout
from .peer_transport import CopyId, Outgoing, PeerTransport

logger = logging.getLogger(__name__)


def ring_targets(nodes: list[int], me: int, replicas: int) -> list[int]:
    """The nodes that hold ``me``'s copies: the next ``replicas`` in the sorted ring, never ``me``."""
    ring = sorted(set(nodes))
    if me not in ring:
        return []
    i = ring.index(me)
    return [ring[(i + k) % len(ring)] for k in range(1, min(replicas, len(ring) - 1) + 1)]


@dataclass
class _Job:
    epoch: str
    step: int
    path: str  # the committed copy's directory (its manifest.json lists what to send)


def outgoing(path: str, step: int) -> tuple[int, list[Outgoing], bytes]:
    """``(world size, files, raw manifest)`` of the committed copy at ``path``, in name order.
    Raises OSError, KeyError, TypeError or ValueError when its manifest is not readable."""
    with open(os.path.join(path, layout.MANIFEST), "rb") as f:
        raw = f.read()
    manifest = json.loads(raw)
    world, files = int(manifest["world_size"]), manifest["files"]
    out = []
    for name in sorted(files):
        size, digest, data = int(files[name]["size"]), int(files[name]["xxh3"]), None
        if faults.corrupting_replicas() and name.endswith(".distcp"):  # tests only
            with open(os.path.join(path, name), "rb") as f:
                data = faults.maybe_corrupt_replica(step, f.read())
            digest = xxh3(data)  # the holder checks what it gets; the reader, the manifest
        out.append(Outgoing(name, size, digest, os.path.join(path, name), data))
    return world, out, raw


class Replicator:
    """This rank's sender: :meth:`submit` a committed copy's directory; a background thread sends
    it to ``targets`` (holder addresses) through ``transport`` (used by that thread only). Counts
    bytes and seconds in the metrics sink; never raises."""

    def __init__(self, rank: int, targets: list[str], transport: PeerTransport, metrics: MetricsSink):
        self.rank = rank
        self.targets = targets
        self.transport = transport
        self.metrics = metrics
        self._cv = threading.Condition()
        self._next: _Job | None = None
        self._active = False  # a job is being sent
        self._closed = False
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
        sent = [0]

        def count(n: int) -> None:
            sent[0] += n

        try:
            world, files, raw = outgoing(job.path, job.step)
            copy = CopyId(job.epoch, job.step, self.rank, world)
            if not self.transport.send(target, copy, files, raw, stop=lambda: self._superseded(job), sent=count):
                return False
        except (OSError, KeyError, TypeError, ValueError) as e:
            self.metrics.counter("elastic_trainer_checkpoint_peer_send_failures_total")
            if target not in self._failing:
                self._failing.add(target)
                logger.warning("replica of step %d to %s failed: %s", job.step, target, e)
            return False
        finally:
            self.metrics.counter("elastic_trainer_checkpoint_peer_sent_bytes_total", sent[0])
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
        self.transport.close()
