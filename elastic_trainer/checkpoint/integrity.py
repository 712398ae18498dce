"""Checksummed DCP writers and verifying readers: the one home of torch-private checkpoint APIs.

Every byte DCP writes is hashed (XXH3-64, ~4.6 GB/s per core here, over the buffers DCP hands
out, without a copy) *as it is written*, never re-read: the writer's file system is wrapped so
each output stream hashes its bytes, cut into segments at every ``tell()``. DCP calls ``tell()``
exactly before and after each item it writes (``filesystem._write_item``), so each item's bytes
are one segment. Each rank's write results carry their item checksums to the coordinator, which
strips them before writing a plain DCP ``.metadata`` (torch's own readers and ``format_utils`` read
the checkpoint unchanged) and then writes ``.checksums.json``: per file its size, XXH3 and the
(offset, length, xxh3) of every item.
The commit (``catalog``) turns that table into the manifest.

Reading verifies every byte it reads: ``.metadata`` is checked against the manifest *before* it
is unpickled, and every item slice DCP reads is checked before ``torch.load`` sees it.

Private torch APIs used here, and only here (``tests/unit/test_integrity.py`` fails loudly when
torch changes them): ``torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter/Reader``,
``filesystem._StorageInfo``, the readers' ``_slice_file`` / ``_get_metadata_path`` methods, the
writers' ``fs`` and ``path`` attributes and the one-segment-per-item ``tell()`` pattern of ``_write_item``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from ..errors import CheckpointIntegrityError
from .layout import CHECKSUMS, METADATA, Checks, digest


# ---------------------------------------------------------------------------------- writing
@dataclass
class _FileRecord:
    size: int = 0
    hasher: Any = None  # XXH3 of the whole file
    segments: dict[int, tuple[int, int]] | None = None  # start offset -> (length, xxh3)

    @property
    def digest(self) -> int:
        return self.hasher.intdigest()


class _HashingStream(io.RawIOBase):
    """A write stream that hashes what passes through, cut into segments at every ``tell()``."""

    def __init__(self, raw, record: _FileRecord):
        self._raw = raw
        self._rec = record
        self._rec.segments = {}
        self._rec.hasher = xxhash.xxh3_64()
        self._seg_start = 0
        self._seg = xxhash.xxh3_64()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")  # DCP hands out tensor storages and BytesIO buffers
        done = 0
        while done < len(view):
            # a short write (a disk that fills writes what fits) is continued, so the next call raises
            # the errno (ENOSPC, EDQUOT) instead of torch's writer failing on a short count
            n = self._raw.write(view[done:])
            n = len(view) - done if n is None else n
            if n <= 0:
                raise OSError(errno.EIO, "write accepted no bytes")
            part = view[done : done + n]
            self._seg.update(part)
            self._rec.hasher.update(part)
            self._rec.size += n
            done += n
        return done

    def tell(self) -> int:
        if self._rec.size > self._seg_start:
            self._rec.segments[self._seg_start] = (self._rec.size - self._seg_start, self._seg.intdigest())
            self._seg_start = self._rec.size
            self._seg.reset()
        return self._rec.size

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self.tell()
        super().close()


class _HashingFS:
    """Wraps a DCP ``FileSystem``: every stream opened for writing hashes its bytes."""

    def __init__(self, inner):
        self._inner = inner
        self._lock = threading.Lock()
        self.records: dict[str, _FileRecord] = {}

    def __getattr__(self, name):
        if name == "_inner":  # during unpickling, before __setstate__
            raise AttributeError(name)
        return getattr(self._inner, name)

    # Pickled with the writer to a writer process (checkpoint.writer = "process") before it writes:
    # the records start empty there, and the lock is the new process's own.
    def __getstate__(self):
        return {"inner": self._inner}

    def __setstate__(self, state):
        self.__init__(state["inner"])

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        try:
            with self._inner.create_stream(path, mode) as raw:
                if "w" not in mode:
                    yield raw
                    return
                rec = _FileRecord()
                with self._lock:
                    self.records[os.path.basename(os.fspath(path))] = rec
                stream = _HashingStream(raw, rec)
                yield stream
                stream.tell()
        except OSError as e:
            if e.filename is not None or e.errno is None:
                raise
            # a write that found the disk full names no file; DCP hands the error to every rank
            # pickled, without its frames: the file goes into the error itself
            raise OSError(e.errno, e.strerror, os.fspath(path)) from e

    def record(self, name: str) -> _FileRecord | None:
        with self._lock:
            return self.records.get(name)


@dataclass
class _Checked:
    """A write result's storage info with the item's checksum, on its way to the coordinator."""

    info: Any  # _StorageInfo
    digest: int
    file_size: int
    file_digest: int


class ChecksummedWriter(StorageWriter):
    """A DCP storage writer that checksums every byte ``inner`` writes (see the module docstring).

    ``inner`` is a plain ``FileSystemWriter`` or ``FsspecWriter`` (as ``Storage.dcp_writer`` builds
    it); this writer owns it: DCP's calls are handed to it, its file system is wrapped so each
    output stream hashes its bytes, and its write results come back with their items' checksums.
    Also writes without the zip CRC32 ``torch.save`` computes and nobody reads (measured:
    0.81 → 0.46 CPU-s per rank for a 556 MB shard); the switch is process-wide, so it is off only
    while this writer writes. ``upload_nice`` > 0 lowers the CPU priority of the thread that
    writes (an experiment knob). Pickled whole to a writer process (``checkpoint.writer =
    "process"``), where it hashes what it writes."""

    def __init__(self, inner: FileSystemWriter, *, upload_nice: int = 0):
        if type(inner) not in _PLAIN_WRITERS:
            raise TypeError(f"no checksummed variant of {type(inner).__name__}")
        self._inner = inner
        self._fs = inner.fs = _HashingFS(inner.fs)
        self.upload_nice = upload_nice

    # DCP's storage-writer protocol, handed to the inner writer
    def reset(self, checkpoint_id=None) -> None:
        self._inner.reset(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._inner.set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan):
        return self._inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans):
        return self._inner.prepare_global_plan(plans)

    def storage_meta(self):
        return self._inner.storage_meta()

    @property
    def checkpoint_id(self):
        return self._inner.checkpoint_id

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # built around a writer, never picked by DCP for a bare checkpoint_id

    def write_data(self, plan, planner):
        if self.upload_nice > 0:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.upload_nice)
            except OSError:  # pragma: no cover - best effort
                pass
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            results = self._inner.write_data(plan, planner).wait()
        finally:
            torch.serialization.set_crc32_options(previous)
        out = []
        for wr in results:
            info = wr.storage_data
            rec = self._fs.record(info.relative_path)
            seg = (rec.segments or {}).get(info.offset) if rec is not None else None
            if info.length == 0:
                seg = (0, 0)
            if rec is None or seg is None or seg[0] != info.length:
                raise CheckpointIntegrityError(
                    f"cannot checksum item {wr.index.fqn} in {info.relative_path}: "
                    "DCP's write pattern changed (see checkpoint/integrity.py)"
                )
            out.append(
                WriteResult(
                    index=wr.index,
                    size_in_bytes=wr.size_in_bytes,
                    storage_data=_Checked(info, seg[1], rec.size, rec.digest),
                )
            )
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(out)
        return fut

    def finish(self, metadata, results) -> None:
        files: dict[str, dict[str, Any]] = {}
        plain = []
        for wr_list in results:
            row = []
            for wr in wr_list:
                c = wr.storage_data
                if not isinstance(c, _Checked):
                    raise CheckpointIntegrityError(f"write result of {wr.index.fqn} carries no checksum")
                f = files.setdefault(c.info.relative_path, {"size": c.file_size, "xxh3": c.file_digest, "items": []})
                f["items"].append([c.info.offset, c.info.length, c.digest])
                row.append(WriteResult(index=wr.index, size_in_bytes=wr.size_in_bytes, storage_data=c.info))
            plain.append(row)
        self._inner.finish(metadata, plain)
        meta = self._fs.record(f"{METADATA}.tmp")
        if meta is None:
            raise CheckpointIntegrityError(
                "cannot checksum .metadata: DCP's write pattern changed (see checkpoint/integrity.py)"
            )
        files[METADATA] = {"size": meta.size, "xxh3": meta.digest}
        for f in files.values():
            if "items" in f:
                f["items"].sort()
        body = json.dumps({"version": 1, "files": files}, sort_keys=True).encode()
        with self._fs.create_stream(self._fs.concat_path(self._inner.path, CHECKSUMS), "wb") as out:
            out.write(body)


try:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as _FsspecReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as _FsspecWriter
except ImportError:  # pragma: no cover - fsspec is a dependency
    _FsspecReader = _FsspecWriter = None  # type: ignore[assignment,misc]

# The writers whose file system and write pattern ChecksummedWriter knows (a subclass may change either).
_PLAIN_WRITERS = (FileSystemWriter, _FsspecWriter)


# ---------------------------------------------------------------------------------- reading
class _VerifyingReads:
    """Mixin for DCP storage readers: verify ``.metadata`` before unpickling and every item slice."""

    checks: Checks = Checks(None, {})
    refused: CheckpointIntegrityError | None = None  # the .metadata refusal, for :func:`load`

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            data = f.read()
        if self.checks.metadata is not None:
            size, want = self.checks.metadata
            if len(data) != size:
                self.refused = CheckpointIntegrityError(f".metadata has {len(data)} bytes, the manifest says {size}")
            elif digest(data) != want:
                self.refused = CheckpointIntegrityError(
                    ".metadata checksum mismatch (corrupted): refused before unpickling"
                )
            if self.refused is not None:
                raise self.refused
        metadata = pickle.loads(data)  # noqa: S301 - verified against the (optionally signed) manifest above
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file, sinfo):
        want = self.checks.items.get((sinfo.relative_path, sinfo.offset))
        if want is None and self.checks.items:
            raise CheckpointIntegrityError(f"{sinfo.relative_path}@{sinfo.offset}: item not listed in the manifest")
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        if len(data) != sinfo.length:
            raise CheckpointIntegrityError(
                f"{sinfo.relative_path}@{sinfo.offset}: short read, {len(data)} of {sinfo.length} bytes"
            )
        if want is not None and (want[0] != sinfo.length or digest(data) != want[1]):
            raise CheckpointIntegrityError(f"{sinfo.relative_path}@{sinfo.offset}: checksum mismatch (corrupted shard)")
        return io.BytesIO(data)


class VerifyingFileSystemReader(_VerifyingReads, FileSystemReader):
    pass


if _FsspecReader is not None:

    class VerifyingFsspecReader(_VerifyingReads, _FsspecReader):
        pass

else:  # pragma: no cover
    VerifyingFsspecReader = None  # type: ignore[assignment,misc]


def load(state_dict: dict, reader, **kwargs: Any) -> None:
    """``dcp.load`` through a :func:`verifying` reader; a refused ``.metadata`` is the error raised.

    torch 2.11's ``dcp.load`` catches ``read_metadata``'s exception and fails with
    ``AssertionError("metadata is None")``, which names no integrity problem (2.12 names it in that
    message; 2.13 raises it); the reader keeps its
    refusal and it is raised here (from DCP's error), so the load fails the same way on every
    supported torch."""
    try:
        dcp.load(state_dict, storage_reader=reader, **kwargs)
    except (Exception, CheckpointException) as e:
        refused = getattr(reader, "refused", None)
        if refused is None or refused is e:
            raise
        raise refused from e


def verifying(reader, checks: Checks):
    """A copy of a DCP ``FileSystemReader`` / ``FsspecReader`` that verifies what it reads."""
    cls = {FileSystemReader: VerifyingFileSystemReader, _FsspecReader: VerifyingFsspecReader}.get(type(reader))
    if cls is None:
        raise TypeError(f"no verifying variant of {type(reader).__name__}")
    new = cls.__new__(cls)
    new.__dict__.update(reader.__dict__)
    new.checks = checks
    return new


_ = _StorageInfo  # imported so that a rename in torch fails this module's import loudly
