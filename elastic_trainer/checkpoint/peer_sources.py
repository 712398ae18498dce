"""What a peer load reads: the W source ranks' copies of one step as one DCP checkpoint.

:class:`SourcesReader` is a verifying DCP reader over a private directory where each source rank
``r`` is ``r<r>/`` (its node-local directory, or files fetched through the transport on first use,
once per node, each checked against the source's manifest) and one ``.metadata`` merges the W
sources' metadata (:func:`merge_metadata`; each source's read by one rank, verified before it is
unpickled, and gathered by the caller). Every item DCP reads is checked against its source
manifest's checksums.

The merge relies on DCP's storage items (``Metadata.storage_data`` values) being dataclasses with a
``relative_path``, as :mod:`.integrity` does; tests/unit/test_peer_holder.py's merged-metadata
test fails loudly if a torch release changes that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import pickle
import re
import shutil
from collections.abc import Iterable, Iterator
from typing import Any

import xxhash
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..errors import CheckpointIntegrityError
from ..storage.peer import PeerError, xxh3
from . import compat, integrity, layout
from .local_tier import copy_dir
from .peer_copies import DISK
from .peer_transport import CopyId, PeerTransport

_SOURCE_RE = re.compile(r"\br(\d+)/")

Sources = dict[int, tuple[str, dict[str, Any]]]  # source rank -> (location, its manifest)
MetadataReads = dict[int, bytes | tuple[str, str]]  # source rank -> its .metadata, or (kind, why)


class SourcesReader(integrity.VerifyingFileSystemReader):
    """A verifying DCP reader over ``<share>/rank-<rank>/``: ``r<src>/`` is each source rank's
    copy, a link to its node-local directory under ``root``, or to ``<share>/r<src>/`` where the
    files fetched from a holder go, once per node (the first rank of the node to need a file
    fetches and verifies it under a lock; the others read it); ``.metadata`` the merge of theirs.
    ``transport``: this reader's own (closed after each read)."""

    def __init__(
        self,
        share: str,
        rank: int,
        root: str,
        sources: Sources,
        transport: PeerTransport,
        copy: CopyId,
    ):
        work = os.path.join(share, f"rank-{rank}")
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        self._work = work
        self._sources = sources
        self._transport = transport
        self._copy = copy  # the step's (epoch, step, world); src varies
        for src in range(copy.world):
            d = os.path.join(work, f"r{src}")
            if sources[src][0] == DISK:
                os.symlink(copy_dir(root, copy.epoch, copy.step, src, copy.world), d)
            else:
                os.makedirs(os.path.join(share, f"r{src}"), exist_ok=True)
                os.symlink(os.path.join(share, f"r{src}"), d)
        super().__init__(work)

    @property
    def from_holders(self) -> bool:
        """Whether this rank read bytes another node's holder served: at least a source's
        ``.metadata``, which every rank merges."""
        return any(location != DISK for location, _ in self._sources.values())

    def metadata_of(self, srcs: Iterable[int]) -> MetadataReads:
        """The verified ``.metadata`` of each source in ``srcs`` (this rank's share of them), or
        why it could not be read: ``("unreachable", why)`` (its holder did not serve it) or
        ``("integrity", why)`` (bad or missing bytes)."""
        out: MetadataReads = {}
        for src in srcs:
            try:
                out[src] = self._read(src, layout.METADATA)
            except CheckpointIntegrityError as e:
                out[src] = ("integrity", str(e))
            except PeerError as e:
                out[src] = ("unreachable", str(e))
            except OSError as e:
                out[src] = ("integrity", str(source_error(src, f"{layout.METADATA}: {e}")))
        return out

    def merge(self, gathered: list[MetadataReads | str]) -> None:
        """Every rank's :meth:`metadata_of` (each source read by one rank of the job), checked
        against the sources' manifests again and merged into this rank's ``.metadata``."""
        raw: MetadataReads = {}
        for part in gathered:
            if isinstance(part, str):
                raise RuntimeError(f"another rank could not start its peer load: {part}")
            raw.update(part)
        items: dict[tuple[str, int], tuple[int, int]] = {}
        merged: Metadata | None = None
        for src in range(self._copy.world):
            data = raw.get(src, ("unreachable", f"r{src}/ (source rank {src}): no rank read its metadata"))
            if isinstance(data, tuple):
                kind, why = data
                raise CheckpointIntegrityError(why) if kind == "integrity" else PeerError(why)
            self._check(src, layout.METADATA, data)
            checks = layout.Checks.from_manifest(self._sources[src][1])
            items.update({(f"r{src}/{f}", off): v for (f, off), v in checks.items.items()})
            merged = merge_metadata(merged, pickle.loads(data), src)  # noqa: S301 - verified against the signed manifest
        assert merged is not None  # at least one source rank
        check_coverage(merged)
        self._items = merged.storage_data
        data = pickle.dumps(merged)
        with open(os.path.join(self._work, layout.METADATA), "wb") as f:
            f.write(data)
        self.checks = layout.Checks((len(data), layout.digest(data)), items)

    def _ensure(self, src: int, name: str) -> None:
        """Source ``src``'s file ``name`` under ``r<src>/``: fetched from its holder when it is not
        there, and then checked whole against the source's manifest (every item DCP reads from
        it is checked again by the verifying reader)."""
        path = os.path.join(self._work, f"r{src}", name)
        location, manifest = self._sources[src]
        if location == DISK and os.path.exists(path):
            return
        want = (manifest.get("files") or {}).get(name)
        if location == DISK or not isinstance(want, dict):
            raise source_error(src, f"{name} is missing")
        with _locked(path):  # through the link: one lock per file and node
            if os.path.exists(path):
                return  # fetched and verified by this node's first rank to need it
            part = path + ".part"
            try:
                with open(part, "wb") as f:
                    out = _Hashing(f)
                    n = self._transport.fetch(location, dataclasses.replace(self._copy, src=src), name, out)
                    got = out.hasher.intdigest()
            except PeerError as e:  # not served: no byte of it was bad (the copy is kept)
                raise PeerError(f"r{src}/ (source rank {src}): {e}") from e
            if n != int(want["size"]) or got != int(want["xxh3"]):
                raise source_error(src, f"{name}: size or checksum does not match its manifest")
            os.rename(part, path)

    def _read(self, src: int, name: str) -> bytes:
        """A small file of source ``src`` (its ``.metadata``), checked whole against its manifest."""
        self._ensure(src, name)
        with open(os.path.join(self._work, f"r{src}", name), "rb") as f:
            data = f.read()
        self._check(src, name, data)
        return data

    def _check(self, src: int, name: str, data: bytes) -> None:
        want = (self._sources[src][1].get("files") or {}).get(name) or {}
        if len(data) != int(want.get("size", -1)) or xxh3(data) != int(want.get("xxh3", -1)):
            raise source_error(src, f"{name}: size or checksum does not match its manifest")

    def read_data(self, plan, planner):
        try:
            for rel in sorted({self._items[i.storage_index].relative_path for i in plan.items}):
                src_dir, _, name = rel.partition("/")
                self._ensure(int(src_dir[1:]), name)
            return super().read_data(plan, planner)
        finally:
            self._transport.close()


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """``path``'s lock file (``<path>.lock``), held exclusively: one rank of the node at a time."""
    fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class _Hashing:
    """A binary file that hashes (XXH3) what is written to it."""

    def __init__(self, f):
        self.f = f
        self.hasher = xxhash.xxh3_64()

    def write(self, data) -> None:
        self.f.write(data)
        self.hasher.update(data)


def source_error(src: int, why: str) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(f"r{src}/ (source rank {src}): {why}")


def bad_source(e: BaseException) -> int | None:
    """The source rank whose bytes an integrity failure names (``r<src>/...``), if any; not one
    whose holder did not serve them (:class:`PeerError`: a request that failed is no bad byte)."""
    for cause in compat.root_causes(e):
        if isinstance(cause, PeerError) or isinstance(cause.__cause__, PeerError):
            continue
        m = _SOURCE_RE.search(str(cause))
        if m:
            return int(m.group(1))
    return None


def merge_metadata(into: Metadata | None, m: Metadata, src: int) -> Metadata:
    """Source ``src``'s metadata merged into ``into``: its chunks and items, paths under ``r<src>/``;
    an item another source already has (replicated state) is kept once."""
    if into is None:
        into = Metadata(state_dict_metadata={}, planner_data={}, storage_data={})
    for fqn, md in m.state_dict_metadata.items():
        have = into.state_dict_metadata.get(fqn)
        if have is None:
            into.state_dict_metadata[fqn] = (
                dataclasses.replace(md, chunks=list(md.chunks)) if isinstance(md, TensorStorageMetadata) else md
            )
        elif isinstance(md, TensorStorageMetadata):
            if not isinstance(have, TensorStorageMetadata) or have.size != md.size:
                raise source_error(src, f"{fqn}: another shape than the other sources'")
            known = {tuple(c.offsets) for c in have.chunks}
            have.chunks += [c for c in md.chunks if tuple(c.offsets) not in known]
    for idx, info in (m.storage_data or {}).items():
        if idx not in into.storage_data:
            into.storage_data[idx] = dataclasses.replace(info, relative_path=f"r{src}/{info.relative_path}")
    if isinstance(m.planner_data, dict):
        for k, v in m.planner_data.items():
            into.planner_data.setdefault(k, v)
    return into


def check_coverage(m: Metadata) -> None:
    """Every tensor's chunks cover it whole: no source is silently missing."""
    for fqn, md in m.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        whole = 1
        for n in md.size:
            whole *= n
        have = 0
        for c in md.chunks:
            v = 1
            for n in c.sizes:
                v *= n
            have += v
        if have != whole:
            raise CheckpointIntegrityError(f"{fqn}: the sources hold {have} of its {whole} elements")
