"""Early writeback: the disk writes a file's bytes while the rest of the file is still being written.

A save is durable once its files are fsynced. Without help, Linux leaves a file's pages dirty in
the page cache until that fsync (or until ``vm.dirty_background_*`` or the 30 s expiry), so the
disk starts only when the writing is over and the fsync waits for all of it: write time + disk
time. :class:`EarlyWriteback` asks the kernel to start writing each stretch of
:data:`STRETCH_BYTES` as soon as it is in the page cache (``sync_file_range`` with
``SYNC_FILE_RANGE_WRITE``: start the I/O, do not wait for it), so the disk works while the rest
is written and the final fsync waits for the tail only. The fsync still makes the save durable;
this only moves the disk's work earlier, and a file system or stream that cannot do it (an
object store's upload stream, another OS) is written as before.
"""

from __future__ import annotations

import ctypes
import io
import os
import stat
import sys
from collections.abc import Callable

STRETCH_BYTES = 8 << 20  # the kernel is asked to write each 8 MiB as it is filled
SYNC_FILE_RANGE_WRITE = 2

SyncFileRange = Callable[[int, int, int, int], int]


def _libc_sync_file_range() -> SyncFileRange | None:
    """libc's ``sync_file_range`` (None off Linux), looked up once at import, before any fork."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


# libc's call (None where there is none); every EarlyWriteback made later uses what this holds
sync_file_range = _libc_sync_file_range()


def regular_file_descriptor(stream) -> int | None:
    """``stream``'s descriptor when it writes a regular file through the page cache, else None (a
    pipe, an upload stream, a file written around the page cache: :mod:`.direct`)."""
    if getattr(stream, "bypasses_page_cache", False):
        return None
    try:
        fd = stream.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return None


class EarlyWriteback:
    """One output file's early writeback. Call :meth:`wrote` after each write with the file's
    size so far and a ``flush`` that hands the stream's buffer to the kernel. ``fd`` None: off.
    ``syscall``: ``sync_file_range(fd, offset, nbytes, flags) -> 0 | -1`` (libc's by default)."""

    def __init__(self, fd: int | None, *, stretch: int = STRETCH_BYTES, syscall: SyncFileRange | None = None):
        self._syscall = syscall or sync_file_range
        self._fd = fd if self._syscall is not None else None
        self._stretch = stretch
        self._start = 0  # the first byte not yet handed to the disk

    @property
    def active(self) -> bool:
        return self._fd is not None

    def wrote(self, size: int, flush: Callable[[], None]) -> None:
        if self._fd is None or size - self._start < self._stretch:
            return
        flush()
        assert self._syscall is not None  # active
        if self._syscall(self._fd, self._start, size - self._start, SYNC_FILE_RANGE_WRITE) != 0:
            self._fd = None  # not supported here (or the device said no): the final fsync does it all
            return
        self._start = size
