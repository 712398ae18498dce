"""One storage implementation over fsspec, for local paths and object stores.

Paths are plain ``str`` (a ``pathlib.Path`` mangles ``s3://``). Every operation is
bounded: botocore/s3fs retries are capped and each call is retried here with
exponential backoff only for errors that look transient; a permanent error surfaces
as :class:`StorageError` within ``timeout * (retries + 1)`` seconds or so.

Credentials are never logged: :meth:`Storage.describe` prints the URI and endpoint only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec

from ..config import CheckpointConfig, check_uri
from ..errors import StorageError, TransientStorageError
from ..heap import collector_paused

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Files each rank's DCP writer uploads in parallel to an object store (DCP's ``thread_count``:
# one thread and one multipart upload per file; s3fs uploads one file's parts one after another).
# bench/s3_throughput.py varies it: on the SeaweedFS fixture 2 and 4 were within the run's noise
# of 1 (the 2 shared cores, not the request pattern, bound it; BENCHMARKS.md), so 1 file per rank.
S3_WRITE_THREADS = 1


@dataclass(frozen=True)
class StorageOptions:
    """Connection settings. ``endpoint_url`` falls back to AWS_ENDPOINT_URL_S3 / FSSPEC_S3_ENDPOINT_URL."""

    endpoint_url: str = ""
    timeout_seconds: float = 20.0
    retries: int = 3
    direct_io: bool = True  # a local root's DCP shard files are written around the page cache (storage.direct)

    def fsspec_kwargs(self, protocol: str) -> dict[str, Any]:
        if protocol != "s3":
            return {}
        endpoint = (
            self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("FSSPEC_S3_ENDPOINT_URL") or ""
        )
        client_kwargs: dict[str, Any] = {}
        if endpoint:
            client_kwargs["endpoint_url"] = endpoint
        # Measured against SeaweedFS through a fault proxy (tests/contract): 4 botocore attempts
        # plus s3fs's own 2 absorb >= 3 consecutive 5xx, and a permanent outage surfaces in
        # ~5-15 s. The read timeout scales with ``timeout_seconds`` for large shards.
        config_kwargs: dict[str, Any] = {
            "retries": {"total_max_attempts": 4, "mode": "standard"},
            "connect_timeout": min(5.0, max(1.0, self.timeout_seconds / 4)),
            "read_timeout": max(2.0, self.timeout_seconds / 4),
        }
        region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
        if region:
            config_kwargs["region_name"] = region
        return {"client_kwargs": client_kwargs, "config_kwargs": config_kwargs, "skip_instance_cache": True}


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    try:
        from botocore.exceptions import BotoCoreError
    except ImportError:  # pragma: no cover - s3fs is a dependency
        BotoCoreError = ()
    if BotoCoreError and isinstance(exc, BotoCoreError):
        return True
    text = f"{type(exc).__name__} {exc}"
    permanent = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket", "403")
    if any(p in text for p in permanent):
        return False
    return isinstance(exc, (OSError, TimeoutError, ConnectionError)) or "Throttl" in text or "SlowDown" in text


def retry(fn: Callable[[], T], *, what: str, retries: int, base_delay: float = 0.2, max_delay: float = 5.0) -> T:
    """Call ``fn``; retry transient errors with exponential backoff + jitter; raise StorageError at the end."""
    attempt = 0
    while True:
        try:
            return fn()
        except FileNotFoundError:
            raise
        except Exception as exc:  # classified below: re-raised as StorageError or TransientStorageError
            if not _is_transient(exc) or attempt >= retries:
                cls = TransientStorageError if _is_transient(exc) else StorageError
                raise cls(f"{what} failed after {attempt + 1} attempt(s): {type(exc).__name__}: {exc}") from exc
            delay = min(max_delay, base_delay * (2**attempt)) * (0.5 + random.random())
            logger.warning(
                "%s failed (%s), retry %d/%d in %.1fs", what, type(exc).__name__, attempt + 1, retries, delay
            )
            time.sleep(delay)
            attempt += 1


class Storage:
    """Filesystem-like access to one checkpoint root: naming and object operations. Thread-safe
    for concurrent calls. ``operations``: how many operations (a listing, a read, a write, ...)
    were asked of it; ``dcp``: DCP's storage readers and writers for paths under it
    (:class:`DcpFactory`); ``checks``: the checks before a run (:class:`AccessChecks`). JSON
    documents: :func:`read_json`, :func:`write_json_atomic`."""

    def __init__(self, uri: str, options: StorageOptions | None = None):
        self.operations = 0
        self._ops_lock = threading.Lock()
        self.protocol = check_uri(uri)
        self.options = options or StorageOptions()
        if self.protocol == "file":
            root = uri[len("file://") :] if uri.startswith("file://") else os.path.abspath(uri)
            self.root = root.rstrip("/") or "/"
        else:
            self.root = uri.rstrip("/")
        self._kwargs = self.options.fsspec_kwargs(self.protocol)
        self.fs, _ = fsspec.core.url_to_fs(
            self.root if self.protocol != "file" else "file://" + self.root, **self._kwargs
        )
        if self.protocol == "s3":
            self.fs.retries = 2  # s3fs's outer retry loop (a class attribute; not a constructor option)
        self.dcp = DcpFactory(self.protocol, self._p, self._kwargs, direct_io=self.options.direct_io)
        self.checks = AccessChecks(self, self._p, self._retry)  # the checks before a run

    @classmethod
    def for_checkpoint(cls, c: CheckpointConfig) -> Storage:
        """The checkpoint root ``checkpoint.dir`` with the section's endpoint, timeout and retries:
        the one way the package opens it."""
        return open_storage(c.dir, c.s3_endpoint_url, c.storage_timeout_seconds, c.storage_retries, c.direct_io)

    # -- naming -----------------------------------------------------------------
    def join(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def describe(self) -> str:
        endpoint = self._kwargs.get("client_kwargs", {}).get("endpoint_url", "")
        return f"{self.root}" + (f" (endpoint {endpoint})" if endpoint else "")

    def _p(self, path: str) -> str:
        """fsspec path without protocol for s3/memory."""
        return self.fs._strip_protocol(path)  # noqa: SLF001 - fsspec gives no public form of it; every implementation has it

    # -- operations -------------------------------------------------------------
    def _retry(self, fn: Callable[[], T], what: str) -> T:
        with self._ops_lock:
            self.operations += 1
        return retry(fn, what=what, retries=self.options.retries)

    def exists(self, path: str) -> bool:
        return self._retry(lambda: self.fs.exists(self._p(path)), f"exists({path})")

    def list_dirs(self, path: str | None = None) -> list[str]:
        """Names of the sub-directories of ``path`` (default: the root); [] when it does not exist."""
        target = self._p(path or self.root)

        def run() -> list[str]:
            try:
                entries = self.fs.ls(target, detail=True, refresh=True)
            except FileNotFoundError:
                return []
            return sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "directory")

        return self._retry(run, f"list({path or self.root})")

    def list_files(self, path: str) -> dict[str, int]:
        """Relative file name -> size in bytes, recursively; {} when ``path`` does not exist."""
        base = self._p(path).rstrip("/")

        def run() -> dict[str, int]:
            if self.protocol == "file":
                return _local_files(base)
            try:
                found = self.fs.find(base, detail=True, withdirs=False)
            except FileNotFoundError:
                return {}
            out = {}
            for name, info in found.items():
                if info.get("type") == "directory":
                    continue
                rel = name[len(base) + 1 :] if name.startswith(base + "/") else posixpath.basename(name)
                out[rel] = int(info.get("size") or 0)
            return out

        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache(base)
        return self._retry(run, f"find({path})")

    def read_bytes(self, path: str) -> bytes:
        return self._retry(lambda: self.fs.cat_file(self._p(path)), f"read({path})")

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        """Write all-or-nothing: an object PUT on S3, write-temp-then-rename locally."""
        p = self._p(path)
        if self.protocol == "file":

            def run() -> None:
                os.makedirs(os.path.dirname(p), exist_ok=True)
                tmp = f"{p}.tmp-{uuid.uuid4().hex[:8]}"
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, p)
                dfd = os.open(os.path.dirname(p), os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        else:

            def run() -> None:
                self.fs.pipe_file(p, data)

        self._retry(run, f"write({path})")

    def delete_tree(self, path: str) -> None:
        def run() -> None:
            try:
                self.fs.rm(self._p(path), recursive=True)
            except FileNotFoundError:
                pass

        self._retry(run, f"delete({path})")

    def delete_files(self, path: str, names: list[str]) -> None:
        """Delete the files ``names`` (relative to ``path``, as a listing found them) and, locally,
        the directories that leaves empty, ``path`` included; a name already gone is skipped. On an
        object store the keys are deleted in bulk without listing them again (``delete_tree``
        lists first: 0.3 s per 1,000 objects on the test S3 server)."""
        if not names:
            return
        paths = [self._p(posixpath.join(path, n)) for n in names]
        if self.protocol != "file":

            def bulk() -> None:
                try:
                    self.fs.rm(paths)  # S3: DeleteObjects, 1,000 keys a request; a key gone is no error
                except FileNotFoundError:  # other filesystems refuse a list with a name gone
                    for p in paths:
                        with contextlib.suppress(FileNotFoundError):
                            self.fs.rm_file(p)

            self._retry(bulk, f"delete({path}: {len(paths)} files)")
            return

        def run() -> None:
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(p)
            top = self._p(path).rstrip("/")
            for d in sorted({os.path.dirname(p) for p in paths}, key=len, reverse=True):
                while d.startswith(top) and len(d) >= len(top):
                    try:
                        os.rmdir(d)
                    except OSError:  # not empty (or gone): its parents are not empty either
                        break
                    d = os.path.dirname(d)

        self._retry(run, f"delete({path}: {len(paths)} files)")

    def makedirs(self, path: str) -> None:
        if self.protocol == "file":
            os.makedirs(self._p(path), exist_ok=True)


class DcpFactory:
    """DCP's storage writers and readers for paths of one :class:`Storage` (``Storage.dcp``): a
    local root gets torch's ``FileSystemWriter``/``FileSystemReader`` (``direct_io``: its shard
    files written around the page cache, :mod:`.direct`), an object store fsspec's, with the
    storage's connection settings and s3fs's retries bounded the same way."""

    def __init__(self, protocol: str, strip: Callable[[str], str], kwargs: dict[str, Any], *, direct_io: bool = True):
        self._protocol = protocol
        self._strip = strip  # the storage's fsspec path without protocol
        self._kwargs = kwargs
        self._direct_io = direct_io

    def writer(self, path: str):
        if self._protocol == "file":
            from torch.distributed.checkpoint import FileSystemWriter

            writer = FileSystemWriter(self._strip(path), single_file_per_rank=True, sync_files=True, thread_count=1)
            if self._direct_io:
                from .direct import DirectFileSystem

                writer.fs = DirectFileSystem()
            return writer
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(
            path, single_file_per_rank=True, sync_files=False, thread_count=S3_WRITE_THREADS, **self._kwargs
        )
        self._bound_retries(writer)
        return writer

    def reader(self, path: str):
        if self._protocol == "file":
            from torch.distributed.checkpoint import FileSystemReader

            return FileSystemReader(self._strip(path))
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader = FsspecReader(path, **self._kwargs)
        self._bound_retries(reader)
        return reader

    def _bound_retries(self, dcp_storage) -> None:
        fs = getattr(getattr(dcp_storage, "fs", None), "fs", None)
        if self._protocol == "s3" and fs is not None and hasattr(fs, "retries"):
            fs.retries = 2


def open_storage(
    uri: str, endpoint_url: str = "", timeout_seconds: float = 20.0, retries: int = 3, direct_io: bool = True
) -> Storage:
    return Storage(
        uri,
        StorageOptions(
            endpoint_url=endpoint_url, timeout_seconds=timeout_seconds, retries=retries, direct_io=direct_io
        ),
    )


class AccessChecks:
    """The checks before a run starts that the credentials at hand reach one :class:`Storage`'s
    root (``Storage.checks``): :meth:`access` (a listing; on S3 the bucket too) and
    :meth:`writable` (an object written and deleted again)."""

    def __init__(self, storage: Storage, strip: Callable[[str], str], retry: Callable[[Callable[[], Any], str], Any]):
        self._storage = storage
        self._strip = strip  # the storage's fsspec path without protocol
        self._retry = retry  # the storage's bounded retry, counted in its operations

    def access(self) -> None:
        """Raise :class:`StorageError` unless the root can be listed with the credentials at hand.

        An absent prefix is fine (a fresh run); on S3 an absent *bucket* is not: its listing is
        empty too, so without this check a run would start and only its first save would fail.
        """
        try:
            if self._storage.protocol == "s3":
                bucket = self._strip(self._storage.root).split("/", 1)[0]
                try:
                    self._retry(
                        lambda: self._storage.fs.call_s3("head_bucket", Bucket=bucket), f"head_bucket({bucket})"
                    )
                except FileNotFoundError:
                    raise StorageError(f"S3 bucket {bucket!r} does not exist (at {self._storage.describe()})") from None
            self._storage.list_dirs()
        except StorageError as e:
            if self._storage.protocol == "s3" and isinstance(e.__cause__, PermissionError):
                hint = "access denied: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and their rights on the bucket"
                raise StorageError(f"{e} ({hint})") from e.__cause__
            raise

    def writable(self) -> None:
        """Raise :class:`StorageError` unless an object can be written under the root and deleted
        again (a reserved ``_probe/`` name, never taken for a checkpoint)."""
        path = self._storage.join("_probe", f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            self._storage.write_bytes_atomic(path, b"elastic-trainer write probe")
        except StorageError as e:
            raise StorageError(f"cannot write under {self._storage.describe()}: {e}") from e.__cause__
        self._storage.delete_tree(path)


def _local_files(base: str) -> dict[str, int]:
    """:meth:`Storage.list_files` of a local directory: one ``scandir`` per directory (fsspec's
    ``find`` costs a ``stat`` and a path normalisation per file: 4x the time at 16,000 files).
    An entry that vanishes while it is listed is left out, as a listing a moment later would."""
    if os.path.isfile(base):
        return {posixpath.basename(base): os.path.getsize(base)}
    out: dict[str, int] = {}
    pending = [""]
    while pending:
        rel = pending.pop()
        try:
            entries = os.scandir(os.path.join(base, rel) if rel else base)
        except (FileNotFoundError, NotADirectoryError):
            if not rel and os.path.lexists(base):
                raise
            continue
        with entries:
            for e in entries:
                name = f"{rel}/{e.name}" if rel else e.name
                try:
                    if e.is_dir():
                        pending.append(name)
                    else:
                        out[name] = e.stat().st_size
                except FileNotFoundError:
                    continue
    return out


def read_json(storage: Storage, path: str) -> Any:
    """The JSON document at ``path``."""
    data = storage.read_bytes(path)
    with collector_paused():
        return json.loads(data)


def write_json_atomic(storage: Storage, path: str, obj: Any) -> None:
    """Write ``obj`` as JSON (keys sorted, ``"key": value`` on one line), all-or-nothing
    (:meth:`Storage.write_bytes_atomic`).

    One line because only that form has the C encoder: an indented manifest of 4,096 ranks took
    1.7 s to encode, this one 0.1 s (``bench/scale.py``)."""
    storage.write_bytes_atomic(path, json.dumps(obj, sort_keys=True).encode() + b"\n")


def backend_modules(uri: str) -> tuple[str, ...]:
    """The module of the fsspec filesystem ``uri`` opens (``s3://`` → ``s3fs``), for a process
    that imports it ahead of need (the warm-start zygote); () for a local path."""
    from fsspec.core import split_protocol
    from fsspec.registry import known_implementations

    protocol = split_protocol(uri)[0]
    if protocol in (None, "file", "local"):
        return ()
    path = known_implementations.get(protocol, {}).get("class", "")
    return (path.rsplit(".", 1)[0],) if "." in path else ()
