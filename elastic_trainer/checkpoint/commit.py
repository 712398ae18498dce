"""Rank 0's commit of checkpoint.dir saves, on its commit thread.

Once a rank's bytes of a save are written (:meth:`Committer.written`, on the upload thread),
rank 0 proves every rank's files complete through the :class:`~.catalog.Catalog`, writes the
manifest and applies retention (:meth:`Committer.commit`, on its own thread); the other ranks'
part ends there (WRITTEN). The committer also keeps what rank 0 knows that the commit thread
changes: the newest commit, whether a newer launch fenced ours, and which load the current
state came from (a commit of a save from before a load changes nothing), under one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .. import faults
from ..errors import FencedError
from . import failure
from .catalog import Catalog
from .save import Save, SaveContext, SaveState

logger = logging.getLogger(__name__)


class Committer:
    """``catalog``: rank 0's (None on the other ranks: their part ends once written);
    ``keep_last``/``keep_every``: retention."""

    def __init__(self, catalog: Catalog | None, ctx: SaveContext, *, keep_last: int, keep_every: int):
        self.catalog = catalog
        self.ctx = ctx
        self.keep = (keep_last, keep_every)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit") if catalog is not None else None
        self._marks_off = False  # see _mark_writer
        self._lock = threading.Lock()
        self._last_committed: int | None = None
        self._fenced: str | None = None
        self.generation = 0  # +1 at every load: a commit of a save from before it changes nothing

    @property
    def last_committed(self) -> int | None:
        with self._lock:
            return self._last_committed

    @property
    def fenced(self) -> str | None:
        with self._lock:
            return self._fenced

    def committed(self, step: int) -> bool:
        """Whether ``step`` is the newest commit and no newer launch fenced ours."""
        with self._lock:
            return self._last_committed == step and self._fenced is None

    def loaded(self, committed: int | None) -> None:
        """A load replaced the state: ``committed`` is the newest commit it knows of."""
        with self._lock:
            self.generation += 1
            self._last_committed = committed

    def set_fenced(self, why: str, step: int) -> None:
        with self._lock:
            self._fenced = why
        logger.error("%s", why)
        self.ctx.events.emit("checkpoint_fenced", step=step, error=why)

    def mark_writer(self, name: str) -> None:
        """Rank 0: mark ``name`` with this epoch, on the commit thread (before its commit)."""
        if self.pool is not None:
            self.pool.submit(self._mark_writer, name)

    def _mark_writer(self, name: str) -> None:
        """Best effort (the marker only refines cleanup): skipped once the manager closes, or
        after a mark failed for a cause no retry changes (a full disk), so neither the commits
        queued behind it nor the exit wait for its futile retries."""
        if self._marks_off:
            return
        try:
            assert self.catalog is not None  # rank 0 (its pool runs this)
            self.catalog.mark_writer(name)
        except Exception as e:  # noqa: BLE001 - the marker only refines cleanup; the save goes on
            logger.warning("could not mark %s with this epoch: %s", name, e)
            if failure.permanent(e):
                self._marks_off = True

    def written(self, save: Save, written: Future, extra: dict[str, Any], generation: int) -> None:
        """Upload thread: this rank's checkpoint.dir bytes are written (or failed). Rank 0 goes on
        to commit on its commit thread; an abandoned save goes nowhere."""
        save.staged()
        exc = written.exception()
        error = ""
        if exc is not None:
            error, save.permanent = failure.describe(exc), failure.permanent(exc)
            logger.error("checkpoint step %d: writing failed", save.step, exc_info=exc)
        if self.catalog is None:
            save.advance(SaveState.FAILED if exc is not None else SaveState.WRITTEN, error=error)
        elif exc is not None:
            if save.state is not SaveState.ABANDONED:  # reported before the state moves: a waiter then sees the event
                self.report_failure(save, error)
            save.advance(SaveState.FAILED, error=error)
        elif save.advance(SaveState.COMMITTING):
            assert self.pool is not None  # rank 0 (it has a catalog)
            try:
                self.pool.submit(self.commit, save, extra, generation)
            except RuntimeError:  # the manager closed (the process is ending) while this upload ran on
                save.advance(SaveState.FAILED, error="not committed: the checkpoint manager closed before it")

    def commit(self, save: Save, extra: dict[str, Any], generation: int) -> None:
        """Rank 0, commit thread: prove the save complete and commit it, then retention."""
        faults.maybe_inject("kill_before_commit", save.step)
        try:
            assert self.catalog is not None and save.name is not None  # rank 0, a save to checkpoint.dir
            manifest = self.catalog.commit(
                save.name,
                step=save.step,
                world_size=self.ctx.world_size,
                mesh_shape=self.ctx.mesh_shape,
                fingerprint=self.ctx.fingerprint,
                torch_version=torch.__version__,
                extra=extra,
            )
        except FencedError as e:
            self.set_fenced(str(e), save.step)
            save.advance(SaveState.FENCED, error=str(e))
            return
        except Exception as e:  # a failed commit is a failed save
            error, save.permanent = f"commit: {failure.describe(e)}", failure.permanent(e)
            logger.error("checkpoint step %d: commit failed", save.step, exc_info=e)
            self.report_failure(save, error)
            save.advance(SaveState.FAILED, error=error)
            return
        duration = time.monotonic() - save.started
        with self._lock:
            if generation == self.generation:  # else a load replaced the state since this save began
                self._last_committed = save.step
        logger.debug(
            "checkpoint step %d committed: %d bytes in %.2fs (%s)",
            save.step,
            manifest["total_bytes"],
            duration,
            save.name,
        )
        self.ctx.events.emit(
            "checkpoint_committed",
            step=save.step,
            name=save.name,
            bytes=manifest["total_bytes"],
            seconds=round(duration, 4),
            world_size=self.ctx.world_size,
        )
        self.ctx.metrics.histogram("elastic_trainer_checkpoint_save_duration_seconds", duration)
        self.ctx.metrics.counter("elastic_trainer_checkpoint_written_bytes_total", manifest["total_bytes"])
        self.ctx.metrics.gauge("elastic_trainer_checkpoint_last_committed_step", save.step)
        self.ctx.metrics.gauge("elastic_trainer_checkpoint_last_commit_timestamp_seconds", manifest["time"])
        try:
            self.catalog.pruner.retention(save.name, *self.keep)
        except FencedError as e:
            self.set_fenced(str(e), save.step)
        except Exception as e:  # noqa: BLE001 - retention is best effort
            logger.warning("retention failed: %s", e)
        save.advance(SaveState.COMMITTED, manifest=manifest)

    def report_failure(self, save: Save, error: str) -> None:
        logger.error("checkpoint step %d failed, not committed: %s", save.step, error)
        self.ctx.events.emit(
            "checkpoint_failed", step=save.step, error=error[:2000], seconds=round(time.monotonic() - save.started, 4)
        )
        self.ctx.metrics.counter("elastic_trainer_checkpoint_save_failures_total")

    def close(self) -> None:
        if self.pool is not None:
            self._marks_off = True
            self.pool.shutdown(wait=True)
