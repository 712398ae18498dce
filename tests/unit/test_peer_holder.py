"""The peer holder (storage/peer.py) on 127.0.0.1: round trip, authentication, retention."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path

import pytest

from elastic_trainer.storage import peer
from elastic_trainer.storage.peer import Client, Holder, PeerError, xxh3

KEY = b"k" * 32
JOB = "job-a"


@pytest.fixture
def holder():
    h = Holder(JOB, KEY, "127.0.0.1").start()
    yield h
    h.close()


def _send_copy(c: Client, step: int, src: int = 0, world: int = 2, files=None, epoch: str = "e1") -> None:
    files = files or {"__0_0.distcp": b"shard-%d" % step, ".metadata": b"meta"}
    for name, data in files.items():
        c.put(epoch, step, src, world, name, data)
    listing = [[n, len(d), xxh3(d)] for n, d in files.items()]
    c.seal(epoch, step, src, world, listing, json.dumps({"step": step}).encode())


def _refused(h: Holder, before: int) -> bool:
    deadline = time.monotonic() + 5
    while h.refused == before and time.monotonic() < deadline:
        time.sleep(0.01)
    return h.refused == before + 1


def test_put_seal_inventory_get_round_trip(holder):
    c = Client(holder.address, JOB, KEY)
    c.put("e1", 4, 1, 2, "__0_0.distcp", b"x" * 1000)
    assert c.inventory() == [], "a copy is invisible until sealed"
    c.put("e1", 4, 1, 2, ".metadata", b"meta")
    c.seal("e1", 4, 1, 2, [["__0_0.distcp", 1000, xxh3(b"x" * 1000)], [".metadata", 4, xxh3(b"meta")]], b'{"m":1}')
    (inv,) = c.inventory()
    assert (inv["epoch"], inv["step"], inv["src"], inv["world"], inv["manifest"]) == ("e1", 4, 1, 2, '{"m":1}')
    assert c.get("e1", 4, 1, 2, "__0_0.distcp") == b"x" * 1000
    with pytest.raises(PeerError, match="no such file"):
        c.get("e1", 4, 0, 2, "__0_0.distcp")
    c.close()


def test_a_file_travels_in_pieces_both_ways(holder, tmp_path, monkeypatch):
    monkeypatch.setattr(peer, "CHUNK", 7)
    data = bytes(range(256)) * 3
    (tmp_path / "f").write_bytes(data)
    c = Client(holder.address, JOB, KEY)
    assert c.put_file("e1", 2, 0, 1, "f", str(tmp_path / "f")) == len(data)
    c.seal("e1", 2, 0, 1, [["f", len(data), xxh3(data)]], b"{}")
    assert c.get("e1", 2, 0, 1, "f") == data
    out = tmp_path / "back"
    with open(out, "wb") as f:
        assert c.get("e1", 2, 0, 1, "f", out=f) == len(data)
    assert out.read_bytes() == data
    with pytest.raises(PeerError, match="continues nothing"):
        c.put("e1", 4, 0, 1, "f", b"late", offset=100)


def test_a_put_whose_bytes_do_not_match_their_checksum_is_never_sealed(holder):
    c = Client(holder.address, JOB, KEY)
    args = {"epoch": "e1", "step": 2, "src": 0, "world": 2, "name": "__0_0.distcp", "xxh3": xxh3(b"good")}
    with pytest.raises(PeerError, match="checksum mismatch"):
        c.request("PUT", args, b"gooD")
    c.put("e1", 2, 0, 2, ".metadata", b"meta")
    with pytest.raises(PeerError, match="missing or not as listed"):
        c.seal("e1", 2, 0, 2, [["__0_0.distcp", 4, xxh3(b"good")], [".metadata", 4, xxh3(b"meta")]], b"{}")
    assert c.inventory() == []


def test_a_bad_mac_gets_nothing_and_the_connection_closes(holder):
    c = Client(holder.address, JOB, b"another key" * 3)
    before = holder.refused
    with pytest.raises(PeerError):
        c.inventory()
    assert _refused(holder, before)


def test_a_request_for_another_job_gets_nothing(holder):
    _send_copy(Client(holder.address, JOB, KEY), 2)
    other = Client(holder.address, "job-b", KEY)  # the same key, another job's name
    before = holder.refused
    with pytest.raises(PeerError):
        other.get("e1", 2, 0, 2, "__0_0.distcp")
    assert _refused(holder, before)


def _raw(address: str, header: dict, body: bytes = b"") -> bytes:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        h = json.dumps(header).encode()
        s.sendall(peer._FRAME.pack(len(h), len(body)) + h + body)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
            if len(b"".join(chunks)) >= peer._FRAME.size:
                hl, bl = peer._FRAME.unpack(b"".join(chunks)[: peer._FRAME.size])
                if len(b"".join(chunks)) >= peer._FRAME.size + hl + bl:
                    break
        return b"".join(chunks)


def _signed(op: str, nonce: str, ts: float, body: bytes = b"", job: str = JOB) -> dict:
    header = {"op": op, "job": job, "nonce": nonce, "ts": ts, "args": {}, "body": hashlib.sha256(body).hexdigest()}
    header["mac"] = peer._mac(KEY, header)
    return header


def test_a_replayed_request_and_a_stale_one_get_nothing(holder):
    header = _signed("INVENTORY", "n-1", time.time())
    assert _raw(holder.address, header) != b"", "the first time it is answered"
    before = holder.refused
    assert _raw(holder.address, header) == b"", "a replay is not"
    assert _refused(holder, before)
    assert _raw(holder.address, _signed("INVENTORY", "n-2", time.time() - 3600)) == b""
    assert _refused(holder, before + 1)


def test_no_key_no_holder():
    with pytest.raises(ValueError, match="key"):
        Holder(JOB, b"", "127.0.0.1")


def test_retention_keeps_the_newest_sealed_steps_per_source(holder):
    c = Client(holder.address, JOB, KEY)
    for step in (2, 4, 6):
        for src in (0, 1):
            _send_copy(c, step, src)
    c.put("e1", 8, 0, 2, "__0_0.distcp", b"half of step 8")  # not sealed yet
    held = sorted((e["step"], e["src"]) for e in c.inventory())
    assert held == [(4, 0), (4, 1), (6, 0), (6, 1)]
    assert holder.held_bytes() == 4 * len(b"shard-4meta") + len(b"half of step 8")
    # a newer world size's steps retire the older world size's; a newer epoch retires the older epoch
    _send_copy(c, 10, 0, world=3)  # the first step after a reshard: the old world size's copies stay
    assert sorted((e["step"], e["world"]) for e in c.inventory()) == [(4, 2), (4, 2), (6, 2), (6, 2), (10, 3)]
    _send_copy(c, 12, 0, world=3)
    assert sorted((e["step"], e["world"]) for e in c.inventory()) == [(10, 3), (12, 3)]
    _send_copy(c, 2, 0, epoch="e2")
    assert [(e["epoch"], e["step"]) for e in c.inventory()] == [("e2", 2)]


@pytest.mark.parametrize(
    ("nodes", "me", "replicas", "targets"),
    [
        ([0, 1, 2], 0, 1, [1]),
        ([0, 1, 2], 2, 1, [0]),
        ([0, 1, 2], 1, 2, [2, 0]),
        ([0, 1, 2], 1, 5, [2, 0]),  # never more than the other nodes, never itself
        ([3, 0], 3, 1, [0]),
        ([0], 0, 1, []),
        ([0, 1], 2, 1, []),  # a node without a holder replicates nowhere
    ],
)
def test_replicas_go_round_a_ring_of_the_other_nodes(nodes, me, replicas, targets):
    from elastic_trainer.checkpoint.peer_replication import ring_targets

    assert ring_targets(nodes, me, replicas) == targets


def test_a_holder_never_listens_on_every_interface():
    for host in ("", "0.0.0.0", "::"):
        with pytest.raises(ValueError, match="every interface"):
            Holder(JOB, KEY, host)


def test_without_a_key_peer_transfer_is_off_and_says_so(tmp_path, monkeypatch, caplog):
    from elastic_trainer import contract
    from elastic_trainer.checkpoint.local_tier import LocalTier
    from elastic_trainer.checkpoint.peer_tier import PeerNode, peer_tier_for
    from elastic_trainer.config import CheckpointConfig, Config
    from elastic_trainer.events import EventLog
    from elastic_trainer.metrics.sink import NullSink
    from elastic_trainer.supervisor.launcher import start_holder

    monkeypatch.delenv(contract.CHECKPOINT_KEY_ENV, raising=False)
    monkeypatch.delenv(contract.PEER_HOLDER_ENV, raising=False)
    c = CheckpointConfig(dir=str(tmp_path / "ckpt"), local_dir=str(tmp_path / "local"))
    tier = LocalTier(c.local_dir, c.dir, rank=0, world_size=1, key=None)
    with caplog.at_level("WARNING"):
        off = peer_tier_for(c, tier, c.dir, key=None, node=PeerNode(), metrics=NullSink(), events=EventLog(None))
        assert off is None
        assert start_holder(Config(checkpoint=c), "127.0.0.1", c.dir) is None
    assert [r.getMessage() for r in caplog.records if "peer transfer is off" in r.getMessage()], caplog.text
    assert contract.PEER_HOLDER_ENV not in os.environ


def test_a_rank_replicates_its_newest_copy_to_its_ring_targets(holder, tmp_path):
    from elastic_trainer.checkpoint.peer_replication import Replicator
    from elastic_trainer.checkpoint.peer_transport import TcpTransport
    from elastic_trainer.metrics.sink import NullSink

    def copy(step: int) -> str:
        d = tmp_path / f"step-{step}"
        d.mkdir()
        files = {"__0_0.distcp": b"s" * (100 + step), ".metadata": b"m"}
        for n, b in files.items():
            (d / n).write_bytes(b)
        listing = {n: {"size": len(b), "xxh3": xxh3(b)} for n, b in files.items()}
        (d / "manifest.json").write_text(json.dumps({"step": step, "world_size": 2, "files": listing}))
        return str(d)

    r = Replicator(1, [holder.address], TcpTransport(JOB, KEY), NullSink())
    try:
        for step in (2, 4):
            r.submit("e1", step, copy(step))
            assert r.idle(10)
        assert r.sent == [2, 4]
        c = Client(holder.address, JOB, KEY)
        assert [(e["step"], e["src"], e["world"]) for e in c.inventory()] == [(2, 1, 2), (4, 1, 2)]
        assert c.get("e1", 4, 1, 2, "__0_0.distcp") == b"s" * 104
        assert json.loads(c.inventory()[1]["manifest"])["files"]["__0_0.distcp"]["size"] == 104
    finally:
        r.close()


def test_merged_metadata_keeps_replicated_items_once_and_refuses_a_gap():
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from elastic_trainer.checkpoint.peer_sources import check_coverage, merge_metadata
    from elastic_trainer.errors import CheckpointIntegrityError

    def source(rows: tuple[int, int]) -> Metadata:
        off, n = torch.Size([rows[0], 0]), torch.Size([rows[1], 4])
        chunk = ChunkStorageMetadata(offsets=off, sizes=n)
        w = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([6, 4]), [chunk])
        return Metadata(
            state_dict_metadata={"w": w, "train": BytesStorageMetadata()},
            planner_data={"w": ("w",), "train": ("train",)},
            storage_data={
                MetadataIndex("w", off): _StorageInfo("__0_0.distcp", 0, 4 * rows[1] * 4),
                MetadataIndex("train", None): _StorageInfo("__0_0.distcp", 100, 8),
            },
        )

    merged = None
    for src, rows in enumerate([(0, 2), (2, 2), (4, 2)]):
        merged = merge_metadata(merged, source(rows), src)
    check_coverage(merged)
    assert [tuple(c.offsets) for c in merged.state_dict_metadata["w"].chunks] == [(0, 0), (2, 0), (4, 0)]
    assert merged.storage_data[MetadataIndex("w", torch.Size([4, 0]))].relative_path == "r2/__0_0.distcp"
    assert merged.storage_data[MetadataIndex("train", None)].relative_path == "r0/__0_0.distcp"  # once, the first

    gap = merge_metadata(merge_metadata(None, source((0, 2)), 0), source((4, 2)), 2)
    with pytest.raises(CheckpointIntegrityError, match="16 of its 24 elements"):
        check_coverage(gap)


class _Nodes:
    """The one collective the peer tier's connect makes: every rank's (node, holder address)."""

    def __init__(self, views):
        self.views = views

    def gather(self, obj):
        return self.views


def test_the_peer_saver_is_a_saver_that_replicates_each_committed_local_copy(holder, tmp_path):
    import time as _time

    import torch

    from elastic_trainer.checkpoint.local_tier import LocalTier, job_key
    from elastic_trainer.checkpoint.peer_tier import PeerSaver, PeerTier
    from elastic_trainer.checkpoint.save import Save, SaveContext
    from elastic_trainer.checkpoint.savers import LocalSaver, Saver
    from elastic_trainer.events import EventLog
    from elastic_trainer.metrics.sink import NullSink

    ckpt = str(tmp_path / "ckpt")
    ctx = SaveContext(0, 1, [1], "fp", EventLog(None), NullSink())
    tier = LocalTier(str(tmp_path / "local"), ckpt, rank=0, world_size=1, key=KEY)
    peer = PeerTier(tier, ckpt, key=KEY, replicas=1, holder=None, node=0, metrics=NullSink(), events=EventLog(None))
    holder.job = job_key(ckpt)
    peer.connect(_Nodes([(0, "127.0.0.1:9"), (1, holder.address)]))  # node 1's holder is the ring's next
    saver = PeerSaver(LocalSaver(tier, ctx, mode="sync"), peer)
    assert isinstance(saver, Saver)
    try:
        now = _time.monotonic()
        save = Save(2, None, started=now, deadline=now + 60, staged=True, epoch="e1")
        started = saver.start(save, {"w": torch.arange(6.0)}, {"remote_chain": [""]})
        assert started.done.result(timeout=30) is True
        assert peer.replicator.idle(10) and peer.replicator.sent == [2]
        (held,) = Client(holder.address, holder.job, KEY).inventory()
        assert (held["epoch"], held["step"], held["src"], held["world"]) == ("e1", 2, 0, 1)
        assert (
            json.loads(held["manifest"])["files"].keys()
            == json.loads((Path(tier.rank_dir("e1", 2)) / "manifest.json").read_text())["files"].keys()
        )
    finally:
        saver.close()
