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

import logging

from torch.distributed.checkpoint import _async_process_executor as _executor

logger = logging.getLogger(__name__)

STOP_TIMEOUT_SECONDS = 5.0


def _process():
    slot = _executor._CHECKPOINT_PROCESS
    return None if slot is None else slot._save_process


def started() -> bool:
    """Whether this process has a writer process (alive or not)."""
    return _executor._CHECKPOINT_PROCESS is not None


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
