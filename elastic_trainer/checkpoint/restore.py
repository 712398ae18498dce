"""The load's fallback loop, every rank: rank 0's plan, then the local tier, the peer tier, then
checkpoint.dir.

:meth:`Restorer.load` asks rank 0's :func:`.resume.decide` for the checkpoint to load
(broadcast), tries the local tier's copies first (when every rank has one that fits), then the
nodes' copies at any world size (:mod:`.peer_tier`, when on), then loads the chosen
checkpoint.dir commit; one whose bytes fail is quarantined and the next older one tried, in the
same start. It returns what was loaded and the lineage position the state now
has (:class:`Restored`); the manager applies it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

from torch.distributed.checkpoint.stateful import Stateful

from ..errors import CheckpointError, NoUsableCheckpointError
from ..storage.fs import Storage
from . import resume as resume_plan
from .agreement import Agreement
from .catalog import Catalog
from .local_tier import Copy, LocalTier
from .peer_load import PeerCopy
from .peer_tier import PeerTier
from .position import Position
from .resume import Decision, LoadResult, LocalLoad
from .save import SaveContext
from .timeline import Timeline

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    """What a load did: ``result`` (None: a fresh state), the ``position`` the state now has,
    the ``tier`` it came from and the newest checkpoint.dir commit it knows of."""

    result: LoadResult | None
    position: Position
    tier: str | None = None
    committed: int | None = None


class Restorer:
    """The load of one manager's states (see the module's docstring); ``catalog``: rank 0's;
    ``local``: the local tier (this rank's copies); ``peer``: the peer tier (the nodes' copies)."""

    def __init__(
        self,
        states: dict[str, Stateful],
        storage: Storage,
        catalog: Catalog | None,
        agreement: Agreement,
        ctx: SaveContext,
        *,
        launch_id: str,
        local: LocalTier | None,
        peer: PeerTier | None = None,
    ):
        self.states = states
        self.storage = storage
        self.catalog = catalog
        self.agreement = agreement
        self.ctx = ctx
        self.launch_id = launch_id
        self.local = local
        self.peer = peer

    def load(self, position: Position, resume: str, *, clean: bool, timeline: Timeline) -> Restored:
        """``clean``: this manager has not loaded before (see :func:`.resume.decide`); the phases
        go into ``timeline`` (:mod:`.timeline`). Raises as :meth:`.manager.CheckpointManager.load`
        documents."""
        failed: set[str] = set()
        skipped_all: list[tuple[int, str]] = []
        try_local = self.local is not None and resume == "latest"
        local_failed, listed = False, None
        if self.peer is not None:
            self.peer.connect(self.agreement)
        if try_local:  # a restart whose copies descend from the newest commit reads nothing of checkpoint.dir
            listed = self._plan(
                # rank 0's catalog: the plan runs there
                lambda: resume_plan.from_names(cast(Catalog, self.catalog), self.launch_id, clean=clean),
                timeline,
                "decision",
            )
            position = self._learnt(position, listed)
            local = self._load_local(position, listed, skipped_all, timeline)
            if isinstance(local, Restored):
                return local
            local_failed = local is LocalLoad.FAILED
        while True:
            decision = self._decide(resume, failed, clean=clean, timeline=timeline)
            position = self._learnt(position, decision)
            skipped_all += [cast(tuple[int, str], tuple(s)) for s in decision.skipped]
            if try_local:
                try_local = False
                assert listed is not None  # planned above (try_local)
                if not local_failed and decision.chosen != listed.chosen:  # else: the same copies, just tried
                    local = self._load_local(position, decision, skipped_all, timeline)
                    if isinstance(local, Restored):
                        return local
                    local_failed = local is LocalLoad.FAILED
                if local_failed and decision.chosen is None:
                    raise CheckpointError(
                        "the local copies failed to load and checkpoint.dir has no commit; "
                        "restarting from a clean state"
                    )
            if decision.chosen is None:
                return self._fresh(position, failed)
            loaded = self._load_remote(position, decision, skipped_all, timeline)
            if isinstance(loaded, Restored):
                return loaded
            step = int(decision.manifest["step"])
            self._skip(decision.chosen, step, f"load failed: {loaded}")
            skipped_all.append((step, f"load failed: {loaded}"))
            failed.add(decision.chosen)

    def _decide(self, resume: str, failed: set[str], *, clean: bool, timeline: Timeline) -> Decision:
        """Every rank: rank 0's choice of the commit to load, never one of ``failed`` (this start's
        failed loads), its layout then checked against the states (:meth:`_check`)."""
        decision = self._plan(
            lambda: resume_plan.decide(
                cast(Catalog, self.catalog),  # rank 0's: the plan runs there
                resume,
                frozenset(failed),
                clean=not failed and clean,
                launch_id=self.launch_id,
                events=self.ctx.events,
            ),
            timeline,
            "decision",
        )
        if decision.chosen is not None and decision.unreadable is None:
            decision = self._check(decision, timeline)
        return decision

    @staticmethod
    def _fresh(position: Position, failed: set[str]) -> Restored:
        """No commit left to load: a fresh state, unless loads failed in this start (``failed``)."""
        if failed:  # every candidate failed its load in this start: never train from step 0 over them
            raise NoUsableCheckpointError(
                f"every committed checkpoint failed to load ({', '.join(sorted(failed))}: quarantined); "
                "not starting over from step 0. 'elastic-trainer ckpt release URI --step N' re-verifies one "
                "and lifts its quarantine if its bytes are good; or start a new run: another checkpoint.dir, "
                'or checkpoint.resume = "none" for this launch'
            )
        return Restored(None, replace(position, parent=None, seq=0, chain=("",)))

    def _load_remote(
        self, position: Position, decision: Decision, skipped: list[tuple[int, str]], timeline: Timeline
    ) -> Restored | str:
        """Every rank: the chosen checkpoint.dir commit, loaded; else why it could not be (rank 0
        could not read its metadata, or its bytes failed: agreed by every rank)."""
        if decision.unreadable is not None:
            return decision.unreadable
        name, manifest = cast(str, decision.chosen), decision.manifest
        step = int(manifest["step"])
        t0 = time.monotonic()
        failure = resume_plan.load_remote(self.states, self.storage, self.agreement, decision, timeline)
        if failure is not None:
            return failure
        seconds = time.monotonic() - t0
        self.ctx.metrics.histogram("elastic_trainer_checkpoint_resume_load_seconds", seconds)
        if self.ctx.rank == 0:
            resume_plan.report_evolution(self.ctx.events, name, step, decision)
        result = LoadResult(step, name, manifest, seconds, skipped, decision.first_start)
        return Restored(result, position.loaded(name, int(manifest.get("seq", 0))), "remote", step)

    def _plan(self, plan: Callable[[], Decision], timeline: Timeline, phase: str) -> Decision:
        """Rank 0's ``plan()`` (its ``phase``, with the storage operations it took), on every
        rank (``agreement``); raises the error it refuses with."""
        mine = None
        if self.ctx.rank == 0:
            operations = self.storage.operations
            with timeline.phase(phase):
                mine = plan()
            if phase == "decision":
                timeline.count("decision_reads", self.storage.operations - operations)
        with timeline.phase("agreement"):
            decision = self.agreement.broadcast(mine)
        if decision.refused is not None:
            raise decision.refused(decision.message)
        return decision

    def _check(self, decision: Decision, timeline: Timeline) -> Decision:
        """Every rank initialises its state (``state_init``: at once, not one rank after the
        other), then rank 0 checks the chosen commit's layout against it (``check``)."""
        with timeline.phase("state_init"):
            state_dicts = resume_plan.init_states(self.states)
        checked = self._plan(
            lambda: resume_plan.check(self.states, state_dicts, self.ctx.world_size, decision, self.ctx.events),
            timeline,
            "check",
        )
        return replace(checked, metadata=decision.metadata)

    @staticmethod
    def _learnt(position: Position, decision: Decision) -> Position:
        return replace(
            position,
            # never forget a name: an abandoned save may still write into it
            taken=position.taken | set(decision.taken),
            epoch=decision.epoch,
            lineage=decision.lineage,
        )

    def _skip(self, name: str, step: int, reason: str) -> None:
        logger.error("checkpoint %s %s", name, reason)
        if self.ctx.rank == 0:
            self.ctx.events.emit("checkpoint_skipped", step=step, name=name, reason=reason)
            try:
                assert self.catalog is not None  # rank 0's
                self.catalog.quarantine.mark(name, reason)
            except Exception as e:  # noqa: BLE001 - skipped in this start either way
                logger.warning("could not quarantine %s: %s", name, e)

    def _load_local(
        self, position: Position, decision: Decision, skipped: list[tuple[int, str]], timeline: Timeline
    ) -> Restored | LocalLoad:
        """Every rank: the local tier's copy, when every rank has one that fits (see
        :func:`.resume.load_local`); else, with a peer tier, the nodes' copies at any world size
        (:meth:`.peer_tier.PeerTier.load`); NONE or FAILED otherwise."""
        t0 = time.monotonic()
        assert self.local is not None  # tried with a local tier only
        loaded: Copy | PeerCopy | LocalLoad = resume_plan.load_local(
            self.local,
            self.states,
            self.agreement,
            decision,
            skipped,
            epoch=position.epoch,
            rank=self.ctx.rank,
            mesh_shape=self.ctx.mesh_shape,
            fingerprint=self.ctx.fingerprint,
            events=self.ctx.events,
            timeline=timeline,
        )
        if isinstance(loaded, LocalLoad) and self.peer is not None:  # not every rank has its own copy: the nodes'
            from_peers = self._load_from_peers(position, decision, skipped, timeline)
            loaded = loaded if from_peers is LocalLoad.NONE else from_peers
        if isinstance(loaded, LocalLoad):
            return loaded
        return self._restored_copy(loaded, position, decision, skipped, time.monotonic() - t0)

    def _load_from_peers(
        self, position: Position, decision: Decision, skipped: list[tuple[int, str]], timeline: Timeline
    ) -> PeerCopy | LocalLoad:
        """Every rank: the nodes' copies (:meth:`.peer_tier.PeerTier.load`), no older than the
        chosen commit."""
        assert self.peer is not None  # tried with a peer tier only
        manifest: dict[str, Any] = decision.manifest
        with timeline.phase("peer_load"):
            return self.peer.load(
                self.states,
                self.agreement,
                epoch=position.epoch,
                remote=decision.chosen,
                min_step=int(manifest["step"]) if decision.chosen else 0,
                fingerprint=self.ctx.fingerprint,
                skipped=skipped,
                attempt=position.lineage,  # this decision's: the same on every rank
            )

    def _restored_copy(
        self,
        copy: Copy | PeerCopy,
        position: Position,
        decision: Decision,
        skipped: list[tuple[int, str]],
        seconds: float,
    ) -> Restored:
        """What loading ``copy`` (this rank's local copy, or one assembled from the nodes' copies)
        in ``seconds`` did, its metrics recorded."""
        assert self.local is not None  # tried with a local tier only
        manifest: dict[str, Any] = decision.manifest
        chosen = decision.chosen
        peer = isinstance(copy, PeerCopy)
        self.ctx.metrics.histogram("elastic_trainer_checkpoint_resume_load_seconds", seconds)
        if not peer:
            self.ctx.metrics.counter("elastic_trainer_checkpoint_local_resumes_total")
        result = LoadResult(
            copy.step,
            copy.name if isinstance(copy, PeerCopy) else os.path.relpath(copy.path, self.local.root),
            copy.manifest,
            seconds,
            skipped,
            decision.first_start,
            tier="peer" if peer else "local",
            tiers=copy.tiers if isinstance(copy, PeerCopy) else None,
        )
        position = position.loaded(
            chosen,
            # a plan from names knows no seq: the copy's is at least the chosen commit's (it descends from it)
            int((copy.manifest if decision.listed else manifest).get("seq", 0)) if chosen else 0,
            chain=copy.manifest.get("remote_chain") or [chosen or ""],
            local_step=None if peer else copy.step,  # a peer load leaves no copy of this rank at this world size
        )
        return Restored(result, position, result.tier, int(manifest["step"]) if chosen else None)
