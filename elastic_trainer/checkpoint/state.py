"""``Stateful`` adapters: the only things the checkpoint manager saves and loads.

Model and optimizer go through ``torch.distributed.checkpoint.state_dict``
(``get_state_dict``/``set_state_dict``): FQN-keyed, sharded DTensors, so DCP can reshard them
at load time. A raw ``optimizer.state_dict()`` of sharded parameters keys state by parameter
index and mis-maps it after a reshard (the classic "loss spike after resume").

Under bf16 mixed precision FSDP2 keeps the sharded parameters in fp32 and casts to bf16 only
for compute, so the checkpoint holds fp32 master weights and fp32 Adam moments: resuming from
bf16 copies would lose the low-order bits that small updates accumulate in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


class ModelState(Stateful):
    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=True))


class OptimizerState(Stateful):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class SchedulerState(Stateful):
    """LR scheduler position. The schedule itself is a pure function of the step and config."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler):
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {
            "last_epoch": torch.tensor(self.scheduler.last_epoch, dtype=torch.int64),
            "last_lr": torch.tensor(self.scheduler.get_last_lr(), dtype=torch.float64),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.last_epoch = int(state_dict["last_epoch"])
        lrs = [float(x) for x in state_dict["last_lr"].tolist()]
        self.scheduler._last_lr = lrs  # noqa: SLF001 - LRScheduler keeps it here
        for group, lr in zip(self.scheduler.optimizer.param_groups, lrs):
            group["lr"] = lr


@dataclass
class TrainState(Stateful):
    """Trainer progress. ``cursor`` is the global sample cursor: the data state. ``skipped``
    holds the global sample ranges ``[start, end)`` a non-finite rollback skipped, so that every
    later resume skips them too."""

    step: int = 0
    tokens_seen: int = 0
    cursor: int = 0
    skipped: list[list[int]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: torch.tensor(getattr(self, k), dtype=torch.int64) for k in ("step", "tokens_seen", "cursor")}
        out["skipped"] = json.dumps(self.skipped)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for k in ("step", "tokens_seen", "cursor"):
            setattr(self, k, int(state_dict[k]))
        self.skipped = [list(map(int, r)) for r in json.loads(state_dict.get("skipped") or "[]")]

    def skip_past_skipped(self) -> None:
        """Move the cursor past any skipped range it stands in."""
        moved = True
        while moved:
            moved = False
            for start, end in self.skipped:
                if start <= self.cursor < end:
                    self.cursor, moved = end, True


class RNGState(Stateful):
    """Host generator state (CUDA generator states are left out so a CPU checkpoint loads on a GPU). Every rank writes the same key, DCP keeps one copy and
    every rank restores it; training draws no per-rank randomness from these generators (data
    order and init are explicitly seeded), so this is for user code that does (e.g. dropout)."""

    def state_dict(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["cpu"])
