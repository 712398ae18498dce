"""The peer tier's transport interface (checkpoint/peer_transport.py), in one process.

One suite runs against every transport: the holders' TCP (a real holder on 127.0.0.1) and an
in-memory one. The in-memory transport then carries a whole peer round trip: a rank's committed
copy replicated to another node's holder, and a rank of that node, whose disk holds nothing,
loading it back through :meth:`PeerTier.load` (inventory, fetch, merged metadata, DCP).
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from elastic_trainer.checkpoint.peer_transport import CopyId, Outgoing, PeerTransport, Sink, TcpTransport
from elastic_trainer.storage.peer import Holder, PeerError, xxh3

KEY = b"k" * 32
JOB = "job-t"


class MemoryTransport(PeerTransport):
    """Holders as dicts, one per address: ``{CopyId: {"files": {name: bytes}, "manifest": bytes | None}}``.
    A missing address is an unreachable holder."""

    def __init__(self, holders: dict[str, dict[CopyId, dict[str, Any]]]):
        self.holders = holders
        self.closed = 0

    def _at(self, at: str) -> dict[CopyId, dict[str, Any]]:
        if at not in self.holders:
            raise PeerError(f"peer holder {at}: unreachable")
        return self.holders[at]

    def send(
        self,
        at: str,
        copy: CopyId,
        files: Sequence[Outgoing],
        manifest: bytes,
        *,
        stop: Callable[[], bool],
        sent: Callable[[int], None],
    ) -> bool:
        held = self._at(at).setdefault(copy, {"files": {}, "manifest": None})
        for f in files:
            if stop():
                return False
            if f.data is not None:
                data = f.data
            else:
                with open(f.path, "rb") as fh:
                    data = fh.read()
            if xxh3(data) != f.xxh3:
                raise PeerError(f"{f.name}: checksum mismatch on receipt")
            held["files"][f.name] = data
            sent(len(data))
        held["manifest"] = manifest
        return True

    def inventory(self, at: str) -> list[dict[str, Any]]:
        return [
            {"epoch": k.epoch, "step": k.step, "src": k.src, "world": k.world, "manifest": c["manifest"].decode()}
            for k, c in sorted(self._at(at).items(), key=lambda kv: (kv[0].step, kv[0].src))
            if c["manifest"] is not None
        ]

    def fetch(self, at: str, copy: CopyId, name: str, out: Sink) -> int:
        held = self._at(at).get(copy)
        if held is None or held["manifest"] is None or name not in held["files"]:
            raise PeerError(f"peer holder {at}: no such file")
        out.write(held["files"][name])
        return len(held["files"][name])

    def drop(self, at: str, copy: CopyId) -> None:
        self._at(at).pop(copy, None)

    def close(self) -> None:
        self.closed += 1


@pytest.fixture(params=["tcp", "memory"])
def transport(request):
    """``(transport, the address of a holder it reaches)``."""
    if request.param == "memory":
        yield MemoryTransport({"mem:0": {}}), "mem:0"
        return
    holder = Holder(JOB, KEY, "127.0.0.1").start()
    t = TcpTransport(JOB, KEY)
    yield t, holder.address
    t.close()
    holder.close()


def _files(tmp_path, data: dict[str, bytes]) -> list[Outgoing]:
    out = []
    for name, b in sorted(data.items()):
        (tmp_path / name).write_bytes(b)
        out.append(Outgoing(name, len(b), xxh3(b), str(tmp_path / name)))
    return out


def _never() -> bool:
    return False


def test_a_sent_copy_is_offered_fetched_and_dropped(transport, tmp_path):
    t, at = transport
    copy = CopyId("e1", 4, 1, 2)
    files = _files(tmp_path, {"__0_0.distcp": b"x" * 1000, ".metadata": b"meta"})
    counted: list[int] = []
    assert t.send(at, copy, files, b'{"m": 1}', stop=_never, sent=counted.append) is True
    assert sorted(counted) == [4, 1000]
    (inv,) = t.inventory(at)
    assert (inv["epoch"], inv["step"], inv["src"], inv["world"], inv["manifest"]) == ("e1", 4, 1, 2, '{"m": 1}')
    out = io.BytesIO()
    assert t.fetch(at, copy, "__0_0.distcp", out) == 1000 and out.getvalue() == b"x" * 1000
    with pytest.raises(PeerError):
        t.fetch(at, CopyId("e1", 4, 0, 2), "__0_0.distcp", io.BytesIO())
    t.drop(at, copy)
    assert t.inventory(at) == []


def test_a_send_stopped_seals_nothing_and_given_bytes_travel_instead_of_the_file(transport, tmp_path):
    t, at = transport
    files = _files(tmp_path, {"a": b"aaaa", "b": b"bbbb"})
    assert t.send(at, CopyId("e1", 2, 0, 1), files, b"{}", stop=lambda: True, sent=lambda n: None) is False
    assert t.inventory(at) == []
    other = b"BBBB"
    swapped = [files[0], Outgoing("b", 4, xxh3(other), files[1].path, other)]
    assert t.send(at, CopyId("e1", 2, 0, 1), swapped, b"{}", stop=_never, sent=lambda n: None) is True
    out = io.BytesIO()
    t.fetch(at, CopyId("e1", 2, 0, 1), "b", out)
    assert out.getvalue() == other


def test_an_unreachable_holder_is_a_peer_error(transport):
    t, _ = transport
    with pytest.raises(PeerError):
        t.inventory("mem:404" if isinstance(t, MemoryTransport) else "127.0.0.1:9")


class _Nodes:
    """The one collective a peer tier's connect makes: every rank's (node, holder address)."""

    def __init__(self, views):
        self.views = views
        self.world_size = len(views)

    def gather(self, obj):
        return self.views


def test_a_copy_replicated_through_a_transport_is_loaded_back_through_it(tmp_path):
    """Node 0's rank replicates its copy of step 2 to node 1's holder (memory); a rank of node 1,
    with nothing on its disk, loads it from there: the interface carries the whole round trip."""
    from elastic_trainer.checkpoint.agreement import Agreement
    from elastic_trainer.checkpoint.local_tier import LocalTier
    from elastic_trainer.checkpoint.peer_load import PeerCopy
    from elastic_trainer.checkpoint.peer_tier import PeerSaver, PeerTier
    from elastic_trainer.checkpoint.save import Save, SaveContext
    from elastic_trainer.checkpoint.savers import LocalSaver
    from elastic_trainer.events import EventLog
    from elastic_trainer.metrics.sink import NullSink

    held: dict[str, dict[CopyId, dict[str, Any]]] = {"mem:1": {}}
    transport = MemoryTransport(held)
    ckpt = str(tmp_path / "ckpt")

    def tier_of(node: int) -> PeerTier:
        local = LocalTier(str(tmp_path / f"local-{node}"), ckpt, rank=0, world_size=1, key=KEY)
        holder = f"mem:{node}" if node else None
        kw: dict[str, Any] = {"metrics": NullSink(), "events": EventLog(None), "transports": lambda timeout: transport}
        return PeerTier(local, ckpt, key=KEY, replicas=1, holder=holder, node=node, **kw)

    source = tier_of(0)
    source.connect(_Nodes([(0, "mem:0"), (1, "mem:1")]))  # node 1's holder is the ring's next
    saver = PeerSaver(LocalSaver(source.tier, SaveContext(0, 1, [1], "fp", EventLog(None), NullSink())), source)
    try:
        now = time.monotonic()
        save = Save(2, None, started=now, deadline=now + 60, staged=True, epoch="e1")
        assert saver.start(save, {"w": torch.arange(6.0)}, {"remote_chain": [""]}).done.result(timeout=30)
        assert source.replicator is not None and source.replicator.idle(10) and source.replicator.sent == [2]
    finally:
        saver.close()
    (copy,) = held["mem:1"]
    assert (copy, held["mem:1"][copy]["manifest"] is not None) == (CopyId("e1", 2, 0, 1), True)

    reader = tier_of(1)
    one = Agreement(1)
    reader.connect(one)
    states = {"w": torch.zeros(6)}
    loaded = reader.load(states, one, epoch="e1", remote=None, min_step=0, fingerprint="fp", skipped=[], attempt="t1")
    assert isinstance(loaded, PeerCopy), loaded
    assert (loaded.step, loaded.tiers) == (2, ["peer"])
    assert json.loads(held["mem:1"][copy]["manifest"])["step"] == 2
    assert torch.equal(states["w"], torch.arange(6.0))
    assert transport.closed >= 2  # the inventory's and the reader's


def test_a_byte_corrupted_in_transit_is_dropped_where_it_was_held(tmp_path):
    """The same round trip, with the held shard corrupted at the same size: the load fails (every
    rank loads checkpoint.dir) and the bad copy is dropped through the transport."""
    from elastic_trainer.checkpoint.agreement import Agreement
    from elastic_trainer.checkpoint.local_tier import LocalTier
    from elastic_trainer.checkpoint.peer_tier import PeerTier
    from elastic_trainer.checkpoint.resume import LocalLoad
    from elastic_trainer.checkpoint.save import Save, SaveContext
    from elastic_trainer.checkpoint.savers import LocalSaver
    from elastic_trainer.events import EventLog
    from elastic_trainer.metrics.sink import NullSink

    ckpt = str(tmp_path / "ckpt")
    src = LocalTier(str(tmp_path / "local-0"), ckpt, rank=0, world_size=1, key=KEY)
    saver = LocalSaver(src, SaveContext(0, 1, [1], "fp", EventLog(None), NullSink()), mode="sync")
    now = time.monotonic()
    save = Save(2, None, started=now, deadline=now + 60, staged=True, epoch="e1")
    assert saver.start(save, {"w": torch.arange(6.0)}, {"remote_chain": [""]}).done.result(timeout=30)
    saver.close()
    held: dict[str, dict[CopyId, dict[str, Any]]] = {"mem:1": {}}
    transport = MemoryTransport(held)
    from elastic_trainer.checkpoint.peer_replication import outgoing

    world, files, raw = outgoing(src.rank_dir("e1", 2), 2)
    assert transport.send("mem:1", CopyId("e1", 2, 0, world), files, raw, stop=_never, sent=lambda n: None)
    (copy,) = held["mem:1"]
    shard = next(n for n in held["mem:1"][copy]["files"] if n.endswith(".distcp"))
    data = held["mem:1"][copy]["files"][shard]
    held["mem:1"][copy]["files"][shard] = data[:-8] + bytes(b ^ 0xFF for b in data[-8:])

    local = LocalTier(str(tmp_path / "local-1"), ckpt, rank=0, world_size=1, key=KEY)
    kw: dict[str, Any] = {"metrics": NullSink(), "events": EventLog(None), "transports": lambda timeout: transport}
    reader = PeerTier(local, ckpt, key=KEY, replicas=1, holder="mem:1", node=1, **kw)
    one = Agreement(1)
    reader.connect(one)
    skipped: list[tuple[int, str]] = []
    states = {"w": torch.zeros(6)}
    loaded = reader.load(
        states, one, epoch="e1", remote=None, min_step=0, fingerprint="fp", skipped=skipped, attempt="t2"
    )
    assert loaded is LocalLoad.FAILED
    assert skipped and skipped[0][0] == 2
    assert held["mem:1"] == {}, "the bad replica is dropped"
