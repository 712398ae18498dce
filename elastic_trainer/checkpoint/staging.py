"""The stager of every async save: the state is copied into a staged copy kept from one save to the next.

DCP's ``DefaultStager`` deep-copies the state dict on every save: it reuses its buffers, but
rebuilds every tensor and DTensor object around them, in Python — ~16 ms for the demo's ~150
DTensors, held under the training process's interpreter lock while the next step runs (and the
training thread, which gives up the lock in every torch op, waits to take it back). This stager
makes that deep copy once (with DCP's stager, so pinned or shared memory as the options say),
keeps it, and on every later save copies the tensors' bytes into it with ``copy_`` (which runs
without the lock): ~1 ms of Python for the same state.

The kept copy is only reused for a state of the same layout: the same keys and container types,
and per tensor the same type, shape and dtype, and for a DTensor the same placements, mesh and
local shape. Any difference (e.g. the optimizer's state appearing after its first step) makes a
new deep copy, so a tensor is never broadcast or cast into a stale buffer. Values that are not
tensors are deep-copied on every save, as DCP's stager does.

The buffers are overwritten by the next save: the manager starts a save only once the previous
one is settled, as with DCP's own reused buffers. With ``use_async_staging`` the copy runs on a
thread of its own (the caller waits on the returned future before mutating the state); CUDA
tensors are copied device → pinned host with non-blocking copies on that thread's current stream
(ordered after the training's kernels), then the device is synchronised.

For the process writer (``for_writer_process``) a staged state is a
:class:`.writer_process.Shipment`: the writer process is given the kept copy's tensors once and
reads every later save's bytes through them. Its kept copy lives in shared memory: a state that
does not fit in the node's ``/dev/shm`` (torch allocates it up front, so this is an error, never a
SIGBUS later) fails the staging with :class:`~elastic_trainer.errors.SharedMemoryFullError`, which
names what was needed and what was free, and :attr:`KeptStager.out_of_shared_memory` says so.

torch < 2.13's ``DefaultStager`` closes its state-dict stager after each ``stage`` (clearing the
copy table a later deep copy needs: ``KeyError: <class 'type'>``), so there a deep copy takes a new
``DefaultStager`` (:data:`STAGER_SINGLE_USE`; ``tests/unit/test_staging.py`` pins which torch does what).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from ..errors import SharedMemoryFullError
from . import writer_process

# torch < 2.13: a DefaultStager stages once (see the module's docstring)
STAGER_SINGLE_USE = torch.__version__ < "2.13"

SHM = "/dev/shm"  # where torch's shared-memory tensors live on Linux (shm_open)


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, DTensor):
        return _tensor_bytes(value.to_local())
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB = {n:,} bytes"


def _shm_free() -> str:
    try:
        st = os.statvfs(SHM)
    except OSError:
        return f"{SHM} not found"
    return f"{_size(st.f_bavail * st.f_frsize)} free in {SHM}"


class _Mismatch(Exception):
    """The state's layout differs from the kept copy's."""


def _same_dtensor(src: DTensor, kept: Any) -> bool:
    return (
        isinstance(kept, DTensor)
        and kept.shape == src.shape
        and kept.dtype == src.dtype
        and kept.placements == src.placements
        and kept.device_mesh == src.device_mesh
        and kept.to_local().shape == src.to_local().shape
    )


def copy_into(src: Any, kept: Any, non_blocking: bool = False) -> Any:
    """``src`` with each tensor's bytes copied into the matching tensor of ``kept`` (a staged
    copy of a state of the same layout); raises :class:`_Mismatch` when the layouts differ."""
    if isinstance(src, DTensor):
        if not _same_dtensor(src, kept):
            raise _Mismatch
        kept.to_local().copy_(src.to_local(), non_blocking=non_blocking)
        return kept
    if isinstance(src, torch.Tensor):
        if type(kept) is not type(src) or kept.shape != src.shape or kept.dtype != src.dtype:
            raise _Mismatch
        kept.copy_(src, non_blocking=non_blocking)
        return kept
    if isinstance(src, dict):
        if type(kept) is not type(src) or kept.keys() != src.keys():
            raise _Mismatch
        out = {k: copy_into(v, kept[k], non_blocking) for k, v in src.items()}
        return out if type(src) is dict else type(src)(out)
    if type(src) in (list, tuple):
        if type(kept) is not type(src) or len(kept) != len(src):
            raise _Mismatch
        return type(src)(copy_into(v, k, non_blocking) for v, k in zip(src, kept, strict=True))
    if isinstance(kept, (torch.Tensor, dict, list, tuple)):
        raise _Mismatch
    return copy.deepcopy(src)


class KeptStager:
    """DCP's ``AsyncStager`` protocol (``dcp.async_save(..., async_stager=)``) over a kept staged
    copy. ``deep_copies``: how many times the state was deep-copied (1 while its layout holds)."""

    _synchronize_after_execute = False

    def __init__(self, options: StagingOptions, *, for_writer_process: bool = False):
        self._deep_options = dataclasses.replace(options, use_async_staging=False)
        self._deep = DefaultStager(self._deep_options)
        self._for_writer_process = for_writer_process  # stage() returns writer_process.Shipment
        self._shipping: writer_process.Kept | None = None
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="et-stager") if options.use_async_staging else None
        )
        self._non_blocking = options.use_non_blocking_copy
        self._shared_memory = options.use_shared_memory
        self._kept: Any = None
        self.deep_copies = 0
        self.out_of_shared_memory = False  # a deep copy into shared memory found no room

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> Future | dict[str, Any]:
        if self._executor is None:
            return self._stage(state_dict)
        return self._executor.submit(self._stage, state_dict)

    def _stage(self, state_dict: dict[str, Any]) -> Any:
        staged = self._staged(state_dict)
        return self._shipping.shipment(staged) if self._shipping is not None else staged

    @torch.no_grad()
    def _staged(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._kept is not None:
            try:
                staged = copy_into(state_dict, self._kept, self._non_blocking)
            except _Mismatch:
                pass
            else:
                if self._non_blocking:
                    torch.accelerator.synchronize()
                return staged
        self._kept = self._shipping = None
        staged = self._deep_copy(state_dict)
        self._kept = staged
        if self._for_writer_process:
            self._shipping = writer_process.Kept(staged)
        self.deep_copies += 1
        return staged

    def _deep_copy(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if STAGER_SINGLE_USE and self.deep_copies:
            self._deep.close()
            self._deep = DefaultStager(self._deep_options)
        try:
            # synchronous (use_async_staging=False): a state dict, never a Future
            return cast(dict[str, Any], self._deep.stage(state_dict))
        except RuntimeError as e:
            if not (self._shared_memory and "shared memory" in str(e)):
                raise
            self.out_of_shared_memory = True
            raise SharedMemoryFullError(
                f"this rank's state ({_size(_tensor_bytes(state_dict))}) does not fit in shared memory "
                f"({_shm_free()}), where checkpoint.writer = 'process' stages it: give the node more shared "
                "memory (on Kubernetes: an emptyDir with medium Memory at /dev/shm) or use checkpoint.writer = "
                f"'thread' (torch: {e})"
            ) from e

    def synchronize_staging(self) -> None:
        """Nothing to do: the caller waits on the future :meth:`stage` returned."""

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._deep.close()
        self._kept = self._shipping = None
