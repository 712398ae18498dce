"""The run history a supervisor keeps while the job runs.

:class:`RunHistory` follows the node's ``events.jsonl`` (written by the supervisor and, on the
node hosting it, by rank 0) and

* feeds every record into the goodput :class:`~elastic_trainer.goodput.Ledger`, which the metrics
  exporter reads at each scrape (``elastic_trainer_wall_seconds{category}``,
  ``elastic_trainer_goodput_ratio``, ``elastic_trainer_goodput_recent_ratio``);
* mirrors the file to ``<checkpoint.dir>/_events/<node>-<launch>-<pid>.<segment>.jsonl`` after
  each checkpoint commit, restart or rendezvous, and at exit, so ``elastic-trainer report`` works
  from the checkpoint root after every pod (and its ``run.dir``) is gone. Objects are segments of
  at most about :data:`SEGMENT_BYTES` of complete lines: the open (last) segment is rewritten
  whole (an atomic PUT or rename) at each mirror, a full one is never written again, so a mirror
  uploads at most one segment however long the job runs. Nodes never write each other's objects,
  and a reader sees a complete earlier version of a segment or the new one, never a torn line.

Thread-safe: :meth:`poll` runs from a background thread and from the scrape hook; only the
background thread (and :meth:`close`) uploads, so a slow checkpoint store never delays a scrape.
"""

from __future__ import annotations

import collections
import heapq
import logging
import os
import re
import threading
import time

from .. import contract
from ..errors import StorageError
from ..events import parse_record
from ..goodput import CATEGORIES, Ledger
from ..metrics.sink import MetricsSink, NullSink

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 4 << 20
READ_CHUNK_BYTES = 4 << 20
_SEGMENT = re.compile(r"^(?P<log>.+?)(?:\.(?P<seq>\d{6}))?\.jsonl$")
RECENT_WINDOW_SECONDS = 600.0
_MIRROR_ON = (
    "checkpoint_committed",
    "restart",
    "rendezvous",
    "membership_change",
    "finished",
    "preempted",
    "job_failed",
)


def mirror_name(node: str, launch_time: float, pid: int) -> str:
    """Name of one node's launch log under ``_events/``; its segments add ``.<seq>.jsonl`` (pure)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node) or "node"
    return f"{safe}-{int(launch_time)}-{pid}"


def segment_name(log: str, seq: int) -> str:
    return f"{log}.{seq:06d}.jsonl"


class RunHistory:
    """One supervisor's follower of ``events_path`` (its node's ``events.jsonl``): the goodput
    ledger it feeds and the gauges it sets (:meth:`export`), and the log's mirror under the
    checkpoint root (``storage``; None: no mirror). ``node`` names the mirror's objects (default:
    the host name); ``clock``: the wall clock (of the gauges and the mirror's name). :meth:`start`
    runs the background thread that polls and uploads; :meth:`close` stops it, then mirrors the
    final log."""

    def __init__(
        self,
        events_path: str,
        storage=None,
        node: str | None = None,
        metrics: MetricsSink | None = None,
        clock=time.time,
    ):
        self.events_path = events_path
        self.storage = storage
        self.metrics = metrics or NullSink()
        self._clock = clock
        self.ledger = Ledger()
        self._offset = 0
        self._partial = b""
        self._lock = threading.Lock()
        self._mirror_due = False
        self._mirror_lock = threading.Lock()
        self._segment_start = 0  # offset in events.jsonl where the open segment begins
        self._segment_seq = 0
        self._recent: collections.deque[tuple[float, float, float]] = collections.deque()
        self.log_name = mirror_name(node or os.uname().nodename, clock(), os.getpid())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- following the log ------------------------------------------------------------------
    def poll(self, mirror: bool = True) -> None:
        """Feed the records appended since the last call; mirror when one of them asked for it
        (and ``mirror``: the scrape hook only feeds, the background thread uploads)."""
        more = True
        while more:  # in bounded chunks: a relaunch on a week-long log neither loads it whole nor holds the lock for it
            with self._lock:
                try:
                    with open(self.events_path, "rb") as f:
                        f.seek(self._offset)
                        data = f.read(READ_CHUNK_BYTES)
                except FileNotFoundError:
                    return
                more = len(data) == READ_CHUNK_BYTES
                self._offset += len(data)
                lines = (self._partial + data).split(b"\n")
                self._partial = lines.pop()  # an incomplete last line waits for the rest
                for line in lines:
                    e = parse_record(line)
                    if e is None:
                        continue
                    self.ledger.feed(e)
                    if e.get("event") in _MIRROR_ON:
                        self._mirror_due = True
        if mirror and self._mirror_due:
            self.mirror()

    def export(self) -> None:
        """Set the goodput gauges (called at each scrape, after :meth:`poll`)."""
        self.poll(mirror=False)
        with self._lock:
            now = self._clock()
            g = self.ledger.result(now=now)
            self._recent.append((now, g.productive_seconds, g.wall_seconds))
            while len(self._recent) > 2 and self._recent[1][0] <= now - RECENT_WINDOW_SECONDS:
                self._recent.popleft()
        if g.wall_seconds <= 0:
            return
        for cat in CATEGORIES:
            self.metrics.gauge("elastic_trainer_wall_seconds", g.categories.get(cat, 0.0), {"category": cat})
        if g.goodput is not None:
            self.metrics.gauge("elastic_trainer_goodput_ratio", g.goodput)
        t0, p0, w0 = self._recent[0]
        if g.wall_seconds - w0 > 0:
            self.metrics.gauge(
                "elastic_trainer_goodput_recent_ratio", (g.productive_seconds - p0) / (g.wall_seconds - w0)
            )
        elif g.goodput is not None:
            self.metrics.gauge("elastic_trainer_goodput_recent_ratio", g.goodput)

    # -- the mirror ---------------------------------------------------------------------------
    def mirror(self) -> bool:
        """Upload the local event log from the open segment on, complete lines only, at most
        :data:`SEGMENT_BYTES` per object: a segment that fills up is final and the rest goes to
        the next one (a relaunch on a long log uploads it as many bounded segments). Failures are
        logged, never raised (a side channel); a failed upload is retried at the next mirror."""
        with self._mirror_lock:
            self._mirror_due = False
            if self.storage is None:
                return False
            try:
                with open(self.events_path, "rb") as f:
                    while True:
                        f.seek(self._segment_start)
                        data = f.read(SEGMENT_BYTES)
                        full = len(data) == SEGMENT_BYTES
                        if full and b"\n" not in data:
                            data += f.readline()  # one record longer than a segment: it is its own
                        end = data.rfind(b"\n") + 1
                        if end == 0:
                            return True
                        name = self.storage.join(
                            contract.EVENTS_MIRROR_DIR, segment_name(self.log_name, self._segment_seq)
                        )
                        try:
                            self.storage.write_bytes_atomic(name, data[:end])
                        except (StorageError, OSError) as e:  # the storage layer raises only these
                            logger.warning("could not mirror the event log to %s: %s", name, e)
                            return False
                        if not full:
                            return True
                        self._segment_start += end
                        self._segment_seq += 1
            except FileNotFoundError:
                return False

    # -- background ---------------------------------------------------------------------------
    def start(self, interval: float = 1.0) -> RunHistory:
        def loop():
            while not self._stop.wait(interval):
                try:
                    self.poll()
                except Exception:  # the poller outlives a failed poll (logged with its traceback)
                    logger.exception("run history poll failed")

        self._thread = threading.Thread(target=loop, name="run-history", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop following, feed the last records and mirror the final log (at exit)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.poll()
        self.mirror()


def read_mirrored_events(storage) -> list[dict]:
    """Every record of every log mirrored under ``<root>/_events/`` (each log's segments joined in
    order; an unsegmented ``<log>.jsonl`` of an earlier version is one segment), each distinct
    record once (a node relaunched on the same ``run.dir`` mirrors its older records again),
    merged by time; each log keeps its own order (one log gives back exactly its file)."""
    segments: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for name in storage.list_files(storage.join(contract.EVENTS_MIRROR_DIR)):
        m = _SEGMENT.match(name)
        if m and "/" not in name:
            segments[m["log"]].append((int(m["seq"] or 0), name))
    seen: set[str] = set()
    logs: list[list[dict]] = []
    for log_name in sorted(segments):
        log = []
        for _, name in sorted(segments[log_name]):
            for line in (
                storage.read_bytes(storage.join(contract.EVENTS_MIRROR_DIR, name))
                .decode("utf-8", "replace")
                .splitlines()
            ):
                line = line.strip()
                if line in seen:
                    continue
                seen.add(line)
                e = parse_record(line)
                if e is not None:
                    log.append(e)
        logs.append(log)
    return list(heapq.merge(*logs, key=lambda e: e["time"] if isinstance(e.get("time"), (int, float)) else 0.0))
