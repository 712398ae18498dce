"""Did the failed generation move the job forward? The supervisor's evidence for the restart
back-off (:func:`.policy.failure_streak`): a new commit in ``checkpoint.dir`` since the previous
failure restart means the job is making progress between failures, not crash-looping, so its
next restart is not delayed.

Every node reads the same storage, so every node reaches the same answer (unlike the event log,
which only rank 0's node has). Reads are bounded: one that does not answer within ``timeout``
counts as "no evidence", which keeps the back-off as it was.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..storage.fs import Storage

logger = logging.getLogger(__name__)

PROBE_SECONDS = 5.0
NOTHING = -1  # "no commit yet": older than any step


class CommitWatch:
    """Compares the newest committed step at a failure restart with the one after the previous.

    ``read`` returns the newest committed step (``None``: nothing committed). After a failure
    restart has stopped the failed generation, :meth:`note` records the newest commit in the
    background (the recovery does not wait for storage); at a failure restart that would be
    backed off, :meth:`progressed` reads it (bounded) and says whether it is newer than the one
    recorded. A read still running when the next one is due counts as no evidence. The agent's
    thread calls both; the background read hands its result over under a lock."""

    def __init__(self, read: Callable[[], int | None], timeout: float = PROBE_SECONDS) -> None:
        self._read = read
        self.timeout = timeout
        self._lock = threading.Lock()
        self._last: int | None = None  # newest committed step as last read (NOTHING: none yet); None: unknown
        self._pending: threading.Thread | None = None

    def note(self) -> None:
        """Record the newest commit in the background (the baseline of the next :meth:`progressed`)."""
        self._start_read()

    def progressed(self) -> bool:
        """True when a step newer than the recorded one is committed now (bounded by ``timeout``)."""
        with self._lock:
            before = self._last
        t = self._start_read()
        if t is None:
            return False
        t.join(self.timeout)
        if t.is_alive():
            logger.warning("reading the newest commit took over %.0f s; backing off as for a crash loop", self.timeout)
            return False
        with self._lock:
            now = self._last
        return before is not None and now is not None and now > before

    def _start_read(self) -> threading.Thread | None:
        if self._pending is not None and self._pending.is_alive():
            return None  # the previous read still hangs: no evidence, and no second thread

        def run() -> None:
            try:
                step = self._read()
            except Exception as e:  # noqa: BLE001 - storage trouble is "no evidence", never a supervisor failure
                logger.warning("could not read the newest commit for the restart back-off: %s", e)
                with self._lock:
                    self._last = None
                return
            with self._lock:
                self._last = NOTHING if step is None else step

        t = threading.Thread(target=run, name="elastic-trainer-commit-watch", daemon=True)
        self._pending = t
        t.start()
        return t


def newest_commit_reader(storage: Storage) -> Callable[[], int | None]:
    """``read`` for :class:`CommitWatch` over ``storage`` (the opened ``checkpoint.dir``): the
    newest step whose directory lists a commit marker and no quarantine. Listings only: it runs
    while the workers restart, and reads no object the restart may be waiting for on a slow store."""
    from ..checkpoint import layout
    from ..checkpoint.catalog import Catalog

    def read() -> int | None:
        _, newest, _ = Catalog(storage).names()
        return None if newest is None else layout.parse_step_dir(newest)

    return read
