"""The checkpoint manager: async DCP saves on a cadence, atomic commits, verified resume.

Public surface (all methods that touch collectives must be called on every rank, at the same
step boundary, in the same order):

* :meth:`load` → the step resumed from (or None); decides on rank 0, broadcasts the decision.
* :meth:`save` → starts a save of ``step`` (async by default); waits for the previous one first.
* :meth:`wait_for_staging` → call before anything mutates the saved tensors (optimizer.step).
* :meth:`finish` → waits for the save in flight (optionally with a deadline), commits it.
* :meth:`close`.

The manager never looks inside the ``Stateful`` objects it is given.

Commit protocol. DCP's save ends with a gather of every rank's write results to rank 0, which
then writes ``.metadata``; so when rank 0's upload future resolves successfully, every shard is
written. Rank 0 then lists the step directory and writes ``manifest.json`` (the commit marker)
in one atomic PUT/rename, emits ``checkpoint_committed`` and applies retention. A save whose
future fails is never committed: ``checkpoint_failed`` is emitted and training goes on with
the previous commit as the latest.

DCP reports a failed save or load as ``CheckpointException``, a ``BaseException``: it is
caught explicitly next to ``Exception`` wherever a DCP future or call is awaited.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from ..config import CheckpointConfig
from ..errors import CheckpointError, CheckpointMismatchError
from ..events import EventLog
from ..metrics.sink import MetricsSink, NullSink
from ..storage.fs import Storage
from .. import faults
from . import layout, scan

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    step: int
    started: float
    staging: Future | None
    upload: Future
    commit: Future | None = None  # rank 0 only
    staged_at: float | None = None


@dataclass
class LoadResult:
    step: int
    manifest: dict[str, Any]
    seconds: float
    skipped: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class SaveStats:
    """Per-save timings (seconds) measured on this rank."""

    step: int
    wait_previous: float = 0.0
    call: float = 0.0  # time async_save (or save) blocked the caller
    staging_wait: float = 0.0  # time wait_for_staging blocked the caller

    @property
    def stall(self) -> float:
        return self.wait_previous + self.call + self.staging_wait


class CheckpointManager:
    def __init__(
        self,
        cfg: CheckpointConfig,
        storage: Storage,
        states: dict[str, Stateful],
        *,
        rank: int,
        world_size: int,
        mesh_shape: list[int],
        group: dist.ProcessGroup | None,
        fingerprint: str,
        events: EventLog | None = None,
        metrics: MetricsSink | None = None,
        use_cuda_staging: bool = False,
        async_mode: str = "thread",
        upload_nice: int = 0,
    ):
        self.cfg = cfg
        self.storage = storage
        self.states = states
        self.rank = rank
        self.world_size = world_size
        self.mesh_shape = mesh_shape
        self.group = group
        self.fingerprint = fingerprint
        self.events = events or EventLog(None)
        self.metrics = metrics or NullSink()
        self._inflight: _InFlight | None = None
        self._stager = None
        self._use_cuda_staging = use_cuda_staging
        # Where an async save's upload runs ("thread" or "process": a saver process per rank,
        # spawned by the first save) and the CPU niceness of the thread that writes. Measured
        # side by side in bench/checkpoint_stall.py --modes: neither beat the defaults (BENCHMARKS.md).
        if async_mode not in ("thread", "process"):
            raise ValueError(f"async_mode: expected thread or process, got {async_mode!r}")
        self._async_mode = async_mode
        self._upload_nice = upload_nice
        self._commit_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit") if rank == 0 else None
        self._lock = threading.Lock()
        self.last_committed_step: int | None = None
        self.loaded_step: int | None = None
        self.save_stats: list[SaveStats] = []
        self.failures = 0
        self._committed_steps: set[int] | None = None  # rank 0, known after load()

    # ------------------------------------------------------------------ discovery
    def discover(self) -> list[layout.Candidate]:
        """Every ``step-*`` directory with its manifest (if any) and its files. Rank 0 only."""
        return scan.scan(self.storage)

    def _ignored_entries(self) -> list[str]:
        return scan.ignored_entries(self.storage)

    # ------------------------------------------------------------------ load
    def _broadcast(self, obj: Any) -> Any:
        if self.group is None or self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def load(self) -> LoadResult | None:
        """Resume from the checkpoint ``cfg.resume`` names. All ranks.

        Rank 0 discovers and verifies (falling back past invalid ones with a
        ``checkpoint_skipped`` event), cleans up uncommitted leftovers, and broadcasts the choice.
        Raises CheckpointError when an explicitly requested step is unusable and
        CheckpointMismatchError when the checkpoint belongs to a different model.
        """
        decision: dict[str, Any] = {}
        if self.rank == 0:
            try:
                decision = self._decide_resume()
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                decision = {"error": f"{type(e).__name__}: {e}"}
        decision = self._broadcast(decision)
        if "error" in decision:
            raise CheckpointError(decision["error"])
        if decision.get("mismatch"):
            key, msg = decision["mismatch"]
            raise CheckpointMismatchError(key, msg)
        if decision.get("chosen") is None:
            return None
        step, manifest = decision["chosen"], decision["manifest"]
        path = self.storage.join(layout.step_dir_name(step))
        t0 = time.monotonic()
        faults.maybe_inject("kill_in_load", step)
        try:
            dcp.load(self.states, storage_reader=self.storage.dcp_reader(path), process_group=self.group)
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"loading {path} failed: {type(e).__name__}: {e}") from e
        seconds = time.monotonic() - t0
        self.loaded_step = step
        self.last_committed_step = step
        self.metrics.histogram("elastic_trainer_checkpoint_resume_load_seconds", seconds)
        return LoadResult(step, manifest, seconds, [tuple(s) for s in decision.get("skipped", [])])

    def _decide_resume(self) -> dict[str, Any]:
        candidates = self.discover()
        for name in self._ignored_entries():
            self.events.emit("checkpoint_ignored", path=name, reason="not a step-XXXXXXXX directory")
        sel = layout.select_for_resume(candidates, self.cfg.resume)
        self._committed_steps = {c.step for c in candidates if c.manifest is not None}
        for step, reason in sel.skipped:
            logger.warning("skipping checkpoint step %d: %s", step, reason)
            self.events.emit("checkpoint_skipped", step=step, reason=reason)
        if self.cfg.resume not in ("latest", "none") and sel.chosen is None:
            reason = sel.skipped[0][1] if sel.skipped else "not found"
            return {"error": f"checkpoint.resume={self.cfg.resume}: checkpoint step {self.cfg.resume} is unusable: {reason}"}
        for c in layout.stale_uncommitted(candidates):
            if sel.chosen is None or c.step != sel.chosen.step:
                logger.info("removing uncommitted leftover %s", c.name)
                self.storage.delete_tree(self.storage.join(c.name))
                self.events.emit("checkpoint_cleaned", step=c.step, reason="uncommitted")
        if sel.chosen is None:
            return {"chosen": None, "skipped": sel.skipped}
        manifest = sel.chosen.manifest
        mismatch = None
        if manifest.get("config_fingerprint") != self.fingerprint:
            mismatch = self._find_mismatch(sel.chosen.step)
        return {"chosen": sel.chosen.step, "manifest": manifest, "skipped": sel.skipped, "mismatch": mismatch}

    def _find_mismatch(self, step: int) -> tuple[str, str] | None:
        """Compare the checkpoint's tensor keys and shapes with the model's; the first difference."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from .preflight import compare_shapes

        meta = self.storage.dcp_reader(self.storage.join(layout.step_dir_name(step))).read_metadata()
        saved = {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        ours = {}
        if "model" in self.states:
            for k, v in self.states["model"].state_dict().items():
                if isinstance(v, torch.Tensor):
                    ours[f"model.{k}"] = tuple(v.shape)
        return compare_shapes(saved, ours, step)

    # ------------------------------------------------------------------ save
    def _get_stager(self):
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = self._use_cuda_staging
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    # PROCESS mode pickles the staged state to the saver process: buffers in
                    # shared memory travel as handles instead of being copied on every save.
                    use_shared_memory=self._async_mode == "process",
                    use_async_staging=True,
                    use_non_blocking_copy=cuda,
                )
            )
        return self._stager

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def save(self, step: int, *, blocking: bool = False) -> SaveStats:
        """Start saving ``step``. All ranks. Waits for the previous save first (measured).

        With ``checkpoint.mode = "async"`` this returns once the state is handed to a
        background stager; call :meth:`wait_for_staging` before mutating parameters.
        """
        stats = SaveStats(step)
        t0 = time.monotonic()
        self._finish_inflight(deadline=None)
        stats.wait_previous = time.monotonic() - t0
        self.metrics.histogram("elastic_trainer_checkpoint_wait_previous_seconds", stats.wait_previous)
        path = self.storage.join(layout.step_dir_name(step))
        if self.rank == 0:
            # Never leave an old commit marker over shards about to be replaced. If storage
            # cannot tell, go on: every rank is entering the save's collectives, and a save that
            # completes writes a fresh manifest (one that fails is reported by _commit).
            # After load() rank 0 knows which steps are committed, so the common case costs no
            # storage round trip on the training thread.
            manifest_path = self.storage.join(layout.step_dir_name(step), layout.MANIFEST)
            try:
                known = self._committed_steps
                if (step in known) if known is not None else self.storage.exists(manifest_path):
                    self.storage.delete_tree(path)
                    if known is not None:
                        known.discard(step)
                self.storage.makedirs(path)
            except Exception as e:  # noqa: BLE001 - storage trouble must not stop training
                logger.warning("before saving step %d: %s: %s", step, type(e).__name__, e)
        writer = _without_crc32(self.storage.dcp_writer(path))
        if self._upload_nice and self.cfg.mode != "sync" and isinstance(writer, _NoCrc32Writes):  # never the training thread
            writer.upload_nice = self._upload_nice
        self.metrics.gauge("elastic_trainer_checkpoint_saves_in_flight", 1)
        t1 = time.monotonic()
        if self.cfg.mode == "sync":
            fut: Future = Future()
            try:
                dcp.save(self.states, storage_writer=writer, process_group=self.group)
                fut.set_result(None)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - handled as a failed save
                fut.set_exception(e)
            self._inflight = _InFlight(step, t1, None, fut)
        else:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            kind = AsyncCheckpointerType.PROCESS if self._async_mode == "process" else AsyncCheckpointerType.THREAD
            resp = dcp.async_save(
                self.states, storage_writer=writer, process_group=self.group, async_stager=self._get_stager(), async_checkpointer_type=kind
            )
            staging = getattr(resp, "staging_completion", None)
            upload = getattr(resp, "upload_completion", resp)
            self._inflight = _InFlight(step, t1, staging, upload)
        stats.call = time.monotonic() - t1
        if self.rank == 0 and self._commit_pool is not None:
            inflight = self._inflight
            inflight.commit = Future()

            def on_upload_done(f: Future, inflight: _InFlight = inflight) -> None:
                inner = self._commit_pool.submit(self._commit, inflight)
                inner.add_done_callback(lambda r: _chain(r, inflight.commit))

            inflight.upload.add_done_callback(on_upload_done)
        self.save_stats.append(stats)
        if blocking:
            self.wait_for_staging()
            self._finish_inflight(deadline=None)
        return stats

    def wait_for_staging(self) -> float:
        """Block until the in-flight save has copied the state out. Returns the seconds waited."""
        inf = self._inflight
        if inf is None or inf.staging is None or inf.staged_at is not None:
            return 0.0
        t0 = time.monotonic()
        try:
            inf.staging.result()
        except (Exception, CheckpointException):  # noqa: BLE001 - the upload future carries the same failure
            logger.exception("staging of step %d failed", inf.step)
        waited = time.monotonic() - t0
        inf.staged_at = time.monotonic()
        if self.save_stats and self.save_stats[-1].step == inf.step:
            self.save_stats[-1].staging_wait += waited
            self.metrics.histogram("elastic_trainer_checkpoint_stall_seconds", self.save_stats[-1].stall)
        return waited

    def _commit(self, inf: _InFlight) -> bool:
        """Rank 0, background thread: write the manifest if the upload succeeded."""
        duration = time.monotonic() - inf.started
        exc = inf.upload.exception()
        if exc is not None:
            self.failures += 1
            logger.error("checkpoint step %d failed, not committed: %s: %s", inf.step, type(exc).__name__, exc)
            self.events.emit("checkpoint_failed", step=inf.step, error=f"{type(exc).__name__}: {exc}"[:2000], seconds=duration)
            self.metrics.counter("elastic_trainer_checkpoint_save_failures_total")
            return False
        name = layout.step_dir_name(inf.step)
        faults.maybe_inject("kill_before_commit", inf.step)
        try:
            files = self.storage.list_files(self.storage.join(name))
            files.pop(layout.MANIFEST, None)
            manifest = layout.build_manifest(
                step=inf.step,
                world_size=self.world_size,
                mesh_shape=self.mesh_shape,
                files=files,
                created=time.time(),
                torch_version=torch.__version__,
                fingerprint=self.fingerprint,
            )
            self.storage.write_json_atomic(self.storage.join(name, layout.MANIFEST), manifest)
        except Exception as e:  # noqa: BLE001 - a failed commit is a failed save
            self.failures += 1
            logger.error("commit of step %d failed: %s", inf.step, e)
            self.events.emit("checkpoint_failed", step=inf.step, error=f"commit: {type(e).__name__}: {e}"[:2000], seconds=duration)
            self.metrics.counter("elastic_trainer_checkpoint_save_failures_total")
            return False
        duration = time.monotonic() - inf.started
        self.last_committed_step = inf.step
        if self._committed_steps is not None:
            self._committed_steps.add(inf.step)
        self.events.emit("checkpoint_committed", step=inf.step, bytes=manifest["total_bytes"], seconds=round(duration, 4), world_size=self.world_size)
        self.metrics.histogram("elastic_trainer_checkpoint_save_duration_seconds", duration)
        self.metrics.counter("elastic_trainer_checkpoint_written_bytes_total", manifest["total_bytes"])
        self.metrics.gauge("elastic_trainer_checkpoint_last_committed_step", inf.step)
        self.metrics.gauge("elastic_trainer_checkpoint_last_commit_timestamp_seconds", manifest["time"])
        self._apply_retention()
        return True

    def _apply_retention(self) -> None:
        try:
            candidates = self.discover()
            committed = [c.step for c in candidates if c.manifest is not None]
            protected = {self.last_committed_step} if self.last_committed_step is not None else set()
            for step in layout.retention_victims(committed, self.cfg.keep_last, self.cfg.keep_every, protected):
                self.storage.delete_tree(self.storage.join(layout.step_dir_name(step)))
                if self._committed_steps is not None:
                    self._committed_steps.discard(step)
                self.events.emit("checkpoint_deleted", step=step, reason="retention")
        except Exception as e:  # noqa: BLE001 - retention is best effort
            logger.warning("retention failed: %s", e)

    def _finish_inflight(self, deadline: float | None) -> bool:
        """Wait for the in-flight save (and, on rank 0, its commit). True if it committed
        (rank 0) / succeeded (other ranks). ``deadline`` is a ``time.monotonic()`` value."""
        inf = self._inflight
        if inf is None:
            return True
        self.wait_for_staging()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ok = True
        try:
            inf.upload.result(timeout=timeout)
            if inf.commit is not None:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                ok = bool(inf.commit.result(timeout=timeout))
        except TimeoutError:
            raise
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - recorded by _commit on rank 0
            if self.rank != 0:
                logger.warning("checkpoint step %d failed on this rank: %s", inf.step, e)
            ok = False
        self._inflight = None
        self.metrics.gauge("elastic_trainer_checkpoint_saves_in_flight", 0)
        return ok

    def finish(self, timeout: float | None = None) -> bool:
        """Wait for the save in flight to be written and committed. Raises TimeoutError past
        ``timeout`` seconds (the save is then abandoned uncommitted)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._finish_inflight(deadline)

    def drain_on_failure(self, timeout: float) -> bool:
        """Exception path: start nothing, but give a save that is already uploading up to
        ``timeout`` seconds to finish (and, on rank 0, to commit). Never raises."""
        inf = self._inflight
        if inf is None:
            return False
        try:
            deadline = time.monotonic() + timeout
            inf.upload.result(timeout=timeout)
            if inf.commit is not None:
                return bool(inf.commit.result(timeout=max(0.0, deadline - time.monotonic())))
            return True
        except BaseException:  # noqa: BLE001 - best effort by design
            return False

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._commit_pool is not None:
            self._commit_pool.shutdown(wait=True)


class _NoCrc32Writes:
    """Mixin for DCP storage writers: ``write_data`` serialises without the zip CRC32s nobody reads.

    DCP writes every tensor with ``torch.save``, whose zip writer computes a CRC32 of the data.
    Measured on 2 CPUs (2 ranks, 556 MB shard each, 8 interleaved saves): 0.81 CPU-seconds per
    rank with it, 0.46 without, CPU an async save's upload takes from training. Neither ``torch.load`` nor DCP's reader
    verifies it (a shard's integrity check is the manifest's sizes). The switch is
    process-wide, so it is off only while this writer writes, in the save's own thread; the
    training thread does not ``torch.save`` meanwhile. A real subclass (not a patched bound
    method) so that the writer survives pickling to PROCESS-mode ``async_save``'s saver process.
    """

    upload_nice = 0  # > 0: lower the CPU priority of the thread that writes (experiment knob)

    def write_data(self, plan, planner):
        if self.upload_nice > 0:
            import os

            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.upload_nice)
            except OSError:  # pragma: no cover - best effort
                pass
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            return super().write_data(plan, planner)
        finally:
            torch.serialization.set_crc32_options(previous)


def _no_crc32_class(base: type) -> type | None:
    from torch.distributed.checkpoint import FileSystemWriter

    if base is FileSystemWriter:
        return _NoCrc32FileSystemWriter
    try:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    except ImportError:  # pragma: no cover - fsspec missing
        return None
    if base is FsspecWriter:
        return _NoCrc32FsspecWriter
    return None


def _without_crc32(writer):
    """A copy of ``writer`` (same attributes) of the no-CRC32 subclass (see ``_NoCrc32Writes``).
    Other writer types are returned unchanged."""
    cls = _no_crc32_class(type(writer))
    if cls is None:
        return writer
    new = cls.__new__(cls)
    new.__dict__.update(writer.__dict__)
    return new


from torch.distributed.checkpoint import FileSystemWriter as _FileSystemWriter  # noqa: E402


class _NoCrc32FileSystemWriter(_NoCrc32Writes, _FileSystemWriter):
    pass


try:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as _FsspecWriter

    class _NoCrc32FsspecWriter(_NoCrc32Writes, _FsspecWriter):
        pass

except ImportError:  # pragma: no cover - fsspec missing
    _NoCrc32FsspecWriter = None  # type: ignore[assignment,misc]


def _chain(src: Future, dst: Future | None) -> None:
    if dst is None or dst.done():
        return
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())
