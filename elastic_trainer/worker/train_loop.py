"""The training loop. Fits on a screen; everything else is called from it."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import faults, log
from ..checkpoint.state import TrainState
from ..config import Config
from ..runtime import Checkpointer, Session, StepContext
from .data import IGNORE_INDEX, StepBatches
from .model import logits_of

logger = logging.getLogger(__name__)


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
    """The built-in trainer: a loop over the same public runtime a user's own script uses
    (:mod:`elastic_trainer.runtime`), so there is one path for both."""

    cfg: Config
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: StepBatches
    session: Session
    ckpt: Checkpointer
    losses: list[float] = field(default_factory=list)

    @property
    def state(self) -> TrainState:
        return self.ckpt.state

    def run(self) -> int:
        """Train to ``train.steps``. Returns the process exit code (see ``exit_codes``); the
        checkpointer has ended the run (:meth:`Checkpointer.end_of_step`)."""
        t, code = self.cfg.train, None
        while code is None:
            step = self.state.step + 1
            if step > t.steps:  # resumed at the end: nothing left to run
                return self.ckpt.end_of_step(None, self.state.step, t.steps)
            log.set_step(step)
            code = self.ckpt.end_of_step(self.train_step(step), step, t.steps)
        return code

    def train_step(self, step: int) -> StepContext:
        with self.session.step(step, checkpointer=self.ckpt) as s:
            self.state.skip_past_skipped()
            micro = self.batches.for_cursor(self.state.cursor)
            # One small all-reduce carries the loss normaliser and the agreed flags (preemption,
            # time-based save, fencing): they need no collective of their own.
            (global_count,) = s.agree(sum(int((mb.targets != IGNORE_INDEX).sum()) for mb in micro))
            if s.preempt or s.fenced:
                return s
            poison = faults.active("nan", step)
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.session.device)
            for mb in micro:
                x, y = mb.inputs.to(self.session.device), mb.targets.to(self.session.device)
                logits = logits_of(self.model(x))
                loss = (
                    F.cross_entropy(
                        logits.float().reshape(-1, logits.shape[-1]),
                        y.reshape(-1),
                        ignore_index=IGNORE_INDEX,
                        reduction="sum",
                    )
                    / global_count
                )
                if poison:
                    loss = loss * float("nan")
                loss.backward()
                loss_sum += loss.detach().double()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
            )
            # The loss is agreed before the optimizer step: with the global gradient norm every
            # rank sees the same two numbers, so non-finite state is never stepped into or saved.
            if not s.check(loss_sum, grad_norm):
                self.optimizer.zero_grad(set_to_none=True)
                return s
            lr = self.optimizer.param_groups[0]["lr"]
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.state.step = step
            self.state.cursor += self.cfg.train.global_batch_size
            tokens = int(global_count)
            self.state.tokens_seen += tokens
            s.record(lr=lr, tokens=tokens)
        self.losses.append(s.loss)
        if self.session.rank == 0 and (
            step % self.cfg.train.log_every == 0 or step == 1 or step == self.cfg.train.steps
        ):
            logger.info("%s", self._progress_line(s.event))
        return s

    def _progress_line(self, rec: dict) -> str:
        c = self.ckpt.cadence
        if c.auto is not None:
            left = (c.interval or 0) - (rec["step"] - c.auto.last_saved)
            nxt = f"{max(0, left)} steps (auto)" if c.interval else "-"
        else:
            nxt = f"{c.fixed - rec['step'] % c.fixed} steps" if c.fixed else "-"
        return (
            f"step {rec['step']}/{self.cfg.train.steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
            f"grad {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s | {rec['step_time_s'] * 1000:.0f} ms | "
            f"world {self.session.world_size} | {self._committed()}, next in {nxt}"
        )

    def _committed(self) -> str:
        step = self.ckpt.manager.last_committed_step  # rank 0's view: what a restart would resume
        return "no ckpt committed yet" if step is None else f"ckpt step {step} committed"
