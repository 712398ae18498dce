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

Where torch's writer would write each rank's items into one file on one thread (what
``Storage.dcp.writer`` builds), :class:`ChecksummedWriter` writes that file itself, byte for byte
the file torch's loop writes, but each tensor's ``torch.save`` archive comes from the bytes kept
for its dtype and shape around the tensor's own (:class:`_TensorArchives`): no pickler per tensor
on the interpreter lock the training thread shares.

Reading verifies every byte it reads: ``.metadata`` is checked against the manifest *before* it
is unpickled, and every item slice DCP reads is checked before ``torch.load`` sees it.

Copies that only this code reads back (the local and peer tiers, never ``checkpoint.dir``) are
written by :class:`RawCopyWriter`: each tensor item is its raw bytes, not a ``torch.save`` archive
(a per-item pickle and zip record cost ~0.2 ms of CPU each, most of a copy's cost), marked
``RAW`` in its storage info so that torch's own reader refuses it by name instead of misreading
it; the verifying readers read both encodings.

Private torch APIs used here, and only here (``tests/unit/test_integrity.py`` fails loudly when
torch changes them): ``torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter/Reader``,
``filesystem._StorageInfo`` (and its ``transform_descriptors``),
``torch.distributed._shard._utils.narrow_tensor_by_index``,
``torch.distributed.checkpoint._nested_dict.flatten_state_dict`` and
``torch.distributed._shard.sharded_tensor.ShardedTensor`` (the raw copier flattens a state as
DCP's planner does), the readers' ``_slice_file`` /
``_get_metadata_path`` methods and ``storage_data`` attribute, the writers' ``fs`` and ``path``
attributes and the one-segment-per-item ``tell()`` pattern of ``_write_item``; for the writer's
own file per rank: ``filesystem.DEFAULT_SUFFIX``, ``SerializationFormat``, the plan's
``_StoragePrefix`` (``plan.storage_data.prefix``), the writers' ``single_file_per_rank``,
``thread_count``, ``sync_files`` and ``transforms`` attributes, and torch.save's archive layout
(one stored ``data/`` record per plain tensor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import math
import os
import pickle
import threading
import time
import zipfile
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem, SerializationFormat, _StorageInfo
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.utils.serialization import config as serialization_config

from ..errors import CheckpointIntegrityError
from ..heap import collector_paused
from ..storage.writeback import EarlyWriteback, regular_file_descriptor
from .layout import CHECKSUMS, METADATA, Checks, digest


# ---------------------------------------------------------------------------------- writing
@dataclasses.dataclass
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
        self._writeback = EarlyWriteback(regular_file_descriptor(raw))  # the fsync then waits for the tail only

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
        self._writeback.wrote(self._rec.size, self._raw.flush)
        return done

    def tell(self) -> int:
        if self._rec.size > self._seg_start:
            assert self._rec.segments is not None  # set in __init__
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
        _HashingFS.__init__(self, state["inner"])

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


class _TensorArchives:
    """``torch.save(tensor, stream)``'s bytes without its per-call Python (~0.1 ms a tensor: the
    pickler, its persistent ids, the zip records; most of a save of many small tensors, and all of
    it on the interpreter lock the training thread waits for). With torch.save's zip CRC32s off
    (as this module writes), a plain tensor's archive is the same bytes before its storage and
    after it for every tensor of one kind (dtype, shape, stride, and torch.save's storage
    alignment): the pickle, the records'
    headers, the alignment padding and the serialisation id depend on those and the sizes only.
    The first tensor of each kind (up to 16 MiB) is saved by ``torch.save`` itself, and the bytes around its
    storage are kept if its storage's bytes are found exactly where the archive's data record
    says; every later tensor of that kind is written as those bytes, its own storage's, and the
    rest. Anything else (a tensor subclass, a view, a sparse, quantised or conjugate tensor, one whose archive
    did not split) goes through ``torch.save``. ``tests/unit/test_integrity.py`` compares the bytes
    with torch.save's for every dtype, so a torch whose archive changes fails there, loudly."""

    _KEPT = 4096  # kinds kept (a model has a few hundred); past it, all are forgotten
    # Larger tensors are not learned: torch.save's per-call cost is small next to their bytes, and
    # learning holds the first one's whole archive in memory (twice, while it is split).
    _LEARN_MAX_BYTES = 16 << 20

    def __init__(self):
        self._parts: dict[tuple, tuple[bytes, bytes] | None] = {}

    @staticmethod
    def _kind(t: torch.Tensor) -> tuple | None:
        if (
            type(t) is not torch.Tensor
            or t.layout != torch.strided
            or t.device.type != "cpu"
            or t.is_quantized
            or t.is_conj()
            or t.is_neg()
            or t.requires_grad
            or not t.is_contiguous()
            or t.storage_offset() != 0
            or t.nbytes == 0
            or t.untyped_storage().nbytes() != t.nbytes
            or torch.serialization.get_crc32_options()  # a CRC32 of the data in the archive's records
        ):
            return None
        # the stride too (a size-1 dim's may differ), and torch.save's alignment of a storage record
        return (t.dtype, tuple(t.shape), t.stride(), serialization_config.save.storage_alignment)

    def write(self, t: torch.Tensor, stream) -> None:
        kind = self._kind(t)
        parts = self._parts.get(kind) if kind is not None else None
        if parts is None:
            if kind is None or kind in self._parts or t.nbytes > self._LEARN_MAX_BYTES:
                # not a plain tensor, its archive did not split, or too large to learn from
                torch.save(t, stream)
                return
            parts = self._learn(kind, t)
            if parts is None:
                torch.save(t, stream)
                return
        stream.write(parts[0])
        stream.write(_raw_bytes(t))
        stream.write(parts[1])

    def _learn(self, kind: tuple, t: torch.Tensor) -> tuple[bytes, bytes] | None:
        buf = io.BytesIO()
        torch.save(t, buf)
        parts = _split_archive(buf, _raw_bytes(t))
        if len(self._parts) >= self._KEPT:
            self._parts.clear()
        self._parts[kind] = parts
        return parts


def _split_archive(archive: io.BytesIO, data: memoryview) -> tuple[bytes, bytes] | None:
    """The bytes of ``torch.save``'s ``archive`` before and after its one storage record, if that
    record holds exactly ``data``; else None."""
    try:
        with zipfile.ZipFile(archive) as z:  # reads the directory in place: no copy of the archive
            records = [i for i in z.infolist() if "/data/" in i.filename and not i.filename.endswith("/")]
    except (zipfile.BadZipFile, ValueError):
        return None
    raw = archive.getbuffer()
    if len(records) != 1 or records[0].file_size != len(data) or records[0].compress_type != zipfile.ZIP_STORED:
        return None
    at = records[0].header_offset
    header = bytes(raw[at : at + 30])
    if header[:4] != b"PK\x03\x04":
        return None
    start = at + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    if raw[start : start + len(data)] != data:
        return None
    return bytes(raw[:start]), bytes(raw[start + len(data) :])


_ARCHIVES = _TensorArchives()  # process-wide: a writer is made per save, the kinds stay


@dataclasses.dataclass
class _Checked:
    """A write result's storage info with the item's checksum, on its way to the coordinator."""

    info: Any  # _StorageInfo
    digest: int
    file_size: int
    file_digest: int


class ChecksummedWriter(StorageWriter):
    """A DCP storage writer that checksums every byte ``inner`` writes (see the module docstring).

    ``inner`` is a plain ``FileSystemWriter`` or ``FsspecWriter`` (as ``Storage.dcp.writer`` builds
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
        self._fs = _HashingFS(inner.fs)
        inner.fs = cast(FileSystem, self._fs)  # a FileSystem to DCP (its calls are handed to it)
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
            if self._one_file_per_rank():
                results = self._write_rank_file(plan, planner)
            else:
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

    def _one_file_per_rank(self) -> bool:
        """Whether the inner writer writes each rank's items into one file on one thread, in
        torch.save's encoding, without extensions: then :meth:`_write_rank_file` writes it."""
        inner = self._inner
        return (
            (torch.cuda.is_available() or not torch.accelerator.is_available())  # see _items_in_order
            and inner.single_file_per_rank
            and inner.thread_count == 1
            and getattr(inner, "serialization_format", SerializationFormat.TORCH_SAVE) is SerializationFormat.TORCH_SAVE
            and not getattr(getattr(inner, "transforms", None), "extensions", ())
        )

    def _write_rank_file(self, plan, planner) -> list[WriteResult]:
        """What torch's ``FileSystemWriter.write_data`` writes for one file per rank on one thread
        (its ``_write_files_from_queue``): the file ``<prefix>0.distcp``, byte items first, then
        the tensors, each as its ``torch.save`` archive (:class:`_TensorArchives`), fsynced when
        the writer syncs files. Byte for byte the same file (tests/unit/test_integrity.py)."""
        inner = self._inner
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results = []
        with inner.fs.create_stream(inner.fs.concat_path(inner.path, name), "wb") as stream:
            for wi in self._items_in_order(plan.items):
                data = planner.resolve_data(wi)
                offset = stream.tell()
                if wi.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    t = data.detach().cpu()
                    if t.untyped_storage().size() != t.nbytes:  # as torch's loader: a view saves its own bytes only
                        t = t.clone()
                    _ARCHIVES.write(t, stream)
                length = stream.tell() - offset
                results.append(
                    WriteResult(index=wi.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))
                )
            if inner.sync_files:
                try:
                    os.fsync(stream.fileno())
                except (AttributeError, io.UnsupportedOperation):  # as torch's writer: a stream without one
                    os.sync()
        return results

    def _items_in_order(self, items: list) -> list:
        """The order torch's writer writes a rank's items in: the byte items, then the tensors, in
        the plan's order, or by size (smallest first, stably) where it loads them through its
        overlapping device loader (on a host with CUDA, copying ahead); other accelerators' hosts
        are left to torch's writer (:meth:`_one_file_per_rank`)."""
        tensors = [wi for wi in items if wi.type != WriteItemType.BYTE_IO]
        if torch.cuda.is_available() and self._inner.per_thread_copy_ahead > 0:
            tensors.sort(key=lambda wi: math.prod(wi.tensor_data.size) * wi.tensor_data.properties.dtype.itemsize)
        return [wi for wi in items if wi.type == WriteItemType.BYTE_IO] + tensors

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


RAW = "elastic_trainer.raw"  # an item's storage descriptor: its bytes are the tensor's, raw
RAW_FILE = "__0_0.distcp"  # the one data file of a raw copy (the name DCP gives a one-process save's)


def _raw_bytes(data: io.BytesIO | torch.Tensor) -> memoryview:
    """The bytes of one write item: a serialised object's, or a tensor's own (on the CPU, contiguous)."""
    if isinstance(data, io.BytesIO):
        return data.getbuffer()
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # numpy's stubs declare an array's buffer (__buffer__) only for Python >= 3.12
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


_IOV_MAX = os.sysconf("SC_IOV_MAX")  # buffers one writev takes


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    """Write ``bufs`` one after the other from the start of ``fd``: a few ``writev`` calls, not one
    write per item (a rank's state is hundreds of small items)."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    i = 0
    while i < len(views):
        n = os.writev(fd, views[i : i + _IOV_MAX])
        while i < len(views) and n >= len(views[i]):  # the items written whole
            n -= len(views[i])
            i += 1
        if n:  # the rest of an item written in part
            views[i] = views[i][n:]


def _in_place(t: torch.Tensor) -> bool:
    """Whether :func:`_raw_bytes` of ``t`` reads its own memory (not a copy)."""
    return t.device.type == "cpu" and t.is_contiguous()


class RawCopyWriter(StorageWriter):
    """A DCP storage writer of one process's copy into the local directory ``path``: one data
    file, every tensor item its raw bytes, every item hashed from memory as it is written; then a
    plain ``.metadata`` (each item's storage info marked :data:`RAW`) and ``.checksums.json`` as
    :class:`ChecksummedWriter` writes them. For the local and peer tiers only (read back by
    :func:`verifying` readers; ``checkpoint.dir`` keeps torch's own encoding). After a save,
    ``items`` and ``metadata`` are what DCP planned (:class:`RawCopier` writes the next copies
    of the same layout from them)."""

    def __init__(self, path: str):
        self.path = path
        self.items: list | None = None
        self.metadata = None
        self.files: dict[str, dict[str, Any]] = {}  # every file written so far: name -> size, XXH3 (items)

    def reset(self, checkpoint_id=None) -> None:
        self.files = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def storage_meta(self):
        return StorageMeta()  # no path in it: the same layout pickles to the same bytes at every step

    @property
    def checkpoint_id(self):
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def write_data(self, plan, planner):
        self.items = sorted(plan.items, key=lambda wi: wi.type == WriteItemType.BYTE_IO)  # tensors first
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.write_items(self.items, planner))
        return fut

    def write_items(self, items: list, planner, views: dict | None = None) -> list[WriteResult]:
        """Write ``items`` (resolved by ``planner``) one after the other into the data file;
        ``views``: the bytes of items read in place, by position (filled here for contiguous CPU
        tensors)."""
        whole = xxhash.xxh3_64()
        bufs, rows, results, offset = [], [], [], 0
        for i, wi in enumerate(items):
            buf = views.get(i) if views is not None else None
            if buf is None:
                data = planner.resolve_data(wi)
                buf = _raw_bytes(data)
                if views is not None and isinstance(data, torch.Tensor) and _in_place(data):
                    views[i] = buf
            bufs.append(buf)
            whole.update(buf)
            rows.append([offset, len(buf), xxhash.xxh3_64_intdigest(buf)])
            info = _StorageInfo(RAW_FILE, offset, len(buf), transform_descriptors=[RAW])
            results.append(WriteResult(index=wi.index, size_in_bytes=len(buf), storage_data=info))
            offset += len(buf)
        path = os.path.join(self.path, RAW_FILE)
        # a recycled copy's file is overwritten in place (its pages reused), then cut to size
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
        try:
            _write_all(fd, bufs)
            os.ftruncate(fd, offset)
            os.fsync(fd)
        except OSError as e:  # writes to a descriptor name no file: name it (a full disk: which one)
            raise OSError(e.errno, e.strerror, path) from None
        finally:
            os.close(fd)
        self.files = {RAW_FILE: {"size": offset, "xxh3": whole.intdigest(), "items": rows}}
        return results

    def finish(self, metadata, results) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for row in results for wr in row}
        metadata.storage_meta = self.storage_meta()
        self.metadata = metadata
        self.write_metadata(pickle.dumps(metadata))

    def write_metadata(self, data: bytes) -> dict[str, dict[str, Any]]:
        """``.metadata`` (pickled), then ``.checksums.json`` listing it and the data file; returns
        that listing (name -> size, XXH3 and, for the data file, its items)."""
        self._write(METADATA, data)
        self.files = {**self.files, METADATA: {"size": len(data), "xxh3": digest(data)}}
        self._write(CHECKSUMS, json.dumps({"version": 1, "files": self.files}, sort_keys=True).encode())
        return self.files

    def _write(self, name: str, data: bytes) -> None:
        tmp = os.path.join(self.path, name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(self.path, name))


def _layout(flat: dict[str, Any]) -> tuple:
    """What DCP's save plan of a flattened state depends on: per key, the kind of value, and for
    a tensor its shape and dtype, for a DTensor also its placements, mesh and local shape."""

    def of(value: Any) -> tuple:
        if isinstance(value, DTensor):
            local = value.to_local()
            return ("D", value.shape, value.dtype, tuple(value.placements), value.device_mesh, local.shape)
        if isinstance(value, torch.Tensor):
            return ("T", type(value), value.shape, value.dtype)
        return ("O",)

    return tuple((k, of(v)) for k, v in flat.items())


def _tensors(flat: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


@dataclasses.dataclass(frozen=True)
class _Planned:
    """One layout's plan: the items in the order written and the ``.metadata`` DCP made for it;
    ``tensors``, the flattened state's tensor objects it was last used with, and ``views``, the
    bytes of those of them read in place (an item's position -> its memoryview)."""

    layout: tuple
    items: list
    metadata: Any  # torch's Metadata
    pickled: dict  # item lengths -> pickled .metadata with those lengths
    tensors: dict
    views: dict
    sharded: bool  # the state holds ShardedTensors (which DCP's planner flattens further)

    def same_objects(self, flat: dict[str, Any]) -> bool:
        """Whether ``flat`` has this plan's keys and the very tensors it was last used with (a kept
        staged copy, refilled in place at every save): then the layout holds without looking at it."""
        return (
            len(flat) == len(self.layout)
            and all(flat.get(k) is v for k, v in self.tensors.items())
            and all(k == want for k, (want, _) in zip(flat, self.layout, strict=True))
        )


class RawCopier:
    """Writes one process's raw copies (:class:`RawCopyWriter`'s format, one directory each),
    planning with DCP only when the state's layout changes: while every flattened key has the
    same kind, shape, dtype and placement as when DCP last planned, a copy is the planned items'
    bytes written in the planned order and the planned ``.metadata`` (pickled again only when an
    object's serialised length changes). A contiguous CPU tensor's bytes are read in place, through
    a view kept while the state holds the same tensor objects (the saver's staged copy, which its
    stager refills at every save). That is a copy's whole cost: its bytes, their XXH3 and a few
    files, without DCP's per-item planning in Python. Copies may run on two threads at once (one
    stuck): the plan is one value, replaced whole."""

    _METADATA_KEPT = 16  # pickled .metadata kept per layout, by item lengths

    def __init__(self):
        self._planned: _Planned | None = None
        self.plans = 0  # how many times DCP planned a copy (tests)

    def save(self, state_dict: dict[str, Any], path: str) -> dict[str, dict[str, Any]]:
        """Write the copy of ``state_dict`` into the (empty, existing) directory ``path``; returns
        the files written (:meth:`RawCopyWriter.write_metadata`)."""
        flat, _ = flatten_state_dict(state_dict)
        writer = RawCopyWriter(path)
        planned = self._planned
        if planned is not None and not planned.same_objects(flat):
            same_layout = _layout(flat) == planned.layout
            planned = dataclasses.replace(planned, tensors=_tensors(flat), views={}) if same_layout else None
        if planned is None:
            dcp.save(state_dict, storage_writer=writer, no_dist=True)
            assert writer.items is not None  # planned by the save
            sharded = any(isinstance(v, ShardedTensor) for v in flat.values())
            self._planned = _Planned(_layout(flat), writer.items, writer.metadata, {}, _tensors(flat), {}, sharded)
            self.plans += 1
            return writer.files
        self._planned = planned
        # the flattened state as DCP's planner resolves an item of it (flattened once, here)
        planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=planned.sharded)
        planner.set_up_planner(flat, storage_meta=None, is_coordinator=True)
        results = writer.write_items(planned.items, planner, planned.views)
        lengths = tuple(r.storage_data.length for r in results)
        data = planned.pickled.get(lengths)
        if data is None:
            storage = {r.index: r.storage_data for r in results}
            data = pickle.dumps(dataclasses.replace(planned.metadata, storage_data=storage))
            if len(planned.pickled) >= self._METADATA_KEPT:
                planned.pickled.clear()
            planned.pickled[lengths] = data
        return writer.write_metadata(data)


# ---------------------------------------------------------------------------------- reading
if TYPE_CHECKING:
    _Reader = FileSystemReader  # what the mixin is mixed into (to the type checker)
else:
    _Reader = object


class _VerifyingReads(_Reader):
    """Mixin for DCP storage readers: verify ``.metadata`` before unpickling and every item slice."""

    checks: Checks = Checks(None, {})
    refused: CheckpointIntegrityError | None = None  # the .metadata refusal, for :func:`load`
    # what :meth:`read_data` took (monotonic start and end) and, of it, the checksums' seconds
    read_span: tuple[float, float] | None = None
    verify_seconds: float = 0.0
    given: Any = None  # the checkpoint's metadata, already read and verified (see :func:`verifying`)

    def read_metadata(self, *args: Any, **kwargs: Any):
        if self.given is not None:  # read and verified once, by the rank that chose the checkpoint
            self.given.storage_meta.load_id = self.load_id
            return self.given
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
        with collector_paused():
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
        t0 = time.monotonic()
        ok = want is None or (want[0] == sinfo.length and digest(data) == want[1])
        self.verify_seconds += time.monotonic() - t0
        if not ok:
            raise CheckpointIntegrityError(f"{sinfo.relative_path}@{sinfo.offset}: checksum mismatch (corrupted shard)")
        return io.BytesIO(data)

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._tensors = metadata.state_dict_metadata

    def read_data(self, plan, planner):
        """Items written :data:`RAW` are read here (verified by :meth:`_slice_file`); a checkpoint
        in torch's own encoding is read by torch's reader. Synchronous (the future is done)."""
        t0 = time.monotonic()
        try:
            return self._read_data(plan, planner)
        finally:
            self.read_span = (t0, time.monotonic())

    def _read_data(self, plan, planner):
        if not any(RAW in (self.storage_data[r.storage_index].transform_descriptors or ()) for r in plan.items):
            return super().read_data(plan, planner)
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for rel, reqs in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, rel), "rb") as stream:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    info = self.storage_data[req.storage_index]
                    if RAW not in (info.transform_descriptors or ()):
                        raise CheckpointIntegrityError(f"{rel}@{info.offset}: not a raw item in a raw copy")
                    data = self._slice_file(stream, info).getbuffer()
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(data))
                        continue
                    tensor = narrow_tensor_by_index(self._raw_tensor(req, data), req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise CheckpointIntegrityError(
                            f"{req.storage_index.fqn}: {tuple(tensor.size())} stored, {tuple(target.size())} wanted"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    def _raw_tensor(self, req, data: memoryview) -> torch.Tensor:
        """The stored chunk ``req`` reads from, as a tensor over ``data``."""
        md = self._tensors.get(req.storage_index.fqn)
        chunk = None
        if isinstance(md, TensorStorageMetadata):
            offsets = torch.Size(req.storage_index.offset or ())
            chunk = next((c for c in md.chunks if torch.Size(c.offsets) == offsets), None)
        fqn = req.storage_index.fqn
        if chunk is None:
            raise CheckpointIntegrityError(f"{fqn}: no stored chunk at {tuple(req.storage_index.offset or ())}")
        dtype = md.properties.dtype
        if len(data) != chunk.sizes.numel() * dtype.itemsize:
            raise CheckpointIntegrityError(f"{fqn}: {len(data)} bytes for a chunk of {tuple(chunk.sizes)} {dtype}")
        if not data:
            return torch.empty(chunk.sizes, dtype=dtype)
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(chunk.sizes)


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


def verifying(reader, checks: Checks, *, metadata: Any = None):
    """A copy of a DCP ``FileSystemReader`` / ``FsspecReader`` that verifies what it reads.
    ``metadata``: the checkpoint's ``.metadata`` as another reader of it returned it (verified
    there): not read again."""
    variants: dict[Any, type[_VerifyingReads]] = {
        FileSystemReader: VerifyingFileSystemReader,
        _FsspecReader: VerifyingFsspecReader,
    }
    cls = variants.get(type(reader))
    if cls is None:
        raise TypeError(f"no verifying variant of {type(reader).__name__}")
    new = cls.__new__(cls)
    new.__dict__.update(reader.__dict__)
    new.checks = checks
    new.given = metadata
    return new


_ = _StorageInfo  # imported so that a rename in torch fails this module's import loudly
