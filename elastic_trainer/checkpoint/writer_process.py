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
``_CHECKPOINT_PROCESS`` slot and its ``_save_process`` (a ``multiprocessing.Process``).
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import _async_process_executor as _executor

logger = logging.getLogger(__name__)

STOP_TIMEOUT_SECONDS = 5.0


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
    """False when this process's writer process was started and is no longer alive (None yet:
    healthy, the next save starts it)."""
    proc = _process()
    return proc is None or proc.is_alive()


def pid() -> int | None:
    proc = _process()
    return None if proc is None else proc.pid


def stop() -> None:
    """End this process's writer process (a save it is running fails) and empty DCP's slot, so
    that the next save starts a new one. Never raises."""
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

    index: int


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
    return _walk(skeleton, _Ref, lambda ref: held[ref.index])
