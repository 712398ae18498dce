"""How often a supervisor reads torch's rendezvous state (``elastic.rdzv_poll_seconds``).

torch's c10d rendezvous (``DynamicRendezvousHandler``) keeps the shared state in the store and
reads it at most once a second: its state holder serves any read within a second of the last one
from memory, and a node waiting for a round to form sleeps a fixed second between reads (its
``_Action.SYNC``). Both sit on every membership change:

* a training node asks every monitor interval whether a node waits to join (a grow), but sees
  the newcomer only when its cached state is a second old: up to 1 s late;
* the node that completes a round returns at once, every other node on its next read, up to a
  second later, and the agents' rank assignment waits for all of them.

:func:`install` makes both ``poll_seconds``: a small read of the store that often per node (the
state is a few hundred bytes per node), only while a round forms and while the agent checks for
waiting nodes. On a cluster of thousands of nodes, set it back towards torch's 1 s.

The one use of torch's private rendezvous code for this is here: the state holder's
``_cache_duration``, and the module-level ``_delay`` of
``torch.distributed.elastic.rendezvous.dynamic_rendezvous`` with its ``_delay(seconds=1)`` in the
wait loop and its ``_delay(seconds=(0, 0.3))`` before a join in round 0.
``tests/unit/test_round_poll.py`` fails loudly when torch changes them.
"""

from __future__ import annotations

from typing import Any

TORCH_POLL_SECONDS = 1  # torch's fixed wait between reads of a forming round, and its read cache
FIRST_JOIN_SKEW_SECONDS = (0, 0.3)  # torch's random delay before a join while the job is in round 0


def install(handler, poll_seconds: float) -> None:
    """Read the rendezvous state every ``poll_seconds`` instead of every second, for ``handler``
    (a ``DynamicRendezvousHandler``; others are left alone) and, for the wait between reads of a
    forming round, in this whole process (the supervisor has one handler). Other delays torch asks
    for are kept, but one: the random skew (up to 0.3 s) torch puts before a node's join while the
    job is in its first round, which it meant for the job's first join and which also delays the
    first restart of every job; a node that has joined once joins again without it. Idempotent."""
    from .rendezvous import KeyedRendezvousHandler

    if isinstance(handler, KeyedRendezvousHandler):  # the package's own: the period is its setting
        handler.poll_seconds = poll_seconds
        return
    holder = getattr(handler, "_state_holder", None)
    if holder is None or not hasattr(holder, "_cache_duration"):
        return
    holder._cache_duration = poll_seconds
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    torch_delay = getattr(dynamic_rendezvous._delay, "torch_delay", dynamic_rendezvous._delay)
    if not hasattr(handler.next_rendezvous, "joined"):
        join = handler.next_rendezvous

        def next_rendezvous(*args, **kwargs):
            result = join(*args, **kwargs)
            wrapper.joined = True
            return result

        wrapper: Any = next_rendezvous  # Any: mypy does not model a function's own attributes
        wrapper.joined = False
        handler.next_rendezvous = wrapper
    joined = handler.next_rendezvous

    def _delay(seconds):
        if seconds == FIRST_JOIN_SKEW_SECONDS and joined.joined:
            return
        torch_delay(poll_seconds if seconds == TORCH_POLL_SECONDS else seconds)

    delay: Any = _delay  # Any: mypy does not model a function's own attributes
    delay.torch_delay = torch_delay
    dynamic_rendezvous._delay = delay
