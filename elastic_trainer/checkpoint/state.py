"""``Stateful`` adapters: the only things the checkpoint manager saves and loads.

Model and optimizer go through ``torch.distributed.checkpoint.state_dict``
(``get_state_dict``/``set_state_dict``; saving keeps the model's verified layout between saves,
:mod:`.dsd`): FQN-keyed, sharded DTensors, so DCP can reshard them
at load time. A raw ``optimizer.state_dict()`` of sharded parameters keys state by parameter
index and mis-maps it after a reshard (the classic "loss spike after resume").

Under bf16 mixed precision FSDP2 keeps the sharded parameters in fp32 and casts to bf16 only
for compute, so the checkpoint holds fp32 master weights and fp32 Adam moments: resuming from
bf16 copies would lose the low-order bits that small updates accumulate in.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from .. import data_view
from .dsd import StateDicts


class ModelState(Stateful):
    """The model. Its state dict's tensors share storage with the parameters and buffers, and
    DCP's load reads into them in place: when the load hands back the very dict
    :meth:`state_dict` returned, holding the same tensors, the model has its state already and
    is not copied onto itself again (``set_model_state_dict`` otherwise)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._dicts = StateDicts(model)
        self._given: tuple[dict[str, Any], dict[str, Any]] | None = None  # the last dict returned, and its values

    def state_dict(self) -> dict[str, Any]:
        out = self._dicts.model_state_dict()
        self._given = (out, dict(out))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        given = self._given
        if given is not None and state_dict is given[0] and _same_values(state_dict, given[1]):
            return
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=True))


def _same_values(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


class OptimizerState(Stateful):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        self._dicts = StateDicts(model, optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self._dicts.optimizer_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class SchedulerState(Stateful):
    """An LR scheduler, resumed exactly through its own ``state_dict()``: any torch scheduler
    (``LambdaLR``, ``StepLR``, ``OneCycleLR``, ``CosineAnnealingWarmRestarts``, ``SequentialLR``,
    ``ChainedScheduler``, ``ReduceLROnPlateau``, ...) and transformers' ``get_*_schedule_with_warmup``.

    The state is held as JSON text (one object, the same on every rank, so DCP saves one copy and
    any world size reads it; JSON rather than a pickle: loading it runs no code). ``last_epoch``
    and ``last_lr`` are kept beside it as before: a checkpoint written before the full state was
    saved (no ``state``) resumes its position from them, as it always did."""

    optional_on_load = ("state",)

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "state": json.dumps(s.state_dict()),
            "last_epoch": torch.tensor(getattr(s, "last_epoch", -1), dtype=torch.int64),  # ChainedScheduler has none
            "last_lr": torch.tensor(_last_lr(s), dtype=torch.float64),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        s = self.scheduler
        if "state" in state_dict:
            s.load_state_dict(json.loads(state_dict["state"]))
            lrs = _last_lr(s)
        else:  # written before the full state was saved: its position only
            s.last_epoch = int(state_dict["last_epoch"])
            lrs = [float(x) for x in state_dict["last_lr"].tolist()]
            s._last_lr = lrs  # noqa: SLF001 - LRScheduler keeps it here
        for group, lr in zip(s.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr


def _last_lr(scheduler: Any) -> list[float]:
    """The learning rates the scheduler last set (``ReduceLROnPlateau`` before its first step
    has none of its own yet: the optimizer's)."""
    last = getattr(scheduler, "_last_lr", None)
    return [float(x) for x in (last if last is not None else [g["lr"] for g in scheduler.optimizer.param_groups])]


class NamedStates(Stateful):
    """Several ``Stateful`` objects of one kind under one checkpoint key (a dict of optimizers or
    schedulers: a generator and a discriminator, a Muon + AdamW split): ``{name: state}``."""

    def __init__(self, states: dict[str, Stateful]):
        for name in states:
            check_state_name(name)
        self.states = dict(states)

    @property
    def optional_on_load(self) -> tuple[str, ...]:
        out: list[str] = []
        for name, s in self.states.items():
            opt = getattr(s, "optional_on_load", False)
            out += [name] if opt is True else [f"{name}.{k}" for k in (opt or ())]
        return tuple(out)

    def state_dict(self) -> dict[str, Any]:
        return {name: s.state_dict() for name, s in self.states.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, s in self.states.items():
            s.load_state_dict(state_dict.get(name, {}))


def check_state_name(name: str) -> None:
    """A checkpoint key of the user's: DCP joins nested keys with dots, so a name must not hold one."""
    if not isinstance(name, str) or not name or "." in name:
        raise ValueError(
            f"state name {name!r}: a non-empty string without '.' is required (DCP joins nested keys with dots)"
        )


def per_rank_key(rank: int, world_size: int) -> str:
    return f"rank{rank}_of_{world_size}"


class PerRank(Stateful):
    """Register ``obj`` (anything with ``state_dict``/``load_state_dict``) as per-rank state: a
    ``StatefulDataLoader`` per rank, a rank's own generator or metric. Each rank saves its own
    copy (under ``rank{r}_of_{W}``) and gets exactly that copy back at the same world size.

    At another world size a per-rank copy has no owner. The resume stops (exit 2, naming it)
    unless ``obj`` defines the reshard hook::

        def reshard_state_dict(self, saved: list[dict], rank: int, world_size: int) -> dict:
            # saved[r]: what old rank r saved; return what this rank (of world_size) loads

    The copy is one opaque object per rank (the object's own ``state_dict``, serialised with
    ``torch.save``; its bytes are checksummed like every other byte of the checkpoint).
    ``optional_on_load`` of ``obj`` carries over (a per-rank object added to a running job)."""

    per_rank = True

    def __init__(self, obj: Any):
        self.obj = obj
        self.rank, self.world_size = 0, 1
        self._saved_world: int | None = None  # set for the next load (the checkpoint's world size)
        self.restored: bool | None = None

    @property
    def optional_on_load(self) -> bool:
        return bool(getattr(self.obj, "optional_on_load", False))

    @property
    def can_reshard(self) -> bool:
        return callable(getattr(self.obj, "reshard_state_dict", None))

    def bind(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def expect_world(self, saved_world: int | None) -> None:
        """The world size of the checkpoint about to be loaded (the manager calls this)."""
        self._saved_world = saved_world

    def _resharding(self) -> bool:
        return self._saved_world is not None and self._saved_world != self.world_size

    def state_dict(self) -> dict[str, Any]:
        if self._resharding():  # what the load asks for: every old rank's copy
            assert self._saved_world is not None
            return {per_rank_key(r, self._saved_world): b"" for r in range(self._saved_world)}
        buf = io.BytesIO()
        torch.save(self.obj.state_dict(), buf)
        return {per_rank_key(self.rank, self.world_size): buf.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        def unpack(raw: bytes) -> Any:
            return torch.load(io.BytesIO(raw), weights_only=False)  # bytes verified against the manifest's checksums

        if self._resharding():
            assert self._saved_world is not None
            saved = [unpack(state_dict[per_rank_key(r, self._saved_world)]) for r in range(self._saved_world)]
            self.obj.load_state_dict(self.obj.reshard_state_dict(saved, self.rank, self.world_size))
        elif per_rank_key(self.rank, self.world_size) in state_dict:
            self.obj.load_state_dict(unpack(state_dict[per_rank_key(self.rank, self.world_size)]))
        self.restored = bool(state_dict)
        self._saved_world = None


def state_type(obj: Any) -> str:
    """What the manifest records of an optimizer's or scheduler's kind (compared at resume)."""
    inner = obj
    if isinstance(inner, OptimizerState):
        inner = inner.optimizer
    elif isinstance(inner, SchedulerState):
        inner = inner.scheduler
    t = type(inner)
    return f"{t.__module__}.{t.__qualname__}"


def manifest_summaries(states: dict[str, Stateful]) -> dict[str, Any]:
    """``{key: summary}`` of the states the checks before any worker starts read from the
    manifest instead of loading the checkpoint: the data view. (Our own types only: a user's
    object is never asked for anything but its state.)"""
    return {key: s.manifest_summary() for key, s in states.items() if isinstance(s, DataViewState)}


def state_types(states: dict[str, Stateful]) -> dict[str, Any]:
    """``{key: type}`` of the optimizer(s) and scheduler(s) (``{key: {name: type}}`` for a dict of
    them): another optimizer or scheduler type is an incompatibility even when the keys happen to
    agree (Adam and AdamW hold the same keys). Objects of the user's are compared by their keys
    only (a class moved to another module is the same state)."""
    out: dict[str, Any] = {}
    for key, s in states.items():
        if isinstance(s, NamedStates):
            out[key] = {n: state_type(x) for n, x in s.states.items()}
        elif isinstance(s, (OptimizerState, SchedulerState)):
            out[key] = state_type(s)
    return out


def past_skipped(cursor: int, skipped: list[list[int]]) -> int:
    """The first global sample position at or after ``cursor`` outside every ``[start, end)``
    range a non-finite rollback skipped (ranges may chain)."""
    moved = True
    while moved:
        moved = False
        for start, end in skipped:
            if start <= cursor < end:
                cursor, moved = end, True
    return cursor


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
        out: dict[str, Any] = {
            k: torch.tensor(getattr(self, k), dtype=torch.int64) for k in ("step", "tokens_seen", "cursor")
        }
        out["skipped"] = json.dumps(self.skipped)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for k in ("step", "tokens_seen", "cursor"):
            setattr(self, k, int(state_dict[k]))
        self.skipped = [list(map(int, r)) for r in json.loads(state_dict.get("skipped") or "[]")]


class RNGState(Stateful):
    """This rank's random generators: the CPU generator and, where CUDA is available, every
    CUDA device's (``torch.cuda.get_rng_state_all``). Saved under a key of this rank and world
    size (``rank{r}_of_{W}``), so DCP keeps every rank's own stream and a resume at the same
    world size gives each rank its stream back: dropout and other user-code randomness
    continue exactly as in an uninterrupted run.

    On a different world size per-rank streams cannot map 1:1 onto the new ranks, so nothing
    is restored (the keys are absent; ``optional_on_load`` lets the load go on) and
    ``restored`` is False: the caller then calls :meth:`reseed`, which gives each rank a
    stream that is a function of (seed, rank, step) only. A CUDA state saved for fewer devices
    than there are now restores the devices it has; a CPU-only checkpoint restores no CUDA
    generator."""

    optional_on_load = True
    per_rank = True

    def __init__(self, rank: int | None = None, world_size: int | None = None):
        import torch.distributed as dist

        initialised = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if initialised else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if initialised else 1)
        self.restored: bool | None = None  # after a load: whether this rank's streams came back

    @property
    def key(self) -> str:
        return per_rank_key(self.rank, self.world_size)

    def state_dict(self) -> dict[str, Any]:
        mine: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            mine["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
        return {self.key: mine}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = state_dict.get(self.key, {})
        self.restored = "cpu" in mine
        if "cpu" in mine:
            torch.set_rng_state(mine["cpu"])
        cuda = mine.get("cuda", {})
        if cuda and torch.cuda.is_available():
            for i, s in cuda.items():
                if int(i) < torch.cuda.device_count():
                    torch.cuda.set_rng_state(s, int(i))

    def reseed(self, seed: int, step: int) -> int:
        """Seed the CPU and every CUDA generator of this rank from (seed, rank, step). Returns the seed."""
        derived = int.from_bytes(hashlib.sha256(f"{seed}:{self.rank}:{step}".encode()).digest()[:8], "little") & (
            (1 << 63) - 1
        )
        torch.manual_seed(derived)  # also seeds every CUDA device
        return derived


class DataViewState(Stateful):
    """The run's frozen data view (:mod:`elastic_trainer.data_view`): ``view`` is what this run
    reads and saves; ``recorded`` is what a loaded checkpoint holds (None: a fresh start, or a
    checkpoint written before views were recorded). The same on every rank (DCP keeps one copy)."""

    optional_on_load = True

    def __init__(self, view: list[dict] | None = None):
        self.view = list(view or [])
        self.recorded: list[dict] | None = None

    @property
    def view(self) -> list[dict]:
        return self._view

    @view.setter
    def view(self, view: list[dict]) -> None:
        # Set once per start; every save then reuses its encoding and summary (no per-save work).
        self._view = view
        self._encoded = data_view.encode(view)
        self._summary = data_view.summary(view)

    def state_dict(self) -> dict[str, Any]:
        return {"files": self._encoded}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.recorded = data_view.decode(state_dict["files"]) if "files" in state_dict else None

    def manifest_summary(self) -> dict[str, Any]:
        return self._summary


def read_data_view(storage_reader) -> list[dict] | None:
    """The data view recorded in a checkpoint (None if it has none), read without a process
    group: for checks before any worker starts."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from .load_planner import load_planner

    states = {"data": DataViewState()}
    with warnings.catch_warnings():  # torch warns that it loads in one process: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(states, storage_reader=storage_reader, planner=load_planner(states), no_dist=True)
    return states["data"].recorded
