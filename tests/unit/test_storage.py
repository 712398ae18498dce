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


def test_local_listing_agrees_with_fsspecs_find(tmp_path):
    """The local fast path lists what fsspec's ``find`` lists: nested files with their sizes,
    no directories (an empty one lists nothing), a file path as its own name, a missing path as {}."""
    root = tmp_path / "root"
    for rel, size in {"a.bin": 3, "d/b.bin": 0, "d/e/c.bin": 7, ".hidden/x": 2}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * size)
    (root / "empty").mkdir()
    local = open_storage(str(root))
    via_fsspec = {
        os.path.relpath(name, root): info["size"]
        for name, info in local.fs.find(str(root), detail=True, withdirs=False).items()
    }
    assert local.list_files(local.root) == via_fsspec == {"a.bin": 3, "d/b.bin": 0, "d/e/c.bin": 7, ".hidden/x": 2}
    assert local.list_files(local.join("d")) == {"b.bin": 0, "e/c.bin": 7}
    assert local.list_files(local.join("a.bin")) == {"a.bin": 3}
    assert local.list_files(local.join("missing")) == {}


def test_delete_files_deletes_exactly_the_names_and_the_directories_left_empty(storage):
    d = storage.join("step-00000001")
    for rel in ("manifest.json", "a.bin", "sub/b.bin", "sub/deeper/c.bin", "kept/k.bin"):
        storage.write_bytes_atomic(storage.join("step-00000001", rel), b"123")
    storage.delete_files(d, ["manifest.json"])
    assert "manifest.json" not in storage.list_files(d) and "a.bin" in storage.list_files(d)
    storage.delete_files(d, ["a.bin", "sub/b.bin", "sub/deeper/c.bin", "gone.bin"])  # a name gone is skipped
    assert storage.list_files(d) == {"kept/k.bin": 3}  # written since the listing: stays
    assert storage.list_dirs() == ["step-00000001"]
    storage.delete_files(d, ["kept/k.bin"])
    assert storage.list_files(d) == {} and storage.list_dirs() == []


def test_json_documents_are_compact_sorted_and_round_trip(storage):
    doc = {"b": [1, 2.5, "x"], "a": {"nested": None}}
    write_json_atomic(storage, storage.join("doc.json"), doc)
    assert storage.read_bytes(storage.join("doc.json")) == b'{"a": {"nested": null}, "b": [1, 2.5, "x"]}\n'
    assert read_json(storage, storage.join("doc.json")) == doc


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
