"""The checkpointer of a training loop: every guarantee of the built-in trainer, for any loop.

Wraps :class:`~elastic_trainer.checkpoint.manager.CheckpointManager` over named ``Stateful``
objects (the model and optimizer through ``get/set_state_dict``, so a resume reshards; the LR
scheduler; the train state with the global sample cursor; per-rank RNG; any ``extra`` Stateful
of the user's, e.g. a :class:`~elastic_trainer.runtime.sampler.GlobalBatchSampler`), and adds
what a loop needs around it: resume events, the agreed preemption exit (75 only when the final
step is committed), non-finite rollback, the fenced exit, and the run's end.

Its public methods are the loop API: :meth:`steps` (with :meth:`optimizer_step`, :meth:`record`
and :meth:`request_stop` inside it), and for a loop that
keeps its own iteration, :meth:`resume` and :meth:`end_of_step` around ``session.step``. All
methods that touch collectives must be called on every rank in the same order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from .. import contract, exit_codes, faults, log
from ..checkpoint import cadence
from ..checkpoint.manager import CheckpointManager, LoadResult, SaveStats
from ..checkpoint.state import (
    ModelState,
    NamedStates,
    OptimizerState,
    RNGState,
    SchedulerState,
    TrainState,
    check_state_name,
)
from ..checkpoint.timeline import Timeline
from ..config import TrainConfig, check_run_identity
from ..errors import ConfigError
from ..events import write_record
from ..storage.fs import Storage
from .loop import Accumulator, StepData
from .session import Session
from .step import StepContext, Votes

logger = logging.getLogger(__name__)

BACKWARD_TWICE = (
    "a backward pass ran before ckpt.optimizer_step(loss), which does the backward itself "
    "(weighted by the batch's share of the global batch): remove loss.backward()"
)


def shape_fingerprint(model: nn.Module) -> str:
    """A fingerprint of a model's parameter names and shapes (for models without a config)."""
    items = sorted((k, tuple(v.shape)) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor))
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


class Checkpointer:
    """One training loop's checkpoints and exits, for one :class:`~.session.Session` (one per
    session: it registers itself as the session's checkpointer, whose exception path lets an
    in-flight save land).

    Owns the run's named states (model, optimizers, LR schedulers, the train state with the
    global sample cursor, per-rank RNG, the data loader's state and the user's ``extra``) and a
    :class:`~elastic_trainer.checkpoint.manager.CheckpointManager` over ``checkpoint.dir`` that
    saves them; resumes from the newest usable commit, saves on the configured cadence, rolls
    back a non-finite step, and turns preemption, a fenced root and the run's end into the
    agreed exits. Every method that touches collectives is called on every rank, in the same
    order."""

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
    ):
        """``optimizer``/``scheduler``: one, or a dict of them by name (a generator and a
        discriminator, a Muon + AdamW split; every optimizer's parameters belong to ``model``).
        Any torch LR scheduler (``ReduceLROnPlateau`` included) resumes through its own
        ``state_dict()``. ``extra``: more ``Stateful`` objects by name (a name without dots);
        wrap one in :class:`~elastic_trainer.checkpoint.state.PerRank` when each rank has its
        own (a per-rank data loader, RNG or metric). Set ``optional_on_load = True`` on a
        ``Stateful`` added to a running job: a checkpoint without it leaves it as initialised
        (event ``state_added``) instead of stopping the resume.

        ``data``: for :meth:`steps`, a ``DataLoader`` (over a map-style dataset it is made world-size
        invariant: see :mod:`.loop`; its ``batch_size`` is the micro-batch) or any iterable of
        batches; its state is checkpointed.

        ``run_identity``: the settings that define the run (a resume with any of them changed
        is refused naming the key, unless ``checkpoint.allow_changes`` names it); the built-in
        trainer passes ``Config.run_identity()``. Default: with a ``DataLoader`` made world-size
        invariant, ``train.global_batch_size`` and ``train.seed`` (they fix the sample order)."""
        self.session = session
        session.checkpointer = self  # its exception path lets this one's in-flight save land
        cfg = session.cfg
        self.state = train_state or TrainState()
        self.rng = RNGState(session.rank, session.world_size)
        states: dict[str, Stateful] = {"model": ModelState(model)}
        if isinstance(optimizer, dict):
            states["optim"] = NamedStates({n: OptimizerState(model, o) for n, o in optimizer.items()})
        elif optimizer is not None:
            states["optim"] = OptimizerState(model, optimizer)
        if isinstance(scheduler, dict):
            states["lr_scheduler"] = NamedStates({n: SchedulerState(x) for n, x in scheduler.items()})
        elif scheduler is not None:
            states["lr_scheduler"] = SchedulerState(scheduler)
        states["train"] = self.state
        states["rng"] = self.rng
        self.model = model
        self.optimizers = (
            list(optimizer.values()) if isinstance(optimizer, dict) else [optimizer] if optimizer is not None else []
        )
        self.schedulers = (
            list(scheduler.values()) if isinstance(scheduler, dict) else [scheduler] if scheduler is not None else []
        )
        t = cfg.train
        self.data = (
            None
            if data is None
            else StepData(
                data,
                global_batch=t.global_batch_size,
                seed=t.seed,
                rank=session.rank,
                world_size=session.world_size,
                device=session.device,
            )
        )
        if self.data is not None and self.data.state is not None:
            states["sampler"] = self.data.state
        if self.data is not None and self.data.sampler is not None:
            micro = self.data.sampler.micro_batch_size
            if t.micro_batch_size not in (micro, TrainConfig.micro_batch_size):
                raise ConfigError(
                    "train.micro_batch_size",
                    f"{t.micro_batch_size}, but the DataLoader's batch_size ({micro}) is this loop's micro-batch: "
                    f"make them agree (DataLoader(batch_size={t.micro_batch_size})) or leave the key out",
                )
            if run_identity is None:
                run_identity = {"train.global_batch_size": t.global_batch_size, "train.seed": t.seed}
        for name, obj in (extra or {}).items():
            check_state_name(name)
            if name in states:
                raise ValueError(f"extra Stateful name {name!r} is reserved")
            states[name] = obj
        c = cfg.checkpoint
        self.storage = Storage.for_checkpoint(c)
        self._identity = run_identity or {}
        self.manager = CheckpointManager(
            c,
            self.storage,
            states,
            rank=session.rank,
            world_size=session.world_size,
            mesh_shape=list(session.mesh.shape),
            group=session.dist.ckpt_group,
            fingerprint=fingerprint or shape_fingerprint(model),
            events=session.events,
            metrics=session.metrics,
            use_cuda_staging=session.device.type == "cuda",
            control_group=None,  # the training group: main-thread agreements never share the checkpoint group
            # The supervisor's epoch is for its checkpoint root; a script that checkpoints
            # elsewhere takes its own (joined by every restart of this launch) at load.
            epoch=(os.environ.get(contract.CHECKPOINT_EPOCH_ENV) or None)
            if os.environ.get(contract.CHECKPOINT_ROOT_ENV) == c.dir
            else None,
            launch_id=os.environ.get(contract.RUN_ID_ENV, ""),
            run_identity=self._identity,
        )
        self.loaded: LoadResult | None = None
        self._rollback_window_open = False
        # when to save; resume() replaces it with one that knows the run's lineage (auto)
        self.cadence = cadence.Cadence(c, rank=session.rank, start_step=0, now=time.monotonic())
        self._total_steps: int | None = None  # the final step's save is always durable
        self._resumed = False
        self._closed = False
        self._restartable = True  # False: the run ended for a cause a restart cannot change (marker for the supervisor)
        self._final_saved: int | None = None  # the step of the run's final save, once started
        self._acc: Accumulator | None = None  # the step in progress under steps()
        # the current batch under steps(): its loss weight, its index in the step, whether it ends the step
        self._weight, self._index, self._last = 0.0, 0, True
        self._ctx: StepContext | None = None
        self._stop_requested = False
        self.exit_code: int | None = None  # how steps() ended

    # ------------------------------------------------------------------ resume
    def resume(self, after_load: Callable[[LoadResult | None], dict[str, Any]] | None = None) -> int:
        """Load the newest valid commit of this lineage (falling back past bad ones), restore
        per-rank RNG (reseeded deterministically when the world size changed), write the
        ``start``/``resume``/``reshard``/``config_changed`` events and return the step to
        continue after (0 for a fresh start). ``after_load`` may add fields to the resume event."""
        s = self.session
        timeline = Timeline()
        timeline.add("session", s.init_seconds)
        timeline.add("build", time.monotonic() - s.ready)
        self._resumed = True
        restart = int(os.environ.get(contract.RESTART_COUNT_ENV, "0"))
        s.events.emit(
            "start",
            world_size=s.world_size,
            restart_count=restart,
            rank0_host=os.uname().nodename,
            pid=os.getpid(),
            checkpoint_dir=self.storage.describe(),
        )
        loaded = self.loaded = self.manager.load(timeline=timeline)
        if not self.rng.restored:  # a fresh start, or per-rank streams that do not map onto this world size
            self.rng.reseed(s.cfg.train.seed, self.state.step)
        rng_note = (
            "restored"
            if self.rng.restored
            else ("seeded" if loaded is None else "reseeded from (train.seed, rank, step)")
        )
        with timeline.phase("data_position"):
            fields = after_load(loaded) if after_load else {}
        self.cadence = cadence.from_run(
            s.cfg.checkpoint,
            os.path.join(s.cfg.run.dir, contract.EVENTS_FILE),
            rank=s.rank,
            start_step=self.state.step,
            now=time.monotonic(),
            events=s.events,
            metrics=s.metrics,
        )
        if loaded is None:
            return 0
        allowed = check_run_identity(s.cfg, loaded.manifest.get("run_identity") or {}) if self._identity else []
        if allowed and loaded.first_start:
            s.events.emit(
                "config_changed",
                step=loaded.step,
                changes=[{"key": k, "checkpoint": o, "config": n} for k, o, n in allowed],
            )
        saved_world = loaded.manifest.get("world_size")
        s.events.emit(
            "resume",
            step=loaded.step,
            from_world_size=saved_world,
            world_size=s.world_size,
            load_seconds=round(loaded.seconds, 4),
            since_start_seconds=round(time.monotonic() - s.started, 4),
            cursor=self.state.cursor,
            skipped=[list(x) for x in loaded.skipped],
            rng=rng_note,
            tier=loaded.tier,
            **({"tiers": loaded.tiers} if loaded.tiers else {}),
            **fields,
            **timeline.as_fields(),
        )
        logger.debug("rank %d resume timeline: %s", s.rank, timeline.describe())
        if saved_world != s.world_size:
            s.events.emit(
                "reshard",
                step=loaded.step,
                from_world_size=saved_world,
                to_world_size=s.world_size,
                from_mesh=loaded.manifest.get("mesh_shape"),
                to_mesh=list(s.mesh.shape),
                rng=rng_note,
            )
            s.metrics.counter("elastic_trainer_reshard_events_total")
        if s.rank == 0:
            logger.info(
                "resumed from step %d (saved at world %s, now %d) in %.2fs",
                loaded.step,
                saved_world,
                s.world_size,
                loaded.seconds,
            )
        return loaded.step

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
        :meth:`optimizer_step` per ``batch``. Resumes first (unless :meth:`resume` was called),
        then runs each step in the step context (hang watchdog, agreed preemption and fencing),
        saves on the cadence (``checkpoint.interval_steps``/``interval_seconds``/``auto``, and the
        final step), applies the non-finite policy (``train.on_nonfinite``) and, at the end, waits
        for the final commit.

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

        ``after_step(s)``: called on every rank after each step whose ``step`` event was written
        (``s.event``), before its save (e.g. a progress line).

        The loop ends after ``total_steps``, or earlier on preemption (75/76), fencing (73), a
        non-finite stop (65) or :meth:`request_stop`. ``exit_code`` holds the code; when it is not
        0 the process exits with it after the loop (``exit_on_stop=False``: the loop just ends)."""
        if self.data is None:
            raise ValueError("Checkpointer(data=...) is needed for steps(): a DataLoader or any iterable of batches")
        if not self._resumed:
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
        if code != exit_codes.OK and exit_on_stop:
            raise SystemExit(code)

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
            if self.optimizers:
                s.record(lr=self.optimizers[0].param_groups[0]["lr"])
            for opt in self.optimizers:
                opt.step()
            for sched in self.schedulers:
                if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    assert s.loss is not None  # agreed by check()
                    sched.step(s.loss)
                else:
                    sched.step()
            assert self.data is not None  # under steps(), which reads it
            if self.data.sampler is not None:
                self.data.sampler.advance()
            self.state.step = s.step
            if acc.divisor is not None:
                tokens = int(acc.divisor)
                self.state.tokens_seen += tokens
                s.record(tokens=tokens)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self._ctx = self._acc = None
        return s.loss

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

    def end_of_step(self, s, step: int, total_steps: int) -> int | None:
        """After each step ``s`` (a ``session.step`` context) — the one stop protocol of every
        loop, :meth:`steps` and the built-in trainer's alike: fenced → 73; preempted → the final
        commit, 75/76; non-finite → the policy (an exit code, or None after a rollback: continue
        from ``state.step``); else save when due, and at ``total_steps`` (or after
        :meth:`request_stop`) wait for the final commit: 0, 73 or 74. None: go on. When it returns
        a code the run has ended: the checkpointer is closed and the process should exit with it.
        ``s`` None: no step was left to run (resumed at ``total_steps``)."""
        self._total_steps = total_steps
        code: int | None = None
        if s is None:
            code = self._finish()
        elif s.fenced:
            code = self._fenced_exit()
        elif s.preempt:
            code = self._preempt_exit()
        elif s.nonfinite:
            code = self._on_nonfinite(step, s.loss, s.grad_norm, self.data.sampler if self.data is not None else None)
        else:
            final = self._stop_requested or step >= total_steps
            if self.cadence.due(step, total_steps, stop=self._stop_requested):
                self._save(step, meta={"loss": s.loss}, final=final)
                faults.maybe_inject("kill_in_save", step)
            if final:
                code = self._finish()
        if code is not None:
            self._close(code)
        return code

    # ------------------------------------------------------------------ the step's hooks (StepContext)
    def begin_step(self, now: float) -> None:
        """Start of each step: the cadence measures the previous one (and whether a save was writing)."""
        self.cadence.begin_step(now, self.manager.save_in_progress)

    def commit_visible(self, step: int) -> bool:
        """Fault injection (tests, any rank): whether a commit of ``step`` is in checkpoint.dir."""
        return self.manager.commit_visible(step)

    def inject_local_faults(self, step: int) -> None:
        """Fault injection (tests): lose or corrupt this rank's local copies at ``step``."""
        self.manager.inject_local_faults(step)

    def votes(self, now: float) -> Votes:
        """This rank's checkpoint flags in the step's all-reduce: the time trigger, rank 0's
        ``auto`` interval, fenced, and the votes on the save in flight."""
        time_due, interval = self.cadence.votes(now)
        fenced = float(self.manager.fenced is not None)
        return Votes(time_due=time_due, fenced=fenced, interval=interval, save=self.manager.votes())

    def agreed(self, step: int, votes: Votes) -> None:
        """The all-reduced :meth:`votes` of ``step``."""
        self.cadence.agreed(step, votes.time_due, votes.interval)
        self.manager.agreed(votes.save)

    def before_optimizer_step(self) -> float:
        """Wait until the save in flight has copied the state out (the optimizer is about to
        change it). Returns the seconds waited."""
        return self.manager.wait_for_staging()

    def drain_after_failure(self) -> bool:
        """Exception path: let a save already uploading land (bounded); see the manager's."""
        return self.manager.drain_after_failure()

    # ------------------------------------------------------------------ saving
    def _save(self, step: int, meta: dict[str, Any] | None = None, final: bool = False) -> SaveStats:
        """Start an async save of ``step`` (a no-op if that step is already committed). Only
        after a finite step: non-finite state must never be saved. ``final``: the run's last
        save (also implied at ``total_steps``): durable in checkpoint.dir even with a local tier."""
        final = final or (self._total_steps is not None and step >= self._total_steps)
        stats = self.manager.save(step, meta={"skipped_ranges": self.state.skipped, **(meta or {})}, durable=final)
        if final:
            self._final_saved = step
        if not stats.skipped:
            self._rollback_window_open = False
        self.cadence.saved(step, time.monotonic(), remote=stats.remote)
        return stats

    # ------------------------------------------------------------------ ending
    def _finish(self) -> int:
        """End of training (every rank): wait (bounded by ``checkpoint.save_timeout_seconds``)
        for the last save and its commit. Returns the exit code, agreed by every rank: 0; 73 when
        a newer launch fenced the final commit; 74 when the final step was saved but its commit
        failed or did not land in time (event ``final_checkpoint_failed``)."""
        m, s = self.manager, self.session
        settled = m.settle(time.monotonic() + s.cfg.checkpoint.save_timeout_seconds)
        if m.fenced_everywhere():  # the final commit was refused: a newer launch owns the root
            return self._fenced_exit()
        final = self._final_saved
        if final is None or (settled and m.committed_everywhere(final)):
            return exit_codes.OK
        reason = "the save or its commit failed" if settled else "still writing after checkpoint.save_timeout_seconds"
        cause = m.failed_permanently() if settled else None
        if cause is not None:
            reason = f"the save failed for a cause a restart cannot change: {cause}"
        self._restartable = cause is None
        logger.error(
            "final checkpoint of step %d not committed (%s); exiting %d", final, reason, exit_codes.FINAL_SAVE_FAILED
        )
        s.events.emit(
            "final_checkpoint_failed",
            step=final,
            reason=reason,
            last_committed_step=m.last_committed_step,
            restartable=cause is None,
        )
        return exit_codes.FINAL_SAVE_FAILED

    def _preempt_exit(self) -> int:
        """All ranks agreed to stop for preemption: commit the final step within the grace budget.

        Every decision below is agreed by all ranks, so all ranks enter the same collectives and
        return the same code: 75 only when a commit of the final step exists in storage (already,
        or written now), else 76."""
        s, m = self.session, self.manager
        done = self.state.step
        grace = s.cfg.checkpoint.preempt_grace_seconds
        started = s.preempt.received_at or time.monotonic()
        deadline = started + grace
        s.events.emit("preempt_requested", step=done, signal=s.preempt.signal_name, grace_seconds=grace)
        logger.warning("preemption (%s): saving step %d within %.0fs", s.preempt.signal_name, done, grace)
        committed = False
        if m.settle(deadline):
            committed = m.committed_everywhere(done)
            if not committed and done > 0:
                m.save(done, force=True, meta={"skipped_ranges": self.state.skipped})
                committed = m.settle(deadline) and m.committed_everywhere(done)
        if not committed:
            reason = "grace budget exceeded" if time.monotonic() >= deadline else "final checkpoint not committed"
            s.events.emit("preempted", step=done, committed=False, reason=reason)
            logger.error(
                "preemption checkpoint of step %d not committed (%s); exiting %d",
                done,
                reason,
                exit_codes.PREEMPTED_UNCOMMITTED,
            )
            return exit_codes.PREEMPTED_UNCOMMITTED
        s.events.emit("preempted", step=done, committed=True, seconds=round(time.monotonic() - started, 3))
        return exit_codes.PREEMPTED

    def _fenced_exit(self) -> int:
        """A newer launch owns the checkpoint root (agreed by every rank): stop, exit 73."""
        reason = self.manager.fenced or "a newer launch owns the checkpoint root"
        self.session.events.emit("fenced", step=self.state.step, error=reason)
        logger.error("stopping: %s", reason)
        return exit_codes.FENCED

    def _on_nonfinite(
        self, step: int, loss: float, grad_norm: float, sampler: Any = None, global_batch_size: int | None = None
    ) -> int | None:
        """A non-finite loss or gradient norm at ``step`` (agreed by every rank; the optimizer
        step was not taken). ``train.on_nonfinite = stop``: exit 65 (nothing after the last
        finite step is committed). ``rollback``: reload the newest commit of this lineage (a save
        still writing past its deadline is abandoned, never committed), skip the global sample
        range that produced the event (kept in the train state, so later resumes skip it too) and
        continue; a second event before a save after the first stops. Returns an exit code, or
        None to continue. ``sampler``: a GlobalBatchSampler whose cursor and skip list are the
        data state (else the train state's cursor is)."""
        s = self.session
        cursor = sampler.cursor if sampler is not None else self.state.cursor
        size = global_batch_size or (sampler.global_batch_size if sampler is not None else None)
        sample_range = [cursor, cursor + (size or s.cfg.train.global_batch_size)]
        mode = s.cfg.train.on_nonfinite
        s.events.emit("nonfinite", step=step, loss=loss, grad_norm=grad_norm, sample_range=sample_range, action=mode)
        s.metrics.counter("elastic_trainer_train_nonfinite_events_total")
        logger.error("non-finite loss %s / grad norm %s at step %d (samples %s)", loss, grad_norm, step, sample_range)
        if mode == "rollback" and not self._rollback_window_open:
            self.manager.settle(time.monotonic() + s.cfg.checkpoint.save_timeout_seconds)
            loaded = self.manager.load(resume="latest")
            if loaded is not None:
                if sampler is not None:
                    sampler.skip(sample_range)
                else:
                    self.state.skipped.append(sample_range)
                self._rollback_window_open = True
                s.events.emit(
                    "rollback",
                    from_step=step,
                    to_step=loaded.step,
                    skipped_range=sample_range,
                    skipped_ranges=self.state.skipped,
                )
                logger.warning("rolled back to step %d; skipping samples %s", loaded.step, sample_range)
                return None
            why = "no committed checkpoint to roll back to"
        elif mode == "rollback":
            why = "a second non-finite event before a checkpoint after the last rollback"
        else:
            why = "train.on_nonfinite = stop"
        self.manager.settle(time.monotonic() + s.cfg.checkpoint.save_timeout_seconds)
        s.events.emit("nonfinite_stop", step=step, reason=why, last_finite_step=self.state.step)
        logger.error("stopping at step %d (%s); last finite step %d", step, why, self.state.step)
        return exit_codes.NONFINITE

    def _close(self, code: int) -> None:
        """Record how the run ended (``finished`` event, or rank 0's marker for the supervisor
        when ``code`` is not 0) and stop the background machinery. Every rank; once."""
        if self._closed:
            return
        self._closed = True
        s = self.session
        if code == exit_codes.OK:
            s.events.emit(
                "finished",
                step=self.state.step,
                tokens_seen=self.state.tokens_seen,
                last_committed_step=self.manager.last_committed_step,
            )
        else:
            # Every node's supervisor reads the marker in its own run.dir: each node's first
            # worker writes it (what it says is agreed by every rank), atomically, as run.dir may
            # also be one directory shared by the nodes.
            if s.dist.local_rank == 0:
                marker = {
                    "step": self.state.step,
                    "exit_code": code,
                    "committed_step": self.manager.last_committed_step,
                    "restartable": self._restartable,
                }
                path = os.path.join(s.cfg.run.dir, contract.PREEMPT_MARKER)
                # Not written (run.dir full): the supervisor goes by the workers' exit codes.
                write_record(path, marker, f"the marker of exit code {code}")
            if not self._restartable:  # no rank exits before the marker that tells the supervisor not to restart
                self.manager.agreement.all_true(True)
        self.manager.close(finished=code == exit_codes.OK)

    # ------------------------------------------------------------------ the earlier lower-level API
    def __getattr__(self, name: str) -> Any:
        """Scripts written against the earlier lower-level API (``due``/``save``/``finish``/
        ``close``/``preempt_exit``/``fenced_exit``/``on_nonfinite``/``wait_for_staging``) keep
        running, with a DeprecationWarning naming what replaces them: :meth:`end_of_step`."""
        target = _EARLIER_API.get(name)
        if target is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(
            f"Checkpointer.{name}() is deprecated: after each step, code = ckpt.end_of_step(s, step, total_steps) "
            "does fencing, preemption, the non-finite policy, the cadence and the end",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(self, target)

    def _earlier_due(self, step: int, total_steps: int, save_due: bool = False) -> bool:
        self._total_steps = total_steps
        return self.cadence.due(step, total_steps) or save_due

    def _earlier_on_nonfinite(
        self, step: int, loss: float, grad_norm: float, global_batch_size: int, sampler: Any = None
    ) -> int | None:
        return self._on_nonfinite(step, loss, grad_norm, sampler, global_batch_size)

    def _earlier_wait_for_staging(self) -> Any:
        return self.manager.wait_for_staging()


# the earlier lower-level API: its names, and the methods that serve them
_EARLIER_API = {
    "due": "_earlier_due",
    "save": "_save",
    "finish": "_finish",
    "close": "_close",
    "preempt_exit": "_preempt_exit",
    "fenced_exit": "_fenced_exit",
    "on_nonfinite": "_earlier_on_nonfinite",
    "wait_for_staging": "_earlier_wait_for_staging",
}
