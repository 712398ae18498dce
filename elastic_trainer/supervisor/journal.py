"""Where the supervised agent and its collaborators report: the event log, the metrics sink and
this node's name, bundled once so each collaborator takes one argument for all three."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from ..events import EventLog
from ..metrics.sink import MetricsSink, NullSink


@dataclass(frozen=True)
class Journal:
    """The agent's side channel: ``events`` (``events.jsonl``), ``metrics`` (a sink; the null one
    by default) and ``node``, this node's name in events. Reports only; decides nothing."""

    events: EventLog
    metrics: MetricsSink = field(default_factory=NullSink)
    node: str = ""

    def rendezvous(self, *, group_rank: int, nodes: int, world_size: int | None, seconds: float) -> None:
        """A rendezvous round completed on this node."""
        self.events.emit(
            "rendezvous",
            node=self.node,
            pid=os.getpid(),
            group_rank=group_rank,
            nodes=nodes,
            world_size=world_size,
            seconds=round(seconds, 4),
            mono=time.monotonic(),
        )
        self.metrics.counter("elastic_trainer_rendezvous_rounds_total")

    def hang_detected(self) -> None:
        """The hang watchdog reaped a worker."""
        self.metrics.counter("elastic_trainer_hang_detections_total")
