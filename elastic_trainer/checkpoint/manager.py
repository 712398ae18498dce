"""The checkpoint manager: the collective, every-rank part of checkpointing.

Public surface (methods that touch collectives must be called on every rank, at the same step
boundary, in the same order):

* :meth:`load` → resumes from what the catalog plans (or None); falls back past checkpoints
  that fail to load, quarantining each, in the same start.
* :meth:`save` → starts a save of ``step`` (async by default). Saving a step that is already
  committed (the one just loaded, or one this incarnation committed) is a no-op that counts.
* :meth:`wait_for_staging` → call before anything mutates the saved tensors (optimizer.step).
* :meth:`settle` / :meth:`finish` → wait (bounded) for the save in flight and its commit;
  :meth:`committed_everywhere` / :meth:`fenced_everywhere` → rank 0's answers, agreed.
* :meth:`close`.

Each save is a :class:`~.save.Save` (its states and transitions are documented there); the
manager keeps at most one in flight. Its bytes are written by the savers it is given
(:mod:`.savers`: checkpoint.dir through DCP, and the local tier, whose copies the peer tier
replicates to other nodes: :mod:`.peer_tier`), its agreements go through the
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
replace them all together when one is not (:mod:`.writer_process`).

DCP reports a failed save or load as ``CheckpointException``, a ``BaseException``: it is caught
explicitly next to ``Exception`` wherever a DCP call is awaited.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from .. import faults
from ..config import CheckpointConfig
from ..errors import CheckpointError, FencedError, NoUsableCheckpointError
from ..events import EventLog
from ..metrics.sink import MetricsSink, NullSink
from ..storage.fs import Storage
from . import failure, layout, peer_tier, writer_process
from . import resume as resume_plan
from .agreement import Agreement
from .catalog import Catalog, checkpoint_key
from .local_tier import CHAIN_MAX, LocalTier
from .resume import Decision, LoadResult, LocalLoad
from .save import Save, SaveState
from .savers import LocalSaver, RemoteSaver
from .state import PerRank, manifest_summaries, state_types

logger = logging.getLogger(__name__)

DRAIN_SECONDS = 10.0  # how long the exception path waits for a save already uploading
# settle: the ranks agree at least this often while a save is still writing somewhere, so a rank
# whose part is done never waits in a collective for longer (it would time out at the training
# group's timeout, elastic.hang_timeout_seconds >= 5, while the other waits up to the save's deadline)
SETTLE_POLL_SECONDS = 1.0
_OK = (SaveState.COMMITTED, SaveState.WRITTEN)  # a save's ends that mean "this rank's part is done"


@dataclass
class SaveStats:
    """Per-save timings (seconds) measured on this rank."""

    step: int
    wait_previous: float = 0.0
    call: float = 0.0  # time async_save (or save) blocked the caller
    staging_wait: float = 0.0  # time wait_for_staging blocked the caller
    skipped: str = ""  # why no save was started ("" when one was)

    @property
    def stall(self) -> float:
        return self.wait_previous + self.call + self.staging_wait


class _Agreed(NamedTuple):
    """The step's all-reduce about the save in flight (:meth:`CheckpointManager.agreed`)."""

    save: Save | None
    settled: bool  # on every rank
    ok: bool  # ended well on every rank
    usable: bool  # every rank's writer process (if any) is usable

    @property
    def clear(self) -> bool:
        """Nothing to wait for and nothing to restart: the next save starts without a collective."""
        return self.settled and self.ok and self.usable


class CheckpointManager:
    """Checkpointing of named ``Stateful`` objects on every rank.

    ``remote``/``local``: the savers (defaults: :class:`~.savers.RemoteSaver` into ``storage``
    per ``cfg.mode``/``cfg.writer``, and a :class:`~.savers.LocalSaver` when ``cfg.local_dir`` is
    set); ``agreement``: how the ranks agree (default: the process groups; with one rank, the
    identity). ``group`` is the checkpoint group DCP loads and saves on; ``control_group`` the
    training group the agreements between saves use."""

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
        local: LocalSaver | None = None,
        agreement: Agreement | None = None,
    ):
        self.cfg = cfg
        self.storage = storage
        self.states = states
        self.rank = rank
        self.world_size = world_size
        self.mesh_shape = mesh_shape
        self.group = group
        self.fingerprint = fingerprint
        self.events = events or EventLog(None)
        self.metrics = metrics or NullSink()
        self.agreement = agreement or Agreement(world_size, group, control_group)
        self.remote = remote or RemoteSaver(
            storage, group, mode=cfg.mode, writer=cfg.writer, cuda_staging=use_cuda_staging
        )
        if local is None and cfg.local_dir:
            tier = LocalTier(cfg.local_dir, storage.root, rank=rank, world_size=world_size, key=checkpoint_key())
            local = LocalSaver(tier, mode=cfg.mode, cuda_staging=use_cuda_staging)
        # The local tier (checkpoint.local_dir): every save, per rank; checkpoint.dir gets every
        # remote_every-th (and every durable one). See checkpoint/local_tier.py.
        self._local_saver = local
        self.local = local.tier if local is not None else None
        self.peer = peer_tier.from_env(
            cfg, self.local, storage.root, key=checkpoint_key(), metrics=self.metrics, events=self.events
        )
        self.catalog = Catalog(storage, epoch=epoch, events=self.events) if rank == 0 else None
        self._launch_id = launch_id
        self._run_identity = run_identity or {}
        self._commit_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit") if rank == 0 else None
        self._marks_off = False  # see _mark_writer
        # Shared with the commit thread, under _lock: the newest commit rank 0 knows of, why a
        # newer launch stopped our commits, and which load the current state came from.
        self._lock = threading.Lock()
        self._last_committed: int | None = None
        self._fenced: str | None = None
        self._generation = 0  # +1 at every load: a commit of a save from before it changes nothing
        self._inflight: Save | None = None
        self._agreed: _Agreed | None = None  # the step's all-reduce about _inflight
        self.last_save: Save | None = None  # the newest settled save
        self._drain_deadline: float | None = None  # the exception path's budget, once started
        self._writer_failed = False  # process writer: a save of ours failed; restart the writers before the next
        self._writers_started = False  # process writer: started at the first agreement or save (all ranks)
        self._loaded_step: int | None = None
        self._loaded_tier: str | None = None
        self._parent: str | None = None  # the checkpoint the current state descends from
        self._seq = 0
        self._taken: set[str] = set()  # checkpoint directory names in use (same on every rank)
        self._committed: set[int] = set()  # steps this incarnation committed to checkpoint.dir (agreed)
        self._last_stats: SaveStats | None = None  # the newest save started (or timed out); staging adds to it
        self._epoch_name = ""  # the root's launch epoch, learnt at load (names the local copies)
        self._lineage = ""  # agreed at each load: which start wrote a local copy
        self._chain: list[str] = [""]  # remote checkpoints the current state's lineage went through
        self._saves_since_remote = 0
        self._local_saved: set[int] = set()
        self._state_types = state_types(states)  # recorded in every manifest, compared at resume
        for s in states.values():
            if isinstance(s, PerRank):
                s.bind(rank, world_size)

    @property
    def last_committed_step(self) -> int | None:
        """Rank 0: the newest commit it knows of (loaded, or committed since)."""
        with self._lock:
            return self._last_committed

    @property
    def fenced(self) -> str | None:
        """Rank 0: why a newer launch stopped our commits (None: it did not)."""
        with self._lock:
            return self._fenced

    def _set_fenced(self, why: str, step: int) -> None:
        with self._lock:
            self._fenced = why
        logger.error("%s", why)
        self.events.emit("checkpoint_fenced", step=step, error=why)

    # ------------------------------------------------------------------ load
    def load(self, resume: str | None = None) -> LoadResult | None:
        """Resume from what the catalog plans for ``resume`` (default ``cfg.resume``). All ranks.

        Before a byte of tensor data is read, rank 0 checks that the chosen checkpoint fits the
        registered state (:mod:`.compat`); every rank gets the same answer. A checkpoint that
        does not fit raises :class:`CheckpointIncompatibleError` naming every key: nothing is
        quarantined and no older checkpoint is tried (it has the same layout). A checkpoint
        whose bytes fail (checksum, a file missing or short, unpicklable data) is quarantined
        with a ``checkpoint_skipped`` event and the next older valid one is loaded in the same
        start. When commits exist but none can be loaded, :class:`NoUsableCheckpointError`:
        never a silent start from step 0. Raises CheckpointError when an explicitly requested
        step is unusable and FencedError when a newer launch owns the root."""
        resume = self.cfg.resume if resume is None else resume
        self._abandon_inflight()
        failed: set[str] = set()
        skipped_all: list[tuple[int, str]] = []
        try_local = self.local is not None and resume == "latest"
        if self.peer is not None:
            self.peer.connect(self.agreement)
        while True:
            decision = (
                resume_plan.decide(
                    self.catalog,
                    self.states,
                    self.world_size,
                    resume,
                    frozenset(failed),
                    clean=not failed and self._generation == 0,
                    launch_id=self._launch_id,
                    events=self.events,
                )
                if self.rank == 0
                else None
            )
            decision = self.agreement.broadcast(decision)
            if decision.refused is not None:
                raise decision.refused(decision.message)
            self._taken |= set(decision.taken)  # never forget a name: an abandoned save may still write into it
            skipped_all += [tuple(s) for s in decision.skipped]
            self._epoch_name = decision.epoch
            self._lineage = decision.lineage
            if try_local:
                try_local = False
                local = self._load_local(decision, skipped_all)
                if isinstance(local, LoadResult):
                    return local
                if local is LocalLoad.FAILED and decision.chosen is None:
                    raise CheckpointError(
                        "the local copies failed to load and checkpoint.dir has no commit; "
                        "restarting from a clean state"
                    )
            if decision.chosen is None:
                if failed:  # every candidate failed its load in this start: never train from step 0 over them
                    raise NoUsableCheckpointError(
                        f"every committed checkpoint failed to load ({', '.join(sorted(failed))}: quarantined); "
                        "not starting over from step 0. 'elastic-trainer ckpt release URI --step N' re-verifies one "
                        "and lifts its quarantine if its bytes are good; or start a new run: another checkpoint.dir, "
                        'or checkpoint.resume = "none" for this launch'
                    )
                self._loaded(None, None, committed=None)
                self._parent, self._seq = None, 0
                self._chain = [""]
                return None
            name, manifest = decision.chosen, decision.manifest
            step = int(manifest["step"])
            reason = decision.unreadable  # rank 0 could not read the checkpoint's metadata
            if reason is None:
                t0 = time.monotonic()
                loaded = resume_plan.load_remote(self.states, self.storage, self.group, self.agreement, decision)
                if loaded is None:
                    seconds = time.monotonic() - t0
                    self._loaded(step, "remote", committed=step)
                    self._parent, self._seq = name, int(manifest.get("seq", 0))
                    self._chain, self._local_saved = [name], set()
                    self.metrics.histogram("elastic_trainer_checkpoint_resume_load_seconds", seconds)
                    if self.rank == 0:
                        resume_plan.report_evolution(self.events, name, step, decision)
                    return LoadResult(step, name, manifest, seconds, skipped_all, decision.first_start)
                reason = loaded
            reason = f"load failed: {reason}"
            logger.error("checkpoint %s %s", name, reason)
            if self.rank == 0:
                self.events.emit("checkpoint_skipped", step=step, name=name, reason=reason)
                try:
                    self.catalog.quarantine(name, reason)
                except Exception as e:  # noqa: BLE001 - skipped in this start either way
                    logger.warning("could not quarantine %s: %s", name, e)
            skipped_all.append((step, reason))
            failed.add(name)

    def _loaded(self, step: int | None, tier: str | None, *, committed: int | None) -> None:
        """The state now comes from ``step`` (None: fresh): a commit of a save from before this
        load no longer counts (see :meth:`_commit`)."""
        with self._lock:
            self._generation += 1
            self._last_committed = committed
        self._loaded_step, self._loaded_tier = step, tier
        self._committed = set()

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

    def _load_local(self, decision: Decision, skipped: list[tuple[int, str]]) -> LoadResult | LocalLoad:
        """Every rank: the local tier's copy, when every rank has one that fits (see
        :func:`.resume.load_local`); else, with a peer tier, the nodes' copies at any world size
        (:meth:`.peer_tier.PeerTier.load`); NONE or FAILED otherwise."""
        t0 = time.monotonic()
        loaded = resume_plan.load_local(
            self.local,
            self.states,
            self.agreement,
            decision,
            skipped,
            epoch=self._epoch_name,
            rank=self.rank,
            mesh_shape=self.mesh_shape,
            fingerprint=self.fingerprint,
            events=self.events,
        )
        if isinstance(loaded, LocalLoad) and self.peer is not None:  # not every rank has its own copy: the nodes'
            from_peers = self.peer.load(
                self.states,
                self.agreement,
                epoch=self._epoch_name,
                remote=decision.chosen,
                min_step=int(decision.manifest["step"]) if decision.chosen else 0,
                fingerprint=self.fingerprint,
                skipped=skipped,
            )
            loaded = loaded if from_peers is LocalLoad.NONE else from_peers
        if isinstance(loaded, LocalLoad):
            return loaded
        copy, chosen = loaded, decision.chosen
        tier = "peer" if isinstance(copy, peer_tier.PeerCopy) else "local"
        remote_step = int(decision.manifest["step"]) if chosen else 0
        seconds = time.monotonic() - t0
        self._loaded(copy.step, tier, committed=remote_step if chosen else None)
        self._parent, self._seq = chosen, int(decision.manifest.get("seq", 0)) if chosen else 0
        self._chain = list(copy.manifest.get("remote_chain") or [chosen or ""])
        self._local_saved = {copy.step} if tier == "local" else set()
        self.metrics.histogram("elastic_trainer_checkpoint_resume_load_seconds", seconds)
        if tier == "local":
            self.metrics.counter("elastic_trainer_checkpoint_local_resumes_total")
        return LoadResult(
            copy.step,
            copy.name if tier == "peer" else os.path.relpath(copy.path, self.local.root),
            copy.manifest,
            seconds,
            skipped,
            decision.first_start,
            tier=tier,
            tiers=copy.tiers if tier == "peer" else None,
        )

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
        stager; call :meth:`wait_for_staging` before mutating parameters.

        With a local tier every save writes this rank's local copy; checkpoint.dir gets the save
        when it is ``durable`` (the final step), ``force``d or ``blocking`` (preemption), or the
        ``remote_every``-th since the last one there."""
        stats = SaveStats(step)
        t0 = time.monotonic()
        self._writers_started = True  # a save before the first step starts them itself (DCP's way)
        agreed = self._agreed
        # process writer: the save in flight failed on some rank while others still write it: their
        # writers wait in DCP's collectives for writers that never join (a rank that could not stage
        # it): stop every writer now rather than wait for its deadline
        doomed = (
            self.remote.uses_writer_process
            and self._inflight is not None
            and agreed is not None
            and agreed.save is self._inflight
            and not agreed.settled
            and not agreed.ok
        )
        remote = (
            self.local is None or force or blocking or durable or self._saves_since_remote + 1 >= self.cfg.remote_every
        )
        if doomed:
            settled = self._check_writers(doomed=True)
        else:
            settled = self.settle(self._inflight.deadline if self._inflight else None)
            if self.remote.uses_writer_process and remote and not (agreed is not None and agreed.clear):
                settled = self._check_writers()
        stats.wait_previous = time.monotonic() - t0
        self.metrics.histogram("elastic_trainer_checkpoint_wait_previous_seconds", stats.wait_previous)
        if not settled:
            stats.skipped = (
                f"previous save of step {self._inflight.step} still writing after {self.cfg.save_timeout_seconds:.0f}s"
            )
            logger.error("checkpoint step %d skipped: %s", step, stats.skipped)
            if self.rank == 0:
                self.events.emit("checkpoint_failed", step=step, error=stats.skipped, seconds=0.0)
                self.metrics.counter("elastic_trainer_checkpoint_save_failures_total")
            self._last_stats = stats
            return stats
        if self.is_committed(step) and not force:
            stats.skipped = "already committed"
            return stats
        local = self.local is not None and step not in self._local_saved
        if not remote and not local:
            stats.skipped = "already in the local tier"
            return stats
        self.metrics.gauge("elastic_trainer_checkpoint_saves_in_flight", 1)
        t1 = time.monotonic()
        extra = {
            "parent": self._parent,
            "seq": self._seq,
            "launch": self._launch_id,
            "finite": True,
            "run_identity": self._run_identity,
            "state_types": self._state_types,
            "summaries": manifest_summaries(self.states),
            **(meta or {}),
        }
        name = None
        if remote:
            name = layout.next_dir_name(step, self._taken)
            self._taken.add(name)
            self._saves_since_remote = 0
            self._chain = (self._chain + [name])[-CHAIN_MAX:]
            self._parent = name
            self._seq += 1
        else:
            self._saves_since_remote += 1
        save = Save(step, name, started=t1, deadline=t1 + self.cfg.save_timeout_seconds, staged=self.cfg.mode == "sync")
        self._inflight = save
        if remote:
            if self.rank == 0:
                self._commit_pool.submit(self._mark_writer, name)
            staging, written = self.remote.start(self.states, name)
            save.stagings.append(staging)
            save.written = written
            extra["seq"] = self._seq
            written.add_done_callback(
                lambda f, generation=self._generation: self._on_written(save, f, {**extra}, generation)
            )
        if local:
            self._local_saved.add(step)
            # the remote save this state descends from (started above when there is one)
            local_extra = {
                **extra,
                "parent": self._parent,
                "seq": self._seq,
                "remote_chain": list(self._chain),
                "lineage": self._lineage,
            }
            staging, committed = self._start_local(step, local_extra, t1)
            save.stagings.append(staging)
            if remote:
                save.track_local(committed)
            else:
                committed.add_done_callback(lambda f: self._on_local_only(save, f.result()))
        stats.call = time.monotonic() - t1
        self._last_stats = stats
        if blocking:
            self.wait_for_staging()
            self.settle(None)
        return stats

    def _on_written(self, save: Save, written: Future, extra: dict[str, Any], generation: int) -> None:
        """Upload thread: this rank's checkpoint.dir bytes are written (or failed). Rank 0 goes on
        to commit on its commit thread; an abandoned save goes nowhere."""
        save.staged()
        exc = written.exception()
        error = ""
        if exc is not None:
            error, save.permanent = failure.describe(exc), failure.permanent(exc)
            logger.error("checkpoint step %d: writing failed", save.step, exc_info=exc)
        if self.rank != 0:
            save.advance(SaveState.FAILED if exc is not None else SaveState.WRITTEN, error=error)
        elif exc is not None:
            if save.state is not SaveState.ABANDONED:  # reported before the state moves: a waiter then sees the event
                self._report_failure(save, error)
            save.advance(SaveState.FAILED, error=error)
        elif save.advance(SaveState.COMMITTING):
            self._commit_pool.submit(self._commit, save, extra, generation)

    @staticmethod
    def _on_local_only(save: Save, committed: bool) -> None:
        save.staged()
        save.advance(
            SaveState.COMMITTED if committed else SaveState.FAILED, error="" if committed else "local copy failed"
        )

    def _check_writers(self, doomed: bool = False) -> bool:
        """Process writer, every rank, before a save (unless the step's all-reduce already found
        every rank's writer usable and the previous save settled well): agree that every rank's
        writer process is usable; if one died or failed a save, or the previous save is still
        writing past its deadline, stop the writers on every rank (the next save starts new ones
        together). If a rank's state did not fit in shared memory, new writers would fail the same
        way: every rank writes with the thread writer from then on (``checkpoint_writer_fallback``).
        ``doomed``: the save in flight already failed on some rank (agreed), and the ranks still
        writing it are stopped at once. Returns whether the previous save is settled after that."""
        stuck = self._inflight is not None
        ok = self.remote.writers_healthy() and not self._writer_failed and not stuck
        if self.agreement.all_true(ok):
            return True
        if not self.agreement.all_true(not self.remote.out_of_shared_memory()):
            why = "a rank's state does not fit in the node's shared memory (/dev/shm)"
            logger.error('checkpoint.writer = "process": %s; writing with the thread writer from now on', why)
            if self.rank == 0:
                self.events.emit("checkpoint_writer_fallback", writer="thread", reason=why)
            self.remote.use_thread_writer()
        else:
            why = (
                "a save that failed on another rank was still being written"
                if doomed
                else "still writing past its deadline"
                if stuck
                else "a writer process died or failed a save"
            )
            logger.warning("restarting the checkpoint writer processes: %s", why)
            if self.rank == 0:
                self.events.emit(
                    "checkpoint_writer_restarted", reason=why, step=self._inflight.step if self._inflight else None
                )
            self.remote.stop_writers()
        self._writer_failed = False
        # the stopped writer failed that save: wait for it to say so
        return self.settle(time.monotonic() + writer_process.STOP_TIMEOUT_SECONDS * 2)

    def _start_local(self, step: int, extra: dict[str, Any], started: float) -> tuple[Future | None, Future]:
        """Start this rank's local copy of ``step`` (no collectives): (staging, committed) futures;
        the second resolves to whether the copy was written and committed. Never raises."""
        done: Future = Future()
        epoch = self._epoch_name

        def commit(f: Future) -> None:
            try:
                exc = f.exception()
                if exc is not None:
                    raise exc
                manifest = self.local.commit(
                    epoch,
                    step,
                    mesh_shape=self.mesh_shape,
                    fingerprint=self.fingerprint,
                    torch_version=torch.__version__,
                    extra=extra,
                )
                if self.peer is not None:
                    self.peer.replicate(epoch, step)
            except BaseException as e:  # noqa: BLE001 - the local tier is best effort; checkpoint.dir is the record
                logger.warning("local copy of step %d failed on this rank: %s: %s", step, type(e).__name__, e)
                self.metrics.counter("elastic_trainer_checkpoint_local_save_failures_total")
                done.set_result(False)
                return
            self.metrics.counter("elastic_trainer_checkpoint_local_saves_total")
            if self.rank == 0:
                self.events.emit(
                    "checkpoint_local_saved",
                    step=step,
                    bytes=manifest["total_bytes"],
                    seconds=round(time.monotonic() - started, 4),
                )
            done.set_result(True)

        staging, written = self._local_saver.start(self.states, epoch, step)
        written.add_done_callback(commit)
        return staging, done

    def _mark_writer(self, name: str) -> None:
        """Best effort (the marker only refines cleanup): skipped once the manager closes, or
        after a mark failed for a cause no retry changes (a full disk), so neither the commits
        queued behind it nor the exit wait for its futile retries."""
        if self._marks_off:
            return
        try:
            self.catalog.mark_writer(name)
        except Exception as e:  # noqa: BLE001 - the marker only refines cleanup; the save goes on
            logger.warning("could not mark %s with this epoch: %s", name, e)
            if failure.permanent(e):
                self._marks_off = True

    def wait_for_staging(self) -> float:
        """Block until the in-flight save has copied the state out. Returns the seconds waited."""
        save = self._inflight
        if save is None or save.state is not SaveState.STAGING:
            return 0.0
        t0 = time.monotonic()
        for staging in save.stagings:
            try:
                if staging is not None:
                    staging.result()
            except (Exception, CheckpointException):  # the upload future carries the same failure
                logger.exception("staging of step %d failed", save.step)
        save.staged()
        waited = time.monotonic() - t0
        stats = self._last_stats
        if stats is not None and stats.step == save.step:
            stats.staging_wait += waited
            self.metrics.histogram("elastic_trainer_checkpoint_stall_seconds", stats.stall)
        return waited

    def _commit(self, save: Save, extra: dict[str, Any], generation: int) -> None:
        """Rank 0, commit thread: prove the save complete and commit it, then retention."""
        faults.maybe_inject("kill_before_commit", save.step)
        try:
            manifest = self.catalog.commit(
                save.name,
                step=save.step,
                world_size=self.world_size,
                mesh_shape=self.mesh_shape,
                fingerprint=self.fingerprint,
                torch_version=torch.__version__,
                extra=extra,
            )
        except FencedError as e:
            self._set_fenced(str(e), save.step)
            save.advance(SaveState.FENCED, error=str(e))
            return
        except Exception as e:  # a failed commit is a failed save
            error, save.permanent = f"commit: {failure.describe(e)}", failure.permanent(e)
            logger.error("checkpoint step %d: commit failed", save.step, exc_info=e)
            self._report_failure(save, error)
            save.advance(SaveState.FAILED, error=error)
            return
        duration = time.monotonic() - save.started
        with self._lock:
            if generation == self._generation:  # else a load replaced the state since this save began
                self._last_committed = save.step
        logger.debug(
            "checkpoint step %d committed: %d bytes in %.2fs (%s)",
            save.step,
            manifest["total_bytes"],
            duration,
            save.name,
        )
        self.events.emit(
            "checkpoint_committed",
            step=save.step,
            name=save.name,
            bytes=manifest["total_bytes"],
            seconds=round(duration, 4),
            world_size=self.world_size,
        )
        self.metrics.histogram("elastic_trainer_checkpoint_save_duration_seconds", duration)
        self.metrics.counter("elastic_trainer_checkpoint_written_bytes_total", manifest["total_bytes"])
        self.metrics.gauge("elastic_trainer_checkpoint_last_committed_step", save.step)
        self.metrics.gauge("elastic_trainer_checkpoint_last_commit_timestamp_seconds", manifest["time"])
        try:
            self.catalog.retention(save.name, self.cfg.keep_last, self.cfg.keep_every)
        except FencedError as e:
            self._set_fenced(str(e), save.step)
        except Exception as e:  # noqa: BLE001 - retention is best effort
            logger.warning("retention failed: %s", e)
        save.advance(SaveState.COMMITTED, manifest=manifest)

    def _report_failure(self, save: Save, error: str) -> None:
        logger.error("checkpoint step %d failed, not committed: %s", save.step, error)
        self.events.emit(
            "checkpoint_failed", step=save.step, error=error[:2000], seconds=round(time.monotonic() - save.started, 4)
        )
        self.metrics.counter("elastic_trainer_checkpoint_save_failures_total")

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
        everywhere_ok = agreed.ok if pre_agreed else None
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
            self.remote.failed()
            self._writer_failed = save.name is not None and self.remote.uses_writer_process
            if self.rank != 0:
                logger.warning("checkpoint step %d failed on this rank: %s", save.step, save.error)
        if everywhere_ok is None and save.name is not None:
            everywhere_ok = self.agreement.all_true(state in _OK)
        if save.name is not None and everywhere_ok:
            self._committed.add(save.step)
        return True

    def votes(self) -> tuple[float, float, float]:
        """This rank's elements of the step's all-reduce (SUM): the save in flight is not settled
        here; it settled here but did not end well; this rank's writer process is not usable.
        :meth:`agreed` takes the sums."""
        unusable = float(self._writer_failed or not self.remote.writers_healthy())
        save = self._inflight
        if save is None:
            return 0.0, 0.0, unusable
        settled = save.settled  # once settled, a save stays settled in the same state
        return float(not settled), float(settled and save.state not in _OK), unusable

    def agreed(self, unsettled: float, failed: float, unusable: float) -> None:
        """The all-reduced :meth:`votes`: when the save in flight is settled on every rank (and
        every writer process is usable), the next save's wait for it (:meth:`settle`, and the
        process writer's check) needs no collective of its own. The first call starts the
        writer processes (``checkpoint.writer = "process"``), so the first save need not."""
        self._agreed = _Agreed(self._inflight, unsettled == 0, failed == 0, unusable == 0)
        if not self._writers_started:  # the first step: every rank here together, before any save
            self._writers_started = True
            self.remote.start_writers()

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

    def committed_everywhere(self, step: int) -> bool:
        """Collective: rank 0's answer to "is ``step`` committed?", agreed by every rank. Call
        with no save in flight (after :meth:`settle`)."""
        with self._lock:
            mine = self.rank != 0 or (self._last_committed == step and self._fenced is None)
        return self.agreement.all_true(mine)

    def failed_permanently(self) -> str | None:
        """Collective, after :meth:`settle`: the cause of the last save's failure when it failed on
        some rank for a cause a restart cannot change (no space, no permission, a read-only file
        system, a quota, a missing bucket; see :mod:`.failure`), else None. Agreed by every rank;
        the cause is the first such rank's line."""
        save = self.last_save
        mine = save.error if save is not None and save.state not in _OK and save.permanent else None
        if self.agreement.all_true(mine is None):
            return None
        return next(c for c in self.agreement.gather(mine) if c is not None)

    def fenced_everywhere(self) -> bool:
        """Collective: rank 0's answer to "did a newer launch fence our commits?", agreed by
        every rank (e.g. after the final save, whose commit may be the one refused)."""
        return not self.agreement.all_true(self.fenced is None)

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

    def commit_visible(self, step: int) -> bool:
        """Fault injection (tests, any rank): whether a commit of ``step`` is in checkpoint.dir."""
        return any(
            layout.parse_step_dir(name) == step and self.storage.exists(self.storage.join(name, layout.MANIFEST))
            for name in self.storage.list_dirs()
        )

    def inject_local_faults(self, step: int) -> None:
        """Fault injection (tests): lose or corrupt this rank's local copies at ``step``."""
        if self.local is not None:
            faults.maybe_damage_local(step, lambda: self.local.copies_on_disk(self._epoch_name))

    def close(self, finished: bool = False) -> None:
        """``finished``: the run ended normally; this rank's local copies are dropped (no restart
        of this launch will need them, and a later launch never uses them)."""
        self.remote.close()
        if self._local_saver is not None:
            self._local_saver.close()
        if self.peer is not None:
            self.peer.close()
        if finished and self.local is not None:
            self.local.drop_epoch(self._epoch_name)
        if self._commit_pool is not None:
            self._marks_off = True
            self._commit_pool.shutdown(wait=True)
