"""The training loop. Fits on a screen; everything else is called from it."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import exit_codes, log
from ..checkpoint import cadence, layout
from ..checkpoint.manager import CheckpointManager
from ..checkpoint.state import TrainState
from ..config import Config
from ..events import EventLog, read_events
from ..metrics.sink import MetricsSink
from .. import faults
from .data import IGNORE_INDEX, StepBatches
from .model import logits_of

logger = logging.getLogger(__name__)



class PreemptionFlag:
    """Set from a signal handler (SIGTERM/SIGUSR1); read at step boundaries."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.received_at: float | None = None

    def install(self, signals=(signal.SIGTERM, signal.SIGUSR1)) -> None:
        for s in signals:
            signal.signal(s, self._handler)

    def _handler(self, signum, frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self.received_at = time.monotonic()

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


def lr_lambda(cfg: Config):
    t = cfg.train

    def f(step: int) -> float:
        """Multiplier of ``train.lr`` for optimizer step ``step + 1`` (LambdaLR counts from 0)."""
        s = step + 1
        if t.warmup_steps and s <= t.warmup_steps:
            return s / t.warmup_steps
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (s - t.warmup_steps) / span)
        floor = t.min_lr / t.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


@dataclass
class Trainer:
    cfg: Config
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: StepBatches
    state: TrainState
    ckpt: CheckpointManager
    events: EventLog
    metrics: MetricsSink
    rank: int
    world_size: int
    device: torch.device
    preempt: PreemptionFlag = field(default_factory=PreemptionFlag)
    timer_scope: contextlib.AbstractContextManager | None = None
    losses: list[float] = field(default_factory=list)
    _rollback_window_open: bool = False
    _collective_wait: float = 0.0  # seconds this rank spent in the step's explicit all-reduces
    _cadence: cadence.AutoCadence | None = None  # checkpoint.interval_steps = "auto"
    _tick: tuple[float, bool] | None = None  # (start of the loop iteration, it started a save)

    def run(self) -> int:
        """Train to ``train.steps``. Returns the process exit code (see ``exit_codes``)."""
        t = self.cfg.train
        last_save_time = time.monotonic()
        self._start_cadence()
        while self.state.step < t.steps:
            self._measure_cadence()
            step = self.state.step + 1
            log.set_step(step)
            with self._watchdog(f"step-{step}"):  # training progress only: storage waits have their own deadlines
                time_due = self.cfg.checkpoint.interval_seconds > 0 and time.monotonic() - last_save_time >= self.cfg.checkpoint.interval_seconds
                record = self.train_step(step, time_due)
            if record["fenced"]:
                return self._fenced_exit()
            if record["preempt"]:
                return self._preempt_exit(step)
            if record["nonfinite"]:
                code = self._on_nonfinite(step, record)
                if code is not None:
                    return code
                continue
            if layout.should_save(step, t.steps, self._fixed_interval, record["save_due"] or self._cadence_due(step), False):
                stats = self.ckpt.save(step, meta={"loss": record["loss"], "skipped_ranges": self.state.skipped})
                if not stats.skipped:
                    self._rollback_window_open = False
                self._cadence_saved(step)
                faults.maybe_inject("kill_in_save", step)
                last_save_time = time.monotonic()
        try:
            self.ckpt.finish()
        except TimeoutError as e:
            logger.error("final checkpoint not committed within checkpoint.save_timeout_seconds: %s", e)
            self.events.emit("checkpoint_failed", step=self.state.step, error=f"final save: {e}", seconds=self.cfg.checkpoint.save_timeout_seconds)
        if self.ckpt.fenced_everywhere():  # the final commit was refused: a newer launch owns the root
            return self._fenced_exit()
        return 0

    def train_step(self, step: int, time_due: bool) -> dict:
        t0 = time.monotonic()
        faults.maybe_inject("raise", step)
        faults.maybe_inject("kill", step)
        faults.maybe_inject("hang", step)
        faults.maybe_inject("slow", step)
        self.state.skip_past_skipped()
        micro = self.batches.for_cursor(self.state.cursor)
        local_count = sum(int((mb.targets != IGNORE_INDEX).sum()) for mb in micro)
        # One small all-reduce per step carries the loss normaliser and the agreed flags, so the
        # time-based save trigger, preemption and fencing need no collective of their own.
        fenced = float(self.ckpt.fenced is not None)
        interval_vote = self._cadence.vote() if self._cadence is not None else 0.0
        agreed = torch.tensor([local_count, float(self.preempt.requested), float(time_due), fenced, interval_vote], dtype=torch.float64, device=self.device)
        t_wait = time.monotonic()
        dist.all_reduce(agreed)
        self._collective_wait = time.monotonic() - t_wait
        global_count, preempt, save_due, fenced, interval_vote = agreed.tolist()
        self._cadence_agreed(step, interval_vote)
        if preempt > 0 or fenced > 0:
            return {"preempt": preempt > 0, "fenced": fenced > 0, "nonfinite": False, "save_due": True}
        poison = faults.active("nan", step)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb in micro:
            x, y = mb.inputs.to(self.device), mb.targets.to(self.device)
            logits = logits_of(self.model(x))
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum") / global_count
            if poison:
                loss = loss * float("nan")
            loss.backward()
            loss_sum += loss.detach().double()
        self.ckpt.wait_for_staging()
        if self.cfg.train.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), float("inf"))
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        # The loss is agreed before the optimizer step (the same all-reduce as before, moved):
        # with the global gradient norm, every rank sees the same two numbers and takes the same
        # decision, so non-finite state is never stepped into, saved or committed.
        t_wait = time.monotonic()
        dist.all_reduce(loss_sum)
        self._collective_wait += time.monotonic() - t_wait
        loss = float(loss_sum)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return {"preempt": False, "fenced": False, "nonfinite": True, "loss": loss, "grad_norm": grad_norm, "save_due": False}
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.state.step = step
        self.state.cursor += self.cfg.train.global_batch_size
        tokens = int(global_count)
        self.state.tokens_seen += tokens
        dt = time.monotonic() - t0
        self.losses.append(loss)
        rec = self.events.emit(
            "step",
            step=step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            world_size=self.world_size,
            step_time_s=round(dt, 6),
            tokens_per_s=round(tokens / dt, 2) if dt > 0 else 0.0,
        )
        self._observe(rec, tokens)
        if self.rank == 0 and (step % self.cfg.train.log_every == 0 or step == 1 or step == self.cfg.train.steps):
            logger.info("%s", self._progress_line(rec))
        return {"preempt": False, "fenced": False, "nonfinite": False, "loss": loss, "save_due": save_due > 0}

    def _observe(self, rec: dict, tokens: int) -> None:
        m = self.metrics
        m.gauge("elastic_trainer_train_step", rec["step"])
        m.gauge("elastic_trainer_train_loss", rec["loss"])
        m.gauge("elastic_trainer_train_learning_rate", rec["lr"])
        m.gauge("elastic_trainer_train_grad_norm", rec["grad_norm"])
        m.gauge("elastic_trainer_train_tokens_per_second", rec["tokens_per_s"])
        m.histogram("elastic_trainer_train_step_duration_seconds", rec["step_time_s"])
        m.counter("elastic_trainer_train_samples_total", self.cfg.train.global_batch_size)
        m.counter("elastic_trainer_train_tokens_total", tokens)
        # Straggler view: a slow rank's compute share grows; the others wait for it in the all-reduces.
        m.counter("elastic_trainer_rank_compute_seconds_total", max(0.0, rec["step_time_s"] - self._collective_wait))
        m.counter("elastic_trainer_rank_collective_wait_seconds_total", self._collective_wait)
        m.counter("elastic_trainer_rank_steps_total")
        rss = _resident_bytes()
        if rss is not None:
            m.gauge("elastic_trainer_process_resident_memory_bytes", rss)
        if self.device.type == "cuda":
            m.gauge("elastic_trainer_process_cuda_memory_allocated_bytes", torch.cuda.memory_allocated(self.device))
            m.gauge("elastic_trainer_process_cuda_memory_reserved_bytes", torch.cuda.memory_reserved(self.device))

    def _progress_line(self, rec: dict) -> str:
        if self._cadence is not None:
            left = (self._cadence.interval or 0) - (rec["step"] - self._cadence.last_saved)
            nxt = f"{max(0, left)} steps (auto)" if self._cadence.interval else "-"
        else:
            every = self._fixed_interval
            nxt = f"{every - rec['step'] % every} steps" if every else "-"
        return (
            f"step {rec['step']}/{self.cfg.train.steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
            f"grad {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s | {rec['step_time_s'] * 1000:.0f} ms | "
            f"world {self.world_size} | next ckpt in {nxt}"
        )

    # -- checkpoint.interval_steps = "auto" (see checkpoint/cadence.py) -------------------------
    @property
    def _fixed_interval(self) -> int:
        every = self.cfg.checkpoint.interval_steps
        return 0 if every == "auto" else every

    def _start_cadence(self) -> None:
        """Fixed interval: set the gauge. Auto: rank 0 reads this job's lineage from the event log
        (failures, observed time, restart cost, last measurement); the interval itself is agreed
        in the first step's all-reduce."""
        c = self.cfg.checkpoint
        if c.interval_steps != "auto":
            self.metrics.gauge("elastic_trainer_checkpoint_interval_steps", c.interval_steps)
            return
        lineage = cadence.Lineage()
        if self.rank == 0:
            try:
                lineage = cadence.lineage_from_events(read_events(os.path.join(self.cfg.run.dir, "events.jsonl")))
            except (OSError, ValueError, TypeError, KeyError) as e:  # a damaged log: start from the prior
                logger.warning("checkpoint cadence: could not read the event log (%s); using the prior", e)
        self._cadence = cadence.AutoCadence(
            rank=self.rank, start_step=self.state.step, lineage=lineage, prior_mtbf_seconds=c.auto_prior_mtbf_seconds,
            prior_weight_seconds=c.auto_prior_weight_seconds, min_steps=c.auto_min_steps, max_steps=c.auto_max_steps, now=time.monotonic(),
        )

    def _measure_cadence(self) -> None:
        """Rank 0, top of each loop iteration: feed the previous iteration's wall time."""
        if self._cadence is None or self.rank != 0:
            return
        now = time.monotonic()
        if self._tick is not None:
            self._cadence.observe(now - self._tick[0], self._tick[1], self.ckpt.save_in_progress, now)
        self._tick = (now, False)

    def _cadence_due(self, step: int) -> bool:
        return self._cadence is not None and self._cadence.due(step)

    def _cadence_saved(self, step: int) -> None:
        if self._cadence is not None:
            self._cadence.saved(step)
            if self._tick is not None:
                self._tick = (self._tick[0], True)

    def _cadence_agreed(self, step: int, vote: float) -> None:
        if self._cadence is None:
            return
        change = self._cadence.agree(vote)
        if change is None:
            return
        self.metrics.gauge("elastic_trainer_checkpoint_interval_steps", change.interval_steps)
        b = change.basis
        self.events.emit(
            "checkpoint_interval_changed", step=step, interval_steps=change.interval_steps, previous=change.previous,
            save_cost_s=b.get("save_cost_s"), restart_cost_s=b.get("restart_cost_s"), failure_rate_per_h=b.get("failure_rate_per_h"),
            reason=b.get("reason"), step_seconds=b.get("step_seconds"), commit_lag_s=b.get("commit_lag_s"), failures=b.get("failures"),
        )
        if self.rank == 0:
            logger.info("checkpoint interval %s -> %d steps (%s)", change.previous, change.interval_steps, b)

    def _preempt_exit(self, step_not_run: int) -> int:
        """All ranks agreed to stop: commit one final checkpoint within the grace budget.

        Every decision below is agreed by all ranks (collectives on the training group), so all
        ranks enter the same collectives and exit with the same code: 75 only when a commit of
        the final step exists in storage (already, or written now), else 76."""
        done = self.state.step
        grace = self.cfg.checkpoint.preempt_grace_seconds
        started = self.preempt.received_at or time.monotonic()
        deadline = started + grace
        self.events.emit("preempt_requested", step=done, signal=self.preempt.signal_name, grace_seconds=grace)
        logger.warning("preemption (%s): saving step %d within %.0fs", self.preempt.signal_name, done, grace)
        committed = False
        if self.ckpt.finish_agreed(deadline) is not None:
            committed = self.ckpt.committed_everywhere(done)
            if not committed and done > 0:
                self.ckpt.save(done, force=True, meta={"skipped_ranges": self.state.skipped})
                committed = self.ckpt.finish_agreed(deadline) is not None and self.ckpt.committed_everywhere(done)
        if not committed:
            reason = "grace budget exceeded" if time.monotonic() >= deadline else "final checkpoint not committed"
            self.events.emit("preempted", step=done, committed=False, reason=reason)
            logger.error("preemption checkpoint of step %d not committed (%s); exiting %d", done, reason, exit_codes.PREEMPTED_UNCOMMITTED)
            return exit_codes.PREEMPTED_UNCOMMITTED
        self.events.emit("preempted", step=done, committed=True, seconds=round(time.monotonic() - started, 3))
        return exit_codes.PREEMPTED

    def _fenced_exit(self) -> int:
        """Rank 0 found a newer launch on the checkpoint root; every rank agreed in the step's all-reduce."""
        reason = self.ckpt.fenced or "a newer launch owns the checkpoint root"
        self.events.emit("fenced", step=self.state.step, error=reason)
        logger.error("stopping: %s", reason)
        return exit_codes.FENCED

    def _on_nonfinite(self, step: int, rec: dict) -> int | None:
        """A non-finite loss or gradient norm at ``step`` (agreed: both numbers are global).

        ``stop``: exit 65 (nothing after the last finite step is committed). ``rollback``: reload
        the newest commit of this lineage, skip the global sample range that produced the event
        (recorded in the train state, so later resumes skip it too) and continue; a second event
        before a save after the first stops. Returns an exit code, or None to continue."""
        gbs = self.cfg.train.global_batch_size
        sample_range = [self.state.cursor, self.state.cursor + gbs]
        mode = self.cfg.train.on_nonfinite
        self.events.emit("nonfinite", step=step, loss=rec["loss"], grad_norm=rec["grad_norm"], sample_range=sample_range, action=mode)
        self.metrics.counter("elastic_trainer_train_nonfinite_events_total")
        logger.error("non-finite loss %s / grad norm %s at step %d (samples %s)", rec["loss"], rec["grad_norm"], step, sample_range)
        if mode == "rollback" and not self._rollback_window_open:
            self.ckpt.finish_agreed(time.monotonic() + self.cfg.checkpoint.save_timeout_seconds)
            loaded = self.ckpt.load(resume="latest")
            if loaded is not None:
                self.state.skipped.append(sample_range)
                self._rollback_window_open = True
                self.events.emit("rollback", from_step=step, to_step=loaded.step, skipped_range=sample_range, skipped_ranges=self.state.skipped)
                logger.warning("rolled back to step %d; skipping samples %s", loaded.step, sample_range)
                return None
            why = "no committed checkpoint to roll back to"
        elif mode == "rollback":
            why = "a second non-finite event before a checkpoint after the last rollback"
        else:
            why = "train.on_nonfinite = stop"
        self.ckpt.finish_agreed(time.monotonic() + self.cfg.checkpoint.save_timeout_seconds)
        self.events.emit("nonfinite_stop", step=step, reason=why, last_finite_step=self.state.step)
        logger.error("stopping at step %d (%s); last finite step %d", step, why, self.state.step)
        return exit_codes.NONFINITE

    @contextlib.contextmanager
    def _watchdog(self, scope: str):
        if self.timer_scope is None:
            yield
            return
        from torch.distributed.elastic import timer

        with timer.expires(after=self.cfg.elastic.hang_timeout_seconds, scope=scope):
            yield


def _resident_bytes() -> int | None:
    """Resident set size of this process from /proc (None where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
