"""Shard files written around the page cache (``storage.direct``): every byte lands, in order, at
any write pattern; the file is whole whenever its descriptor is handed out for the fsync; a short
or failed write ends in the disk's own error; a file system without ``O_DIRECT`` is written as
before; and a DCP checkpoint written this way is the same format torch's own reader reads."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pickle
import signal
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from elastic_trainer.checkpoint import integrity, layout
from elastic_trainer.config import config_from_dict
from elastic_trainer.storage import direct, writeback
from elastic_trainer.storage.fs import Storage, open_storage

pytestmark = pytest.mark.skipif(not direct.O_DIRECT, reason="this OS has no O_DIRECT")


@pytest.fixture
def small_buffers(monkeypatch):
    """Buffers of 3 alignment blocks, so a few KB cross many buffers and tails."""
    monkeypatch.setattr(direct, "BUFFER_BYTES", 3 * direct.ALIGN)
    monkeypatch.setattr(direct, "_POOL", direct._BufferPool())


def _payload(n: int) -> bytes:
    return bytes((i * 7 + i // 251) % 256 for i in range(n))


def _disk_full(fd, buf, offset):
    """``os.pwrite`` on a full disk."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _open(path) -> direct.DirectFile:
    f = direct.open_direct(path)
    if f is None:
        pytest.skip(f"{path.parent}'s file system does not take O_DIRECT")
    return f


def test_unaligned_writes_across_buffers_land_whole_and_in_order(tmp_path, small_buffers):
    data = _payload(10 * direct.ALIGN + 123)
    cuts = [0, 1, 17, 4096, 4097, 9000, 12288, 20000, 30000, 40000, len(data)]
    path = tmp_path / "a.distcp"
    with _open(path) as f:
        for a, b in zip(cuts, cuts[1:], strict=False):
            assert f.write(memoryview(data)[a:b]) == b - a
        assert f.tell() == len(data)
    assert path.read_bytes() == data


def test_the_descriptor_is_handed_out_with_every_byte_in_the_file_and_writing_goes_on(tmp_path, small_buffers):
    """DCP fsyncs ``stream.fileno()`` before it closes the stream: the file holds every byte by
    then, at its true size. Writing after that rewrites the padded tail block in place."""
    path = tmp_path / "b.distcp"
    first, second = _payload(5000), _payload(20000)[::-1]
    with _open(path) as f:
        f.write(first)
        fd = f.fileno()
        os.fsync(fd)
        assert path.read_bytes() == first  # not padded: cut back to its size
        f.write(second)
        f.fileno()
        assert path.read_bytes() == first + second
        f.write(b"z")
    assert path.read_bytes() == first + second + b"z"


def test_a_short_direct_write_is_finished_and_a_failed_one_raises_the_disks_error(tmp_path, monkeypatch, small_buffers):
    real = os.pwrite
    calls = {"n": 0}

    def short_once(fd, buf, offset):
        calls["n"] += 1
        if calls["n"] == 1:  # a direct write that lands in part (as when the disk fills up)
            return real(fd, buf[: direct.ALIGN], offset)  # an aligned prefix
        return real(fd, buf, offset)

    monkeypatch.setattr(direct.os, "pwrite", short_once)
    data = _payload(8 * direct.ALIGN + 5)
    path = tmp_path / "c.distcp"
    with _open(path) as f:
        f.write(data)
    assert path.read_bytes() == data

    monkeypatch.setattr(direct.os, "pwrite", _disk_full)
    with pytest.raises(OSError) as e, _open(tmp_path / "d.distcp") as f:
        f.write(data)  # the first full buffer's write fails on the I/O thread ...
    assert e.value.errno == errno.ENOSPC  # ... and its error reaches the writer (here at the latest on close)


def test_a_failed_tail_write_raises_the_disks_error_and_closes_the_descriptor_with_the_pool_full(
    tmp_path, monkeypatch, small_buffers
):
    """The error's traceback holds no slice of a buffer: the pool, already full, unmaps it, and the
    file's descriptor is closed, whatever the write raised."""
    done = [_open(tmp_path / f"{i}.distcp") for i in range(2)]
    f = _open(tmp_path / "tail.distcp")
    for g in done:
        g.close()  # the pool now keeps all it will keep
    f.write(_payload(100))

    monkeypatch.setattr(direct.os, "pwrite", _disk_full)
    fd = f._fd
    with pytest.raises(OSError) as e:
        f.close()
    assert e.value.errno == errno.ENOSPC and e.value.__context__ is None
    assert f.closed and not os.path.exists(f"/proc/self/fd/{fd}")


def test_a_child_forked_while_the_pool_is_locked_writes_and_a_closed_file_refuses_writes(tmp_path, small_buffers):
    """The buffer pool's lock, held by another thread of the parent at the fork, is not held in the
    child; a write after close raises ValueError, as a file object's does."""
    with direct._POOL._lock:
        pid = os.fork()
        if pid == 0:  # the child: write a file through the pool, then leave without cleanup
            try:
                with _open(tmp_path / "child.distcp") as f:
                    f.write(_payload(5000))
            finally:
                os._exit(0)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not finish writing in 30 s (the pool's lock stayed held)")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert (tmp_path / "child.distcp").read_bytes() == _payload(5000)
    f = _open(tmp_path / "closed.distcp")
    f.close()
    with pytest.raises(ValueError):
        f.write(b"x")


def test_a_file_system_that_refuses_direct_writes_after_open_gets_them_through_the_page_cache(
    tmp_path, monkeypatch, small_buffers
):
    real, refused = os.pwrite, []

    def refuse_direct(fd, buf, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & direct.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buf, offset)

    monkeypatch.setattr(direct.os, "pwrite", refuse_direct)
    data = _payload(7 * direct.ALIGN + 99)
    path = tmp_path / "r.distcp"
    with _open(path) as f:
        f.write(data)
        os.fsync(f.fileno())
    assert refused == [0], "one refusal, then every write through the page cache"
    assert path.read_bytes() == data


def test_a_file_system_without_o_direct_is_written_through_the_page_cache(tmp_path, monkeypatch):
    real = os.open

    def refuse(path, flags, *a):
        if flags & direct.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a)

    monkeypatch.setattr(direct.os, "open", refuse)
    assert direct.open_direct(tmp_path / "e.distcp") is None
    fs = direct.DirectFileSystem()
    with fs.create_stream(tmp_path / "e.distcp", "wb") as s:
        assert not getattr(s, "bypasses_page_cache", False)
        assert writeback.regular_file_descriptor(s) is not None  # early writeback, as before
        s.write(b"abc")
    assert (tmp_path / "e.distcp").read_bytes() == b"abc"


def test_a_checkpoint_written_around_the_page_cache_is_torch_dcp_and_verifies(tmp_path):
    """Through the manager's writer (checksums as written): torch's own reader reads it back
    equal, and so does the verifying reader, every item checked; the shard is byte for byte the
    one written through the page cache."""
    state = {f"t{i}": torch.randn(700 + 13 * i, 129) for i in range(12)}
    state["small"] = torch.arange(5)
    storage = open_storage(str(tmp_path / "root"))
    path = storage.join("step-1")
    storage.makedirs(path)
    writer = integrity.ChecksummedWriter(storage.dcp.writer(path))
    assert isinstance(writer._inner.fs._inner, direct.DirectFileSystem)
    dcp.save(state, storage_writer=writer, no_dist=True)
    dcp_to_torch_save(path, tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert all(torch.equal(back[k], state[k]) for k in state)
    table = json.loads((tmp_path / "root" / "step-1" / layout.CHECKSUMS).read_text())["files"]
    checks = layout.Checks.from_manifest({"files": table})
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=integrity.verifying(storage.dcp.reader(path), checks), no_dist=True)
    assert all(torch.equal(target[k], state[k]) for k in state)
    pickle.loads(pickle.dumps(writer))  # noqa: S301 - our own bytes: a writer process unpickles it so
    buffered = open_storage(str(tmp_path / "root"), direct_io=False)
    other = buffered.join("step-2")
    buffered.makedirs(other)
    dcp.save(state, storage_writer=integrity.ChecksummedWriter(buffered.dcp.writer(other)), no_dist=True)
    shard = "__0_0.distcp"
    assert (tmp_path / "root" / "step-1" / shard).read_bytes() == (tmp_path / "root" / "step-2" / shard).read_bytes()


def test_checkpoint_direct_io_false_writes_through_the_page_cache(tmp_path):
    cfg = config_from_dict({"checkpoint": {"dir": str(tmp_path), "direct_io": False}})
    w = Storage.for_checkpoint(cfg.checkpoint).dcp.writer(str(tmp_path / "x"))
    assert not isinstance(w.fs, direct.DirectFileSystem)
    on = config_from_dict({"checkpoint": {"dir": str(tmp_path)}})
    assert isinstance(Storage.for_checkpoint(on.checkpoint).dcp.writer(str(tmp_path / "x")).fs, direct.DirectFileSystem)
