"""A process that dies with its parent: Linux's ``PR_SET_PDEATHSIG``, the one way every process
of a launch uses it (a worker with its supervisor or zygote, the zygote with the supervisor, a
data loader's worker with its rank). Elsewhere these are no-ops."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15

Prctl = Callable[..., int]


def libc_prctl() -> Prctl | None:
    """libc's ``prctl`` (None off Linux). Look it up before a fork: a child of a threaded process
    had better not load libraries."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


def prctl(option: int, arg, fn: Prctl | None = None) -> None:
    """``prctl(option, arg)`` on Linux (``fn``: libc's, looked up earlier)."""
    fn = fn or libc_prctl()
    if fn is not None:
        fn(option, arg, 0, 0, 0)


def die_with_parent(parent: int, *, code: int = 0, fn: Prctl | None = None) -> None:
    """SIGKILL this process when ``parent`` dies; if it already has (this process's parent is no
    longer ``parent``), exit now with ``code``."""
    if not sys.platform.startswith("linux"):
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, fn)
    if os.getppid() != parent:  # it died before the call
        os._exit(code)
