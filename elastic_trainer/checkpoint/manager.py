"""The checkpoint manager: the collective, every-rank part of checkpointing.

Public surface (methods that touch collectives must be called on every rank, at the same step
boundary, in the same order):

* :meth:`load` → resumes from what the catalog plans (or None); falls back past checkpoints
  that fail to load, quarantining each, in the same start.
* :meth:`save` → starts a save of ``step`` (async by default). Saving a step that is already
  committed (the one just loaded, or one this incarnation committed) is a no-op that counts.
* :meth:`wait_for_staging` → call before anything mutates the saved tensors (optimizer.step).
* :meth:`settle` / :meth:`finish` → wait (bounded) for the save in flight and its commit;
  ``verdicts`` (:class:`Verdicts`: ``committed_everywhere``, ``fenced_everywhere``,
  ``failed_permanently``) → rank 0's answers, agreed.
* ``fault_hooks`` (:class:`FaultHooks`) → fault injection for the tests.
* :meth:`close`.

Each save is a :class:`~.save.Save` (its states and transitions are documented there); the
manager keeps at most one in flight. What a save does (which tiers, which name, the lineage in
its manifests) is decided by :func:`.position.plan_save` from the manager's
:class:`~.position.Position`; its bytes are written by the savers it is given (:mod:`.savers`:
checkpoint.dir through DCP, and the local tier, which commits its own copies, replicated to
other nodes by :mod:`.peer_tier`); rank 0 commits
checkpoint.dir saves through its :class:`~.commit.Committer`; a load is the
:class:`~.restore.Restorer`'s fallback loop; its agreements go through the
:class:`~.agreement.Agreement` it is given, and rank 0's bookkeeping (scan, verification,
commit, quarantine, retention, fencing) is the :class:`~.catalog.Catalog`'s. The manager never
looks inside the ``Stateful`` objects it is given.

Storage time is bounded by ``checkpoint.save_timeout_seconds`` per save, never by the hang
watchdog: a save still writing when the next one is due is waited for at most until its deadline;
past it, the new save is skipped (``checkpoint_failed``) and training goes on. Whether every
rank's previous save is done is agreed with one tiny all-reduce on the *control* group (the
training group), never on the checkpoint group a background upload may be using. A load (a
rollback) gives up on a save still writing: it is abandoned, never committed, and its directory
is kept out of the names later saves use.

With ``checkpoint.writer = "process"`` the checkpoint.dir upload runs in a persistent writer
process per rank; before each such save the ranks also agree that every writer is usable, and
replace them all together when one is not (:meth:`.savers.ProcessWriterSaver.check`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, cast

import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from .. import faults
from ..config import CheckpointConfig
from ..events import EventLog
from ..metrics.sink import MetricsSink, NullSink
from ..storage.fs import Storage
from . import layout, peer_tier, writer_process
from .agreement import Agreed, Agreement, SaveVotes
from .catalog import Catalog, checkpoint_key
from .commit import Committer
from .local_tier import LocalTier
from .position import Position, SavePlan, plan_save, remote_due
from .restore import Restorer
from .resume import LoadResult
from .save import Save, SaveContext, SaveState, SaveStats
from .savers import LocalSaver, ProcessWriterSaver, RemoteSaver, remote_saver
from .state import PerRank, manifest_summaries, state_types
from .timeline import Timeline

logger = logging.getLogger(__name__)

DRAIN_SECONDS = 10.0  # how long the exception path waits for a save already uploading
# settle: the ranks agree at least this often while a save is still writing somewhere, so a rank
# whose part is done never waits in a collective for longer (it would time out at the training
# group's timeout, elastic.hang_timeout_seconds >= 5, while the other waits up to the save's deadline)
SETTLE_POLL_SECONDS = 1.0
_OK = (SaveState.COMMITTED, SaveState.WRITTEN)  # a save's ends that mean "this rank's part is done"


def _local_savers(
    cfg: CheckpointConfig, root: str, ctx: SaveContext, *, cuda_staging: bool, node: peer_tier.PeerNode | None
) -> tuple[LocalSaver | peer_tier.PeerSaver, peer_tier.PeerTier | None]:
    """The local tier's saver under ``cfg.local_dir`` (every save, per rank; checkpoint.dir gets
    every remote_every-th and every durable one: see :mod:`.local_tier`), replicating to other
    nodes' memory when the peer tier is on; and that peer tier (None: off)."""
    tier = LocalTier(cfg.local_dir, root, rank=ctx.rank, world_size=ctx.world_size, key=checkpoint_key())
    local = LocalSaver(tier, ctx, mode=cfg.mode, cuda_staging=cuda_staging)
    peer = peer_tier.peer_tier_for(cfg, tier, root, key=tier.key, node=node, metrics=ctx.metrics, events=ctx.events)
    return (local, None) if peer is None else (peer_tier.PeerSaver(local, peer), peer)


class CheckpointManager:
    """Checkpointing of named ``Stateful`` objects on every rank.

    ``remote``/``local``: the savers (defaults: :func:`~.savers.remote_saver` into ``storage``
    per ``cfg.mode``/``cfg.writer``, and a :class:`~.savers.LocalSaver` when ``cfg.local_dir`` is
    set, replicated to other nodes through the peer tier per ``cfg.peer_replicas``); ``peer``: the
    peer tier a given ``local`` replicates through (the load reads the nodes' copies through it);
    ``peer_node``: where this rank's node sits among the peer holders (:class:`~.peer_tier.PeerNode`,
    read from the environment by the caller); ``agreement``: how the ranks agree (default: the
    process groups; with one rank, the identity). ``group`` is the checkpoint group DCP loads and
    saves on; ``control_group`` the training group the agreements between saves use."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        storage: Storage,
        states: dict[str, Stateful],
        *,
        rank: int,
        world_size: int,
        mesh_shape: list[int],
        group: dist.ProcessGroup | None,
        fingerprint: str,
        events: EventLog | None = None,
        metrics: MetricsSink | None = None,
        use_cuda_staging: bool = False,
        control_group: dist.ProcessGroup | None = None,
        epoch: str | None = None,
        launch_id: str = "",
        run_identity: dict[str, Any] | None = None,
        remote: RemoteSaver | None = None,
        local: LocalSaver | peer_tier.PeerSaver | None = None,
        peer: peer_tier.PeerTier | None = None,
        peer_node: peer_tier.PeerNode | None = None,
        agreement: Agreement | None = None,
    ):
        self.cfg, self.storage, self.states, self.rank, self.world_size = cfg, storage, states, rank, world_size
        self.events = events or EventLog(None)
        self.metrics = metrics or NullSink()
        self.agreement = agreement or Agreement(world_size, group, control_group)
        self.remote = remote or remote_saver(
            storage, group, mode=cfg.mode, writer=cfg.writer, cuda_staging=use_cuda_staging
        )
        ctx = SaveContext(rank, world_size, mesh_shape, fingerprint, self.events, self.metrics)
        if local is None and cfg.local_dir:
            local, peer = _local_savers(cfg, storage.root, ctx, cuda_staging=use_cuda_staging, node=peer_node)
        self._local_saver = local
        self.local = local.tier if local is not None else None
        only = cfg.resume_certified_only
        self.catalog = Catalog(storage, epoch=epoch, events=self.events, certified_only=only) if rank == 0 else None
        self.committer = Committer(self.catalog, ctx, keep_last=cfg.keep_last, keep_every=cfg.keep_every)
        # certified commits are checkpoint.dir's: with resume_certified_only no copy of a tier is loaded
        tiers = {"local": self.local, "peer": peer} if not only else {"local": None, "peer": None}
        self.restorer = Restorer(states, storage, self.catalog, self.agreement, ctx, launch_id=launch_id, **tiers)
        self._manifest = {"launch": launch_id, "finite": True, "run_identity": run_identity or {}}  # in every one
        self._manifest["state_types"] = state_types(states)  # compared at resume
        self._inflight: Save | None = None
        self._agreed: Agreed | None = None  # the step's all-reduce about _inflight
        self.last_save: Save | None = None  # the newest settled save
        self._drain_deadline: float | None = None  # the exception path's budget, once started
        self._writers_started = False  # process writer: started at the first agreement or save (all ranks)
        self._loaded_step: int | None = None
        self._loaded_tier: str | None = None
        self._position = Position()  # the current state's lineage (same on every rank)
        self._committed: set[int] = set()  # steps this incarnation committed to checkpoint.dir (agreed)
        self._last_stats: SaveStats | None = None  # the newest save started (or timed out); staging adds to it
        self.verdicts = Verdicts(self.agreement, self.committer, rank, last_save=lambda: self.last_save)
        self.fault_hooks = FaultHooks(storage, self.local, epoch=lambda: self._position.epoch, settle=self._settle)
        for s in states.values():
            if isinstance(s, PerRank):
                s.bind(rank, world_size)

    @property
    def last_committed_step(self) -> int | None:
        """Rank 0: the newest commit it knows of (loaded, or committed since)."""
        return self.committer.last_committed

    @property
    def fenced(self) -> str | None:
        """Rank 0: why a newer launch stopped our commits (None: it did not)."""
        return self.committer.fenced

    # ------------------------------------------------------------------ load
    def load(self, resume: str | None = None, *, timeline: Timeline | None = None) -> LoadResult | None:
        """Resume from what the catalog plans for ``resume`` (default ``cfg.resume``). All ranks.

        Before a byte of tensor data is read, rank 0 checks that the chosen checkpoint fits the
        registered state (:mod:`.compat`); every rank gets the same answer. A checkpoint that
        does not fit raises :class:`CheckpointIncompatibleError` naming every key: nothing is
        quarantined and no older checkpoint is tried (it has the same layout). A checkpoint
        whose bytes fail (checksum, a file missing or short, unpicklable data) is quarantined
        with a ``checkpoint_skipped`` event and the next older valid one is loaded in the same
        start. When commits exist but none can be loaded, :class:`NoUsableCheckpointError`:
        never a silent start from step 0. Raises CheckpointError when an explicitly requested
        step is unusable and FencedError when a newer launch owns the root. ``timeline``: where
        the load's phases go (:mod:`.timeline`)."""
        resume = self.cfg.resume if resume is None else resume
        self._abandon_inflight()
        restored = self.restorer.load(
            self._position, resume, clean=self.committer.generation == 0, timeline=timeline or Timeline()
        )
        self._position = restored.position
        self.committer.loaded(restored.committed)  # a commit of a save from before this load no longer counts
        self._loaded_step = restored.result.step if restored.result else None
        self._loaded_tier, self._committed = restored.tier, set()
        return restored.result

    def _abandon_inflight(self) -> None:
        """Before a load: a save still writing (a rollback after its deadline passed) is given up
        on: it is never committed, and its name stays taken. A commit already in progress is
        waited for, so the plan sees it."""
        save, self._inflight, self._agreed = self._inflight, None, None
        if save is None:
            return
        if save.abandon("a load replaced the state it saves"):
            logger.warning("checkpoint step %d abandoned: still writing when the state was reloaded", save.step)
        else:  # committing (short, bounded by storage timeouts) or ended: let it land before planning
            save.wait(max(save.deadline, time.monotonic() + self.cfg.storage_timeout_seconds))
        self.metrics.gauge("elastic_trainer_checkpoint_saves_in_flight", 0)

    # ------------------------------------------------------------------ save
    @property
    def save_in_progress(self) -> bool:
        """Whether this rank's part of the latest save is still being written. Rank-local: a
        measurement (checkpoint cadence), never a decision that ranks must share."""
        save = self._inflight
        return save is not None and save.writing

    def is_committed(self, step: int) -> bool:
        """Whether every rank knows ``step`` committed in checkpoint.dir: loaded from there, or
        saved there by this incarnation and agreed committed. A save of such a step is a no-op."""
        return (step == self._loaded_step and self._loaded_tier == "remote") or step in self._committed

    def save(
        self,
        step: int,
        *,
        blocking: bool = False,
        meta: dict[str, Any] | None = None,
        force: bool = False,
        durable: bool = False,
    ) -> SaveStats:
        """Start saving ``step``. All ranks. ``meta`` goes into the manifest (e.g. the loss).

        Waits for the previous save first, at most until that save's deadline (measured); when
        it is still writing on some rank past it, this save is skipped (``checkpoint_failed``).
        With ``checkpoint.mode = "async"`` this returns once the state is handed to a background
        stager; call :meth:`wait_for_staging` before mutating parameters. Which tiers get the
        save (with a local tier, checkpoint.dir gets a ``durable``, ``force``d or ``blocking``
        one, or the ``remote_every``-th): :func:`.position.plan_save`."""
        stats, t0 = SaveStats(step), time.monotonic()
        self._writers_started = True  # a save before the first step starts them itself (DCP's way)
        due: dict[str, Any] = {
            "force": force,
            "blocking": blocking,
            "durable": durable,
            "remote_every": self.cfg.remote_every,
        }
        due["has_local"] = self.local is not None
        settled = self._wait_previous(remote_due(self._position, **due))
        stats.wait_previous = time.monotonic() - t0
        self.metrics.histogram("elastic_trainer_checkpoint_wait_previous_seconds", stats.wait_previous)
        if not settled:
            return self._skip_behind(stats)
        plan, self._position = plan_save(self._position, step, committed=self.is_committed(step), **due)
        if plan.skipped:
            stats.skipped = plan.skipped
            return stats
        t1 = time.monotonic()
        stats.remote = plan.name is not None
        self._start(step, plan, t1, meta)
        stats.call = time.monotonic() - t1
        self._last_stats = stats
        if blocking:
            self.wait_for_staging()
            self.settle(None)
        return stats

    def _wait_previous(self, remote: bool) -> bool:
        """Before a save, every rank: settle the previous one (and, with the process writer and a
        save to checkpoint.dir, check the writers unless the step's all-reduce found every rank's
        usable and that save ended well). Returns whether it is settled."""
        agreed, inflight, process = self._agreed, self._inflight, self.remote.uses_writer_process
        # process writer: the save in flight failed on some rank while others still write it: their
        # writers wait in DCP's collectives for writers that never join (a rank that could not stage
        # it): stop every writer now rather than wait for its deadline
        doomed = (
            inflight is not None
            and agreed is not None
            and agreed.save is inflight
            and not agreed.settled
            and not agreed.ok
        )
        if not (process and doomed):
            settled = self.settle(inflight.deadline if inflight else None)
            if not (process and remote and not (agreed is not None and agreed.clear)):
                return settled
        events = self.events if self.rank == 0 else None
        writers = cast(ProcessWriterSaver, self.remote)  # uses_writer_process: the process writer
        if writers.check(self.agreement, stuck=self._inflight, doomed=doomed, events=events):
            return True
        # the stopped writer failed that save: wait for it to say so
        return self.settle(time.monotonic() + writer_process.STOP_TIMEOUT_SECONDS * 2)

    def _skip_behind(self, stats: SaveStats) -> SaveStats:
        """The previous save is still writing past its deadline somewhere: this one is skipped."""
        assert self._inflight is not None  # still writing
        stats.skipped = (
            f"previous save of step {self._inflight.step} still writing after {self.cfg.save_timeout_seconds:.0f}s"
        )
        logger.error("checkpoint step %d skipped: %s", stats.step, stats.skipped)
        if self.rank == 0:
            self.events.emit("checkpoint_failed", step=stats.step, error=stats.skipped, seconds=0.0)
            self.metrics.counter("elastic_trainer_checkpoint_save_failures_total")
        self._last_stats = stats
        return stats

    def _start(self, step: int, plan: SavePlan, started: float, meta: dict[str, Any] | None) -> None:
        """Start the savers ``plan`` names (no collectives) and wire their ends into the save."""
        self.metrics.gauge("elastic_trainer_checkpoint_saves_in_flight", 1)
        summaries = manifest_summaries(self.states)
        manifest = {"parent": None, "seq": 0, **self._manifest, "summaries": summaries, **(meta or {})}
        deadline = started + self.cfg.save_timeout_seconds
        sync, epoch = self.cfg.mode == "sync", self._position.epoch
        save = Save(step, plan.name, started=started, deadline=deadline, staged=sync, epoch=epoch)
        self._inflight = save
        if plan.name is not None:
            remote, generation = {**manifest, **plan.remote_extra}, self.committer.generation
            self.committer.mark_writer(plan.name)
            staging, save.written = self.remote.start(save, self.states, remote)
            save.stagings.append(staging)
            save.written.add_done_callback(lambda f: self.committer.written(save, f, remote, generation))
        if plan.local:
            assert self._local_saver is not None  # planned with a local tier only
            staging, committed = self._local_saver.start(save, self.states, {**manifest, **plan.local_extra})
            save.stagings.append(staging)
            if plan.name is not None:
                save.track_local(committed)
            else:
                committed.add_done_callback(lambda f: save.local_only_ended(f.result()))

    def wait_for_staging(self) -> float:
        """Block until the in-flight save has copied the state out. Returns the seconds waited."""
        save = self._inflight
        waited = save.wait_for_staging() if save is not None else None
        if waited is None:
            return 0.0
        assert save is not None  # it waited
        stats = self._last_stats
        if stats is not None and stats.step == save.step:
            stats.staging_wait += waited
            self.metrics.histogram("elastic_trainer_checkpoint_stall_seconds", stats.stall)
        return waited

    # ------------------------------------------------------------------ waiting
    def settle(self, deadline: float | None) -> bool:
        """Collective: wait for the save in flight (and, on rank 0, its commit) until ``deadline``
        (``time.monotonic()``; None: no limit). True when no save is in flight any more on any
        rank (:attr:`last_save` is the one that settled); False when one is still running on
        some rank past its deadline (it stays in flight). While one is running somewhere, the
        ranks agree every :data:`SETTLE_POLL_SECONDS` whether all are done and whether any is past
        its deadline: a rank whose part ended (or failed early) waits with the others, never in
        one long collective."""
        save = self._inflight
        agreed, self._agreed = self._agreed, None
        # this step's all-reduce found it settled on every rank: no collective of its own
        pre_agreed = agreed is not None and agreed.save is save and agreed.settled
        if save is None:
            if not pre_agreed:
                self.agreement.all_true(True)
            return True
        everywhere_ok = agreed.ok if pre_agreed and agreed is not None else None
        if not pre_agreed:
            self.wait_for_staging()
            while True:
                poll = time.monotonic() + SETTLE_POLL_SECONDS
                save.wait(poll if deadline is None else min(poll, deadline))
                if self.agreement.all_true(save.settled):
                    break
                if not self.agreement.all_true(deadline is None or time.monotonic() < deadline):
                    return False
        self._inflight, self.last_save = None, save
        self.metrics.gauge("elastic_trainer_checkpoint_saves_in_flight", 0)
        state = save.state
        if state not in _OK:
            if save.name is not None:
                self.remote.reset()
            if self.rank != 0:
                logger.warning("checkpoint step %d failed on this rank: %s", save.step, save.error)
        if everywhere_ok is None and save.name is not None:
            everywhere_ok = self.agreement.all_true(state in _OK)
        if save.name is not None and everywhere_ok:
            self._committed.add(save.step)
        return True

    def votes(self) -> SaveVotes:
        """This rank's votes in the step's all-reduce (SUM) on the save in flight; :meth:`agreed`
        takes the sums."""
        unusable = float(not self.remote.healthy())
        save = self._inflight
        if save is None:
            return SaveVotes(unusable=unusable)
        settled = save.settled  # once settled, a save stays settled in the same state
        return SaveVotes(float(not settled), float(settled and save.state not in _OK), unusable)

    def agreed(self, votes: SaveVotes) -> None:
        """The all-reduced :meth:`votes`: when the save in flight is settled on every rank (and
        every writer process is usable), the next save's wait for it (:meth:`settle`, and the
        process writer's check) needs no collective of its own. The first call starts the
        writer processes (``checkpoint.writer = "process"``), so the first save need not."""
        self._agreed = Agreed(self._inflight, votes.unsettled == 0, votes.failed == 0, votes.unusable == 0)
        if not self._writers_started:  # the first step: every rank here together, before any save
            self._writers_started = True
            if self.remote.uses_writer_process:
                cast(ProcessWriterSaver, self.remote).start_writers()

    def finish(self, timeout: float | None = None) -> bool:
        """Collective: wait for the save in flight to be written and committed, at most
        ``timeout`` seconds (default: its per-save deadline). Returns whether this rank's part
        ended well (rank 0: committed). Raises TimeoutError past it (the save stays in flight)."""
        save = self._inflight
        if save is None:
            self.agreement.all_true(True)
            return self.last_save is None or self.last_save.state in _OK
        if not self.settle(save.deadline if timeout is None else time.monotonic() + timeout):
            raise TimeoutError(f"checkpoint step {save.step} still writing")
        return save.state in _OK

    def drain_after_failure(self) -> bool:
        """Exception path (starts no save and no collective): give a save that is already
        uploading up to :data:`DRAIN_SECONDS` in all (over every call) to finish (and, on rank 0,
        to commit). True when nothing is left in flight. Never raises."""
        save = self._inflight
        if save is None:
            return True
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + DRAIN_SECONDS
            logger.warning("step failed: letting the save already in flight finish (at most %.0fs)", DRAIN_SECONDS)
        return save.name is not None and save.wait(self._drain_deadline) in _OK

    def _settle(self) -> None:
        if self._inflight is not None:
            self._inflight.wait(time.monotonic() + DRAIN_SECONDS)

    def close(self, finished: bool = False) -> None:
        """``finished``: the run ended normally; this rank's local copies are dropped (no restart
        of this launch will need them, and a later launch never uses them)."""
        self.remote.close()
        if self._local_saver is not None:
            self._local_saver.close()
        if finished and self.local is not None:
            self.local.drop_epoch(self._position.epoch)
        self.committer.close()


class Verdicts:
    """Rank 0's answers about the saves, agreed by every rank (``CheckpointManager.verdicts``):
    each is a collective, called by every rank with no save in flight (after
    :meth:`CheckpointManager.settle`). ``last_save``: the manager's newest settled save."""

    def __init__(self, agreement: Agreement, committer: Committer, rank: int, *, last_save: Callable[[], Save | None]):
        self.agreement = agreement
        self.committer = committer
        self.rank = rank
        self._last_save = last_save

    def committed_everywhere(self, step: int) -> bool:
        """Collective: rank 0's answer to "is ``step`` committed?", agreed by every rank. Call
        with no save in flight (after :meth:`CheckpointManager.settle`)."""
        return self.agreement.all_true(self.rank != 0 or self.committer.committed(step))

    def failed_permanently(self) -> str | None:
        """Collective, after :meth:`CheckpointManager.settle`: the cause of the last save's
        failure when it failed on some rank for a cause a restart cannot change (no space, no
        permission, a read-only file system, a quota, a missing bucket; see :mod:`.failure`),
        else None. Agreed by every rank; the cause is the first such rank's line."""
        save = self._last_save()
        mine = save.error if save is not None and save.state not in _OK and save.permanent else None
        if self.agreement.all_true(mine is None):
            return None
        return next(c for c in self.agreement.gather(mine) if c is not None)

    def fenced_everywhere(self) -> bool:
        """Collective: rank 0's answer to "did a newer launch fence our commits?", agreed by
        every rank (e.g. after the final save, whose commit may be the one refused)."""
        return not self.agreement.all_true(self.committer.fenced is None)


class FaultHooks:
    """Fault injection (tests, any rank; ``CheckpointManager.fault_hooks``), enabled through
    ``ELASTIC_TRAINER_INJECT_FAULT`` (:mod:`elastic_trainer.faults`). ``epoch``: the manager's
    current lineage epoch; ``settle``: lets the save in flight land (bounded)."""

    def __init__(
        self, storage: Storage, local: LocalTier | None, *, epoch: Callable[[], str], settle: Callable[[], None]
    ):
        self.storage = storage
        self.local = local
        self._epoch = epoch
        self._settle = settle

    def commit_visible(self, step: int) -> bool:
        """Whether a commit of ``step`` is in checkpoint.dir."""
        return any(
            layout.parse_step_dir(name) == step and self.storage.exists(self.storage.join(name, layout.MANIFEST))
            for name in self.storage.list_dirs()
        )

    def inject_local_faults(self, step: int) -> None:
        """Lose or corrupt this rank's local copies at ``step``."""
        local = self.local
        if local is not None:
            faults.maybe_damage_local(step, lambda: local.copies_on_disk(self._epoch()), self._settle)
