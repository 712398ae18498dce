"""Shard files written around the page cache (``O_DIRECT``), through two aligned buffers.

A buffered ``write()`` copies every byte into the page cache, and the kernel then allocates,
tracks, writes back and later reclaims those pages: 0.3–1.2 CPU-s per GB in our measurements
on 2 cores, on the cores that train, against ~0.12 for a plain memory copy. A checkpoint's shards are written
once and read back only by a later process, so :class:`DirectFile` skips the page cache: each
write is copied into one of two page-aligned buffers, and a full buffer goes to the disk by
direct I/O on a thread of the file's own while the writer fills the other. The disk's DMA reads
the buffer itself; the closing fsync then waits for the file's metadata and the device's cache
only.

Direct I/O needs every write aligned (address, offset, length). The buffers are; the file's tail,
whenever the descriptor is handed out (:meth:`DirectFile.fileno`: the fsync that makes the file
durable) or the file closes, is written padded to the alignment and the file truncated back to
its true size. The tail stays in its buffer, so writing on after that rewrites the same aligned
block. A short write (a disk that filled up) is finished through an ordinary descriptor, which
then raises the real error (ENOSPC, EDQUOT); a file system that takes ``O_DIRECT`` at open but
refuses the writes (EINVAL) gets every write from then on through that descriptor.

:func:`open_direct` returns None where the file system refuses ``O_DIRECT`` (tmpfs, some FUSE
mounts; other OSes have no such flag): the caller then writes as before, through the page cache.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem

ALIGN = 4096  # every direct write's offset and length (a multiple of any device's logical block)
BUFFER_BYTES = 8 << 20  # each buffer: 8 MiB (a full one is one write)
BUFFERS = 2  # one being filled while the other is written (more in flight measured no faster)
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0: this OS has none


class _BufferPool:
    """The aligned buffers, kept from one file to the next: mapping and first touching 16 MiB
    costs milliseconds a file, and a rank writes one file per save."""

    def __init__(self, keep: int = 4):
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []
        self._keep = keep

    def get(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        # anonymous (page-aligned) and private: a child forked later never writes into ours
        return mmap.mmap(-1, BUFFER_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def after_fork(self) -> None:
        """In a forked child: a lock another thread of the parent held stays held there."""
        self._lock = threading.Lock()

    def put(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)
                return
        try:
            buf.close()
        except BufferError:  # a view of it still held somewhere: the collector unmaps it with the view
            pass


_POOL = _BufferPool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _POOL.after_fork())  # the pool the child sees then


def open_direct(path: str | os.PathLike) -> DirectFile | None:
    """``path`` created (truncated) for writing around the page cache; None where the file
    system does not take ``O_DIRECT``."""
    if not O_DIRECT:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as e:
        if e.errno == errno.EINVAL:  # this file system does not take O_DIRECT
            return None
        raise
    try:
        return DirectFile(fd, os.fspath(path))
    except BaseException:
        os.close(fd)
        raise


class DirectFileSystem(FileSystem):
    """torch's local DCP ``FileSystem`` whose shard files (``*.distcp``) are written with direct
    I/O where the file system takes it; every other file (``.metadata``), and every read, as torch
    does. Module-level, so a writer process can unpickle the writer that holds it."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):
        f = open_direct(path) if mode == "wb" and os.fspath(path).endswith(DEFAULT_SUFFIX) else None
        if f is None:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with f:
            yield f


def _padded(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class DirectFile(io.RawIOBase):
    """A file being written with direct I/O (see the module docstring). Not thread-safe: one
    writer at a time, as a file object."""

    bypasses_page_cache = True  # storage.writeback: no early writeback to ask for

    def __init__(self, fd: int, path: str):
        super().__init__()
        self._fd = fd
        self._path = path
        self._plain: int | None = None  # an ordinary descriptor, for the rest of a short or refused write
        self._refused = False  # a direct write was refused (EINVAL): every write goes through _plain
        self._bufs = [memoryview(_POOL.get()) for _ in range(BUFFERS)]
        self._cur = 0  # the buffer being filled
        self._fill = 0  # bytes in it
        self._offset = 0  # the file offset of its first byte (aligned)
        self._size = 0  # bytes written to this file
        self._tail_written = 0  # padded bytes of the current buffer already in the file
        self._io = ThreadPoolExecutor(BUFFERS - 1, thread_name_prefix="et-direct-io")
        self._pending: collections.deque[Future] = collections.deque()  # the other buffers' writes, oldest first

    # ------------------------------------------------------------------------- file object
    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if self.closed:
            raise ValueError(f"write to closed file {self._path}")
        view = memoryview(b).cast("B")
        done = 0
        while done < len(view):
            buf = self._bufs[self._cur]
            n = min(len(buf) - self._fill, len(view) - done)
            buf[self._fill : self._fill + n] = view[done : done + n]
            self._fill += n
            done += n
            if self._fill == len(buf):
                self._hand_off()
        self._size += done
        return done

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        """Nothing: bytes go to the disk a whole buffer at a time; :meth:`fileno` and :meth:`close`
        put the tail in the file."""

    def fileno(self) -> int:
        """The descriptor, once every byte written so far is in the file (the caller fsyncs it)."""
        self._write_tail()
        return self._fd

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._write_tail()
        finally:
            try:
                self._io.shutdown(wait=True)
                for b in self._bufs:
                    m = b.obj  # the mmap the view was made of
                    try:
                        b.release()
                    except BufferError:  # still exported: not reused
                        continue
                    _POOL.put(m)  # type: ignore[arg-type]
                self._bufs = []
            finally:  # the descriptors are closed whatever happened above, and the write's own error raised
                os.close(self._fd)
                if self._plain is not None:
                    os.close(self._plain)
                super().close()

    # ------------------------------------------------------------------------- the writes
    def _hand_off(self) -> None:
        """The current buffer is full: an I/O thread writes it while the next is filled."""
        buf, offset = self._bufs[self._cur], self._offset
        self._pending.append(self._io.submit(self._pwrite_all, buf, offset))
        self._cur = (self._cur + 1) % len(self._bufs)
        self._offset += len(buf)
        self._fill = 0
        self._tail_written = 0
        if len(self._pending) == len(self._bufs):  # every buffer in flight: the next to fill is the oldest's
            self._pending.popleft().result()

    def _wait(self) -> None:
        """Every buffer's write done; a failed one raises here, on the writer's thread."""
        while self._pending:
            self._pending.popleft().result()

    def _write_tail(self) -> None:
        """The bytes of the current buffer, padded to the alignment, then the file cut to its size."""
        self._wait()
        if self._fill == 0 or self._fill == self._tail_written:
            return
        padded = _padded(self._fill)
        buf = self._bufs[self._cur]
        buf[self._fill : padded] = bytes(padded - self._fill)
        with buf[:padded] as part:  # released on the way out, also when the write raises
            self._pwrite_all(part, self._offset)
        os.ftruncate(self._fd, self._size)
        self._tail_written = self._fill

    def _pwrite_all(self, buf: memoryview, offset: int) -> None:
        n = 0
        if not self._refused:
            try:
                n = os.pwrite(self._fd, buf, offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._refused = True  # it took O_DIRECT at open but refuses the writes: page cache from here
        if n < len(buf):
            # the rest through an ordinary descriptor: after a refused direct write, or a short one
            # (a disk that filled up), whose continuation then raises what the disk says
            if self._plain is None:
                self._plain = os.open(self._path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            while n < len(buf):
                with buf[n:] as rest:  # no slice of a pooled buffer outlives the call, not even in a traceback
                    k = os.pwrite(self._plain, rest, offset + n)
                if k <= 0:
                    raise OSError(errno.EIO, "write accepted no bytes", self._path)
                n += k
