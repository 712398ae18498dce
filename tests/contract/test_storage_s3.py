"""Contract suite for :class:`elastic_trainer.storage.fs.Storage`, run against every backend.

The same operations as ``tests/unit/test_storage.py`` (write, list, read, overwrite,
delete, a DCP round trip) on local paths, ``file://``, ``memory://`` and ``s3://`` on a
real SeaweedFS (``tests/fixtures/s3.py``), then what only S3 has: credentials checked by
the server, a missing bucket, and faults injected by ``tests/fixtures/faultproxy.py``
between the client and the server (transient ones absorbed, a permanent outage surfacing
as a typed error within a bound).

Credentials reach the storage layer only through the ``AWS_*`` environment variables, as
in a worker; the endpoint is passed explicitly (``checkpoint.s3_endpoint_url``).
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from elastic_trainer.errors import ConfigError, StorageError, TransientStorageError
from elastic_trainer.storage.fs import Storage, open_storage, read_json, write_json_atomic

pytestmark = pytest.mark.timeout(180)

BACKENDS = ["local", "file", "memory", pytest.param("s3", marks=pytest.mark.s3)]


def _s3_env(monkeypatch, server, secret: str | None = None) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret if secret is not None else server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", server.region)
    for name in ("AWS_ENDPOINT_URL_S3", "FSSPEC_S3_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(params=BACKENDS)
def storage(request, tmp_path, monkeypatch) -> Storage:
    if request.param == "local":
        return open_storage(str(tmp_path / "root"))
    if request.param == "file":
        return open_storage(f"file://{tmp_path}/root")
    if request.param == "memory":
        return open_storage(f"memory://et-{uuid.uuid4().hex[:8]}/root")
    server = request.getfixturevalue("s3_server")
    _s3_env(monkeypatch, server)
    bucket = server.make_bucket()
    return open_storage(f"s3://{bucket}/runs/a", endpoint_url=server.endpoint_url, timeout_seconds=8, retries=2)


# ---------------------------------------------------------------------------- every backend
def test_empty_root_lists_nothing(storage):
    storage.checks.access()  # an absent prefix is a fresh root, not an error
    assert storage.list_dirs() == []
    assert storage.list_files(storage.join("step-00000001")) == {}
    assert not storage.exists(storage.join("step-00000001", "manifest.json"))


def test_write_list_read_delete(storage):
    write_json_atomic(storage, storage.join("step-00000001", "manifest.json"), {"step": 1})
    storage.write_bytes_atomic(storage.join("step-00000001", "sub", "x.bin"), b"12345")
    storage.write_bytes_atomic(storage.join("step-00000002", "__0_0.distcp"), b"")
    assert storage.list_dirs() == ["step-00000001", "step-00000002"]
    files = storage.list_files(storage.join("step-00000001"))
    assert files == {"manifest.json": files["manifest.json"], "sub/x.bin": 5}
    assert storage.list_files(storage.join("step-00000002")) == {"__0_0.distcp": 0}
    assert read_json(storage, storage.join("step-00000001", "manifest.json")) == {"step": 1}
    assert storage.read_bytes(storage.join("step-00000001", "sub", "x.bin")) == b"12345"
    assert storage.exists(storage.join("step-00000001", "manifest.json"))
    storage.delete_tree(storage.join("step-00000001"))
    assert not storage.exists(storage.join("step-00000001", "manifest.json"))
    assert storage.list_files(storage.join("step-00000001")) == {}
    storage.delete_tree(storage.join("never-existed"))


def test_overwrite_replaces_whole_object(storage):
    path = storage.join("step-00000003", "manifest.json")
    storage.write_bytes_atomic(path, b"x" * 1000)
    write_json_atomic(storage, path, {"v": 2})
    assert read_json(storage, path) == {"v": 2}
    assert list(storage.list_files(storage.join("step-00000003"))) == ["manifest.json"]


@pytest.mark.timing  # a tight wall-clock bound: run alone (scripts/pytest.sh)
def test_reading_a_missing_object_is_file_not_found_without_retries(storage):
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(storage.join("nope", "manifest.json"))
    assert time.monotonic() - t0 < 2.0


def test_dcp_round_trip(storage):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.tensor([1.5, -2.0]), "n": 7}
    path = storage.join("step-00000004")
    storage.makedirs(path)
    dcp.save(state, storage_writer=storage.dcp.writer(path), no_dist=True)
    files = storage.list_files(path)
    assert ".metadata" in files and any(f.endswith(".distcp") for f in files), files
    out = {"w": torch.zeros(3, 4), "b": torch.zeros(2), "n": 0}
    dcp.load(out, storage_reader=storage.dcp.reader(path), no_dist=True)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"]) and out["n"] == 7


# ---------------------------------------------------------------------------- S3 only
s3_only = pytest.mark.s3


@s3_only
def test_wrong_secret_is_a_permanent_error_without_retries(s3_server, s3_bucket, monkeypatch):
    secret = "wrong-" + uuid.uuid4().hex
    _s3_env(monkeypatch, s3_server, secret=secret)
    s = open_storage(f"s3://{s3_bucket}/x", endpoint_url=s3_server.endpoint_url, timeout_seconds=8, retries=3)
    t0 = time.monotonic()
    with pytest.raises(StorageError) as e:
        s.write_bytes_atomic(s.join("a"), b"1")
    assert not isinstance(e.value, TransientStorageError) and "after 1 attempt" in str(e.value)
    with pytest.raises(StorageError):
        s.list_dirs()
    with pytest.raises(StorageError, match="access denied: check AWS_ACCESS_KEY_ID"):
        s.checks.access()
    assert time.monotonic() - t0 < 10
    assert secret not in str(e.value) and secret not in s.describe()


@s3_only
def test_missing_bucket_is_an_error_not_an_empty_root(s3_server, monkeypatch):
    """An empty listing of a bucket that does not exist would make the run start "fresh" and
    fail at its first save; the storage layer must say the bucket is missing instead."""
    _s3_env(monkeypatch, s3_server)
    s = open_storage(
        f"s3://missing-{uuid.uuid4().hex[:12]}/x", endpoint_url=s3_server.endpoint_url, timeout_seconds=8, retries=1
    )
    with pytest.raises(StorageError, match="(?i)bucket"):
        s.checks.access()


@s3_only
def test_transient_faults_are_absorbed(s3_server, s3_bucket, fault_proxy, monkeypatch):
    _s3_env(monkeypatch, s3_server)
    s = open_storage(f"s3://{s3_bucket}/x", endpoint_url=fault_proxy.endpoint_url, timeout_seconds=8, retries=2)
    payload = bytes(range(256)) * 64
    fault_proxy.fail_next(3, status=503, methods=("PUT",))
    s.write_bytes_atomic(s.join("step-00000001", "a.bin"), payload)
    fault_proxy.drop_next(1, methods=("PUT",))
    s.write_bytes_atomic(s.join("step-00000001", "b.bin"), payload)
    fault_proxy.fail_next(2, status=500, methods=("GET",))
    assert s.read_bytes(s.join("step-00000001", "a.bin")) == payload
    fault_proxy.delay_next(1, 1.0, methods=("GET",))
    assert s.list_files(s.join("step-00000001")) == {"a.bin": len(payload), "b.bin": len(payload)}
    assert fault_proxy.pending == 0 and sum(fault_proxy.faulted.values()) == 7


@s3_only
def test_permanent_outage_surfaces_within_a_bound_and_recovers(s3_server, s3_bucket, fault_proxy, monkeypatch):
    _s3_env(monkeypatch, s3_server)
    s = open_storage(f"s3://{s3_bucket}/x", endpoint_url=fault_proxy.endpoint_url, timeout_seconds=8, retries=1)
    s.write_bytes_atomic(s.join("before"), b"ok")
    fault_proxy.outage(True)
    t0 = time.monotonic()
    with pytest.raises(TransientStorageError):
        s.write_bytes_atomic(s.join("during"), b"x")
    elapsed = time.monotonic() - t0
    print(f"outage surfaced as TransientStorageError after {elapsed:.1f}s ({fault_proxy.faulted['PUT']} PUTs refused)")
    assert elapsed < 60
    fault_proxy.outage(False)
    s.write_bytes_atomic(s.join("after"), b"ok")
    assert s.read_bytes(s.join("after")) == b"ok"


@s3_only
def test_dcp_write_through_an_outage_fails_and_writes_no_metadata(s3_server, s3_bucket, fault_proxy, monkeypatch):
    """DCP reports it as ``CheckpointException``, a ``BaseException`` (not an ``Exception``):
    the checkpoint manager has to catch it by name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    _s3_env(monkeypatch, s3_server)
    s = open_storage(f"s3://{s3_bucket}/x", endpoint_url=fault_proxy.endpoint_url, timeout_seconds=8, retries=1)
    fault_proxy.outage(True)
    t0 = time.monotonic()
    with pytest.raises(CheckpointException) as e:
        dcp.save({"w": torch.ones(64, 64)}, storage_writer=s.dcp.writer(s.join("step-00000001")), no_dist=True)
    elapsed = time.monotonic() - t0
    assert not isinstance(e.value, Exception)
    print(f"DCP save through an outage failed after {elapsed:.1f}s")
    assert elapsed < 60
    fault_proxy.outage(False)
    assert ".metadata" not in s.list_files(s.join("step-00000001"))


def test_bad_uri_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="checkpoint.dir"):
        open_storage("s3://Bad_Bucket/x")
    with pytest.raises(ConfigError, match="checkpoint.dir"):
        open_storage("gs://bucket/x")


@s3_only
def test_parallel_s3_shard_uploads_stay_checksummed_and_verified(s3_server, s3_bucket, monkeypatch):
    """``S3_WRITE_THREADS`` > 1 (several files per rank, uploaded by parallel threads through the
    hashing writer) keeps the checkpoint a checksummed, verified plain DCP checkpoint: every
    shard file is listed in the checksums, it loads back exactly, and a corrupted shard is refused."""
    import json

    import torch.distributed.checkpoint as dcp

    from elastic_trainer.checkpoint import integrity, layout
    from elastic_trainer.storage import fs as storage_fs

    monkeypatch.setattr(storage_fs, "S3_WRITE_THREADS", 3)
    _s3_env(monkeypatch, s3_server)
    s = open_storage(f"s3://{s3_bucket}/t", endpoint_url=s3_server.endpoint_url, timeout_seconds=8, retries=2)
    path = s.join("step-00000001")
    state = {f"t{i}": torch.randn(64, 32) for i in range(6)}
    dcp.save(state, storage_writer=integrity.ChecksummedWriter(s.dcp.writer(path)), no_dist=True)
    shards = sorted(f for f in s.list_files(path) if f.endswith(".distcp"))
    assert len(shards) == 3, shards
    table = json.loads(s.read_bytes(s.join("step-00000001", layout.CHECKSUMS)))
    assert sorted(f for f in table["files"] if f.endswith(".distcp")) == shards
    checks = layout.Checks.from_manifest(table)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=integrity.verifying(s.dcp.reader(path), checks), no_dist=True)
    assert all(torch.equal(out[k], state[k]) for k in state)

    key = s._p(s.join("step-00000001", shards[1]))
    data = bytearray(s.fs.cat_file(key))
    data[len(data) // 2] ^= 0xFF
    s.fs.pipe_file(key, bytes(data))
    with pytest.raises(BaseException, match="checksum mismatch"):
        dcp.load(
            {k: torch.zeros_like(v) for k, v in state.items()},
            storage_reader=integrity.verifying(s.dcp.reader(path), checks),
            no_dist=True,
        )
