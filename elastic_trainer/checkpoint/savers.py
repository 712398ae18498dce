"""The savers: what writes a save's bytes, given to the manager (tests give it fakes).

A saver's ``start`` begins writing and returns ``(staging, written)``: ``staging`` resolves once
the state is copied out of the training tensors (None: the call itself copied it, a synchronous
save), ``written`` once this rank's bytes are written (its exception: why not). ``start`` never
raises: a save that cannot start is a ``written`` future that failed.

* :class:`RemoteSaver`: a checkpoint.dir directory through DCP (``dcp.save``, on an upload
  thread kept between saves when async, or ``dcp.async_save`` on a writer process per rank, see
  :mod:`.writer_process`),
  with the checksummed writer, a background stager and the plan cache.
* :class:`LocalSaver`: this rank's copy in the local tier (``checkpoint.local_dir``), no
  collectives.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from ..storage.fs import Storage
from . import integrity, save_planner, writer_process
from .local_tier import LocalTier

logger = logging.getLogger(__name__)


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


def _failed(e: BaseException) -> tuple[None, Future]:
    f: Future = Future()
    f.set_exception(e)
    return None, f


class _Uploads:
    """The thread an async save writes on, kept from one save to the next (DCP's ``async_save``
    starts a thread per save, and the save call waits for it to start). A save started while the
    previous upload still runs (an abandoned or stuck one) gets a thread of its own, as with DCP,
    so it never queues behind it."""

    def __init__(self, name: str):
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future | None = None

    def start(self, states: dict[str, Stateful], stager, save) -> tuple[Future, Future]:
        """``dcp.async_save``'s thread path: the states' state dicts are taken on the calling
        thread and handed to ``stager``; ``save(staged)`` runs on the upload thread once staged.
        Returns (staging, written)."""
        state_dict = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in states.items()}
        staging = stager.stage(state_dict)  # a future: the stager copies in the background

        def upload():
            return save(staging.result())

        if self._last is None or self._last.done():
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix=self._name)
            self._last = self._pool.submit(upload)
            return staging, self._last
        own = ThreadPoolExecutor(1, thread_name_prefix=self._name)
        written = own.submit(upload)
        written.add_done_callback(lambda _f: own.shutdown(wait=False))
        return staging, written

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._pool = self._last = None


class _Staged:
    """A stager made on first use and kept: it keeps its staged copy of the state from one save
    to the next and copies the bytes into it (:mod:`.staging`)."""

    def __init__(self, cuda: bool, shared_memory: bool):
        self._options = (cuda, shared_memory)
        self._stager = None

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


class RemoteSaver:
    """Every rank: DCP saves into checkpoint.dir directories. ``mode``: ``checkpoint.mode``
    (sync / async); ``writer``: ``checkpoint.writer`` (thread / process); ``upload_nice``: the
    CPU niceness of the writing thread (never the training thread)."""

    def __init__(
        self,
        storage: Storage,
        group: dist.ProcessGroup | None,
        *,
        mode: str = "async",
        writer: str = "thread",
        cuda_staging: bool = False,
        upload_nice: int = 0,
    ):
        if writer not in ("thread", "process"):
            raise ValueError(f"checkpoint.writer: expected thread or process, got {writer!r}")
        self.storage = storage
        self.group = group
        self.sync = mode == "sync"
        self.uses_writer_process = writer == "process" and not self.sync
        self._upload_nice = upload_nice
        self._cuda_staging = cuda_staging
        self._stager = _Staged(cuda_staging, shared_memory=writer == "process")
        self._uploads = _Uploads("et-upload")
        self._plan_key = save_planner.new_key()  # DCP plan cache of these saves

    def start(self, states: dict[str, Stateful], name: str) -> tuple[Future | None, Future]:
        try:
            writer = integrity.ChecksummedWriter(
                self.storage.dcp_writer(self.storage.join(name)), upload_nice=0 if self.sync else self._upload_nice
            )
            planner = save_planner.make(self._plan_key)
            if self.sync:
                dcp.save(states, storage_writer=writer, process_group=self.group, planner=planner)
                done: Future = Future()
                done.set_result(None)
                return None, done
            if not self.uses_writer_process:
                return self._uploads.start(
                    states,
                    self._stager.get(),
                    lambda staged: dcp.save(staged, storage_writer=writer, process_group=self.group, planner=planner),
                )
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            writer_process.wait_started()
            resp = dcp.async_save(
                states,
                storage_writer=writer,
                process_group=self.group,
                async_stager=self._stager.get(),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                planner=planner,
            )
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a save that cannot start is a failed save
            return _failed(e)
        return resp.staging_completion, resp.upload_completion

    def failed(self) -> None:
        """After a failed save: the ranks' plan caches may be out of step; plan the next afresh."""
        save_planner.forget(self._plan_key)

    def start_writers(self) -> None:
        """Every rank together, before the first save: start the writer processes now (in the
        background) instead of at that save. A start that cannot begin is left to the save."""
        if not self.uses_writer_process:
            return
        try:
            writer_process.prestart(self.group)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank gets DCP's exchange's error
            logger.warning("the checkpoint writer processes start at the first save instead: %s", e)

    def writers_healthy(self) -> bool:
        """This rank's writer process is usable (always, without one)."""
        return not self.uses_writer_process or writer_process.healthy()

    def out_of_shared_memory(self) -> bool:
        """This rank's process-writer staging found no room for the state in shared memory."""
        return self.uses_writer_process and self._stager.out_of_shared_memory()

    def use_thread_writer(self) -> None:
        """Every rank together: stop the writer processes and write every later async save on the
        upload thread, staged in ordinary memory (the process writer cannot stage the state)."""
        writer_process.stop()
        self.uses_writer_process = False
        self._stager.close()
        self._stager = _Staged(self._cuda_staging, shared_memory=False)
        save_planner.forget(self._plan_key)

    def stop_writers(self) -> None:
        """Every rank together: stop the writer processes (the next save starts new ones)."""
        writer_process.stop()
        save_planner.forget(self._plan_key)

    def close(self) -> None:
        save_planner.forget(self._plan_key)
        if self.uses_writer_process:
            writer_process.stop()
        self._uploads.close()
        self._stager.close()


class LocalSaver:
    """This rank's copies in the local tier, with their own stager: the checkpoint.dir upload of
    the same step may still be reading the other one's buffers."""

    def __init__(self, tier: LocalTier, *, mode: str = "async", cuda_staging: bool = False):
        self.tier = tier
        self.sync = mode == "sync"
        self._stager = _Staged(cuda_staging, shared_memory=False)
        self._uploads = _Uploads("et-local-upload")

    def start(self, states: dict[str, Stateful], epoch: str, step: int) -> tuple[Future | None, Future]:
        try:
            writer = self.tier.writer(epoch, step)
            if self.sync:
                dcp.save(states, storage_writer=writer, no_dist=True)
                done: Future = Future()
                done.set_result(None)
                return None, done
            return self._uploads.start(
                states, self._stager.get(), lambda staged: dcp.save(staged, storage_writer=writer, no_dist=True)
            )
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - as a failed local copy
            return _failed(e)

    def close(self) -> None:
        self._uploads.close()
        self._stager.close()
