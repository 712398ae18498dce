"""The peer tier's load (every rank, when the own-copy local load is not possible): the newest
step every rank can assemble from the nodes' copies, at any world size.

Each rank lists what it can reach (its node's disk, and every live holder's copies: each holder is
asked for its inventory by its own node's first rank and the answers are gathered, one request per
holder and load), keeping only copies whose manifest is sealed and signed, of this launch epoch and
model, descending from the remote checkpoint the catalog chose, at that step or newer
(:class:`Want`, :func:`usable`). The ranks agree on the newest step (and lineage, and the world
size W it was saved at) for which *every* rank reaches a copy of every source rank 0..W-1. Each
rank then loads it through DCP with the resharding load planner, over a
:class:`~.peer_sources.SourcesReader` (its merged ``.metadata``: each source's read by one rank
and gathered, once per load). Any gap, unreachable holder or bad byte on any rank: every rank
falls back to checkpoint.dir (never a partial load), and a source copy whose bytes failed their
check is dropped where it was held (one a holder did not serve is kept: a failed request is no bad
byte).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from ..events import EventLog
from ..metrics.sink import MetricsSink
from ..storage.peer import SOCKET_TIMEOUT_SECONDS, PeerError
from . import compat, integrity, layout
from .agreement import Agreement
from .load_planner import load_planner
from .local_tier import LocalTier
from .peer_copies import DISK, NodeCopies
from .peer_sources import MetadataReads, Sources, SourcesReader, bad_source
from .peer_transport import CopyId, TransportFactory
from .resume import LocalLoad
from .state import PerRank

logger = logging.getLogger(__name__)

_SHARE = ".peer-load-"  # + a load's attempt: what the ranks of a node fetch once, under the job's local dir
CONTROL_TIMEOUT_SECONDS = 10.0  # an inventory or a drop

Step = tuple[int, Any, int]  # (step, lineage, world size)
Entry = tuple[int, int, int, dict[str, Any]]  # (step, source rank, world size, manifest)


@dataclass(frozen=True)
class PeerCopy:
    """What a peer load loaded (``manifest``: source rank 0's)."""

    step: int
    name: str
    manifest: dict[str, Any]
    tiers: list[str]  # per rank: "peer" (read bytes from another node's holder) or "local" (its node's only)


@dataclass(frozen=True)
class Want:
    """What a usable copy is: of this launch ``epoch`` and model ``fingerprint``, descending from
    the checkpoint.dir commit ``remote`` (None: none), at ``min_step`` or newer."""

    epoch: str
    min_step: int
    remote: str | None
    fingerprint: str


@dataclass(frozen=True)
class Placement:
    """Where a rank sits among the holders, learnt at connect: its ``node`` rank, its node's
    ``holder`` address (None: none), whether it is its node's first rank (``leader``: the one
    that asks its node's holder)."""

    node: int
    holder: str | None
    leader: bool


def usable(m: Any, key: bytes, want: Want, *, src: int, world: int, step: int) -> bool:
    """Whether manifest ``m``, offered as source ``src``'s copy of ``step`` at ``world``, is one
    to load: sealed and signed under ``key``, and as ``want`` says."""
    return (
        isinstance(m, dict)
        and layout.format_problem(m) is None
        and layout.seal_problem(m, key) is None
        and "hmac" in m
        and m.get("step") == step
        and m.get("rank") == src
        and m.get("world_size") == world
        and m.get("epoch") == want.epoch
        and m.get("config_fingerprint") == want.fingerprint
        and (want.remote or "") in (m.get("remote_chain") or [])
        and layout.METADATA in (m.get("files") or {})
    )


def usable_entries(inventory: list[dict[str, Any]], key: bytes, want: Want) -> list[Entry]:
    """The usable ones of an ``inventory``'s entries (see :func:`usable`)."""
    out = []
    for e in inventory:
        try:
            m = json.loads(e["manifest"])
            step, src, world = int(e["step"]), int(e["src"]), int(e["world"])
        except (KeyError, TypeError, ValueError):
            continue
        if step >= want.min_step and usable(m, key, want, src=src, world=world, step=step):
            out.append((step, src, world, m))
    return out


def _order(k: Step) -> tuple[int, str, int]:
    step, lineage, world = k
    return (step, str(lineage or ""), world)


class PeerLoader:
    """The load side of one rank's peer tier (see the module docstring). ``transports``: makes
    the transports it asks the holders through (one per load and request kind)."""

    def __init__(
        self,
        tier: LocalTier,
        key: bytes,
        placement: Placement,
        transports: TransportFactory,
        *,
        metrics: MetricsSink,
        events: EventLog,
    ):
        self.tier, self.key, self.placement = tier, key, placement
        self.disk = NodeCopies(tier.root)
        self.transports = transports
        self.metrics, self.events = metrics, events

    def reachable(self, agreement: Agreement, want: Want) -> dict[Step, Sources]:
        """Collective. ``{(step, lineage, W): {src: (location, manifest)}}`` this rank can read: its
        node's disk first, then every holder's copies (its own node's first). Each holder is asked
        for its inventory once, by the first rank of its own node, and the usable entries are
        gathered: one inventory per node and load, not one per pair of nodes."""
        p = self.placement
        disk: list[Entry] = []
        held = None
        try:
            disk = usable_entries(self.disk.inventory(), self.key, want)
            if p.leader and p.holder:
                held = self._inventory(p.holder, want)
        except OSError as e:
            logger.warning("peer tier unreadable: %s", e)
        answers = agreement.gather((p.node, p.holder, held) if held is not None else None)
        held_by = sorted({(n, a): e for n, a, e in filter(None, answers)}.items(), key=lambda kv: kv[0][0] != p.node)
        out: dict[Step, Sources] = {}
        for location, entries in [(DISK, disk), *(((a, e) for (_, a), e in held_by))]:
            for step, src, world, m in entries:
                out.setdefault((step, m.get("lineage"), world), {}).setdefault(src, (location, m))
        return out

    def _inventory(self, address: str, want: Want) -> list[Entry] | None:
        """This node's holder's usable copies (None: unreachable). Entries are checked (sealed,
        signed, this launch) before they go to the other ranks."""
        transport = self.transports(CONTROL_TIMEOUT_SECONDS)
        try:
            return usable_entries(transport.inventory(address), self.key, want)
        except (PeerError, ValueError) as e:
            logger.warning("peer holder %s unreachable: %s", address, e)
            return None
        finally:
            transport.close()

    def load(
        self, states: dict[str, Stateful], agreement: Agreement, want: Want, *, skipped: list, attempt: str
    ) -> PeerCopy | LocalLoad:
        """Every rank: the newest step every rank can assemble, loaded; NONE (no such step) or
        FAILED (a load failed somewhere: the state may be partly overwritten; every rank must
        load checkpoint.dir). ``attempt``: names this load, the same on every rank (what the
        ranks of a node fetch once goes there); a failure is appended to ``skipped``."""
        share = self._open_share(attempt)
        mine = self.reachable(agreement, want)
        best = self._agree(agreement, mine, want)
        if best is None:
            shutil.rmtree(share, ignore_errors=True)  # nothing was fetched into it
            return LocalLoad.NONE
        step, _, world = best
        sources = mine[best]
        copy = CopyId(want.epoch, step, 0, world)
        error, held, bad = self._read(states, agreement, sources, copy, share)
        results = agreement.gather((error, held))
        shutil.rmtree(share, ignore_errors=True)  # every rank of the node has read what it needs
        if any(err for err, _ in results):
            if bad is not None and bad in sources:
                self._drop(sources[bad][0], CopyId(want.epoch, step, bad, world))
            reason = next(f"rank {r}: {err}" for r, (err, _) in enumerate(results) if err)
            logger.error("peer load of step %d failed: %s", step, error or "on another rank")
            if self.tier.rank == 0:
                self.events.emit(
                    "checkpoint_peer_skipped",
                    step=step,
                    reason=f"load failed: {reason}"[:2000],
                    remote_step=want.min_step,
                )
            skipped.append((step, f"peer copy: load failed: {reason}"[:2000]))
            return LocalLoad.FAILED
        self.metrics.counter("elastic_trainer_checkpoint_peer_resumes_total")
        tiers = ["peer" if f else "local" for _, f in results]
        return PeerCopy(step, f"peer:step-{step:08d}/world-{world}", sources[0][1], tiers)

    def _open_share(self, attempt: str) -> str:
        """This load's directory under the job's local dir (an interrupted load's removed)."""
        root = self.tier.root
        share = os.path.join(root, f"{_SHARE}{attempt}")
        try:
            for n in os.listdir(root):  # an interrupted load's leftovers
                if n.startswith(_SHARE) and n != os.path.basename(share):
                    shutil.rmtree(os.path.join(root, n), ignore_errors=True)
            os.makedirs(share, exist_ok=True)
        except OSError as e:
            logger.warning("peer tier unreadable: %s", e)
        return share

    def _agree(self, agreement: Agreement, mine: dict[Step, Sources], want: Want) -> Step | None:
        """Collective: the newest step every rank reaches every source rank of (None: none)."""
        complete = {k for k, srcs in mine.items() if set(srcs) >= set(range(k[2]))}
        views = agreement.gather(sorted(complete, key=_order))
        common = set.intersection(*(set(map(tuple, v)) for v in views))
        if common:
            return max(common, key=_order)
        if self.tier.rank == 0 and any(views):
            self.events.emit(
                "checkpoint_peer_skipped",
                step=max(k[0] for v in views for k in v),
                reason="no step whose every shard every rank can reach",
                remote_step=want.min_step,
            )
        return None

    def _read(
        self, states: dict[str, Stateful], agreement: Agreement, sources: Sources, copy: CopyId, share: str
    ) -> tuple[str, bool, int | None]:
        """Collective: ``states`` loaded from ``sources``; ``(error, read from a holder, the
        source whose bytes failed)`` (error "": loaded)."""
        rank, world = self.tier.rank, copy.world
        error, held, bad = "", False, None
        reader: SourcesReader | None = None
        try:
            reader = SourcesReader(share, rank, self.tier.root, sources, self.transports(SOCKET_TIMEOUT_SECONDS), copy)
            own: MetadataReads | str = reader.metadata_of(range(rank, world, agreement.world_size))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must reach the gather
            own = compat.one_line(e, 2000)
        gathered = agreement.gather(own)  # each source's .metadata read once in the job, not once per node
        try:
            if reader is None:
                raise RuntimeError(f"could not start the peer load: {own}")
            reader.merge(gathered)
            for s in states.values():
                if isinstance(s, PerRank):
                    s.expect_world(world)
            integrity.load(states, reader, planner=load_planner(states), no_dist=True)
            held = reader.from_holders
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed and handled by the caller
            error = compat.one_line(e, 2000)
            bad = bad_source(e) if compat.is_integrity(e) else None
        return error, held, bad

    def _drop(self, location: str, copy: CopyId) -> None:
        logger.warning(
            "dropping the copy of rank %d of %d at step %d (%s): a byte failed its check",
            copy.src,
            copy.world,
            copy.step,
            location,
        )
        try:
            if location == DISK:
                self.disk.drop(copy.epoch, copy.step, copy.src, copy.world)
            else:
                transport = self.transports(CONTROL_TIMEOUT_SECONDS)
                try:
                    transport.drop(location, copy)
                finally:
                    transport.close()
        except (OSError, PeerError) as e:
            logger.warning("could not drop it: %s", e)
