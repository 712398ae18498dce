"""What a (re)start or a rollback loads: rank 0's plan, and the load of a checkpoint.dir commit.

:func:`decide` runs on rank 0 only and never raises: its :class:`Decision` is broadcast, and
every rank then loads the same checkpoint, or raises the same error. :func:`load_remote` runs on
every rank and agrees whether the load failed, and how: bad bytes (integrity: quarantine it and
fall back to an older commit) or good bytes this code cannot take (compatibility: stop, naming
the keys, with nothing changed). The manager (:mod:`.manager`) runs the fallback loop.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from .. import faults
from ..errors import CheckpointError, CheckpointIncompatibleError, FencedError, NoUsableCheckpointError
from ..events import EventLog
from ..storage.fs import Storage
from . import compat, integrity, layout
from .agreement import Agreement
from .catalog import Catalog, ResumePlan
from .load_planner import load_planner
from .local_tier import Copy, LocalTier
from .state import PerRank
from .timeline import Timeline

logger = logging.getLogger(__name__)


@dataclass
class LoadResult:
    step: int
    name: str
    manifest: dict[str, Any]
    seconds: float
    skipped: list[tuple[int, str]] = field(default_factory=list)
    first_start: bool = True
    tier: str = "remote"  # "local": every rank loaded its copy from checkpoint.local_dir; "peer": the nodes' copies
    tiers: list[str] | None = None  # "peer": per rank, "local" (its node's copies only) or "peer"


@dataclass
class Decision:
    """Rank 0's resume plan, broadcast to every rank. ``refused``: the error every rank raises
    with ``message`` instead of loading; else ``chosen`` (None: start fresh)."""

    refused: type[Exception] | None = None
    message: str = ""
    chosen: str | None = None
    manifest: dict[str, Any] = field(default_factory=dict)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    taken: list[str] = field(default_factory=list)
    first_start: bool = True
    unreadable: str | None = None  # the chosen checkpoint's metadata could not be read: damage
    added: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)
    epoch: str = ""
    lineage: str = ""
    listed: bool = False  # from names alone (:func:`from_names`): ``chosen`` unverified, ``manifest`` its step only
    # the chosen commit's DCP metadata, read and verified by rank 0: every rank plans its load
    # from it (DCP's own load reads it again on every rank and agrees on the plans)
    metadata: Any = None


class LocalLoad(enum.Enum):
    NONE = "no copy every rank has"
    FAILED = "a copy failed to load"


def _take_epoch(cat: Catalog, launch_id: str) -> None:
    if cat.epoch is None:
        cat.fence.acquire(launch_id or f"standalone-{time.time_ns()}")


def from_names(cat: Catalog, launch_id: str, *, clean: bool) -> Decision:
    """Rank 0, before :func:`decide` when a local tier may hold this launch's state: the plan
    from checkpoint.dir's listings alone, reading no object there (on a slow or distant
    checkpoint.dir a restart's reads are its cost). ``chosen``: the newest directory that lists
    a commit marker and no quarantine, unverified: only a local or peer copy of this launch that
    descends from it (it is in the copy's signed lineage) and is at least as new is loaded on
    this plan, and those copies are verified byte by byte as they load. Anything else (no such
    copy, a failed load) takes :func:`decide`, which verifies. ``clean``: as for :func:`decide`
    (uncommitted directories go, by the listing: :meth:`.Pruner.clean_listed`). Never raises."""
    try:
        _take_epoch(cat, launch_id)
        names, newest, uncommitted = cat.names()
        cleaned = set(cat.pruner.clean_listed(uncommitted)) if clean else set()
        return Decision(
            chosen=newest,
            manifest={"step": layout.parse_step_dir(newest)} if newest else {},
            taken=[n for n in names if n not in cleaned],
            first_start=False,  # a copy of this launch's epoch exists only after a start of it
            epoch=cat.epoch or "",
            lineage=uuid.uuid4().hex[:12],
            listed=True,
        )
    except FencedError as e:
        return Decision(FencedError, str(e))
    except Exception as e:  # noqa: BLE001 - reported on every rank
        return Decision(CheckpointError, f"{type(e).__name__}: {e}")


def decide(
    cat: Catalog,
    resume: str,
    exclude: frozenset[str],
    *,
    clean: bool,
    launch_id: str,
    events: EventLog,
) -> Decision:
    """Rank 0: plan the load for ``resume`` (``latest``, ``none`` or a step), past the names in
    ``exclude`` (failed in this start), and read the chosen commit's ``.metadata`` (its layout is
    checked against the registered state by :func:`check`, once every rank initialised its
    state). Never raises (the answer is broadcast to every rank).
    ``clean``: remove uncommitted directories (at a process's first load only: a later one, a
    rollback, may have abandoned a save that is still writing)."""
    try:
        # One scan for the whole decision: on a slow or distant checkpoint.dir every read is a
        # round trip on the restart's path.
        _take_epoch(cat, launch_id)
        candidates = cat.scan()
        plan = cat.plan_resume(resume, exclude, candidates=candidates)
        _report_plan(cat, plan, events)
        refusal = _refusal(plan, resume, events)
        if refusal is not None:
            return refusal
        cleaned = _clean(cat, plan, candidates) if clean else set()
        out = Decision(
            skipped=plan.skipped,
            taken=sorted(c.name for c in candidates if c.name not in cleaned),
            first_start=plan.first_start,
            # lineage: names the local copies this start writes
            epoch=cat.epoch or "",
            lineage=uuid.uuid4().hex[:12],
        )
        if plan.chosen is None:
            return out
        assert plan.chosen.manifest is not None  # verified
        out.chosen, out.manifest = plan.chosen.name, plan.chosen.manifest
        try:
            out.metadata = cat.read_metadata(plan.chosen)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - unreadable metadata is damage: quarantined by the load loop
            out.unreadable = compat.one_line(e)
        return out
    except FencedError as e:
        return Decision(FencedError, str(e))
    except Exception as e:  # noqa: BLE001 - reported on every rank
        return Decision(CheckpointError, f"{type(e).__name__}: {e}")


def _report_plan(cat: Catalog, plan: ResumePlan, events: EventLog) -> None:
    """Rank 0: events for the root's stray directories and the skipped checkpoints; the corrupt
    ones quarantined (best effort: they are skipped in this start either way)."""
    for name in cat.ignored_entries():
        events.emit("checkpoint_ignored", path=name, reason="not a step-XXXXXXXX directory")
    for step, reason in plan.skipped:
        logger.warning("skipping checkpoint step %d: %s", step, reason)
        events.emit("checkpoint_skipped", step=step, reason=reason)
    for name, reason in plan.corrupt:
        try:
            cat.quarantine.mark(name, reason)
        except Exception as e:  # noqa: BLE001 - skipped in this start either way
            logger.warning("could not quarantine %s: %s", name, e)


def _refusal(plan: ResumePlan, resume: str, events: EventLog) -> Decision | None:
    """The refusal to resume from ``plan`` (recorded in ``events``): the step ``resume`` names is
    unusable, the newest commit is incompatible, or no commit is usable; None when it may go on."""
    if resume not in ("latest", "none") and plan.first_start and plan.chosen is None:
        reason = plan.skipped[0][1] if plan.skipped else "not found"
        return Decision(CheckpointError, f"checkpoint.resume={resume}: checkpoint step {resume} is unusable: {reason}")
    stop = plan.stop_reason()
    if plan.incompatible is not None:
        events.emit("checkpoint_incompatible", name=plan.incompatible[0], reason=plan.incompatible[1])
        assert stop is not None  # stop_reason names an incompatible commit
        return Decision(CheckpointIncompatibleError, stop)
    if stop is not None:
        events.emit("resume_refused", reason=stop, unusable=[n for n, _ in plan.unusable])
        return Decision(NoUsableCheckpointError, stop)
    return None


def _clean(cat: Catalog, plan: ResumePlan, candidates: list[layout.Candidate]) -> set[str]:
    """Remove the uncommitted directories but the chosen one's; at a launch's first start, record
    the commit it starts from. Returns the names removed."""
    keep = frozenset({plan.chosen.name}) if plan.chosen else frozenset()
    cleaned = {c.name for c in cat.pruner.clean_uncommitted(keep, candidates)}
    if plan.first_start:
        cat.fence.record_base(plan.chosen.name if plan.chosen else None)
    return cleaned


def init_states(states: dict[str, Stateful]) -> dict[str, dict[str, Any]]:
    """Every rank, once a commit is chosen and before :func:`check`: each shared state's
    ``state_dict()``, which DCP's load would ask for anyway. The first one of an optimizer whose
    state is still empty runs DSD's initialisation (one step with zero gradients and no learning
    rate: on sharded parameters, most of a small model's load); done here, every rank runs it at
    the same time instead of rank 0 in its check and then the others in the load."""
    return {k: v.state_dict() for k, v in states.items() if not getattr(v, "per_rank", False)}


def check(
    states: dict[str, Stateful],
    state_dicts: dict[str, dict[str, Any]],
    world_size: int,
    decision: Decision,
    events: EventLog,
) -> Decision:
    """Rank 0, after :func:`init_states` on every rank: ``decision`` with what the chosen
    commit's ``.metadata`` says against the registered state (:mod:`.compat`): the keys it adds,
    ignores or leaves absent; or a refusal when the code cannot take it. Never raises. Without
    the metadata: every rank has it from the decision (not broadcast twice)."""
    out = replace(decision, metadata=None)
    try:
        report = compat.check(states, decision.metadata, decision.manifest, world_size, state_dicts=state_dicts)
        if not report.ok:
            step = int(decision.manifest["step"])
            events.emit("checkpoint_incompatible", step=step, name=decision.chosen, problems=report.problems)
            assert decision.chosen is not None  # checked: a chosen commit
            return Decision(CheckpointIncompatibleError, report.message(decision.chosen))
        out.added, out.ignored, out.absent = report.added, report.ignored, list(report.absent)
        return out
    except Exception as e:  # noqa: BLE001 - reported on every rank
        return Decision(CheckpointError, f"{type(e).__name__}: {e}")


def report_evolution(events: EventLog, name: str, step: int, decision: Decision) -> None:
    """Rank 0: events for state the load left as initialised or did not load (on purpose)."""
    if decision.added:
        events.emit("state_added", step=step, name=name, keys=decision.added[:100])
        logger.warning(
            "checkpoint %s has no %s: left as initialised (optional_on_load)", name, ", ".join(decision.added[:10])
        )
    if decision.ignored:
        events.emit("state_ignored", step=step, name=name, keys=decision.ignored)
        logger.warning(
            "checkpoint %s holds %s, which this code does not register: not loaded", name, ", ".join(decision.ignored)
        )


def load_remote(
    states: dict[str, Stateful],
    storage: Storage,
    agreement: Agreement,
    decision: Decision,
    timeline: Timeline,
) -> str | None:
    """Every rank: load the chosen checkpoint from checkpoint.dir, except the optional Statefuls
    it holds nothing of (left as initialised). None when every rank loaded it; else the
    integrity problem (agreed: quarantine it). Raises CheckpointIncompatibleError (agreed) when
    a rank's failure is not about the bytes (the code could not take them). Adds DCP's
    ``planning``, ``reading``, ``verifying`` and ``set_state_dict`` to ``timeline``."""
    name, manifest = decision.chosen, decision.manifest
    assert name is not None  # loaded: a chosen commit
    some = {k: v for k, v in states.items() if k not in decision.absent}
    faults.maybe_inject("kill_in_load", int(manifest["step"]))
    for s in states.values():
        if isinstance(s, PerRank):
            s.expect_world(manifest.get("world_size"))
    mine: tuple[str, str] = ("", "")
    reader = None
    t0 = time.monotonic()
    try:
        reader = integrity.verifying(
            storage.dcp.reader(storage.join(name)), layout.Checks.from_manifest(manifest), metadata=decision.metadata
        )
        # Every rank plans from the broadcast metadata alone: a load plan needs no other rank's
        # (DCP's global load plan is the local ones), and the ranks agree on the outcome below.
        integrity.load(some, reader, planner=load_planner(some), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed and handled below
        mine = ("integrity" if compat.is_integrity(e) else "incompatible", compat.one_line(e))
    _add_load_phases(timeline, t0, time.monotonic(), reader)
    if agreement.all_true(not mine[0], control=False):
        return None
    views = [v for v in agreement.gather(mine) if v[0]]
    bad = [v for v in views if v[0] == "integrity"]
    if bad:
        return bad[0][1]
    raise CheckpointIncompatibleError(
        f"checkpoint {name} is intact but this code could not load it: {views[0][1]} "
        "(nothing was quarantined or changed; register the same state as the run that wrote it, "
        'or start a new run: another checkpoint.dir, or checkpoint.resume = "none")'
    )


def _add_load_phases(timeline: Timeline, start: float, end: float, reader: Any) -> None:
    """DCP's load from ``start`` to ``end``, split at the reader's ``read_data``: before it the
    plan (metadata, plans, their collectives), after it the state handed to the ``Stateful``s."""
    span = getattr(reader, "read_span", None)
    if span is None:  # it failed before reading
        timeline.add("planning", end - start)
        return
    verify = reader.verify_seconds
    timeline.add("planning", span[0] - start)
    timeline.add("reading", span[1] - span[0] - verify)
    timeline.add("verifying", verify)
    timeline.add("set_state_dict", end - span[1])


def load_local(
    tier: LocalTier,
    states: dict[str, Stateful],
    agreement: Agreement,
    decision: Decision,
    skipped: list[tuple[int, str]],
    *,
    epoch: str,
    rank: int,
    mesh_shape: list[int],
    fingerprint: str,
    events: EventLog,
    timeline: Timeline,
) -> Copy | LocalLoad:
    """Every rank: load the newest local copy that every rank can prove, if it is at least as
    new as the remote choice and descends from it. Returns the result, NONE (no common
    copy) or FAILED (a load failed somewhere: the state may be partly overwritten, and the
    failing ranks dropped their copy). All ranks load the same tier: never a mix. Returns the copy
    loaded, else NONE (no common copy) or FAILED."""
    chosen = decision.chosen
    remote_step = int(decision.manifest["step"]) if chosen else 0
    copies, why = _usable_copies(tier, epoch, remote_step, chosen, mesh_shape, fingerprint)
    # A copy is named by (step, the start that wrote it): after a rollback or a restart a step
    # may exist twice in one epoch, and ranks must agree on the very same save.
    views = agreement.gather(([(c.step, c.manifest.get("lineage")) for c in copies], why))
    common = set.intersection(*(set(map(tuple, keys)) for keys, _ in views))
    if not common:
        if rank == 0:
            _report_no_common_copy(views, remote_step, events)
        return LocalLoad.NONE
    best = max(common)
    copy = next(c for c in copies if (c.step, c.manifest.get("lineage")) == best)
    error = _load_copy(tier, states, copy, timeline)
    if not agreement.all_true(not error, control=False):
        if error:  # this rank's copy is bad: never chosen again
            logger.error("local copy of step %d failed to load: %s", copy.step, error)
            tier.discard(copy)
        if rank == 0:
            events.emit(
                "checkpoint_local_skipped",
                step=copy.step,
                reason=f"load failed: {error or 'on another rank'}",
                remote_step=remote_step,
            )
        skipped.append((copy.step, f"local copy: load failed: {error or 'on another rank'}"))
        return LocalLoad.FAILED
    return copy


def _usable_copies(
    tier: LocalTier, epoch: str, remote_step: int, chosen: str | None, mesh_shape: list[int], fingerprint: str
) -> tuple[list[Copy], str]:
    """This rank's copies that may be loaded (other epochs' purged first), and why there are none."""
    try:
        tier.purge_other_epochs(epoch)
        return tier.usable(epoch, min_step=remote_step, remote=chosen, mesh_shape=mesh_shape, fingerprint=fingerprint)
    except OSError as e:
        return [], f"local tier unreadable: {type(e).__name__}: {e}"


def _report_no_common_copy(views: list[Any], remote_step: int, events: EventLog) -> None:
    """Rank 0, when some rank has copies but no copy is on every rank: say which ranks lack them."""
    if not any(steps for steps, _ in views):
        return
    reasons = "; ".join(f"rank {r}: {w}" for r, (steps, w) in enumerate(views) if not steps) or "no step every rank has"
    events.emit(
        "checkpoint_local_skipped",
        step=max(k[0] for keys, _ in views for k in keys),
        reason=f"not on every rank ({reasons})",
        remote_step=remote_step,
    )


def _load_copy(tier: LocalTier, states: dict[str, Stateful], copy: Copy, timeline: Timeline) -> str:
    """This rank's load of ``copy`` into ``states`` (no collectives): "" when it loaded, else the error."""
    faults.maybe_inject("kill_in_load", copy.step)
    error, reader = "", None
    t0 = time.monotonic()
    try:
        reader = tier.reader(copy)
        integrity.load(states, reader, planner=load_planner(states), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed and handled by load_local
        error = f"{type(e).__name__}: {e}"[:2000]
    _add_load_phases(timeline, t0, time.monotonic(), reader)
    return error
