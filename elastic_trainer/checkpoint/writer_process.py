"""The persistent checkpoint writer process (``checkpoint.writer = "process"``).

With ``"process"`` every save to ``checkpoint.dir`` is written by DCP's process-based async
save (``AsyncCheckpointerType.PROCESS``): one writer process per rank, spawned by the first save
and kept for the next ones, with a gloo group of its own between the ranks' writers. The
background stager copies the state into *shared memory* buffers it reuses, and the staged state
travels to the writer as handles to them, never as bytes. Everything of the save that runs
Python — DCP's planning and its gather/scatter, ``torch.save``'s serialisation of every item,
the XXH3 checksums of what is written (the checksummed writer is pickled to the writer process
and hashes there), ``.metadata`` and ``.checksums.json`` — then runs in the writer's interpreter,
not under the training process's GIL. Rank 0's commit (reading ``.checksums.json``, proving the
files, the manifest, fencing) stays in the training process, on its commit thread.

What travels on each save is small: the staged state is a :class:`Shipment`. The writer process
is given the kept staged copy's tensors (handles to their shared memory, one file descriptor
each through multiprocessing's resource sharer: ~20 ms of the training process's CPU, most of it
under its GIL, for the demo's ~180 tensors) once, the first time it writes that copy; every later
save of the same copy sends the state's structure with a reference in place of each tensor, and
every value that is not a tensor, as before. The stager copies each save's bytes into those same
buffers (:mod:`.staging`), so the writer reads the new bytes through the mapping it already has.

DCP starts the writer at the first save, in the background: a few seconds of importing torch in
a new interpreter, so the first save commits that much later, and on busy cores that start runs
beside training steps. :func:`prestart` starts it earlier, at a point every rank reaches
together (the manager calls it at its first step's agreement, before any save): DCP's own
exchange of the writers' rendezvous address on the checkpoint group, then DCP's start of the
process on a thread of ours, which puts it into DCP's slot when it is up. A save waits for a
start still under way (:func:`wait_started`, bounded; then the save fails). A start that failed
makes :func:`healthy` false, so the ranks agree to :func:`stop` every writer; the next save then
starts new ones the way DCP's first save does. :func:`stop` also ends a start under way (its
process is killed, it never enters the slot).

DCP keeps its writer process in one module-level slot (``_CHECKPOINT_PROCESS``) that it never
resets: a writer that died would fail every later save. The manager therefore asks
:func:`healthy` before each save, agrees on the answers of every rank (a writer group with one
member gone cannot write), and when any rank's writer died or failed a save, every rank calls
:func:`stop`: the next save spawns a fresh writer on every rank at the same call, as DCP's
first save does (its spawn is a collective on the checkpoint group). A writer still busy past
the save's deadline is stopped the same way (agreed), which turns a stuck write into a failed
save instead of one that blocks every later save.

Private torch API used here, and only here (``tests/dist/test_writer_process.py`` fails loudly
when torch changes it): ``torch.distributed.checkpoint._async_process_executor``'s
``_CHECKPOINT_PROCESS`` slot and its ``_save_process`` (a ``multiprocessing.Process``),
``_ProcessGroupInitInfo``, and ``_AsyncCheckpointProcess``'s constructor taken in its steps
(``ctx``, ``_process_pipe``, ``_save_process``, ``_checkpointing_subprocess``,
``_wait_for_response``, ``_CheckpointSaveProcessControlOpts.INIT_COMPLETE``).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import threading
import weakref
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import _async_process_executor as _executor

logger = logging.getLogger(__name__)

STOP_TIMEOUT_SECONDS = 5.0
START_WAIT_SECONDS = 60.0  # a save waits this long at most for a writer started ahead of it
_INIT_TIMEOUT_SECONDS = 1800.0  # DCP's own wait for a new writer (gloo's default init timeout)


def _writer():
    """This process's writer process as DCP holds it (a new object for every new process)."""
    return _executor._CHECKPOINT_PROCESS


def _process():
    slot = _writer()
    return None if slot is None else slot._save_process


def started() -> bool:
    """Whether this process has a writer process (alive or not)."""
    return _writer() is not None


def healthy() -> bool:
    """False when this process's writer process was started and is no longer alive, or its
    start ahead of the first save failed (None yet, or a start under way: healthy)."""
    if _starting is not None and _starting.failed():
        return False
    proc = _process()
    return proc is None or proc.is_alive()


def pid() -> int | None:
    proc = _process()
    return None if proc is None else proc.pid


class _Start:
    """A writer process being started ahead of the first save, on a thread of its own: DCP's
    ``_AsyncCheckpointProcess`` constructor in its steps (spawn the process, wait for it to
    report ready), so that :meth:`cancel` can reach the process while it starts."""

    def __init__(self, info):
        self._lock = threading.Lock()  # between the start's thread and cancel
        self.error: BaseException | None = None
        self._cancelled = False
        self._process = None
        self._thread = threading.Thread(target=self._run, args=(info,), name="et-writer-start", daemon=True)
        self._thread.start()

    def _run(self, info) -> None:
        cls = _executor._AsyncCheckpointProcess
        writer = cls.__new__(cls)
        writer.ctx = multiprocessing.get_context("spawn")
        writer._process_pipe, child_end = writer.ctx.Pipe()
        writer._save_process = writer.ctx.Process(
            target=cls._checkpointing_subprocess, args=(info, child_end), daemon=True
        )
        try:
            with self._lock:
                if self._cancelled:
                    return
                self._process = writer._save_process
                writer._save_process.start()
            child_end.close()  # the writer's death then ends the wait below
            ready = writer._wait_for_response(timeout=_INIT_TIMEOUT_SECONDS)
            if ready != _executor._CheckpointSaveProcessControlOpts.INIT_COMPLETE:
                raise RuntimeError(f"the checkpoint writer process answered {ready!r} to its start")
            with self._lock:
                if not self._cancelled:
                    _executor._CHECKPOINT_PROCESS = writer
                    return
        except BaseException as e:  # noqa: BLE001 - reported by wait_started / healthy
            self.error = e
        if writer._save_process.pid is not None:
            writer._save_process.kill()
            writer._save_process.join(STOP_TIMEOUT_SECONDS)

    def wait(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def failed(self) -> bool:
        return not self._thread.is_alive() and self.error is not None

    def cancel(self) -> None:
        """The start never enters DCP's slot; the process it started is killed."""
        with self._lock:
            self._cancelled = True
            proc = self._process
        if proc is not None:
            proc.kill()  # DCP's wait for it then ends
        self._thread.join(STOP_TIMEOUT_SECONDS)


_starting: _Start | None = None


def prestart(group) -> None:
    """Every rank together, a collective on ``group`` (the checkpoint group, as DCP's first save
    uses): start this process's writer process now, in the background, instead of at the first
    save. Nothing to start when one is already there or under way."""
    global _starting
    info = _executor._ProcessGroupInitInfo(group)  # on every rank, whatever it decides below
    if _writer() is None and _starting is None:
        _starting = _Start(info)


def wait_started(timeout: float = START_WAIT_SECONDS) -> None:
    """Before a save: wait for a start under way (:func:`prestart`); RuntimeError when it failed
    or is not done within ``timeout`` (the save fails; the ranks then replace every writer)."""
    global _starting
    start = _starting
    if start is None:
        return
    if not start.wait(timeout):
        raise RuntimeError(f"the checkpoint writer process did not start within {timeout:.0f}s")
    if start.error is not None:
        raise RuntimeError(f"the checkpoint writer process did not start: {start.error}")
    _starting = None


def stop() -> None:
    """End this process's writer process (a save it is running fails) and a start under way, and
    empty DCP's slot, so that the next save starts a new one. Never raises."""
    global _starting
    start, _starting = _starting, None
    if start is not None:
        start.cancel()
    proc = _process()
    _executor._CHECKPOINT_PROCESS = None
    if proc is None:
        return
    try:
        if proc.is_alive():
            proc.kill()  # it holds nothing to flush (a save it runs is abandoned), and a stuck one may not take SIGTERM
        proc.join(STOP_TIMEOUT_SECONDS)
    except (OSError, ValueError, AssertionError) as e:  # already reaped / closed
        logger.warning("stopping the checkpoint writer process: %s", e)


class _Ref(NamedTuple):
    """A tensor of the kept copy, by its place in :attr:`Kept.tensors`."""

    position: int  # (not ``index``: that would shadow tuple.index)


_ids = itertools.count(1)
_sent: dict[int, weakref.ref] = {}  # kept copy id → the writer (DCP's slot object) that holds its tensors
_received: dict[int, list] = {}  # in the writer process: kept copy id → its tensors (the newest copy only)


def _walk(value: Any, kind: type, leaf) -> Any:
    """``value`` (a state dict) with ``leaf(x)`` in place of every ``x`` of type ``kind``."""
    if isinstance(value, kind):
        return leaf(value)
    if isinstance(value, dict):
        out = {k: _walk(v, kind, leaf) for k, v in value.items()}
        return out if type(value) is dict else type(value)(out)
    if type(value) in (list, tuple):
        return type(value)(_walk(v, kind, leaf) for v in value)
    return value


class Kept:
    """A kept staged copy (every tensor in shared memory) as the writer process gets it: its
    tensors, in a fixed order, and a process-unique id."""

    def __init__(self, staged: Any):
        self.id = next(_ids)
        self.tensors: list[torch.Tensor] = []
        _walk(staged, torch.Tensor, self.tensors.append)
        self._index = {id(t): i for i, t in enumerate(self.tensors)}

    def shipment(self, staged: Any) -> Shipment:
        """``staged`` (a state whose tensors are this copy's) ready for the writer process."""
        return Shipment(
            self, _walk(staged, torch.Tensor, lambda t: _Ref(self._index[id(t)]) if id(t) in self._index else t)
        )


class Shipment:
    """A staged state on its way to the writer process (DCP pickles it into the writer's pipe;
    the writer gets back the plain state dict). The kept copy's tensors go along only when the
    writer process that will read this does not hold them yet."""

    def __init__(self, kept: Kept, skeleton: Any):
        self.kept, self.skeleton = kept, skeleton

    def __reduce__(self):
        writer = _writer()
        holder = _sent.get(self.kept.id)
        tensors = None if writer is not None and holder is not None and holder() is writer else self.kept.tensors
        if tensors is not None:
            _sent.clear()  # a writer holds one copy: an older one is never referenced again
            if writer is not None:
                _sent[self.kept.id] = weakref.ref(writer)
        return _unship, (self.kept.id, tensors, self.skeleton)


def _unship(kept_id: int, tensors: list | None, skeleton: Any) -> Any:
    """In the writer process: the state dict a :class:`Shipment` stands for."""
    if tensors is not None:
        _received.clear()
        _received[kept_id] = tensors
    held = _received.get(kept_id)
    if held is None:  # the writer dies of it (the save fails) and every rank's writer is replaced
        raise RuntimeError(f"checkpoint writer: staged copy {kept_id} was never received (holding {list(_received)})")
    return _walk(skeleton, _Ref, lambda ref: held[ref.position])
