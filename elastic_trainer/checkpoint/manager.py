"""The checkpoint manager: the collective, every-rank part of checkpointing.

Public surface (methods that touch collectives must be called on every rank, at the same step
boundary, in the same order):

* :meth:`load` → resumes from what the catalog plans (or None); falls back past checkpoints
  that fail to load, quarantining each, in the same start.
* :meth:`save` → starts a save of ``step`` (async by default). Saving a step that is already
  committed (the one just loaded, or one this incarnation saved) is a no-op that counts.
* :meth:`wait_for_staging` → call before anything mutates the saved tensors (optimizer.step).
* :meth:`finish` → waits (bounded) for the save in flight and its commit.
* :meth:`close`.

Rank 0's bookkeeping (scan, verification, commit, quarantine, retention, fencing) is the
:class:`~elastic_trainer.checkpoint.catalog.Catalog`'s. The manager never looks inside the
``Stateful`` objects it is given.

Storage time is bounded by ``checkpoint.save_timeout_seconds`` per save, never by the hang
watchdog: a save still writing when the next one is due is waited for at most until its deadline;
past it, the new save is skipped (``checkpoint_failed``) and training goes on. Whether every
rank's previous save is done is agreed with one tiny all-reduce on the *control* group (the
training group), never on the checkpoint group a background upload may be using.

With ``checkpoint.writer = "process"`` the checkpoint.dir upload runs in a persistent writer
process per rank; before each such save the ranks also agree that every writer is usable, and
replace them all together when one is not (:mod:`.writer_process`).

DCP reports a failed save or load as ``CheckpointException``, a ``BaseException``: it is caught
explicitly next to ``Exception`` wherever a DCP future or call is awaited.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from .. import collectives, faults
from ..config import CheckpointConfig
from ..errors import CheckpointError, CheckpointIncompatibleError, FencedError, NoUsableCheckpointError
from ..events import EventLog
from ..metrics.sink import MetricsSink, NullSink
from ..storage.fs import Storage
from . import compat, integrity, layout, save_planner, writer_process
from .catalog import Catalog, checkpoint_key
from .load_planner import load_planner
from .local_tier import CHAIN_MAX, LocalTier
from .state import PerRank, state_types

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    step: int
    name: str | None  # the checkpoint.dir directory; None for a save to the local tier only
    started: float
    staging: Future | None
    upload: Future | None  # the checkpoint.dir write; None for a local-only save
    commit: Future | None = None  # rank 0 only
    staged_at: float | None = None
    local_staging: Future | None = None
    local: Future | None = None  # this rank's local copy written and committed -> bool




@dataclass
class LoadResult:
    step: int
    name: str
    manifest: dict[str, Any]
    seconds: float
    skipped: list[tuple[int, str]] = field(default_factory=list)
    first_start: bool = True
    tier: str = "remote"  # "local": every rank loaded its copy from checkpoint.local_dir


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


class CheckpointManager:
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
        async_mode: str = "thread",
        upload_nice: int = 0,
        control_group: dist.ProcessGroup | None = None,
        epoch: str | None = None,
        launch_id: str = "",
        run_identity: dict[str, Any] | None = None,
    ):
        self.cfg = cfg
        self.storage = storage
        self.states = states
        self.rank = rank
        self.world_size = world_size
        self.mesh_shape = mesh_shape
        self.group = group
        self.control_group = control_group
        self.fingerprint = fingerprint
        self.events = events or EventLog(None)
        self.metrics = metrics or NullSink()
        self._inflight: _InFlight | None = None
        self._stager = None
        self._use_cuda_staging = use_cuda_staging
        # Where an async save's upload runs (checkpoint.writer: "thread", or "process": a writer
        # process per rank, see checkpoint/writer_process.py) and the CPU niceness of the thread
        # that writes (bench/checkpoint_stall.py --modes; BENCHMARKS.md).
        if async_mode not in ("thread", "process"):
            raise ValueError(f"async_mode: expected thread or process, got {async_mode!r}")
        self._async_mode = async_mode
        self._writer_failed = False  # process writer: a save of ours failed; restart the writers before the next
        self._upload_nice = upload_nice
        self.catalog = Catalog(storage, epoch=epoch, events=self.events) if rank == 0 else None
        self._launch_id = launch_id
        self._run_identity = run_identity or {}
        self._commit_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit") if rank == 0 else None
        self._lock = threading.Lock()  # guards the fields the commit thread writes
        self.last_committed_step: int | None = None  # rank 0: newest commit it knows of
        self.fenced: str | None = None  # rank 0: why a newer launch stopped our commits
        self.loaded_step: int | None = None
        self._parent: str | None = None  # the checkpoint the current state descends from
        self._seq = 0
        self._taken: set[str] = set()  # checkpoint directory names in use (same on every rank)
        self._saved: set[int] = set()  # steps this incarnation saved (same on every rank)
        self.save_stats: list[SaveStats] = []
        self.failures = 0
        self._plan_key = save_planner.new_key()  # DCP plan cache of this manager's saves
        # The local tier (checkpoint.local_dir): every save, per rank; checkpoint.dir gets every
        # remote_every-th (and every durable one). See checkpoint/local_tier.py.
        self.local = LocalTier(cfg.local_dir, storage.root, rank=rank, world_size=world_size, key=checkpoint_key()) if cfg.local_dir else None
        self._local_stager = None
        self._epoch_name = ""  # the root's launch epoch, learnt at load (names the local copies)
        self._lineage = ""  # agreed at each load: which start wrote a local copy
        self._chain: list[str] = [""]  # remote checkpoints the current state's lineage went through
        self._saves_since_remote = 0
        self._local_saved: set[int] = set()
        self.loaded_tier: str | None = None
        self._state_types = state_types(states)  # recorded in every manifest, compared at resume
        for s in states.values():
            if isinstance(s, PerRank):
                s.bind(rank, world_size)

    # ------------------------------------------------------------------ collectives helpers
    def _broadcast(self, obj: Any) -> Any:
        if self.group is None and not dist.is_initialized() or self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _all_true(self, flag: bool, group) -> bool:
        """Every rank's ``flag`` is true. Main thread only."""
        if self.world_size == 1 or not dist.is_initialized():
            return flag
        t = torch.tensor([0.0 if flag else 1.0], dtype=torch.float64)
        if dist.get_backend(group) == "nccl":  # pragma: no cover - GPU only
            t = t.cuda()
        collectives.all_reduce(t, group=group)
        return float(t.item()) == 0.0

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
        failed: set[str] = set()
        skipped_all: list[tuple[int, str]] = []
        try_local = self.local is not None and resume == "latest"
        while True:
            decision = self._decide(resume, frozenset(failed)) if self.rank == 0 else {}
            if self.rank == 0:
                decision["epoch"] = self.catalog.epoch or ""
                decision["lineage"] = uuid.uuid4().hex[:12]  # names the local copies this start will write
            decision = self._broadcast(decision)
            if "fenced" in decision:
                raise FencedError(decision["fenced"])
            if "error" in decision:
                raise CheckpointError(decision["error"])
            if "incompatible" in decision:
                raise CheckpointIncompatibleError(decision["incompatible"])
            if "stop" in decision:
                raise NoUsableCheckpointError(decision["stop"])
            self._taken = set(decision.get("taken", []))
            skipped_all += [tuple(s) for s in decision.get("skipped", [])]
            self._epoch_name = decision.get("epoch", "")
            self._lineage = decision.get("lineage", "")
            if try_local:
                try_local = False
                local = self._load_local(decision, skipped_all)
                if isinstance(local, LoadResult):
                    return local
                if local == "failed" and decision.get("chosen") is None:
                    raise CheckpointError("the local copies failed to load and checkpoint.dir has no commit; restarting from a clean state")
            if decision.get("chosen") is None:
                if failed:  # every candidate failed its load in this start: never train from step 0 over them
                    raise NoUsableCheckpointError(
                        f"every committed checkpoint failed to load ({', '.join(sorted(failed))}: quarantined); not starting over from step 0. "
                        "'elastic-trainer ckpt release URI --step N' re-verifies one and lifts its quarantine if its bytes are good; "
                        "or start a new run: another checkpoint.dir, or checkpoint.resume = \"none\" for this launch"
                    )
                self._parent, self._seq = None, 0
                self._chain, self.loaded_tier = [""], None
                return None
            name, manifest = decision["chosen"], decision["manifest"]
            step = int(manifest["step"])
            reason = decision.get("integrity")  # rank 0 could not read the checkpoint's metadata
            if reason is None:
                t0 = time.monotonic()
                loaded = self._load_remote(name, manifest, frozenset(decision.get("absent", ())))
                if loaded is None:
                    seconds = time.monotonic() - t0
                    self.loaded_step = step
                    self.last_committed_step = step
                    self._parent, self._seq = name, int(manifest.get("seq", 0))
                    self._saved = set()
                    self._chain, self.loaded_tier, self._local_saved = [name], "remote", set()
                    self.metrics.histogram("elastic_trainer_checkpoint_resume_load_seconds", seconds)
                    if self.rank == 0:
                        self._report_evolution(name, step, decision)
                    return LoadResult(step, name, manifest, seconds, skipped_all, bool(decision.get("first_start", True)))
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

    def _load_remote(self, name: str, manifest: dict[str, Any], absent: frozenset[str]) -> str | None:
        """Every rank: load ``name`` from checkpoint.dir, except the optional Statefuls it holds
        nothing of (``absent``: left as initialised). None when every rank loaded it; else the
        integrity problem (agreed: quarantine it). Raises CheckpointIncompatibleError (agreed)
        when a rank's failure is not about the bytes (the code could not take them)."""
        states = {k: v for k, v in self.states.items() if k not in absent}
        faults.maybe_inject("kill_in_load", int(manifest["step"]))
        for s in self.states.values():
            if isinstance(s, PerRank):
                s.expect_world(manifest.get("world_size"))
        mine: tuple[str, str] = ("", "")
        try:
            reader = integrity.verifying(self.storage.dcp_reader(self.storage.join(name)), integrity.Checks.from_manifest(manifest))
            dcp.load(states, storage_reader=reader, process_group=self.group, planner=load_planner(states))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed and handled below
            mine = ("integrity" if compat.is_integrity(e) else "incompatible", compat.one_line(e))
        if self._all_true(not mine[0], self.group):
            return None
        views = [v for v in self._gather(mine) if v[0]]
        bad = [v for v in views if v[0] == "integrity"]
        if bad:
            return bad[0][1]
        raise CheckpointIncompatibleError(
            f"checkpoint {name} is intact but this code could not load it: {views[0][1]} (nothing was quarantined or changed; "
            "register the same state as the run that wrote it, or start a new run: another checkpoint.dir, or checkpoint.resume = \"none\")"
        )

    def _report_evolution(self, name: str, step: int, decision: dict[str, Any]) -> None:
        """Rank 0: events for state the load left as initialised or did not load (on purpose)."""
        if decision.get("added"):
            self.events.emit("state_added", step=step, name=name, keys=decision["added"][:100])
            logger.warning("checkpoint %s has no %s: left as initialised (optional_on_load)", name, ", ".join(decision["added"][:10]))
        if decision.get("ignored"):
            self.events.emit("state_ignored", step=step, name=name, keys=decision["ignored"])
            logger.warning("checkpoint %s holds %s, which this code does not register: not loaded", name, ", ".join(decision["ignored"]))

    def _gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1 or not dist.is_initialized():
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _load_local(self, decision: dict[str, Any], skipped: list[tuple[int, str]]) -> LoadResult | str:
        """Every rank: load the newest local copy that every rank can prove, if it is at least as
        new as the remote choice and descends from it. Returns the result, "none" (no common
        copy) or "failed" (a load failed somewhere: the state may be partly overwritten, and the
        failing ranks dropped their copy). All ranks load the same tier: never a mix."""
        chosen = decision.get("chosen")
        remote_step = int(decision["manifest"]["step"]) if chosen else 0
        epoch = self._epoch_name
        try:
            self.local.purge_other_epochs(epoch)
            copies, why = self.local.usable(epoch, min_step=remote_step, remote=chosen, mesh_shape=self.mesh_shape, fingerprint=self.fingerprint)
        except OSError as e:
            copies, why = [], f"local tier unreadable: {type(e).__name__}: {e}"
        # A copy is named by (step, the start that wrote it): after a rollback or a restart a step
        # may exist twice in one epoch, and ranks must agree on the very same save.
        views = self._gather(([(c.step, c.manifest.get("lineage")) for c in copies], why))
        common = set.intersection(*(set(map(tuple, keys)) for keys, _ in views))
        if not common:
            if self.rank == 0 and any(steps for steps, _ in views):
                reasons = "; ".join(f"rank {r}: {w}" for r, (steps, w) in enumerate(views) if not steps) or "no step every rank has"
                self.events.emit("checkpoint_local_skipped", step=max(k[0] for keys, _ in views for k in keys), reason=f"not on every rank ({reasons})", remote_step=remote_step)
            return "none"
        best = max(common)
        copy = next(c for c in copies if (c.step, c.manifest.get("lineage")) == best)
        t0 = time.monotonic()
        faults.maybe_inject("kill_in_load", copy.step)
        error = ""
        try:
            dcp.load(self.states, storage_reader=self.local.reader(copy), planner=load_planner(self.states), no_dist=True)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed and handled below
            error = f"{type(e).__name__}: {e}"[:2000]
        if not self._all_true(not error, self.group):
            if error:  # this rank's copy is bad: never chosen again
                logger.error("local copy of step %d failed to load: %s", copy.step, error)
                self.local.discard(copy)
            if self.rank == 0:
                self.events.emit("checkpoint_local_skipped", step=copy.step, reason=f"load failed: {error or 'on another rank'}", remote_step=remote_step)
            skipped.append((copy.step, f"local copy: load failed: {error or 'on another rank'}"))
            return "failed"
        seconds = time.monotonic() - t0
        self.loaded_step, self.loaded_tier = copy.step, "local"
        self._parent, self._seq = chosen, int(decision["manifest"].get("seq", 0)) if chosen else 0
        self._chain = list(copy.manifest.get("remote_chain") or [chosen or ""])
        self._saved, self._local_saved = set(), {copy.step}
        self.metrics.histogram("elastic_trainer_checkpoint_resume_load_seconds", seconds)
        self.metrics.counter("elastic_trainer_checkpoint_local_resumes_total")
        return LoadResult(copy.step, os.path.relpath(copy.path, self.local.root), copy.manifest, seconds, skipped, bool(decision.get("first_start", True)), tier="local")

    def _decide(self, resume: str, exclude: frozenset[str]) -> dict[str, Any]:
        """Rank 0: plan the resume. Never raises (the answer is broadcast to every rank)."""
        cat = self.catalog
        try:
            if cat.epoch is None:
                cat.acquire_epoch(self._launch_id or f"standalone-{time.time_ns()}")
            plan = cat.plan_resume(resume, exclude)
            for name in cat.ignored_entries():
                self.events.emit("checkpoint_ignored", path=name, reason="not a step-XXXXXXXX directory")
            for step, reason in plan.skipped:
                logger.warning("skipping checkpoint step %d: %s", step, reason)
                self.events.emit("checkpoint_skipped", step=step, reason=reason)
            for name, reason in plan.corrupt:
                try:
                    cat.quarantine(name, reason)
                except Exception as e:  # noqa: BLE001 - skipped in this start either way
                    logger.warning("could not quarantine %s: %s", name, e)
            if resume not in ("latest", "none") and plan.first_start and plan.chosen is None:
                reason = plan.skipped[0][1] if plan.skipped else "not found"
                return {"error": f"checkpoint.resume={resume}: checkpoint step {resume} is unusable: {reason}"}
            stop = plan.stop_reason()
            if plan.incompatible is not None:
                self.events.emit("checkpoint_incompatible", name=plan.incompatible[0], reason=plan.incompatible[1])
                return {"incompatible": stop}
            if stop is not None:
                self.events.emit("resume_refused", reason=stop, unusable=[n for n, _ in plan.unusable])
                return {"stop": stop}
            if not exclude:
                cat.clean_uncommitted(frozenset({plan.chosen.name}) if plan.chosen else frozenset())
                if plan.first_start:
                    cat.record_base(plan.chosen.name if plan.chosen else None)
            taken = sorted(c.name for c in cat.scan())
            if plan.chosen is None:
                return {"chosen": None, "skipped": plan.skipped, "taken": taken, "first_start": plan.first_start}
            manifest = plan.chosen.manifest
            out = {"chosen": plan.chosen.name, "manifest": manifest, "skipped": plan.skipped, "taken": taken, "first_start": plan.first_start}
            try:
                metadata = cat.read_metadata(plan.chosen)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - unreadable metadata is damage: quarantined by load()
                return {**out, "integrity": compat.one_line(e)}
            report = compat.check(self.states, metadata, manifest, self.world_size)
            if not report.ok:
                message = report.message(plan.chosen.name)
                self.events.emit("checkpoint_incompatible", step=plan.chosen.step, name=plan.chosen.name, problems=report.problems)
                return {"incompatible": message}
            self.last_committed_step = plan.chosen.step
            return {**out, "added": report.added, "ignored": report.ignored, "absent": report.absent}
        except FencedError as e:
            return {"fenced": str(e)}
        except Exception as e:  # noqa: BLE001 - reported on every rank
            return {"error": f"{type(e).__name__}: {e}"}

    # ------------------------------------------------------------------ save
    def _new_stager(self, shared_memory: bool):
        from torch.distributed.checkpoint.staging import DefaultStager

        return DefaultStager(staging_options(cuda=self._use_cuda_staging, shared_memory=shared_memory))

    def _get_stager(self):
        if self._stager is None:
            self._stager = self._new_stager(self._async_mode == "process")
        return self._stager

    def _get_local_stager(self):
        """The local tier's own stager: a stager reuses its buffers, and the object-store
        upload of the same step may still be reading the other one's."""
        if self._local_stager is None:
            self._local_stager = self._new_stager(False)
        return self._local_stager

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    @property
    def save_in_progress(self) -> bool:
        """Whether this rank's part of the latest save is still being written. Rank-local: a
        measurement (checkpoint cadence), never a decision that ranks must share."""
        inf = self._inflight
        return inf is not None and any(f is not None and not f.done() for f in (inf.upload, inf.local))

    def is_committed(self, step: int) -> bool:
        """Whether ``step`` is known committed in checkpoint.dir on every rank's shared knowledge
        (loaded from there or saved there by this incarnation); a save of such a step is a no-op."""
        return (step == self.loaded_step and self.loaded_tier == "remote") or step in self._saved

    def save(self, step: int, *, blocking: bool = False, meta: dict[str, Any] | None = None, force: bool = False, durable: bool = False) -> SaveStats:
        """Start saving ``step``. All ranks. ``meta`` goes into the manifest (e.g. the loss).

        Waits for the previous save first, at most until that save's deadline (measured); when
        it is still writing on some rank past it, this save is skipped (``checkpoint_failed``).
        With ``checkpoint.mode = "async"`` this returns once the state is handed to a background
        stager; call :meth:`wait_for_staging` before mutating parameters.

        With a local tier every save writes this rank's local copy; checkpoint.dir gets the save
        when it is ``durable`` (the final step), ``force``d or ``blocking`` (preemption), or the
        ``remote_every``-th since the last one there."""
        stats = SaveStats(step)
        if self.is_committed(step) and not force:
            stats.skipped = "already committed"
            return stats
        remote = self.local is None or force or blocking or durable or self._saves_since_remote + 1 >= self.cfg.remote_every
        local = self.local is not None and step not in self._local_saved
        if not remote and not local:
            stats.skipped = "already in the local tier"
            return stats
        t0 = time.monotonic()
        previous_done = self._finish_inflight(deadline=self._deadline_of(self._inflight), agree=True)
        if self._uses_writer_process(remote):
            previous_done = self._check_writers(previous_done)
        stats.wait_previous = time.monotonic() - t0
        self.metrics.histogram("elastic_trainer_checkpoint_wait_previous_seconds", stats.wait_previous)
        if previous_done is None:
            stats.skipped = f"previous save of step {self._inflight.step} still writing after {self.cfg.save_timeout_seconds:.0f}s"
            logger.error("checkpoint step %d skipped: %s", step, stats.skipped)
            if self.rank == 0:
                self.events.emit("checkpoint_failed", step=step, error=stats.skipped, seconds=0.0)
                self.metrics.counter("elastic_trainer_checkpoint_save_failures_total")
            self.save_stats.append(stats)
            return stats
        self.metrics.gauge("elastic_trainer_checkpoint_saves_in_flight", 1)
        t1 = time.monotonic()
        inflight = _InFlight(step, None, t1, None, None)
        extra = {"parent": self._parent, "seq": self._seq, "launch": self._launch_id, "finite": True, "run_identity": self._run_identity,
                 "state_types": self._state_types, **(meta or {})}
        if remote:
            name = layout.next_dir_name(step, self._taken)
            self._taken.add(name)
            self._saved.add(step)
            self._saves_since_remote = 0
            self._chain = (self._chain + [name])[-CHAIN_MAX:]
            inflight.name = name
            inflight.staging, inflight.upload = self._start_remote(name)
            self._parent = name
            self._seq += 1
        else:
            self._saves_since_remote += 1
        if local:
            self._local_saved.add(step)
            # the remote save this state descends from (started above when there is one)
            local_extra = {**extra, "parent": self._parent, "seq": self._seq, "remote_chain": list(self._chain), "lineage": self._lineage}
            inflight.local_staging, inflight.local = self._start_local(step, local_extra, t1)
        self._inflight = inflight
        stats.call = time.monotonic() - t1
        if remote and self.rank == 0 and self._commit_pool is not None:
            inflight = self._inflight
            inflight.commit = Future()
            extra["seq"] = self._seq

            def on_upload_done(f: Future, inflight: _InFlight = inflight) -> None:
                inner = self._commit_pool.submit(self._commit, inflight, extra)
                inner.add_done_callback(lambda r: _chain(r, inflight.commit))

            inflight.upload.add_done_callback(on_upload_done)
        self.save_stats.append(stats)
        if blocking:
            self.wait_for_staging()
            self._finish_inflight(deadline=None)
        return stats

    def _uses_writer_process(self, remote: bool) -> bool:
        return remote and self._async_mode == "process" and self.cfg.mode != "sync"

    def _check_writers(self, previous_done: bool | None) -> bool | None:
        """Process writer, every rank, before a save: agree that every rank's writer process is
        usable; if one died or failed a save, or the previous save is still writing past its
        deadline (agreed by ``previous_done is None``), stop the writers on every rank (the
        next save starts new ones together). Returns the previous save's state after that."""
        ok = writer_process.healthy() and not self._writer_failed and previous_done is not None
        if self._all_true(ok, self.control_group):
            return previous_done
        why = "still writing past its deadline" if previous_done is None else "a writer process died or failed a save"
        logger.warning("restarting the checkpoint writer processes: %s", why)
        if self.rank == 0:
            self.events.emit("checkpoint_writer_restarted", reason=why, step=self._inflight.step if self._inflight else None)
        writer_process.stop()
        save_planner.forget(self._plan_key)
        if previous_done is None:  # the stopped writer failed that save: wait for it to say so
            previous_done = self._finish_inflight(deadline=time.monotonic() + writer_process.STOP_TIMEOUT_SECONDS * 2, agree=True)
        self._writer_failed = False
        return previous_done

    def _start_remote(self, name: str) -> tuple[Future | None, Future]:
        """Start the checkpoint.dir save into ``name``: (staging, upload) futures."""
        if self.rank == 0:
            self._commit_pool.submit(self._mark_writer, name)
        writer = integrity.checksummed(self.storage.dcp_writer(self.storage.join(name)))
        if self._upload_nice and self.cfg.mode != "sync":  # never the training thread
            writer.upload_nice = self._upload_nice
        if self.cfg.mode == "sync":
            fut: Future = Future()
            try:
                dcp.save(self.states, storage_writer=writer, process_group=self.group, planner=save_planner.make(self._plan_key))
                fut.set_result(None)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - handled as a failed save
                fut.set_exception(e)
            return None, fut
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = AsyncCheckpointerType.PROCESS if self._async_mode == "process" else AsyncCheckpointerType.THREAD
        resp = dcp.async_save(
            self.states, storage_writer=writer, process_group=self.group, async_stager=self._get_stager(), async_checkpointer_type=kind,
            planner=save_planner.make(self._plan_key),
        )
        return getattr(resp, "staging_completion", None), getattr(resp, "upload_completion", resp)

    def _start_local(self, step: int, extra: dict[str, Any], started: float) -> tuple[Future | None, Future]:
        """Start this rank's local copy of ``step`` (no collectives): (staging, committed) futures;
        the second resolves to whether the copy was written and committed. Never raises."""
        done: Future = Future()
        epoch = self._epoch_name

        def commit(f: Future | None) -> None:
            try:
                exc = f.exception() if f is not None else None
                if exc is not None:
                    raise exc
                manifest = self.local.commit(epoch, step, mesh_shape=self.mesh_shape, fingerprint=self.fingerprint, torch_version=torch.__version__, extra=extra)
            except BaseException as e:  # noqa: BLE001 - the local tier is best effort; checkpoint.dir is the record
                logger.warning("local copy of step %d failed on this rank: %s: %s", step, type(e).__name__, e)
                self.metrics.counter("elastic_trainer_checkpoint_local_save_failures_total")
                done.set_result(False)
                return
            self.metrics.counter("elastic_trainer_checkpoint_local_saves_total")
            if self.rank == 0:
                self.events.emit("checkpoint_local_saved", step=step, bytes=manifest["total_bytes"], seconds=round(time.monotonic() - started, 4))
            done.set_result(True)

        try:
            writer = self.local.writer(epoch, step)
            if self.cfg.mode == "sync":
                dcp.save(self.states, storage_writer=writer, no_dist=True)
                commit(None)
                return None, done
            resp = dcp.async_save(self.states, storage_writer=writer, no_dist=True, async_stager=self._get_local_stager())
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - as a failed local copy
            failed: Future = Future()
            failed.set_exception(e)
            commit(failed)
            return None, done
        upload = getattr(resp, "upload_completion", resp)
        upload.add_done_callback(commit)
        return getattr(resp, "staging_completion", None), done

    def _deadline_of(self, inf: _InFlight | None) -> float | None:
        return None if inf is None else inf.started + self.cfg.save_timeout_seconds

    def _mark_writer(self, name: str) -> None:
        try:
            self.catalog.mark_writer(name)
        except Exception as e:  # noqa: BLE001 - the marker only refines cleanup; the save goes on
            logger.warning("could not mark %s with this epoch: %s", name, e)

    def wait_for_staging(self) -> float:
        """Block until the in-flight save has copied the state out. Returns the seconds waited."""
        inf = self._inflight
        if inf is None or (inf.staging is None and inf.local_staging is None) or inf.staged_at is not None:
            return 0.0
        t0 = time.monotonic()
        for staging in (inf.staging, inf.local_staging):
            try:
                if staging is not None:
                    staging.result()
            except (Exception, CheckpointException):  # noqa: BLE001 - the upload future carries the same failure
                logger.exception("staging of step %d failed", inf.step)
        waited = time.monotonic() - t0
        inf.staged_at = time.monotonic()
        if self.save_stats and self.save_stats[-1].step == inf.step:
            self.save_stats[-1].staging_wait += waited
            self.metrics.histogram("elastic_trainer_checkpoint_stall_seconds", self.save_stats[-1].stall)
        return waited

    def _commit(self, inf: _InFlight, extra: dict[str, Any]) -> bool:
        """Rank 0, background thread: prove the save complete and commit it, then retention."""
        duration = time.monotonic() - inf.started
        exc = inf.upload.exception()
        if exc is not None:
            return self._failed(inf, f"{type(exc).__name__}: {exc}", duration)
        faults.maybe_inject("kill_before_commit", inf.step)
        try:
            manifest = self.catalog.commit(
                inf.name,
                step=inf.step,
                world_size=self.world_size,
                mesh_shape=self.mesh_shape,
                fingerprint=self.fingerprint,
                torch_version=torch.__version__,
                extra=extra,
            )
        except FencedError as e:
            with self._lock:
                self.fenced = str(e)
            logger.error("%s", e)
            self.events.emit("checkpoint_fenced", step=inf.step, error=str(e))
            return False
        except Exception as e:  # noqa: BLE001 - a failed commit is a failed save
            return self._failed(inf, f"commit: {type(e).__name__}: {e}", duration)
        duration = time.monotonic() - inf.started
        with self._lock:
            self.last_committed_step = inf.step
        logger.debug("checkpoint step %d committed: %d bytes in %.2fs (%s)", inf.step, manifest["total_bytes"], duration, inf.name)
        self.events.emit("checkpoint_committed", step=inf.step, name=inf.name, bytes=manifest["total_bytes"], seconds=round(duration, 4), world_size=self.world_size)
        self.metrics.histogram("elastic_trainer_checkpoint_save_duration_seconds", duration)
        self.metrics.counter("elastic_trainer_checkpoint_written_bytes_total", manifest["total_bytes"])
        self.metrics.gauge("elastic_trainer_checkpoint_last_committed_step", inf.step)
        self.metrics.gauge("elastic_trainer_checkpoint_last_commit_timestamp_seconds", manifest["time"])
        try:
            self.catalog.retention(inf.name, self.cfg.keep_last, self.cfg.keep_every)
        except FencedError as e:
            with self._lock:
                self.fenced = str(e)
            self.events.emit("checkpoint_fenced", step=inf.step, error=str(e))
        except Exception as e:  # noqa: BLE001 - retention is best effort
            logger.warning("retention failed: %s", e)
        return True

    def _failed(self, inf: _InFlight, error: str, duration: float) -> bool:
        self.failures += 1
        logger.error("checkpoint step %d failed, not committed: %s", inf.step, error)
        self.events.emit("checkpoint_failed", step=inf.step, error=error[:2000], seconds=round(duration, 4))
        self.metrics.counter("elastic_trainer_checkpoint_save_failures_total")
        return False

    def _finish_inflight(self, deadline: float | None, agree: bool = False) -> bool | None:
        """Wait for the in-flight save (and, on rank 0, its commit) until ``deadline``
        (``time.monotonic()``; None = forever). Returns True if it committed (rank 0) /
        succeeded (other ranks), False if it failed, None if it is still running (then it stays
        in flight). With ``agree``, the "still running" answer is agreed by every rank."""
        inf = self._inflight
        if inf is None:
            if agree:
                self._all_true(True, self.control_group)
            return True
        self.wait_for_staging()
        ok: bool | None = True
        try:
            if inf.upload is not None:
                inf.upload.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            if inf.commit is not None:
                ok = bool(inf.commit.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())))
            if inf.local is not None:
                local_ok = inf.local.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                ok = ok if inf.upload is not None else local_ok
        except TimeoutError:
            ok = None
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - recorded by _commit on rank 0
            save_planner.forget(self._plan_key)  # a failed save may have left the ranks' plan caches out of step
            self._writer_failed = inf.upload is not None and self._async_mode == "process"
            if self.rank != 0:
                logger.warning("checkpoint step %d failed on this rank: %s", inf.step, e)
            ok = False
        if agree and not self._all_true(ok is not None, self.control_group):
            return None
        if ok is None:
            return None
        self._inflight = None
        self.metrics.gauge("elastic_trainer_checkpoint_saves_in_flight", 0)
        return ok

    def finish(self, timeout: float | None = None) -> bool:
        """Wait for the save in flight to be written and committed, at most ``timeout`` seconds
        (default: its per-save deadline). Raises TimeoutError past it (the save stays uncommitted
        unless it lands later)."""
        deadline = self._deadline_of(self._inflight) if timeout is None else time.monotonic() + timeout
        ok = self._finish_inflight(deadline)
        if ok is None:
            raise TimeoutError(f"checkpoint step {self._inflight.step} still writing")
        return ok

    def finish_agreed(self, deadline: float | None) -> bool | None:
        """Collective :meth:`finish`: None when the save is still running on some rank."""
        return self._finish_inflight(deadline, agree=True)

    def committed_everywhere(self, step: int) -> bool:
        """Collective: rank 0's answer to "is ``step`` committed?", agreed by every rank. Call
        with no save in flight (after :meth:`finish_agreed`)."""
        with self._lock:
            mine = self.rank != 0 or (self.last_committed_step == step and self.fenced is None)
        return self._all_true(mine, self.control_group)

    def fenced_everywhere(self) -> bool:
        """Collective: rank 0's answer to "did a newer launch fence our commits?", agreed by
        every rank (e.g. after the final save, whose commit may be the one refused)."""
        with self._lock:
            mine = self.fenced is None
        return not self._all_true(mine, self.control_group)

    def drain_on_failure(self, timeout: float) -> bool:
        """Exception path: start nothing, but give a save that is already uploading up to
        ``timeout`` seconds to finish (and, on rank 0, to commit). Never raises."""
        inf = self._inflight
        if inf is None or inf.upload is None:
            return False
        try:
            deadline = time.monotonic() + timeout
            inf.upload.result(timeout=timeout)
            if inf.commit is not None:
                return bool(inf.commit.result(timeout=max(0.0, deadline - time.monotonic())))
            return True
        except BaseException:  # noqa: BLE001 - best effort by design
            return False

    def inject_local_faults(self, step: int) -> None:
        """Fault injection (tests): lose or corrupt this rank's local copies at ``step``."""
        if self.local is not None:
            faults.maybe_damage_local(step, lambda: self.local.copies_on_disk(self._epoch_name))

    def close(self, finished: bool = False) -> None:
        """``finished``: the run ended normally; this rank's local copies are dropped (no restart
        of this launch will need them, and a later launch never uses them)."""
        save_planner.forget(self._plan_key)
        if self._async_mode == "process":
            writer_process.stop()
        for stager in (self._stager, self._local_stager):
            if stager is not None:
                stager.close()
        self._stager = self._local_stager = None
        if finished and self.local is not None:
            self.local.drop_epoch(self._epoch_name)
        if self._commit_pool is not None:
            self._commit_pool.shutdown(wait=True)


def staging_options(*, cuda: bool, shared_memory: bool):
    """How a save's stager copies the state out (pure; one mechanism for CPU and GPU): always in
    the background, into buffers it keeps for the next save. CUDA tensors go device → pinned
    host memory with non-blocking copies (pinned memory and non-blocking copies need an
    accelerator); ``shared_memory`` (the process writer): buffers in shared memory, handed to
    the writer process as handles instead of being copied on every save (on CUDA: pinned too)."""
    from torch.distributed.checkpoint.staging import StagingOptions

    return StagingOptions(use_pinned_memory=cuda, use_shared_memory=shared_memory, use_async_staging=True, use_non_blocking_copy=cuda)


def _chain(src: Future, dst: Future | None) -> None:
    if dst is None or dst.done():
        return
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())
