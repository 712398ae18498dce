"""The savers: what writes a save's bytes, given to the manager (tests give it fakes).

Every saver implements :class:`Saver`: ``start`` begins writing one :class:`~.save.Save` and
returns :class:`Started` (``staging`` resolves once the state is copied out of the training
tensors, None when the call itself copied it, a synchronous save; ``done`` once the saver's part
has ended), never raising: a save that cannot start is a ``done`` that failed. ``healthy`` says
whether the next save can be written; ``reset`` puts the saver back in a known state after one of
its saves failed; ``close`` stops it.

* :class:`RemoteSaver` (the thread writer) and :class:`ProcessWriterSaver` (the process writer):
  a checkpoint.dir directory through DCP (``dcp.save``, on an upload thread kept between saves
  when async, or ``dcp.async_save`` on a writer process per rank, see :mod:`.writer_process`),
  with the checksummed writer, a background stager and the plan cache. ``done`` resolves once
  this rank's bytes are written (its exception: why not); rank 0's commit is the manager's. The
  process writer's policy is its saver's (:meth:`ProcessWriterSaver.check`).
* :class:`LocalSaver`: this rank's copy in the local tier (``checkpoint.local_dir``), no
  collectives. It commits its own copy: ``done`` resolves to whether the copy was committed.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast, runtime_checkable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from .. import collectives
from ..events import EventLog
from ..storage.fs import Storage
from . import failure, integrity, save_planner, writer_process
from .agreement import Agreement
from .local_tier import LocalTier
from .save import Save, SaveContext

if TYPE_CHECKING:
    from .staging import KeptStager

logger = logging.getLogger(__name__)


class Started(NamedTuple):
    """A save a saver started: ``staging`` (None: already copied out) and ``done``."""

    staging: Future | None
    done: Future


@runtime_checkable
class Saver(Protocol):
    """What writes a save's bytes (see the module's docstring)."""

    def start(self, save: Save, states: dict[str, Stateful], manifest: dict[str, Any]) -> Started: ...

    def healthy(self) -> bool: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


def staging_options(*, cuda: bool, shared_memory: bool):
    """How a save's stager copies the state out (pure; one mechanism for CPU and GPU): always in
    the background, into a staged copy it keeps for the next save (:mod:`.staging`). CUDA tensors go device → pinned
    host memory with non-blocking copies (pinned memory and non-blocking copies need an
    accelerator); ``shared_memory`` (the process writer): buffers in shared memory, handed to
    the writer process as handles instead of being copied on every save (on CUDA: pinned too)."""
    from torch.distributed.checkpoint.staging import StagingOptions

    return StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=shared_memory, use_async_staging=True, use_non_blocking_copy=cuda
    )


def _state_dicts(states: dict[str, Stateful]) -> dict[str, Any]:
    """What DCP's save takes of ``states``: each ``Stateful``'s state dict."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in states.items()}


def _failed(e: BaseException) -> Started:
    f: Future = Future()
    f.set_exception(e)
    return Started(None, f)


def _done(result: Any = None) -> Started:
    f: Future = Future()
    f.set_result(result)
    return Started(None, f)


class _Uploads:
    """The thread an async save writes on, kept from one save to the next (DCP's ``async_save``
    starts a thread per save, and the save call waits for it to start). A save started while the
    previous upload still runs (an abandoned or stuck one) gets a thread of its own, as with DCP,
    so it never queues behind it."""

    def __init__(self, name: str):
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future | None = None

    def start(self, states: dict[str, Stateful], stager, save) -> Started:
        """``dcp.async_save``'s thread path: the states' state dicts are taken on the calling
        thread and handed to ``stager``; ``save(staged)`` runs on the upload thread once staged.
        Returns (staging, written)."""
        state_dict = _state_dicts(states)
        staging = stager.stage(state_dict)  # a future: the stager copies in the background

        def upload():
            return save(staging.result())

        if self._last is None or self._last.done():
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix=self._name)
            self._last = self._pool.submit(upload)
            return Started(staging, self._last)
        own = ThreadPoolExecutor(1, thread_name_prefix=self._name)
        written = own.submit(upload)
        written.add_done_callback(lambda _f: own.shutdown(wait=False))
        return Started(staging, written)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._pool = self._last = None


class _Staged:
    """A stager made on first use and kept: it keeps its staged copy of the state from one save
    to the next and copies the bytes into it (:mod:`.staging`)."""

    def __init__(self, cuda: bool, shared_memory: bool):
        self._options = (cuda, shared_memory)
        self._stager: KeptStager | None = None

    def get(self):
        if self._stager is None:
            from .staging import KeptStager

            cuda, shared_memory = self._options
            self._stager = KeptStager(
                staging_options(cuda=cuda, shared_memory=shared_memory), for_writer_process=shared_memory
            )
        return self._stager

    def out_of_shared_memory(self) -> bool:
        return self._stager is not None and self._stager.out_of_shared_memory

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
        self._stager = None


def remote_saver(
    storage: Storage,
    group: dist.ProcessGroup | None,
    *,
    mode: str = "async",
    writer: str = "thread",
    cuda_staging: bool = False,
    upload_nice: int = 0,
) -> RemoteSaver:
    """The checkpoint.dir saver for ``checkpoint.mode``/``checkpoint.writer``: the process
    writer for async saves with ``writer = "process"``, else the thread writer."""
    if writer not in ("thread", "process"):
        raise ValueError(f"checkpoint.writer: expected thread or process, got {writer!r}")
    if writer == "process" and mode != "sync":
        return ProcessWriterSaver(storage, group, cuda_staging=cuda_staging, upload_nice=upload_nice)
    return RemoteSaver(storage, group, mode=mode, cuda_staging=cuda_staging, upload_nice=upload_nice)


class RemoteSaver:
    """The thread writer, every rank: DCP saves into checkpoint.dir directories, on an upload
    thread kept between saves (``mode = "sync"``: on the calling thread). ``upload_nice``: the
    CPU niceness of the writing thread (never the training thread)."""

    uses_writer_process = False

    def __init__(
        self,
        storage: Storage,
        group: dist.ProcessGroup | None,
        *,
        mode: str = "async",
        cuda_staging: bool = False,
        upload_nice: int = 0,
        shared_memory: bool = False,
    ):
        self.storage = storage
        self.group = group
        self.sync = mode == "sync"
        self._upload_nice = upload_nice
        self._cuda_staging = cuda_staging
        self._stager = _Staged(cuda_staging, shared_memory=shared_memory)
        self._uploads = _Uploads("et-upload")
        self._plan_key = save_planner.new_key()  # DCP plan cache of these saves

    def _writer_and_planner(self, name: str):
        writer = integrity.ChecksummedWriter(
            self.storage.dcp.writer(self.storage.join(name)), upload_nice=0 if self.sync else self._upload_nice
        )
        return writer, save_planner.make(self._plan_key)

    def start(self, save: Save, states: dict[str, Stateful], manifest: dict[str, Any]) -> Started:
        """This rank's bytes of ``save`` into its checkpoint.dir directory (``manifest`` is rank
        0's commit's, not the saver's)."""
        try:
            assert save.name is not None  # a save to checkpoint.dir
            writer, planner = self._writer_and_planner(save.name)
            group = collectives.dcp_group(self.group)
            if self.sync:
                dcp.save(states, storage_writer=writer, planner=planner, **group)
                return _done()
            return self._uploads.start(
                states,
                self._stager.get(),
                lambda staged: dcp.save(staged, storage_writer=writer, planner=planner, **group),
            )
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a save that cannot start is a failed save
            return _failed(e)

    def healthy(self) -> bool:
        return True

    def reset(self) -> None:
        """After a failed save: the ranks' plan caches may be out of step; plan the next afresh."""
        save_planner.forget(self._plan_key)

    def close(self) -> None:
        save_planner.forget(self._plan_key)
        self._uploads.close()
        self._stager.close()


class ProcessWriterSaver(RemoteSaver):
    """The process writer (``checkpoint.writer = "process"``, async), every rank: ``dcp.async_save``
    on a persistent writer process per rank (:mod:`.writer_process`), staged in shared memory.
    Owns the writers' policy: before a save the ranks agree that every writer is usable, and
    replace them all together when one is not (:meth:`check`); when a rank's state does not fit
    in shared memory, every rank falls back to the thread writer for good."""

    def __init__(
        self, storage: Storage, group: dist.ProcessGroup | None, *, cuda_staging: bool = False, upload_nice: int = 0
    ):
        super().__init__(storage, group, cuda_staging=cuda_staging, upload_nice=upload_nice, shared_memory=True)
        self.uses_writer_process = True  # False once every rank fell back to the thread writer
        self._writer_failed = False  # a save failed: check (and restart) the writers before the next

    def start(self, save: Save, states: dict[str, Stateful], manifest: dict[str, Any]) -> Started:
        if not self.uses_writer_process:
            return super().start(save, states, manifest)
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

        try:
            assert save.name is not None  # a save to checkpoint.dir
            writer, planner = self._writer_and_planner(save.name)
            writer_process.wait_started()
            resp = cast(  # a response, not a Future: the kept stager stages in the background
                AsyncSaveResponse,
                dcp.async_save(
                    states,
                    storage_writer=writer,
                    process_group=self.group,
                    async_stager=self._stager.get(),
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                    planner=planner,
                ),
            )
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a save that cannot start is a failed save
            return _failed(e)
        return Started(resp.staging_completion, resp.upload_completion)

    def healthy(self) -> bool:
        """This rank's writer process is usable (always, once fallen back): alive, and no save of
        it failed since the writers were last checked."""
        return not self.uses_writer_process or (writer_process.healthy() and not self._writer_failed)

    def reset(self) -> None:
        """After a failed save: plan the next afresh, and check the writers before it."""
        super().reset()
        self._writer_failed = self.uses_writer_process

    def start_writers(self) -> None:
        """Every rank together, before the first save: start the writer processes now (in the
        background) instead of at that save. A start that cannot begin is left to the save."""
        if not self.uses_writer_process:
            return
        try:
            writer_process.prestart(self.group)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank gets DCP's exchange's error
            logger.warning("the checkpoint writer processes start at the first save instead: %s", e)

    def check(self, agreement: Agreement, *, stuck: Save | None, doomed: bool, events: EventLog | None) -> bool:
        """Process writer, every rank, before a save: agree that every rank's writer process is
        usable. If one died or failed a save, or ``stuck`` (the previous save) is still writing
        past its deadline, stop the writers on every rank (the next save starts new ones
        together). If a rank's state did not fit in shared memory, new writers would fail the same
        way: every rank writes with the thread writer from then on (``checkpoint_writer_fallback``).
        ``doomed``: the save in flight already failed on some rank (agreed), and the ranks still
        writing it are stopped at once. ``events``: rank 0's. True when every writer was usable;
        False when they were stopped: the save in flight then fails (wait for it to say so)."""
        if agreement.all_true(self.healthy() and stuck is None):
            return True
        if not agreement.all_true(not (self.uses_writer_process and self._stager.out_of_shared_memory())):
            why = "a rank's state does not fit in the node's shared memory (/dev/shm)"
            logger.error('checkpoint.writer = "process": %s; writing with the thread writer from now on', why)
            if events is not None:
                events.emit("checkpoint_writer_fallback", writer="thread", reason=why)
            self._use_thread_writer()
        else:
            why = (
                "a save that failed on another rank was still being written"
                if doomed
                else "still writing past its deadline"
                if stuck is not None
                else "a writer process died or failed a save"
            )
            logger.warning("restarting the checkpoint writer processes: %s", why)
            if events is not None:
                events.emit("checkpoint_writer_restarted", reason=why, step=stuck.step if stuck else None)
            writer_process.stop()
            save_planner.forget(self._plan_key)
        self._writer_failed = False
        return False

    def _use_thread_writer(self) -> None:
        """Every rank together: stop the writer processes and write every later async save on the
        upload thread, staged in ordinary memory (the process writer cannot stage the state)."""
        writer_process.stop()
        self.uses_writer_process = False
        self._stager.close()
        self._stager = _Staged(self._cuda_staging, shared_memory=False)
        save_planner.forget(self._plan_key)

    def close(self) -> None:
        if self.uses_writer_process:
            writer_process.stop()
        super().close()


class LocalSaver:
    """This rank's copies in the local tier, with their own stager (the checkpoint.dir upload of
    the same step may still be reading the other one's buffers). Commits each copy itself
    (:meth:`commit`): best effort, checkpoint.dir is the record."""

    def __init__(self, tier: LocalTier, ctx: SaveContext, *, mode: str = "async", cuda_staging: bool = False):
        self.tier = tier
        self.ctx = ctx
        self.sync = mode == "sync"
        self._stager = _Staged(cuda_staging, shared_memory=False)
        self._uploads = _Uploads("et-local-upload")
        self._copier = integrity.RawCopier()
        self._failing = False  # the last copy failed: the next failure's traceback is not logged again

    def start(self, save: Save, states: dict[str, Stateful], manifest: dict[str, Any]) -> Started:
        """This rank's copy of ``save`` (named by its epoch and step), committed with ``manifest``
        once written: ``done`` resolves to whether it was. No collectives."""
        done: Future = Future()
        try:
            path = self.tier.prepare(save.epoch, save.step)
            if self.sync:
                started = _done(self._copier.save(_state_dicts(states), path))
            else:
                copy = self._copier.save
                started = self._uploads.start(states, self._stager.get(), lambda staged: copy(staged, path))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - as a failed local copy
            started = _failed(e)
        started.done.add_done_callback(lambda f: done.set_result(self.commit(save, f, manifest)))
        return Started(started.staging, done)

    def commit(self, save: Save, written: Future, manifest: dict[str, Any]) -> bool:
        """Upload thread: commit this rank's copy of ``save`` once ``written`` (its result: the
        files the copier wrote). Never raises."""
        try:
            exc = written.exception()
            if exc is not None:
                raise exc
            sealed = self.tier.commit(
                save.epoch,
                save.step,
                mesh_shape=self.ctx.mesh_shape,
                fingerprint=self.ctx.fingerprint,
                torch_version=torch.__version__,
                extra=manifest,
                written=written.result(),
            )
        except BaseException as e:  # noqa: BLE001 - the local tier is best effort; checkpoint.dir is the record
            self._failed(save, e)
            return False
        self._failing = False
        self.ctx.metrics.counter("elastic_trainer_checkpoint_local_saves_total")
        if self.ctx.rank == 0:
            self.ctx.events.emit(
                "checkpoint_local_saved",
                step=save.step,
                bytes=sealed["total_bytes"],
                seconds=round(time.monotonic() - save.started, 4),
            )
        return True

    def _failed(self, save: Save, e: BaseException) -> None:
        """A copy that failed: its attempt removed (:meth:`.LocalTier.abandon`), its cause on one
        line (log, rank 0's event), the traceback in the log at the first failure of a run of them
        (a full disk fails every save)."""
        error = failure.describe(e)
        self.tier.abandon(save.epoch, save.step)
        logger.warning(
            "local copy of step %d failed on this rank: %s", save.step, error, exc_info=None if self._failing else e
        )
        self._failing = True
        self.ctx.metrics.counter("elastic_trainer_checkpoint_local_save_failures_total")
        if self.ctx.rank == 0:
            seconds = round(time.monotonic() - save.started, 4)
            self.ctx.events.emit("checkpoint_local_failed", step=save.step, error=error, seconds=seconds)

    def healthy(self) -> bool:
        return True

    def reset(self) -> None:
        """Nothing to reset: every copy has a writer and a stager buffer of its own step."""

    def close(self) -> None:
        self._uploads.close()
        self._stager.close()
