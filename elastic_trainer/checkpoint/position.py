"""Where the current state stands in its lineage, and what the next save of it does: pure.

A :class:`Position` is a value: the checkpoint.dir checkpoint the state descends from, the
names already in use, which steps have a local copy. :func:`plan_save` decides, from a position
and a save request, whether the save goes to checkpoint.dir, the local tier, both or neither,
the name it takes and the manifest fields that record its lineage, and returns the position
after it. The manager holds one position and replaces it at every load and every save; the same
sequence of loads and saves gives every rank the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from . import layout
from .local_tier import CHAIN_MAX


@dataclass(frozen=True)
class Position:
    """``parent``: the checkpoint.dir checkpoint the state descends from (None: none); ``seq``:
    how many checkpoint.dir saves its lineage holds; ``chain``: the newest of them (what a local
    copy descends from); ``taken``: checkpoint.dir names in use (an abandoned save may still be
    writing into one); ``saves_since_remote``: local-only saves since the last checkpoint.dir one;
    ``local_steps``: steps with a local copy; ``epoch``/``lineage``: the root's launch epoch and
    which start wrote a local copy, learnt at load."""

    parent: str | None = None
    seq: int = 0
    chain: tuple[str, ...] = ("",)
    taken: frozenset[str] = field(default_factory=frozenset)
    saves_since_remote: int = 0
    local_steps: frozenset[int] = field(default_factory=frozenset)
    epoch: str = ""
    lineage: str = ""

    def loaded(
        self, parent: str | None, seq: int, chain: list[str] | None = None, local_step: int | None = None
    ) -> Position:
        """The state now comes from ``parent`` at ``seq``: a checkpoint.dir commit, or
        ``local_step``'s local copy descending from ``chain``."""
        return replace(
            self,
            parent=parent,
            seq=seq,
            chain=tuple(chain or [parent or ""]),
            local_steps=frozenset(() if local_step is None else (local_step,)),
        )


@dataclass(frozen=True)
class SavePlan:
    """What one save does. ``skipped``: why it does nothing ("" when it saves); ``name``: its
    checkpoint.dir directory (None: not saved there); ``local``: a local copy is written;
    ``remote_extra``/``local_extra``: the lineage fields of the two manifests."""

    skipped: str = ""
    name: str | None = None
    local: bool = False
    remote_extra: dict[str, Any] = field(default_factory=dict)
    local_extra: dict[str, Any] = field(default_factory=dict)


def remote_due(
    position: Position, *, force: bool, blocking: bool, durable: bool, remote_every: int, has_local: bool
) -> bool:
    """Whether the next save goes to checkpoint.dir: always without a local tier; with one, when
    ``durable`` (the final step), ``force``d or ``blocking`` (preemption), or the
    ``remote_every``-th since the last one there."""
    return not has_local or force or blocking or durable or position.saves_since_remote + 1 >= remote_every


def plan_save(
    position: Position,
    step: int,
    *,
    force: bool = False,
    blocking: bool = False,
    durable: bool = False,
    remote_every: int = 1,
    has_local: bool = False,
    committed: bool = False,
) -> tuple[SavePlan, Position]:
    """The plan of a save of ``step`` from ``position``, and the position after it. ``committed``:
    every rank knows ``step`` committed in checkpoint.dir (a save of it is a no-op unless
    ``force``d)."""
    if committed and not force:
        return SavePlan(skipped="already committed"), position
    remote = remote_due(
        position, force=force, blocking=blocking, durable=durable, remote_every=remote_every, has_local=has_local
    )
    local = has_local and step not in position.local_steps
    if not remote and not local:
        return SavePlan(skipped="already in the local tier"), position
    name = None
    new = position
    if remote:
        name = layout.next_dir_name(step, position.taken)
        new = replace(
            new,
            taken=position.taken | {name},
            saves_since_remote=0,
            chain=(*position.chain, name)[-CHAIN_MAX:],
            parent=name,
            seq=position.seq + 1,
        )
    else:
        new = replace(new, saves_since_remote=position.saves_since_remote + 1)
    if local:
        new = replace(new, local_steps=new.local_steps | {step})
    plan = SavePlan(
        name=name,
        local=local,
        remote_extra={"parent": position.parent, "seq": new.seq},
        # the remote save this state descends from (the one this save starts, when there is one)
        local_extra={"parent": new.parent, "seq": new.seq, "remote_chain": list(new.chain), "lineage": new.lineage},
    )
    return plan, new
