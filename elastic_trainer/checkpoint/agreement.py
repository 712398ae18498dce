"""How the ranks of a checkpoint manager agree: the one place its collectives live.

Every call is collective: all ranks call it at the same point, in the same order, from the main
thread. :class:`Agreement` runs them on the process groups; with one rank (or no process group)
each is the identity, so a manager runs in a single process. Tests give the manager a fake with
the same three methods to play the other ranks' answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from .. import collectives

if TYPE_CHECKING:
    from .save import Save


class Agreement:
    """``group``: the checkpoint group (broadcast/gather of load decisions); ``control_group``:
    the training group, which a background upload never uses (None: the default group)."""

    def __init__(
        self, world_size: int, group: dist.ProcessGroup | None = None, control_group: dist.ProcessGroup | None = None
    ):
        self.world_size = world_size
        self.group = group
        self.control_group = control_group

    def _solo(self) -> bool:
        return self.world_size == 1 or not dist.is_initialized()

    def all_true(self, flag: bool, *, control: bool = True) -> bool:
        """Whether every rank's ``flag`` is true (on the control group, else the checkpoint group)."""
        if self._solo():
            return flag
        group = self.control_group if control else self.group
        t = torch.tensor([0.0 if flag else 1.0], dtype=torch.float64)
        if dist.get_backend(group) == "nccl":  # pragma: no cover - GPU only
            t = t.cuda()
        collectives.all_reduce(t, group=group)
        return float(t.item()) == 0.0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self._solo():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank, on every rank."""
        if self._solo():
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


@dataclass(frozen=True)
class SaveVotes:
    """One rank's votes on the save in flight, carried by the step's all-reduce (SUM): its part
    is not settled here; it settled here but did not end well; this rank's writer is not usable.
    Summed over the ranks, each field counts the ranks that voted so."""

    unsettled: float = 0.0
    failed: float = 0.0
    unusable: float = 0.0

    def as_list(self) -> list[float]:
        return [self.unsettled, self.failed, self.unusable]

    @classmethod
    def from_list(cls, values: list[float]) -> SaveVotes:
        return cls(*values)


class Agreed(NamedTuple):
    """The step's all-reduce about the save in flight (:class:`SaveVotes` summed over the ranks)."""

    save: Save | None
    settled: bool  # on every rank
    ok: bool  # ended well on every rank
    usable: bool  # every rank's writer process (if any) is usable

    @property
    def clear(self) -> bool:
        """Nothing to wait for and nothing to restart: the next save starts without a collective."""
        return self.settled and self.ok and self.usable
