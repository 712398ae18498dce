"""The peer tier (``checkpoint.peer_replicas``): every local-tier copy, replicated to other nodes'
holders, and a load from any mix of nodes' copies at any world size.

:class:`PeerTier` is one rank's: :meth:`~PeerTier.connect` learns every node's holder,
:meth:`~PeerTier.replicate` sends a committed copy in the background, :meth:`~PeerTier.load`
loads from the nodes' copies. Its parts, one module each:

* this node's own copies, as its holder serves them and its ranks read them: :mod:`.peer_copies`;
* replication, a ring over the nodes' holders, one sender thread per rank: :mod:`.peer_replication`;
* the load, its agreement and its merged metadata: :mod:`.peer_load`, :mod:`.peer_sources`;
* the transport the copies travel through, four operations (the holders' TCP by default):
  :mod:`.peer_transport`.

:class:`PeerSaver` is the write side: the local saver, each copy it commits then replicated.
Where this rank's node sits (:class:`PeerNode`: its node rank, its holder's address) is read from
the environment by the caller and passed in; nothing here reads the environment.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from .. import contract
from ..events import EventLog
from ..metrics.sink import MetricsSink
from ..storage.peer import SOCKET_TIMEOUT_SECONDS
from .agreement import Agreement
from .local_tier import LocalTier, job_key
from .peer_load import PeerCopy, PeerLoader, Placement, Want
from .peer_replication import Replicator, ring_targets
from .peer_transport import TcpTransport, TransportFactory
from .resume import LocalLoad
from .save import Save
from .savers import LocalSaver, Started

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerNode:
    """Where this rank's node sits among the holders: its ``node`` rank in the rendezvous round
    (``GROUP_RANK``) and its node's ``holder`` address (the supervisor's
    ``ELASTIC_TRAINER_PEER_HOLDER``; None: this node holds nothing for others and serves nothing,
    e.g. a process group without a supervisor)."""

    node: int = 0
    holder: str | None = None

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> PeerNode:
        """As a worker's environment says (the caller's ``os.environ``, read at its edge)."""
        return cls(int(env.get(contract.GROUP_RANK_ENV, "0") or 0), env.get(contract.PEER_HOLDER_ENV) or None)


class PeerTier:
    """The peer tier of one rank. ``holder``, ``node``: see :class:`PeerNode`; ``transports``:
    makes the transports copies travel through (default: the holders' TCP, :class:`TcpTransport`)."""

    def __init__(
        self,
        tier: LocalTier,
        ckpt_dir: str,
        *,
        key: bytes,
        replicas: int,
        holder: str | None,
        node: int,
        metrics: MetricsSink,
        events: EventLog,
        transports: TransportFactory | None = None,
    ):
        self.tier, self.key = tier, key
        self.replicas, self.holder, self.node = replicas, holder, node
        self.metrics, self.events = metrics, events
        self.transports = transports or TcpTransport.factory(job_key(ckpt_dir), key)
        self.holders: dict[int, str] | None = None  # node rank -> holder address, learnt at connect
        self.loader: PeerLoader | None = None  # made at connect
        self.replicator: Replicator | None = None  # None: nowhere to replicate to

    def connect(self, agreement: Agreement) -> None:
        """Collective, once per process: learn every node's holder; start this rank's sender."""
        if self.holders is not None:
            return
        views = agreement.gather((self.node, self.holder))
        self.holders = {n: a for n, a in views if a}
        leader = all(n != self.node for n, _ in views[: self.tier.rank])  # its node's first rank
        placement = Placement(self.node, self.holder, leader)
        self.loader = PeerLoader(
            self.tier, self.key, placement, self.transports, metrics=self.metrics, events=self.events
        )
        targets = [self.holders[n] for n in ring_targets(list(self.holders), self.node, self.replicas)]
        if targets:
            self.replicator = Replicator(self.tier.rank, targets, self.transports(SOCKET_TIMEOUT_SECONDS), self.metrics)
        elif self.tier.rank == 0:
            logger.info("peer tier: no other node's holder to replicate to (%d node(s) hold copies)", len(self.holders))

    def replicate(self, epoch: str, step: int) -> None:
        """After this rank's local copy of ``step`` committed (any thread): send it in the background."""
        if self.replicator is not None:
            self.replicator.submit(epoch, step, self.tier.rank_dir(epoch, step))

    def load(
        self,
        states: dict[str, Stateful],
        agreement: Agreement,
        *,
        epoch: str,
        remote: str | None,
        min_step: int,
        fingerprint: str,
        skipped: list[tuple[int, str]],
        attempt: str,
    ) -> PeerCopy | LocalLoad:
        """Every rank, after :meth:`connect`: the newest step every rank can assemble from the
        nodes' copies, loaded (:meth:`.peer_load.PeerLoader.load`); NONE (no such step) or FAILED
        (a load failed somewhere: every rank must load checkpoint.dir). ``attempt``: names this
        load, the same on every rank."""
        assert self.loader is not None, "connect() first"
        want = Want(epoch, min_step, remote, fingerprint)
        return self.loader.load(states, agreement, want, skipped=skipped, attempt=attempt)

    def close(self) -> None:
        if self.replicator is not None:
            self.replicator.close()


class PeerSaver:
    """A :class:`~.savers.Saver`: the local saver, each copy it commits then replicated to other
    nodes by ``peer`` (in the background; the save's ``done`` is the local copy's)."""

    def __init__(self, local: LocalSaver, peer: PeerTier):
        self.local, self.peer, self.tier = local, peer, local.tier

    def start(self, save: Save, states: dict[str, Stateful], manifest: dict[str, Any]) -> Started:
        started = self.local.start(save, states, manifest)

        def replicate(f: Future) -> None:
            if f.result():
                self.peer.replicate(save.epoch, save.step)

        started.done.add_done_callback(replicate)
        return started

    def healthy(self) -> bool:
        return self.local.healthy()

    def reset(self) -> None:
        self.local.reset()

    def close(self) -> None:
        self.local.close()
        self.peer.close()


def peer_tier_for(
    cfg,
    tier: LocalTier | None,
    ckpt_dir: str,
    *,
    key: bytes | None,
    node: PeerNode | None,
    metrics: MetricsSink,
    events: EventLog,
) -> PeerTier | None:
    """This rank's peer tier per ``checkpoint.peer_replicas``, or None (off: no local tier,
    ``peer_replicas = 0``, no ``node`` — the caller knows no holder — or no checkpoint key, said
    once)."""
    if tier is None or node is None or cfg.peer_replicas <= 0:
        return None
    if not key:
        if tier.rank == 0:
            logger.warning(
                "checkpoint.peer_replicas = %d but %s is not set: peer transfer is off (holders authenticate "
                "every request with that key)",
                cfg.peer_replicas,
                contract.CHECKPOINT_KEY_ENV,
            )
        return None
    return PeerTier(
        tier,
        ckpt_dir,
        key=key,
        replicas=cfg.peer_replicas,
        holder=node.holder,
        node=node.node,
        metrics=metrics,
        events=events,
    )
