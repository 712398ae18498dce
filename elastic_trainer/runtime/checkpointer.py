"""The training loop of a script: every guarantee of the built-in trainer, for any loop.

:class:`Checkpointer` is the loop side: the user's data made world-size invariant (:mod:`.loop`),
:meth:`~Checkpointer.steps` with one :meth:`~Checkpointer.optimizer_step` per batch (gradient
accumulation, clipping, the non-finite guard) and, for a loop that keeps its own iteration,
:meth:`~Checkpointer.resume` and :meth:`~Checkpointer.end_of_step` around ``session.step``. Its
run (:class:`~.run.Run`: the named states, their checkpoints and every way a run ends) is built
from the session, or injected. All methods that touch collectives must be called on every rank
in the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from .. import exit_codes, log
from ..checkpoint import cadence
from ..checkpoint.manager import CheckpointManager, LoadResult
from ..checkpoint.state import TrainState
from ..storage.fs import Storage
from .loop import Accumulator, loop_data
from .run import open_run, shape_fingerprint
from .session import Session
from .step import StepContext

logger = logging.getLogger(__name__)

__all__ = ["BACKWARD_TWICE", "Checkpointer", "shape_fingerprint"]

BACKWARD_TWICE = (
    "a backward pass ran before ckpt.optimizer_step(loss), which does the backward itself "
    "(weighted by the batch's share of the global batch): remove loss.backward()"
)


class Checkpointer:
    """One training loop over a :class:`~.session.Session`: its data, its steps and its run.

    The run (:attr:`run`) owns the named states (model, optimizers, LR schedulers, the train
    state with the global sample cursor, per-rank RNG, the data loader's state and the user's
    ``extra``) and a :class:`~elastic_trainer.checkpoint.manager.CheckpointManager` over
    ``checkpoint.dir`` that saves them; it resumes from the newest usable commit, saves on the
    configured cadence, rolls back a non-finite step, and turns preemption, a fenced root and
    the run's end into the agreed exits. Every method that touches collectives is called on
    every rank, in the same order."""

    def __init__(
        self,
        session: Session,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | dict[str, torch.optim.Optimizer] | None = None,
        scheduler: Any = None,
        extra: dict[str, Stateful] | None = None,
        data: Any = None,
        train_state: TrainState | None = None,
        fingerprint: str | None = None,
        run_identity: dict[str, Any] | None = None,
        manager: Callable[[dict[str, Stateful]], CheckpointManager] | None = None,
    ):
        """``optimizer``/``scheduler``/``extra``: see :func:`.run.named_states` (one, or a dict
        of them by name; any torch LR scheduler; more ``Stateful`` objects by name).
        ``data``: for :meth:`steps`, a ``DataLoader`` (over a map-style dataset it is made world-size
        invariant: see :mod:`.loop`; its ``batch_size`` is the micro-batch) or any iterable of
        batches; its state is checkpointed.

        ``run_identity``: the settings that define the run (a resume with any of them changed
        is refused naming the key, unless ``checkpoint.allow_changes`` names it); the built-in
        trainer passes ``Config.run_identity()``. Default: with a ``DataLoader`` made world-size
        invariant, ``train.seed`` (and ``train.global_batch_size`` where it was set).
        ``manager``: makes the checkpoint manager over the named states (tests inject one)."""
        self.session = session
        self.model = model
        self.optimizers = list(optimizer.values()) if isinstance(optimizer, dict) else [optimizer] if optimizer else []
        self.schedulers = list(scheduler.values()) if isinstance(scheduler, dict) else [scheduler] if scheduler else []
        self.data, extra, run_identity = loop_data(session, data, dict(extra or {}), run_identity)
        self.run = open_run(
            session,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            extra=extra,
            train_state=train_state,
            fingerprint=fingerprint,
            run_identity=run_identity,
            manager=manager,
        )
        self.state, self.rng, self.hooks = self.run.state, self.run.rng, self.run.hooks
        self.storage: Storage = self.run.storage
        self._acc: Accumulator | None = None  # the step in progress under steps()
        # the current batch under steps(): its loss weight, its index in the step, whether it ends the step
        self._weight, self._index, self._last = 0.0, 0, True
        self._ctx: StepContext | None = None
        self._stop_requested = False
        self.exit_code: int | None = None  # how steps() ended

    # ------------------------------------------------------------------ the run's parts
    @property
    def manager(self) -> CheckpointManager:
        return self.run.manager

    @property
    def cadence(self) -> cadence.Cadence:
        return self.run.cadence

    @property
    def loaded(self) -> LoadResult | None:
        return self.run.loaded

    def resume(self, after_load: Callable[[LoadResult | None], dict[str, Any]] | None = None) -> int:
        """Load the newest valid commit (see :meth:`.run.Run.resume`): the step to continue after.
        The data keeps the global batch the run started with (see :func:`.loop.resumed_global_batch`)."""
        step = self.run.resume(after_load)
        if step and self.data is not None:
            self.data.resumed(self.session.cfg, "train.global_batch_size" in getattr(self.session, "explicit", ()))
        return step

    # ------------------------------------------------------------------ the loop
    def steps(
        self,
        total_steps: int,
        *,
        exit_on_stop: bool = True,
        count: Callable[[Any], int] | None = None,
        after_step: Callable[[StepContext], Any] | None = None,
    ) -> Iterator[tuple[int, Any]]:
        """The training loop: ``for step, batch in ckpt.steps(total): ...`` with one
        :meth:`optimizer_step` per ``batch``. Resumes first (unless :meth:`resume` was called), runs
        each step in the step context (hang watchdog, agreed preemption and fencing) and ends it
        through the run (:meth:`end_of_step`: the cadence's saves, the non-finite policy, the end).

        ``batch`` is one batch as the ``DataLoader`` yields it (at most its ``batch_size`` samples),
        on ``session.device``, at every world size. A step is ``train.global_batch_size`` samples
        over all ranks: when a rank's share is larger than the loader's ``batch_size`` the same
        ``step`` comes with several batches (gradient accumulation), the optimizer stepping after
        the last one; how many depends on the world size, the loop body does not.

        ``count``: for a loss that is a *sum* over items of unequal number per batch (e.g. the
        target tokens of a language model): ``count(batch)`` is how many items the batch's loss
        sums. The step's batches are then read before the first is yielded, their counts summed
        over every rank (in the step's one agreement, which a preempted or fenced step stops
        at: no batch comes), and each batch's loss given to :meth:`optimizer_step` is divided by
        that global count; the step event records it as ``tokens``.

        ``after_step(s)``: on every rank after each step whose ``step`` event was written, before its save.

        The loop ends after ``total_steps``, or earlier on preemption (75/76), fencing (73), a
        non-finite stop (65) or :meth:`request_stop`. ``exit_code`` holds the code; when it is not
        0 the process exits with it after the loop (``exit_on_stop=False``: the loop just ends), as
        it does with 0 at the end of a replay of ``ckpt audit``."""
        if self.data is None:
            raise ValueError("Checkpointer(data=...) is needed for steps(): a DataLoader or any iterable of batches")
        if not self.run.resumed:
            self.resume()
        step, code = self.state.step, None
        try:
            while code is None:
                if step >= total_steps:  # resumed at the end: nothing left to run
                    code = self.end_of_step(None, step, total_steps)
                    break
                step += 1
                log.set_step(step)
                with self.session.step(step, checkpointer=self) as s:
                    try:
                        yield from self._step_batches(s, count)
                    finally:
                        self._ctx = self._acc = None
                if after_step is not None and s.event is not None:
                    after_step(s)
                code = self.end_of_step(s, step, total_steps)
                if s.nonfinite and code is None:  # rolled back: continue after the restored step
                    step = self.state.step
                    self.data.restart()
        finally:
            self.data.restart()  # the loader's workers end with the loop, not at interpreter exit
        self.exit_code = code
        if exit_on_stop and (code != exit_codes.OK or self.run.audit_stop is not None):
            raise SystemExit(code)  # a replay of `ckpt audit` runs the script's steps, not what follows them

    def _step_batches(self, s: StepContext, count: Callable[[Any], int] | None) -> Iterator[tuple[int, Any]]:
        """The batches of step ``s``, each to be closed by one :meth:`optimizer_step`."""
        assert self.data is not None  # steps() reads the data given
        batches: Iterator[tuple[Any, float]] | list[tuple[Any, float]] = self.data.step_batches()
        divisor = None
        if count is not None:
            batches = list(batches)
            (divisor,) = s.agree(sum(count(b) for b, w in batches if w > 0))
            if s.preempt or s.fenced:
                return
        self._ctx, self._acc = s, Accumulator(self.session.device, divisor)
        last = self.data.per_step - 1
        for i, (batch, weight) in enumerate(batches):
            self._weight, self._index, self._last = weight, i, i == last
            yield s.step, batch
            if self._acc is not None and self._acc.count == i:
                raise RuntimeError(f"step {s.step}: call ckpt.optimizer_step(loss) once per batch")

    def optimizer_step(self, loss: torch.Tensor, *, max_norm: float | None = None) -> float | None:
        """The end of each ``batch`` under :meth:`steps`: the backward pass of ``loss`` (the
        batch's mean loss, weighted by its share of the global batch; with ``steps(count=...)``
        the batch's summed loss, divided by the step's global count; do not call
        ``loss.backward()`` yourself: a backward pass before this call is refused). After the
        step's last batch: gradient clipping to ``max_norm`` (global norm; none unless given),
        the staging wait and the agreed non-finite guard (``StepContext.check``), every
        optimizer's and scheduler's step (``ReduceLROnPlateau`` on the global loss), the data
        cursor and ``zero_grad``; returns the step's global loss. Before it (more batches of the
        same step to come): None. The step event's ``lr`` is the first optimizer's learning rate
        the step used."""
        s, acc = self._ctx, self._acc
        if s is None or acc is None or acc.count != self._index:
            raise RuntimeError(
                "ckpt.optimizer_step(loss) belongs inside 'for step, batch in ckpt.steps(...)', once per batch"
            )
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"ckpt.optimizer_step(loss) takes the batch's loss tensor (got {type(loss).__name__}) "
                "and does its backward pass"
            )
        if acc.count == 0 and any(p.grad is not None for p in self.model.parameters()):
            raise RuntimeError(BACKWARD_TWICE)
        try:
            acc.backward(loss, self._weight)
        except RuntimeError as e:
            if "second time" in str(e):
                raise RuntimeError(BACKWARD_TWICE) from e
            raise
        if not self._last:
            return None
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), max_norm if max_norm is not None else float("inf")
        )
        # The loss is agreed before the optimizer step: with the global gradient norm every rank
        # sees the same two numbers, so non-finite state is never stepped into or saved.
        if s.check(acc.loss, grad_norm):
            self._take_step(s, acc)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self._ctx = self._acc = None
        return s.loss

    def _take_step(self, s: StepContext, acc: Accumulator) -> None:
        """The agreed finite step ``s``: every optimizer's and scheduler's step, the data cursor,
        the train state and the step event's fields."""
        if self.optimizers:
            s.record(lr=self.optimizers[0].param_groups[0]["lr"])
        for opt in self.optimizers:
            opt.step()
        self.hooks.optimizer_stepped(s.step)
        for sched in self.schedulers:
            if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                assert s.loss is not None  # agreed by check()
                sched.step(s.loss)
            else:
                sched.step()
        assert self.data is not None  # under steps(), which reads it
        if self.data.sampler is not None:
            s.record(samples=self.data.sampler.global_batch_size)
            self.data.sampler.advance()
        self.state.step = s.step
        if acc.divisor is not None:
            tokens = int(acc.divisor)
            self.state.tokens_seen += tokens
            s.record(tokens=tokens)

    def record(self, **fields: Any) -> None:
        """Extra fields of the current step's ``step`` event (under :meth:`steps`)."""
        if self._ctx is None:
            raise RuntimeError(
                "ckpt.record() belongs inside 'for step, batch in ckpt.steps(...)', before optimizer_step()"
            )
        self._ctx.record(**fields)

    def request_stop(self) -> None:
        """End :meth:`steps` after the current step, with a final save (an early stop). Call on
        every rank at the same step (decide from agreed values, e.g. the global loss)."""
        self._stop_requested = True

    def end_of_step(self, s: StepContext | None, step: int, total_steps: int) -> int | None:
        """After each step ``s`` (a ``session.step`` context) — the one stop protocol of every
        loop, :meth:`steps` and the built-in trainer's alike: fenced → 73; preempted → the final
        commit, 75/76; non-finite → the policy (an exit code, or None after a rollback: continue
        from ``state.step``); else save when due, and at ``total_steps`` (or after
        :meth:`request_stop`) wait for the final commit: 0, 73 or 74. None: go on. When it returns
        a code the run has ended: the checkpointer is closed and the process should exit with it.
        ``s`` None: no step was left to run (resumed at ``total_steps``)."""
        sampler = self.data.sampler if self.data is not None else None
        return self.run.after_step(s, total_steps, stop=self._stop_requested, sampler=sampler)
