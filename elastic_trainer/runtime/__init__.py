"""The runtime every training loop uses: the built-in trainer and a user's own script alike.

Public API (re-exported by :mod:`elastic_trainer`): :func:`init` → :class:`Session`,
:class:`Checkpointer`, :class:`StepContext` (``session.step(n, checkpointer=...)``) and
:class:`GlobalBatchSampler`. See docs/own-script.md.
"""

from .checkpointer import Checkpointer
from .sampler import GlobalBatchSampler, MicroBatchIndices
from .session import PreemptionFlag, Session, init
from .step import StepContext

__all__ = [
    "Checkpointer",
    "GlobalBatchSampler",
    "MicroBatchIndices",
    "PreemptionFlag",
    "Session",
    "StepContext",
    "init",
]
