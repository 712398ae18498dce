"""One training step: agreed flags, the non-finite guard, the hang watchdog, step events/metrics.

    with session.step(step, checkpointer=ckpt) as s:
        s.agree()                       # optional: agree early (default: at the end of the step)
        ...forward/backward...
        if s.check(loss_sum, grad_norm):  # waits for the save's staging; one all-reduce of the loss; False = non-finite
            optimizer.step()
        s.record(lr=..., tokens=...)
    code = ckpt.end_of_step(s, step, total_steps)  # fenced, preempted, non-finite, save when due, the end

Every flag is agreed by all ranks (one small all-reduce carries preemption, the time-based save
trigger, fencing and any per-rank sums the caller adds), so every rank takes the same branch.
The step runs inside the hang watchdog's scope; storage waits never do.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch

from .. import collectives, faults
from ..checkpoint.agreement import SaveVotes
from . import anomaly

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Votes:
    """One rank's flags in the step's all-reduce (SUM), or every rank's summed: preemption
    requested, the time-based save trigger, fenced, rank 0's proposed ``auto`` save interval
    (0 elsewhere), and the checkpoint manager's votes on the save in flight."""

    preempt: float = 0.0
    time_due: float = 0.0
    fenced: float = 0.0
    interval: float = 0.0
    save: SaveVotes = dataclasses.field(default_factory=SaveVotes)

    def to_tensor(self, sums: tuple[float, ...], device: torch.device) -> torch.Tensor:
        """``sums`` (the caller's shares) first, then the flags."""
        flags = [self.preempt, self.time_due, self.fenced, self.interval, *self.save.as_list()]
        return torch.tensor([*map(float, sums), *flags], dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, n_sums: int) -> tuple[list[float], Votes]:
        """The summed ``sums`` and flags of an all-reduced :meth:`to_tensor`."""
        values = t.tolist()
        sums, (preempt, time_due, fenced, interval, *save) = values[:n_sums], values[n_sums:]
        return sums, cls(preempt, time_due, fenced, interval, SaveVotes.from_list(save))


class StepContext:
    """One step of a training loop (``session.step(step, checkpointer=)``): runs inside the hang
    watchdog and injects the configured faults; :meth:`agree` makes one all-reduce of the step's
    flags (preemption, the time-based save trigger, fencing, the checkpoint manager's votes) and
    any sums the caller adds; :meth:`check` guards against a non-finite loss; :meth:`record` adds
    fields to the step's event. On an exception it starts no collective and only lets a save
    already uploading land. One per step, on every rank."""

    def __init__(self, session, step: int, checkpointer=None):
        self.session = session
        self.step = step
        # the run's side of a step (a Checkpointer's or a Run's StepHooks)
        self.ckpt = checkpointer.hooks if checkpointer is not None else None
        self.preempt = False
        self.save_due = False
        self.fenced = False
        self.nonfinite = False  # the guard refused the step: `anomaly` says why
        self.anomaly: str | None = None  # anomaly.NON_FINITE or anomaly.LOSS_SPIKE
        self.spike_threshold: float | None = None  # the loss a spike exceeded
        self.loss: float | None = None
        self.grad_norm: float | None = None
        self.collective_wait = 0.0  # seconds in this context's all-reduces (straggler metrics)
        self.event: dict[str, Any] | None = None  # the step event, once written (a finite step)
        self._agreed = False
        self._fields: dict[str, Any] = {}
        self._scope: AbstractContextManager[None] | None = None
        self._t0 = 0.0

    def __enter__(self) -> StepContext:
        self._t0 = time.monotonic()
        if self.ckpt is not None:
            self.ckpt.begin_step(self.step, self._t0)
        self._scope = self.session.watchdog(f"step-{self.step}")
        self._scope.__enter__()
        try:
            committed = self.ckpt.commit_visible if self.ckpt is not None else None
            for kind in ("raise", "kill", "hang", "slow"):
                faults.maybe_inject(kind, self.step, committed)
            if self.ckpt is not None:
                self.ckpt.inject_local_faults(self.step)
        except BaseException as e:
            self.__exit__(type(e), e, e.__traceback__)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        try:
            if exc_type is None and not self._agreed:
                self.agree()
        finally:
            assert self._scope is not None  # set by __enter__
            self._scope.__exit__(exc_type, exc, tb)
        if exc_type is not None and self.ckpt is not None:
            # The exception path starts no checkpoint and no collective; it only lets a save
            # that is already uploading land (bounded), so the newest commit is not lost.
            self.ckpt.drain_after_failure()
        if exc_type is None and self.loss is not None and not self.nonfinite and not self.preempt and not self.fenced:
            self._emit()
        return False

    @property
    def stop(self) -> bool:
        """Whether the loop must leave this step's normal path (preempt, fenced, or refused by
        the guard: non-finite or a loss spike)."""
        return self.preempt or self.fenced or self.nonfinite

    def agree(self, *sums: float) -> list[float]:
        """One all-reduce (SUM) of ``sums`` (this rank's shares, e.g. its target-token count) and
        of the step's flags: preemption requested, the time-based save trigger, fenced, and the
        checkpoint manager's votes on the save in flight (settled, failed, writer usable). Returns
        the global sums. Call at most once per step, on every rank."""
        s, ck = self.session, self.ckpt
        mine = ck.votes(time.monotonic()) if ck is not None else Votes()
        t = dataclasses.replace(mine, preempt=float(s.preempt.requested)).to_tensor(sums, s.device)
        t0 = time.monotonic()
        if s.world_size > 1:
            collectives.all_reduce(t)
        self.collective_wait += time.monotonic() - t0
        out, votes = Votes.from_tensor(t, len(sums))
        self.preempt, self.save_due, self.fenced = votes.preempt > 0, votes.time_due > 0, votes.fenced > 0
        self._agreed = True
        if ck is not None:
            ck.agreed(self.step, votes)
        return out

    def check(self, loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None = None) -> bool:
        """The non-finite guard, before ``optimizer.step()``: all-reduces (SUM) this rank's share
        of the loss (so :attr:`loss` becomes the global loss) and checks it and the global
        gradient norm (already global: ``clip_grad_norm_`` over DTensor gradients). False when
        either is NaN/Inf, or when the loss spikes (``train.loss_spike_factor``; :attr:`anomaly`
        says which): do not step the optimizer (zero the gradients). First, it waits until a
        save in flight has copied the state out (the optimizer step is about to change it)."""
        s = self.session
        if self.ckpt is not None:
            self.ckpt.before_optimizer_step()
        t = (
            loss.detach().to(torch.float64).reshape(())
            if isinstance(loss, torch.Tensor)
            else torch.tensor(float(loss), dtype=torch.float64)
        )
        t = t.to(s.device)
        t0 = time.monotonic()
        if s.world_size > 1:
            collectives.all_reduce(t)
        self.collective_wait += time.monotonic() - t0
        self.loss = float(t)
        if grad_norm is not None:
            gn = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            self.grad_norm = float(gn)
        if not (math.isfinite(self.loss) and (self.grad_norm is None or math.isfinite(self.grad_norm))):
            self.anomaly = anomaly.NON_FINITE
        elif self.ckpt is not None:
            self.spike_threshold = self.ckpt.judge_loss(self.step, self.loss)
            self.anomaly = anomaly.LOSS_SPIKE if self.spike_threshold is not None else None
        self.nonfinite = self.anomaly is not None
        return not self.nonfinite

    def record(self, **fields: Any) -> None:
        """Extra fields of the step event (e.g. ``lr``, ``tokens``); ``samples``, the step's
        global samples, goes to the samples metric only."""
        self._fields.update(fields)

    def _emit(self) -> None:
        s = self.session
        dt = time.monotonic() - self._t0
        tokens = int(self._fields.pop("tokens", 0))
        # the step's samples as its data counted them (a front end's sampler), else the configured global batch
        samples = int(self._fields.pop("samples", s.cfg.train.global_batch_size))
        rec = s.events.emit(
            "step",
            step=self.step,
            loss=self.loss,
            lr=self._fields.pop("lr", None),
            grad_norm=self.grad_norm,
            world_size=s.world_size,
            step_time_s=round(dt, 6),
            tokens_per_s=round(tokens / dt, 2) if dt > 0 else 0.0,
            **self._fields,
        )
        m = s.metrics
        m.gauge("elastic_trainer_train_step", self.step)
        m.gauge("elastic_trainer_train_loss", self.loss)
        if rec.get("lr") is not None:
            m.gauge("elastic_trainer_train_learning_rate", rec["lr"])
        if self.grad_norm is not None:
            m.gauge("elastic_trainer_train_grad_norm", self.grad_norm)
        m.gauge("elastic_trainer_train_tokens_per_second", rec["tokens_per_s"])
        m.histogram("elastic_trainer_train_step_duration_seconds", dt)
        m.counter("elastic_trainer_train_samples_total", samples)
        m.counter("elastic_trainer_train_tokens_total", tokens)
        # Straggler view: a slow rank's compute share grows; the others wait for it in the all-reduces.
        m.counter("elastic_trainer_rank_compute_seconds_total", max(0.0, dt - self.collective_wait))
        m.counter("elastic_trainer_rank_collective_wait_seconds_total", self.collective_wait)
        m.counter("elastic_trainer_rank_steps_total")
        rss = _resident_bytes()
        if rss is not None:
            m.gauge("elastic_trainer_process_resident_memory_bytes", rss)
        if s.device.type == "cuda":
            m.gauge("elastic_trainer_process_cuda_memory_allocated_bytes", torch.cuda.memory_allocated(s.device))
            m.gauge("elastic_trainer_process_cuda_memory_reserved_bytes", torch.cuda.memory_reserved(s.device))
        self.event = rec


def _resident_bytes() -> int | None:
    """Resident set size of this process from /proc (None where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
