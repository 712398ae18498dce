"""The all-reduce every agreement of ours uses, and the one private torch seam it needs.

gloo runs a collective on a worker thread of its own, which keeps a reference to the tensor
until it has finished with the work: a moment *after* ``wait()`` has returned. If Python drops
the tensor in that moment, torch hands the tensor's Python object over to C++, and the worker
thread must take the GIL to free it. When that happens while the interpreter exits (the
agreement at the end of a run is the last collective of a user's script), the thread is killed
as it takes the GIL and the process aborts ("terminate called without an active exception",
exit -6) although training finished and its checkpoint committed. :func:`all_reduce` returns
only once the worker thread has let go of the tensor, so Python always frees it.

``Tensor._use_count`` (private) is the only way to see that; ``tests/unit/test_collectives.py``
fails loudly if torch changes it.

DCP's own collectives (a save's or a load's gathered plans, as pickled tensors) cannot be waited
for so. A world of one needs none of them: :func:`dcp_group` gives DCP ``no_dist`` there, so a
``python train.py`` that resumes and ends, or ends on its final save, leaves gloo nothing to free.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

RELEASE_TIMEOUT_SECONDS = 5.0


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """``dist.all_reduce(t, group)`` (SUM, in place) that returns once the backend has released ``t``."""
    held = t._use_count()  # type: ignore[attr-defined]  # not in torch's stubs
    dist.all_reduce(t, group=group)
    if t.device.type == "cpu":  # gloo; NCCL frees on its own watchdog thread, never at exit like this
        wait_released(t, held)


def wait_released(t: torch.Tensor, held: int, timeout: float = RELEASE_TIMEOUT_SECONDS) -> bool:
    """Until no more than ``held`` references to ``t``'s tensor remain (bounded). False on timeout."""
    deadline = time.monotonic() + timeout
    while t._use_count() > held:  # type: ignore[attr-defined]  # not in torch's stubs
        if time.monotonic() > deadline:
            return False
        time.sleep(50e-6)  # no GIL needed by the releasing thread: Python still holds t
    return True


def dcp_group(group: dist.ProcessGroup | None) -> dict[str, Any]:
    """DCP's save/load keywords for ``group``: ``process_group`` where it has peers, ``no_dist``
    in a world of one (the same files and plan, without a collective)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        return {"process_group": group}
    return {"no_dist": True}
