"""The fsspec storage layer on local paths, file:// and memory:// (S3 has its own suite)."""

import os
import uuid

import pytest

from elastic_trainer.errors import StorageError, TransientStorageError
from elastic_trainer.storage.fs import open_storage, read_json, retry, write_json_atomic


@pytest.fixture(params=["local", "file", "memory"])
def storage(request, tmp_path):
    if request.param == "local":
        return open_storage(str(tmp_path / "root"))
    if request.param == "file":
        return open_storage(f"file://{tmp_path}/root")
    return open_storage(f"memory://et-{uuid.uuid4().hex[:8]}/root")


def test_write_list_read_delete(storage):
    assert storage.list_dirs() == []
    assert storage.list_files(storage.join("step-00000001")) == {}
    write_json_atomic(storage, storage.join("step-00000001", "manifest.json"), {"step": 1})
    storage.write_bytes_atomic(storage.join("step-00000001", "sub", "x.bin"), b"12345")
    assert storage.list_dirs() == ["step-00000001"]
    files = storage.list_files(storage.join("step-00000001"))
    assert files["sub/x.bin"] == 5 and "manifest.json" in files
    assert read_json(storage, storage.join("step-00000001", "manifest.json")) == {"step": 1}
    assert storage.exists(storage.join("step-00000001", "manifest.json"))
    storage.delete_tree(storage.join("step-00000001"))
    assert not storage.exists(storage.join("step-00000001", "manifest.json"))
    storage.delete_tree(storage.join("never-existed"))


def test_atomic_local_write_leaves_no_temp_files(tmp_path):
    s = open_storage(str(tmp_path))
    for i in range(3):
        s.write_bytes_atomic(s.join("m.json"), str(i).encode())
    assert os.listdir(tmp_path) == ["m.json"] and (tmp_path / "m.json").read_text() == "2"


def test_retry_absorbs_transient_errors_and_gives_up_on_permanent_ones():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("reset")
        return "ok"

    assert retry(flaky, what="op", retries=3, base_delay=0.001) == "ok" and len(calls) == 3

    def down():
        raise ConnectionError("refused")

    with pytest.raises(TransientStorageError, match="after 3 attempt"):
        retry(down, what="op", retries=2, base_delay=0.001)

    def denied():
        raise PermissionError("AccessDenied")

    with pytest.raises(StorageError) as e:
        retry(denied, what="op", retries=5, base_delay=0.001)
    assert not e.value.retryable and "after 1 attempt" in str(e.value)


def test_describe_never_shows_credentials(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    s = open_storage("s3://bucket/prefix", endpoint_url="http://127.0.0.1:9")
    text = s.describe()
    assert "s3cr3t-value" not in text and "AKIAEXAMPLE" not in text and "127.0.0.1:9" in text


def test_for_checkpoint_opens_the_root_with_the_sections_settings():
    from elastic_trainer.config import CheckpointConfig
    from elastic_trainer.storage.fs import Storage, StorageOptions

    c = CheckpointConfig(
        dir="s3://bucket/runs/a", s3_endpoint_url="http://127.0.0.1:9", storage_timeout_seconds=8, storage_retries=5
    )
    s = Storage.for_checkpoint(c)
    assert s.root == "s3://bucket/runs/a" and "127.0.0.1:9" in s.describe()
    assert s.options == StorageOptions(endpoint_url="http://127.0.0.1:9", timeout_seconds=8, retries=5)
