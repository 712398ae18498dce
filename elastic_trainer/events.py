"""Event log: JSON lines in ``<run.dir>/events.jsonl`` (``contract.EVENTS_FILE``).

Workers write only from rank 0 (``EventLog(path, enabled=rank == 0)``); the supervisor writes
its own lifecycle records (restarts) to the same file. Each line is one complete JSON object
written with a single ``write`` on a file opened in append mode, so concurrent writers
(supervisor and rank 0, or a background commit thread) never interleave within a line.
Every record carries ``event`` and ``time`` (unix seconds); the events, their fields and their
meaning are catalogued in :data:`elastic_trainer.contract.EVENTS`.

The log is a record, not a dependency: a write that fails (run.dir's disk full, its mount gone)
drops the record with one warning, and training goes on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from . import contract

logger = logging.getLogger(__name__)


class EventLog:
    check = False
    """When True (the test suites switch it on), :meth:`emit` raises ValueError for an event, or a
    field, that is not in the catalogue (``contract.EVENTS``), or a required field it lacks."""

    def __init__(self, path: str | None, enabled: bool = True):
        self.path = path
        self.enabled = enabled and path is not None
        self._lock = threading.Lock()
        self.dropped = 0  # records not written since the last one that was
        if self.enabled and path is not None:  # enabled implies a path
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        if EventLog.check:
            problems = contract.event_problems(event, fields)
            if problems:
                raise ValueError("; ".join(problems))
        record = {"event": event, "time": time.time(), **fields}
        if self.enabled:
            assert self.path is not None  # enabled implies a path
            line = json.dumps(record, sort_keys=False, default=str) + "\n"
            with self._lock:
                try:
                    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    try:
                        os.write(fd, line.encode())
                    finally:
                        os.close(fd)
                except OSError as e:
                    if not self.dropped:
                        logger.warning(
                            "event log %s not written (%s): training goes on, events are dropped until it can be",
                            self.path,
                            e.strerror or e,
                        )
                    self.dropped += 1
                else:
                    if self.dropped:
                        logger.warning("event log %s written again; %d event(s) dropped", self.path, self.dropped)
                        self.dropped = 0
        return record


def write_record(path: str, obj: dict[str, Any], what: str) -> bool:
    """Write ``obj`` as JSON to ``path`` in run.dir atomically (a temporary file beside it, named
    by host and pid: run.dir may be shared by the nodes, then renamed over it). Best effort, like
    the event log: a failure leaves no temporary file, warns naming ``what``, returns False."""
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
        return True
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        logger.warning("%s not written to %s (%s)", what, path, e.strerror or e)
        return False


def read_events(path: str, tail_bytes: int | None = None) -> Iterator[dict[str, Any]]:
    """Yield records; a torn last line (writer killed mid-write) is skipped. With ``tail_bytes``,
    only the records that start within the file's last ``tail_bytes`` bytes."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as raw:
        if tail_bytes is not None and raw.seek(0, os.SEEK_END) > tail_bytes:
            raw.seek(-tail_bytes - 1, os.SEEK_END)
            raw.readline()  # the rest of a line that started before the window (or its newline)
        else:
            raw.seek(0)
        for line in raw:
            record = parse_record(line)
            if record is not None:
                yield record


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_record(line: bytes | str) -> dict[str, Any] | None:
    """One line of an event log as a record; None for a blank, torn or damaged line (anything
    but a JSON object with a string ``event``, a numeric ``time`` and an integer or null
    ``step`` where it has them), which every reader skips."""
    line = line.strip()
    if not line:
        return None
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("event"), str):
        return None
    if "time" in record and not _number(record["time"]):
        return None
    step = record.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        return None
    return record
