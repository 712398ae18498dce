"""The built-in trainer: its LR schedule, its loss and its progress line, on the runtime's one
training loop (:meth:`~elastic_trainer.runtime.checkpointer.Checkpointer.steps`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .. import faults
from ..config import Config
from ..runtime import Checkpointer, StepContext
from .data import IGNORE_INDEX, MicroBatch, target_tokens
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
    (:meth:`Checkpointer.steps` and :meth:`Checkpointer.optimizer_step`), so there is one path
    for both. Its loss is a sum over target tokens, normalised by the step's global count of
    them (``steps(count=...)``)."""

    cfg: Config
    model: torch.nn.Module
    ckpt: Checkpointer

    def run(self) -> int:
        """Train to ``train.steps`` (a replay of ``ckpt audit`` ends at the step it audits, on the
        run's own schedule). Returns the process exit code (see ``exit_codes``); the
        checkpointer has ended the run (:meth:`Checkpointer.end_of_step`)."""
        self.train(self.cfg.train.steps, self._log_progress)
        assert self.ckpt.exit_code is not None  # steps() sets it as it ends
        return self.ckpt.exit_code

    def train(self, total_steps: int, after_step: Callable[[StepContext], Any] | None = None) -> None:
        """The steps up to ``total_steps`` (:meth:`Checkpointer.steps`; ``exit_code`` says how they ended)."""
        clip = self.cfg.train.grad_clip
        for step, mb in self.ckpt.steps(total_steps, exit_on_stop=False, count=target_tokens, after_step=after_step):
            self.ckpt.optimizer_step(self.loss(step, mb), max_norm=clip if clip > 0 else None)

    def loss(self, step: int, mb: MicroBatch) -> torch.Tensor:
        """The micro-batch's cross-entropy, summed over its target tokens."""
        device = self.ckpt.session.device
        x, y = mb.inputs.to(device), mb.targets.to(device)
        logits = logits_of(self.model(x))
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return loss * float("nan") if faults.active("nan", step) else loss

    def _log_progress(self, s: StepContext) -> None:
        if self.ckpt.session.rank == 0 and (
            s.step % self.cfg.train.log_every == 0 or s.step == 1 or s.step == self.cfg.train.steps
        ):
            assert s.event is not None  # after_step: a step whose event was written
            logger.info("%s", self._progress_line(s.event))

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
            f"world {self.ckpt.session.world_size} | {self._committed()}, next in {nxt}"
        )

    def _committed(self) -> str:
        step = self.ckpt.manager.last_committed_step  # rank 0's view: what a restart would resume
        return "no ckpt committed yet" if step is None else f"ckpt step {step} committed"
