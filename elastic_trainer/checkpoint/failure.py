"""Why a save failed, in one line, and whether a restart could change it.

A save's exception is rarely its cause: DCP wraps each rank's failure in a
``CheckpointException`` whose text is a traceback per rank, fsspec and the writer threads chain
theirs. :func:`cause` walks those wrappers (DCP's failures, ``__cause__``, ``__context__``) to the
innermost exception; :func:`describe` names it on one line (type, errno, message, file name) for
the ``checkpoint_failed`` event; :func:`permanent` says whether it is a cause a restart of the
group cannot change (no space, no permission, a read-only file system, a quota, a bucket that
does not exist), for which a failed final save ends the run at once.
"""

from __future__ import annotations

import errno
import os

from .compat import root_causes

# errno values no restart of the workers can change: the storage, not the process, is the problem
PERMANENT_ERRNOS = frozenset({errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EROFS, errno.EDQUOT})
# object stores say it in words (s3fs raises FileNotFoundError/PermissionError from botocore's codes)
PERMANENT_WORDS = ("NoSuchBucket", "specified bucket does not exist", "AccessDenied", "QuotaExceeded")


def cause(exc: BaseException) -> BaseException:
    """The exception that says why: the innermost ``OSError`` with an errno behind ``exc``
    (through DCP's per-rank failures, the first rank's, and the ``__cause__``/``__context__``
    chain); else the first exception that is not DCP's wrapper (our own errors name the problem
    in words the exceptions they chain do not)."""
    chain = _chain(exc)
    with_errno = [e for e in chain if isinstance(e, OSError) and e.errno is not None]
    if with_errno:
        return with_errno[-1]
    return next((e for e in chain if root_causes(e) == [e]), chain[-1])


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and not any(e is seen for seen in out) and len(out) < 32:
        out.append(e)
        inner = root_causes(e)
        if inner != [e]:
            e = inner[0]
            continue
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return out


def describe(exc: BaseException, limit: int = 500) -> str:
    """``Type: [Errno N] message: 'file'`` of :func:`cause`, on one line."""
    e = cause(exc)
    if isinstance(e, OSError) and e.errno is not None:
        text = f"[Errno {e.errno}] {e.strerror or os.strerror(e.errno)}"
        if e.filename is not None:
            text += f": {str(e.filename)!r}"
    else:
        text = " ".join(str(e).split())
    out = f"{type(e).__name__}: {text}" if text else type(e).__name__
    if e is not exc:
        out += f" (in {type(exc).__name__})"
    return out if len(out) <= limit else out[: limit - 3] + "..."


def permanent(exc: BaseException) -> bool:
    """Whether the failure is one a restart cannot change (see :data:`PERMANENT_ERRNOS`)."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in PERMANENT_ERRNOS:
            return True
        text = str(e)
        if any(w in text for w in PERMANENT_WORDS):
            return True
    return False
