"""Where a resume's time goes: :class:`Timeline`, the seconds of its named phases on one rank.

The phases, in the order a resume runs them (the ``resume`` event's ``phases``, rank 0's):

* ``session``   ``init()``: the process groups, the event log, the metrics sink
* ``build``     the script's own work between ``init()`` and ``resume()`` (model, sharding, optimizer)
* ``decision``  rank 0: the catalog's plan (listing, manifests, the chosen commit's ``.metadata``);
  ``decision_reads`` counts its storage operations
* ``agreement`` waiting for and exchanging rank 0's plan (on rank 0: the broadcast itself)
* ``state_init`` every rank's first ``state_dict()`` of its states (DSD's optimizer-state
  initialisation: one optimizer step with zero gradients), on every rank at once
* ``check``     rank 0: the checkpoint's layout against the registered state (:mod:`.compat`)
* ``planning``  DCP's load plan: the metadata, the local and global plans and their collectives
* ``reading``   the bytes of this rank's items, read and copied into the state
* ``verifying`` the checksums of what was read (within ``reading``'s wall time, counted apart)
* ``set_state_dict`` the loaded state handed to the model and optimizers
* ``data_position`` the data loader's position restored (the script's ``after_load``)

A phase that runs twice (a fallback past a damaged commit) adds up.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

# a resume from checkpoint.dir's phases, in the order they run (the local and peer tiers' differ)
PHASES = (
    "session",
    "build",
    "decision",
    "agreement",
    "state_init",
    "check",
    "planning",
    "reading",
    "verifying",
    "set_state_dict",
    "data_position",
)


class Timeline:
    """Seconds per phase of one resume, in the order each phase first ran. The main thread's."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + max(0.0, seconds)

    def count(self, name: str, n: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - t0)

    def as_fields(self) -> dict[str, object]:
        """The ``resume`` event's fields: ``phases`` (seconds, 4 decimals) and the counts."""
        return {"phases": {k: round(v, 4) for k, v in self.phases.items()}, **self.counts}

    def describe(self) -> str:
        """One line for the log: ``decision 0.012s, agreement 0.001s, ...``."""
        return ", ".join(f"{k} {v:.3f}s" for k, v in self.phases.items())
