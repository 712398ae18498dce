"""One run's checkpoints and ends, under every front end.

A :class:`Run` is built from a :class:`~elastic_trainer.checkpoint.manager.CheckpointManager`
(:func:`build` makes one over the run's named states; a test injects its own) and owns what a
run does around its steps: :meth:`Run.resume`, one :meth:`Run.after_step` per step — fenced
(73), preempted (75/76), non-finite (65, or a rollback), a save when due, the final step — an
explicit :meth:`Run.save`, and :meth:`Run.finish` (the final commit: 0, 73 or 74). The built-in
trainer, a user's own loop, Lightning, Accelerate and the worker's exception path all end a step
and a run through these calls; what each ending decides is in :mod:`.ends`. A step
(:class:`~.step.StepContext`) reaches the run through :class:`StepHooks`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from .. import contract, exit_codes, faults
from ..checkpoint import cadence
from ..checkpoint.manager import CheckpointManager, LoadResult, SaveStats
from ..checkpoint.peer_tier import PeerNode
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
from ..config import check_run_identity
from ..events import write_record
from ..storage.fs import Storage
from . import anomaly, ends
from .session import Session
from .step import Votes

logger = logging.getLogger(__name__)

OTHER_LAUNCHER = "other"  # a manifest's command entry when no supervisor of ours started the script


def shape_fingerprint(model: nn.Module) -> str:
    """A fingerprint of a model's parameter names and shapes (for models without a config)."""
    items = sorted((k, tuple(v.shape)) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor))
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def named_states(
    model: nn.Module, optimizer: Any, scheduler: Any, train: TrainState, rng: RNGState, extra: dict[str, Stateful]
) -> dict[str, Stateful]:
    """The run's checkpointed states by name: the model and optimizers (through
    ``get/set_state_dict``, so a resume reshards), the LR schedulers, the train state, per-rank RNG
    and the caller's ``extra``.

    ``optimizer``/``scheduler``: one, or a dict of them by name (a generator and a discriminator,
    a Muon + AdamW split; every optimizer's parameters belong to ``model``); any torch LR
    scheduler (``ReduceLROnPlateau`` included) resumes through its own ``state_dict()``.
    ``extra``: more ``Stateful`` objects by name (a name without dots, none of the reserved
    ones); wrap one in :class:`~elastic_trainer.checkpoint.state.PerRank` when each rank has its
    own. Set ``optional_on_load = True`` on one added to a running job: a checkpoint without it
    leaves it as initialised (event ``state_added``)."""
    states: dict[str, Stateful] = {"model": ModelState(model)}
    if isinstance(optimizer, dict):
        states["optim"] = NamedStates({n: OptimizerState(model, o) for n, o in optimizer.items()})
    elif optimizer is not None:
        states["optim"] = OptimizerState(model, optimizer)
    if isinstance(scheduler, dict):
        states["lr_scheduler"] = NamedStates({n: SchedulerState(x) for n, x in scheduler.items()})
    elif scheduler is not None:
        states["lr_scheduler"] = SchedulerState(scheduler)
    states["train"], states["rng"] = train, rng
    for name, obj in extra.items():
        check_state_name(name)
        if name in states:
            raise ValueError(f"extra Stateful name {name!r} is reserved")
        states[name] = obj
    return states


def build(
    session: Session,
    states: dict[str, Stateful],
    *,
    fingerprint: str,
    run_identity: dict[str, Any],
) -> CheckpointManager:
    """The manager of ``session``'s run over ``states``, saving into ``checkpoint.dir``."""
    c = session.cfg.checkpoint
    return CheckpointManager(
        c,
        Storage.for_checkpoint(c),
        states,
        rank=session.rank,
        world_size=session.world_size,
        mesh_shape=list(session.mesh.shape),
        group=session.dist.ckpt_group,
        fingerprint=fingerprint,
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
        run_identity=run_identity,
        peer_node=PeerNode.from_environ(os.environ),  # where this node's holder is: the supervisor says
    )


def audit_stop() -> int | None:
    """The step a replay of ``ckpt audit`` ends at (``ELASTIC_TRAINER_REPLAY_TO_STEP``), else None."""
    raw = os.environ.get(contract.REPLAY_TO_STEP_ENV, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def open_run(
    session: Session,
    *,
    model: nn.Module,
    optimizer: Any = None,
    scheduler: Any = None,
    extra: dict[str, Stateful] | None = None,
    train_state: TrainState | None = None,
    fingerprint: str | None = None,
    run_identity: dict[str, Any] | None = None,
    manager: Callable[[dict[str, Stateful]], CheckpointManager] | None = None,
) -> Run:
    """The run of ``session`` over ``model`` and the rest (see :func:`named_states`), whose
    checkpoints a manager made by ``manager`` keeps (default: :func:`build`, into
    ``checkpoint.dir``; tests inject their own)."""
    state, rng = train_state or TrainState(), RNGState(session.rank, session.world_size)
    states = named_states(model, optimizer, scheduler, state, rng, extra or {})
    if manager is None:
        made = build(
            session, states, fingerprint=fingerprint or shape_fingerprint(model), run_identity=run_identity or {}
        )
    else:
        made = manager(states)
    return Run(session, made, state=state, rng=rng, identity=run_identity, model=model)


class Run:
    """The checkpoints and ends of one run on one :class:`~.session.Session` (registered as the
    session's run: its exception path lets an in-flight save land). ``state`` and ``rng`` are the
    train state and per-rank RNG among ``manager``'s states; ``identity`` the settings a resume
    must find unchanged (empty: none checked); ``model`` the model whose parameters a replay
    (``train.on_nonfinite = "replay"``) compares. Every call is made on every rank, in the same
    order."""

    def __init__(
        self,
        session: Session,
        manager: CheckpointManager,
        *,
        state: TrainState,
        rng: RNGState,
        identity: dict[str, Any] | None = None,
        model: nn.Module | None = None,
    ):
        self.session, self.manager, self.state, self.rng, self.model = session, manager, state, rng, model
        self.storage = manager.storage
        self.identity = identity or {}
        self.loaded: LoadResult | None = None
        # when to save; resume() replaces it with one that knows the run's lineage (auto)
        self.cadence = cadence.Cadence(session.cfg.checkpoint, rank=session.rank, start_step=0, now=time.monotonic())
        self.hooks = StepHooks(self)
        self.resumed = False
        self._rollback_window_open = False
        t = session.cfg.train
        self.spikes = anomaly.SpikeGuard(t.loss_spike_factor, t.loss_spike_window)
        self.replayer = anomaly.Replayer(model, session.rank, session.world_size, session.device)
        self.audit_stop = audit_stop()  # `ckpt audit`'s replay of this run: the step it ends at
        self._final_saved: int | None = None  # the step of the run's final save, once started
        self._closed = False
        session.run = self

    # ------------------------------------------------------------------ resume
    def resume(self, after_load: Callable[[LoadResult | None], dict[str, Any]] | None = None) -> int:
        """Load the newest valid commit of this lineage (falling back past bad ones), restore
        per-rank RNG (reseeded deterministically when the world size changed), write the
        ``start``/``resume``/``reshard``/``config_changed`` events and return the step to
        continue after (0 for a fresh start). ``after_load`` may add fields to the resume event.
        A commit whose run-identity settings differ from this run's: ConfigError (exit 2)."""
        s = self.session
        timeline = Timeline()
        timeline.add("session", s.init_seconds)
        timeline.add("build", time.monotonic() - s.ready)
        self.resumed = True
        s.events.emit(
            "start",
            world_size=s.world_size,
            restart_count=int(os.environ.get(contract.RESTART_COUNT_ENV, "0")),
            rank0_host=os.uname().nodename,
            pid=os.getpid(),
            checkpoint_dir=self.storage.describe(),
        )
        loaded = self.loaded = self.manager.load(timeline=timeline)
        if not self.rng.restored:  # a fresh start, or per-rank streams that do not map onto this world size
            self.rng.reseed(s.cfg.train.seed, self.state.step)
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
        allowed = check_run_identity(s.cfg, loaded.manifest.get("run_identity") or {}) if self.identity else []
        if allowed and loaded.first_start:
            changes = [{"key": k, "checkpoint": o, "config": n} for k, o, n in allowed]
            s.events.emit("config_changed", step=loaded.step, changes=changes)
        ends.resumed(s, loaded, self.state, self._rng_note(), fields, timeline)
        return loaded.step

    def _rng_note(self) -> str:
        if self.rng.restored:
            return "restored"
        return "seeded" if self.loaded is None else "reseeded from (train.seed, rank, step)"

    # ------------------------------------------------------------------ a step's end
    def after_step(self, ctx: Any, total_steps: int, *, stop: bool = False, sampler: Any = None) -> int | None:
        """After each step ``ctx`` (a ``session.step`` context), every front end's one stop
        protocol: fenced → 73; preempted → the final commit, 75/76; non-finite → the policy (an
        exit code, or None after a rollback: continue from ``state.step``); else a save when the
        cadence says so, and at ``total_steps`` (or with ``stop``, an early stop) :meth:`finish`.
        None: go on. A code ends the run (the run is closed; exit with it). ``ctx`` None: no step
        was left to run (resumed at the end). ``sampler``: the data's GlobalBatchSampler, whose
        cursor and skip list are the data position (else the train state's cursor is)."""
        if ctx is None:
            return self.finish()
        if ctx.fenced or ctx.preempt or ctx.nonfinite:
            code = self._stopped(ctx, sampler)
            if code is not None:
                self._close(code)
            return code
        pending = self.replayer.pending
        if pending is not None and ctx.step == pending.step:  # the replay passed the anomalous step
            code = self._replay_ended(ctx, reproduced=False)
            if code is not None:
                self._close(code)
                return code
        if stop or ctx.step >= total_steps or ctx.step == self.audit_stop:
            return self.finish(meta={"loss": ctx.loss})
        if self.cadence.due(ctx.step, total_steps):
            self.save(ctx.step, meta={"loss": ctx.loss})
            faults.maybe_inject("kill_in_save", ctx.step)
        return None

    def _stopped(self, ctx: Any, sampler: Any) -> int | None:
        s, m = self.session, self.manager
        if ctx.fenced:
            return ends.fenced(s, m, self.state.step)
        if ctx.preempt:
            return ends.preempted(s, m, self.state)
        cursor = sampler.cursor if sampler is not None else self.state.cursor
        size = sampler.global_batch_size if sampler is not None else s.cfg.train.global_batch_size
        sample_range = [cursor, cursor + size]
        ends.anomalous(s, ctx, sample_range)
        why = self._anomaly_policy(ctx, sample_range, sampler)
        return None if why is None else ends.nonfinite_stop(s, m, self.state, ctx, sample_range, why)

    def _anomaly_policy(self, ctx: Any, sample_range: list[int], sampler: Any) -> str | None:
        """``train.on_nonfinite`` on a refused step: None when the run goes on (rolled back, or
        replaying), else why it stops. A replay that reproduces its anomaly ends as a rollback."""
        mode, pending = self.session.cfg.train.on_nonfinite, self.replayer.pending
        if pending is not None:
            if ctx.step != pending.step:
                self.replayer.pending = None
                return f"another anomaly, at step {ctx.step}, while replaying step {pending.step}"
            self._replay_ended(ctx, reproduced=True)  # the data: its samples are skipped, as a rollback does
            mode = "rollback"
        elif mode == "replay":
            return None if self._start_replay(ctx) else "no committed checkpoint to roll back to"
        if mode != "rollback":
            return "train.on_nonfinite = stop"
        if self._rollback_window_open:
            return "a second non-finite event before a checkpoint after the last rollback"
        if not ends.rolled_back(self.session, self.manager, self.state, ctx, sample_range, sampler):
            return "no committed checkpoint to roll back to"
        self._after_reload()
        self._rollback_window_open = True
        return None

    def _start_replay(self, ctx: Any) -> bool:
        """``train.on_nonfinite = replay``: fingerprint this rank's state, reload the newest
        commit and replay the same batches up to ``ctx``'s step. False: no commit to go back to."""
        before = self.replayer.snapshot()
        loaded = ends.reload(self.session, self.manager)
        if loaded is None:
            return False
        self._after_reload()
        self.replayer.start(ctx.step, ctx.loss, loaded.step, before)
        ends.replaying(self.session, ctx, loaded.step)
        return True

    def _after_reload(self) -> None:
        """The state of the newest commit was reloaded: the spike test forgets the steps after it."""
        self.spikes.rolled_back(self.state.step)

    def _replay_ended(self, ctx: Any, *, reproduced: bool) -> int | None:
        """The replay reached its anomalous step again (``ctx``): judge it (:mod:`.anomaly`).
        An exit code when the node of the rank whose state differed leaves the job
        (``elastic.exclude_corrupt_node``, several nodes): the replayed step is committed first."""
        pending = self.replayer.pending
        assert pending is not None  # the caller checked
        outcome = self.replayer.resolve(reproduced)
        s = self.session
        per_node = int(os.environ.get(contract.LOCAL_WORLD_SIZE_ENV) or s.world_size)
        ends.replayed(s, outcome, pending.loss, ctx.loss, per_node)
        nodes = max(1, s.world_size // per_node)
        if outcome.reproduced or not outcome.ranks or not s.cfg.elastic.exclude_corrupt_node:
            return None
        if nodes == 1:
            logger.warning("elastic.exclude_corrupt_node: a single node has none to go on without it; it goes on")
            return None
        self.save(ctx.step, meta={"loss": ctx.loss}, final=True)
        return ends.excluded(s, self.manager, ctx.step, outcome.ranks[0] // per_node, nodes, s.rank // per_node)

    # ------------------------------------------------------------------ saving
    def save(self, step: int, meta: dict[str, Any] | None = None, final: bool = False) -> SaveStats:
        """Start an async save of ``step`` (a no-op if that step is already committed). Only
        after a finite step: non-finite state is never saved. ``final``: the run's last save:
        durable in checkpoint.dir even with a local tier, and :meth:`finish` waits for it."""
        recorded = {"skipped_ranges": self.state.skipped, **self._replay_record(), **(meta or {})}
        stats = self.manager.save(step, meta=recorded, durable=final)
        if final:
            self._final_saved = step
        if not stats.skipped:
            self._rollback_window_open = False
        self.cadence.saved(step, time.monotonic(), remote=stats.remote)
        return stats

    def _replay_record(self) -> dict[str, Any]:
        """What every manifest records for ``ckpt audit``'s replay of the run: the resolved config,
        the ranks per node (to name the node of a rank) and what the supervisor runs (``launch``;
        ``run`` with the script's command line and working directory; or another launcher)."""
        s = self.session
        to_dict = getattr(s.cfg, "to_dict", None)
        out: dict[str, Any] = {"config": to_dict()} if to_dict is not None else {}
        out["local_world_size"] = int(os.environ.get(contract.LOCAL_WORLD_SIZE_ENV) or s.world_size)
        command = os.environ.get(contract.SCRIPT_COMMAND_ENV)
        out["command"] = json.loads(command) if command else {"entry": OTHER_LAUNCHER}
        return out

    # ------------------------------------------------------------------ the end
    def finish(self, meta: dict[str, Any] | None = None) -> int:
        """End of training (every rank): save the last step (durably, unless that step is already
        committed in checkpoint.dir), wait (bounded by ``checkpoint.save_timeout_seconds``) for
        it and its commit, record the end and close. Returns the exit code, agreed by every rank:
        0; 73 when a newer launch fenced the final commit; 74 when the final step was saved but its
        commit failed or did not land in time (event ``final_checkpoint_failed``)."""
        step = self.state.step
        if step > 0 and not self.manager.is_committed(step):
            self.save(step, meta=meta, final=True)
            faults.maybe_inject("kill_in_save", step)
        code, restartable = ends.finished(self.session, self.manager, self.state.step, self._final_saved)
        self._close(code, restartable=restartable)
        return code

    def _close(self, code: int, *, restartable: bool = True) -> None:
        """Record how the run ended (``finished`` event, or every node's marker for its
        supervisor when ``code`` is not 0; ``restartable`` False: a restart cannot change the
        cause) and stop the background machinery. Every rank; once."""
        if self._closed:
            return
        self._closed = True
        s, m = self.session, self.manager
        if code == exit_codes.OK:
            last = m.last_committed_step
            s.events.emit(
                "finished", step=self.state.step, tokens_seen=self.state.tokens_seen, last_committed_step=last
            )
        else:
            # Every node's supervisor reads the marker in its own run.dir: each node's first
            # worker writes it (what it says is agreed by every rank), atomically, as run.dir may
            # also be one directory shared by the nodes.
            if s.dist.local_rank == 0:
                marker = {
                    "step": self.state.step,
                    "exit_code": code,
                    "committed_step": m.last_committed_step,
                    "restartable": restartable,
                }
                # Not written (run.dir full): the supervisor goes by the workers' exit codes.
                write_record(os.path.join(s.cfg.run.dir, contract.PREEMPT_MARKER), marker, f"the marker of exit {code}")
            if not restartable:  # no rank exits before the marker that tells the supervisor not to restart
                m.agreement.all_true(True)
        m.close(finished=code == exit_codes.OK)


class StepHooks:
    """What a step (:class:`~.step.StepContext`) asks of its run: the cadence's measurements,
    fault injection, the run's flags in the step's all-reduce, the staging wait and the exception
    path's drain. An internal protocol: front ends call :class:`Run`, never these."""

    def __init__(self, run: Run):
        self._run = run

    def begin_step(self, step: int, now: float) -> None:
        """Start of each step: the cadence measures the previous one (and whether a save was
        writing); a replay fingerprints the state its anomalous step starts from."""
        self._run.cadence.begin_step(now, self._run.manager.save_in_progress)
        self._run.replayer.begin_step(step)

    def optimizer_stepped(self, step: int) -> None:
        """After the optimizer step of ``step`` (every front end): fault injection (tests), a bit
        flipped in this rank's parameters."""
        if self._run.model is not None:
            faults.maybe_flip_bit(step, self._run.model.named_parameters())

    def judge_loss(self, step: int, loss: float) -> float | None:
        """The spike test of ``step``'s agreed finite global loss: the threshold it exceeded, else None."""
        return self._run.spikes.judge(step, loss)

    def commit_visible(self, step: int) -> bool:
        """Fault injection (tests, any rank): whether a commit of ``step`` is in checkpoint.dir."""
        return self._run.manager.fault_hooks.commit_visible(step)

    def inject_local_faults(self, step: int) -> None:
        """Fault injection (tests): lose or corrupt this rank's local copies at ``step``."""
        self._run.manager.fault_hooks.inject_local_faults(step)

    def votes(self, now: float) -> Votes:
        """This rank's checkpoint flags in the step's all-reduce: the time trigger, rank 0's
        ``auto`` interval, fenced, and the votes on the save in flight."""
        time_due, interval = self._run.cadence.votes(now)
        fenced = float(self._run.manager.fenced is not None)
        return Votes(time_due=time_due, fenced=fenced, interval=interval, save=self._run.manager.votes())

    def agreed(self, step: int, votes: Votes) -> None:
        """The all-reduced :meth:`votes` of ``step``."""
        self._run.cadence.agreed(step, votes.time_due, votes.interval)
        self._run.manager.agreed(votes.save)

    def before_optimizer_step(self) -> float:
        """Wait until the save in flight has copied the state out (the optimizer is about to
        change it). Returns the seconds waited."""
        return self._run.manager.wait_for_staging()

    def drain_after_failure(self) -> bool:
        """Exception path: let a save already uploading land (bounded); see the manager's."""
        return self._run.manager.drain_after_failure()
