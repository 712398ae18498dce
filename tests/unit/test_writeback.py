"""Early writeback (storage/writeback.py): a shard's bytes go to the disk while the rest is still
being written, so the save's fsync waits for the tail only; where the kernel or the stream cannot
do it, the file is written exactly as before."""

from __future__ import annotations

import io
import json
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from elastic_trainer.checkpoint import integrity, layout
from elastic_trainer.storage import writeback
from elastic_trainer.storage.writeback import SYNC_FILE_RANGE_WRITE, EarlyWriteback, regular_file_descriptor

MB = 1 << 20


class _Calls:
    def __init__(self, result: int = 0):
        self.calls: list[tuple[int, int, int, int]] = []
        self.result = result

    def __call__(self, fd: int, offset: int, nbytes: int, flags: int) -> int:
        self.calls.append((fd, offset, nbytes, flags))
        return self.result


def test_each_filled_stretch_is_handed_to_the_disk_once_after_a_flush():
    sync, flushed = _Calls(), []
    wb = EarlyWriteback(7, stretch=8 * MB, syscall=sync)
    for size in range(3 * MB, 31 * MB, 3 * MB):  # writes of 3 MB: sizes 3, 6, ..., 30 MB
        wb.wrote(size, lambda size=size: flushed.append(size))
    assert sync.calls == [
        (7, 0, 9 * MB, SYNC_FILE_RANGE_WRITE),
        (7, 9 * MB, 9 * MB, SYNC_FILE_RANGE_WRITE),
        (7, 18 * MB, 9 * MB, SYNC_FILE_RANGE_WRITE),
    ]
    assert flushed == [9 * MB, 18 * MB, 27 * MB], "the buffer reaches the kernel before each range is written"


def test_a_refused_call_turns_it_off_without_an_error():
    sync = _Calls(result=-1)
    wb = EarlyWriteback(7, stretch=MB, syscall=sync)
    for size in (2 * MB, 4 * MB, 6 * MB):
        wb.wrote(size, lambda: None)
    assert len(sync.calls) == 1 and not wb.active


def test_streams_without_a_regular_file_are_left_alone(tmp_path):
    assert regular_file_descriptor(io.BytesIO()) is None
    r, w = os.pipe()
    try:
        with os.fdopen(w, "wb", closefd=False) as pipe:
            assert regular_file_descriptor(pipe) is None
    finally:
        os.close(r)
        os.close(w)
    with open(tmp_path / "f", "wb") as f:
        assert regular_file_descriptor(f) == f.fileno()
    sync = _Calls()
    off = EarlyWriteback(None, stretch=1, syscall=sync)
    off.wrote(10 * MB, lambda: None)
    assert not off.active and sync.calls == []


def test_a_checksummed_save_hands_its_shard_to_the_disk_as_it_writes_and_stays_exact(tmp_path, monkeypatch):
    """Through DCP and the checksummed writer, on this machine's kernel: the real call succeeds on
    the shard file, and the checkpoint's bytes and checksums are what they are without it."""
    real = writeback.sync_file_range
    assert real is not None, "libc's sync_file_range was not found (Linux has it)"
    seen: list[tuple[int, int, int]] = []

    def spy(fd: int, offset: int, nbytes: int, flags: int) -> int:
        rc = real(fd, offset, nbytes, flags)
        seen.append((offset, nbytes, rc))
        return rc

    g = torch.Generator().manual_seed(5)
    state = {"model": {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(6)}}  # 24 MB
    monkeypatch.setattr(writeback, "sync_file_range", spy)
    dcp.save(state, storage_writer=integrity.ChecksummedWriter(FileSystemWriter(str(tmp_path / "a"))))
    assert len(seen) >= 2 and all(rc == 0 for _, _, rc in seen), seen
    assert [o for o, _, _ in seen] == sorted(o for o, _, _ in seen) and seen[0][0] == 0, "contiguous, in order"
    monkeypatch.setattr(writeback, "sync_file_range", None)
    dcp.save(state, storage_writer=integrity.ChecksummedWriter(FileSystemWriter(str(tmp_path / "b"))))
    a, b = (json.loads((tmp_path / d / layout.CHECKSUMS).read_text())["files"] for d in ("a", "b"))
    shard = [n for n in a if n.endswith(".distcp")]
    assert shard and all(a[n] == b[n] for n in shard), "the same bytes, the same checksums"
