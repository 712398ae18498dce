"""An anomalous step — a non-finite loss or gradient norm, or a loss spike — and whether the data
or the hardware made it.

The guard (:class:`SpikeGuard`) judges each step's agreed global loss, so every rank decides
the same. With ``train.on_nonfinite = "replay"`` the run answers the question the other policies
cannot: at the anomaly every rank fingerprints its shard of the model's parameters (the state the
step started from: its optimizer step was not taken), the run rolls back to the newest commit
*keeping* the batches, and replays them. A resume at the same world size is bitwise identical to
an uninterrupted run, so the replay reaches the anomalous step in the very same state, unless
something computed wrong the first time:

* the replay reproduces the anomaly: it is the data (or the model): its samples are skipped, as
  ``rollback`` does;
* it does not: the step is **silent data corruption**. The ranks whose state differed from the
  replay's are named (the one whose tensor moved most first), with their node and tensor; the run
  goes on from the replay, on the fault-free path, having skipped nothing.

A fault a commit took in before the anomaly showed is in the state the replay starts from: the
replay reproduces it. ``elastic-trainer ckpt audit`` of that commit finds it.

:class:`Replayer` holds the replay in flight; :class:`~.run.Run` owns one and calls it from its
non-finite policy. Decisions are pure (:func:`fingerprint`, :func:`differences`,
:func:`culprit`); every rank takes the same branch (they rest on agreed values and one all-reduce).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import collectives

logger = logging.getLogger(__name__)

NON_FINITE = "non-finite"
LOSS_SPIKE = "loss spike"

# A parameter's fingerprint: the sum of its local shard's bit patterns (as integers: any one
# flipped bit changes it) and its largest magnitude (how far a difference moved it).
Fingerprint = dict[str, tuple[int, float]]


class SpikeGuard:
    """The loss-spike test: a step's global loss above ``factor`` × the median of the
    ``window`` steps before it (once that many are known since the process started; a positive
    median). ``factor`` 0: no test. Fed agreed values only, so every rank judges alike; a
    rollback forgets the steps after the one it restored, so a replay is judged as the original was."""

    def __init__(self, factor: float, window: int):
        self.factor, self.window = factor, window
        self._losses: dict[int, float] = {}

    def threshold(self, step: int) -> float | None:
        """The loss above which ``step`` spikes, or None when it is not judged."""
        if self.factor <= 0:
            return None
        before = [self._losses[s] for s in range(step - self.window, step) if s in self._losses]
        if len(before) < self.window:
            return None
        median = statistics.median(before)
        return self.factor * median if median > 0 else None

    def judge(self, step: int, loss: float) -> float | None:
        """The threshold ``loss`` exceeded at ``step`` (a spike), else None, and the loss kept
        (nothing is kept with the test off)."""
        if self.factor <= 0:
            return None
        limit = self.threshold(step)
        if limit is not None and loss > limit:
            return limit
        self._losses[step] = loss
        for old in [s for s in self._losses if s < step - self.window]:
            del self._losses[old]
        return None

    def rolled_back(self, step: int) -> None:
        """The state of ``step`` was restored: the losses after it are the replay's to give again."""
        for later in [s for s in self._losses if s > step]:
            del self._losses[later]


def fingerprint(model: nn.Module) -> Fingerprint:
    """Every parameter's fingerprint on this rank (its local shard), by name, in model order."""
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
    out: Fingerprint = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            t = local.detach().contiguous().reshape(-1)
            if not t.numel():
                out[name] = (0, 0.0)
                continue
            bits = int(t.view(ints[t.element_size()]).to(torch.int64).sum()) if t.element_size() in ints else 0
            out[name] = (bits, float(t.abs().max()) if t.is_floating_point() else 0.0)
    return out


def differences(before: Fingerprint, after: Fingerprint) -> tuple[int | None, float]:
    """Where this rank's state at the anomaly (``before``) differs from the replay's (``after``):
    the index (in model order) of the first differing parameter, or None, and how far the
    differing ones moved at most (the change of the largest magnitude, relative to the replay's)."""
    first, score = None, 0.0
    for i, (name, (bits, top)) in enumerate(before.items()):
        other = after.get(name)
        if other is None or other[0] != bits:
            first = i if first is None else first
            ref = other[1] if other is not None else 0.0
            score = max(score, abs(top - ref) / ref if ref > 0 else abs(top - ref))
    return first, score


def culprit(rows: list[list[float]]) -> list[int]:
    """The ranks whose state differed (``rows``: per rank ``[differs, score, first index]``),
    the one that moved most first (ties: the lowest rank)."""
    differ = [r for r, row in enumerate(rows) if row[0] > 0]
    return sorted(differ, key=lambda r: (-rows[r][1], r))


@dataclass
class Pending:
    """A replay in flight: the anomalous ``step`` (its global ``loss``), replayed from the commit
    of ``from_step``; ``before``: this rank's fingerprint at the anomaly; ``after``: at the
    replay's start of the same step."""

    step: int
    loss: float | None
    from_step: int
    before: Fingerprint
    after: Fingerprint | None = field(default=None)


@dataclass(frozen=True)
class Outcome:
    """How a replay ended: ``reproduced`` (the data), or not, with the ranks whose state differed
    (``ranks``: the one that moved most first) and its first differing parameter (``tensor``)."""

    step: int
    from_step: int
    reproduced: bool
    ranks: list[int]
    tensor: str | None


class Replayer:
    """The replay of one anomaly at a time, on every rank (see the module)."""

    def __init__(self, model: nn.Module | None, rank: int, world_size: int, device: torch.device):
        self.model, self.rank, self.world_size, self.device = model, rank, world_size, device
        self.pending: Pending | None = None

    def start(self, step: int, loss: float | None, from_step: int, before: Fingerprint) -> None:
        """The run rolled back to ``from_step`` after an anomaly at ``step``; ``before``: this
        rank's fingerprint taken at the anomaly (:meth:`snapshot`, before the rollback)."""
        self.pending = Pending(step, loss, from_step, before)

    def snapshot(self) -> Fingerprint:
        """This rank's fingerprint now (the model's parameters; none without a model)."""
        return fingerprint(self.model) if self.model is not None else {}

    def begin_step(self, step: int) -> None:
        """Start of each step: when the replay reaches the anomalous step, fingerprint the state it starts from."""
        p = self.pending
        if p is not None and step == p.step:
            p.after = self.snapshot()

    def resolve(self, reproduced: bool) -> Outcome:
        """At the anomalous step of the replay (every rank): compare each rank's state at the
        anomaly with the replay's (one all-reduce) and end the replay."""
        p = self.pending
        assert p is not None and p.after is not None  # begin_step ran at p.step
        self.pending = None
        first, score = differences(p.before, p.after)
        rows = torch.zeros(self.world_size, 3, dtype=torch.float64, device=self.device)
        if first is not None:
            rows[self.rank] = torch.tensor([1.0, score, float(first)], dtype=torch.float64)
        if self.world_size > 1:
            collectives.all_reduce(rows)
        table = rows.tolist()
        ranks = culprit(table)
        names = list(p.before)
        tensor = names[int(table[ranks[0]][2])] if ranks and int(table[ranks[0]][2]) < len(names) else None
        return Outcome(p.step, p.from_step, reproduced, ranks, tensor)
