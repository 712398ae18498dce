"""The event-log mirror under ``<checkpoint.dir>/_events/`` (supervisor/history.py).

A week-long job writes hundreds of MB of events: each mirror must upload a bounded segment, not
the whole file, and ``report`` on the checkpoint root must still get every record back, in order.
"""

from __future__ import annotations

import json
import threading

import pytest

from elastic_trainer.contract import EVENTS_MIRROR_DIR
from elastic_trainer.storage.fs import open_storage
from elastic_trainer.supervisor import history
from elastic_trainer.supervisor.history import RunHistory, read_mirrored_events


class Recording:
    """A real local storage that records every upload's size, and can fail or block them."""

    def __init__(self, root):
        self.inner = open_storage(str(root))
        self.uploads: list[tuple[str, int]] = []
        self.fail = 0
        self.gate: threading.Event | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write_bytes_atomic(self, path, data):
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            self.fail -= 1
            raise OSError("injected: object store unavailable")
        self.uploads.append((path, len(data)))
        self.inner.write_bytes_atomic(path, data)


def _append(path, records, torn: str = ""):
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(torn)


def _records(first, n, event="step"):
    return [{"event": event, "time": 1000.0 + i, "step": i, "pad": "x" * 80} for i in range(first, first + n)]


def test_segments_bound_each_upload_and_join_back_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(history, "SEGMENT_BYTES", 2000)
    log = tmp_path / "events.jsonl"
    store = Recording(tmp_path / "ckpt")
    h = RunHistory(str(log), storage=store, node="node-a", clock=lambda: 1700000000.0)
    written = []
    for k in range(12):  # 12 commits, ~10 steps each, a mirror after each commit
        batch = _records(k * 11, 10) + [
            {"event": "checkpoint_committed", "time": 1000.0 + k * 11 + 10, "step": k * 11 + 10}
        ]
        written += batch
        _append(log, batch)
        h.poll()
    size = log.stat().st_size
    assert size > 6 * 2000, "the log is several segments long"
    # every upload is bounded by a segment plus what was appended between two mirrors (11 lines)
    per_mirror = max(len(json.dumps(r)) + 1 for r in written) * 11
    assert max(n for _, n in store.uploads) <= 2000 + per_mirror, store.uploads
    assert sum(n for _, n in store.uploads) < 3 * size, "not the whole file per mirror (that would be ~6x here)"
    names = sorted(store.inner.list_files(store.inner.join(EVENTS_MIRROR_DIR)))
    assert len(names) >= 6 and all(n.startswith("node-a-1700000000-") and n.endswith(".jsonl") for n in names), names
    assert read_mirrored_events(store.inner) == written


def test_a_torn_last_line_waits_for_its_end(tmp_path):
    log = tmp_path / "events.jsonl"
    store = Recording(tmp_path / "ckpt")
    h = RunHistory(str(log), storage=store, node="n")
    rec = _records(0, 3)
    _append(log, rec[:2] + [{"event": "checkpoint_committed", "time": 1002.5, "step": 2}], torn='{"event": "step", "ti')
    h.poll()
    assert [e["step"] for e in read_mirrored_events(store.inner)] == [0, 1, 2]
    _append(log, [], torn='me": 1003.0, "step": 3}\n')
    h.close()
    assert [e["step"] for e in read_mirrored_events(store.inner)] == [0, 1, 2, 3]


def test_a_failed_upload_is_retried_and_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(history, "SEGMENT_BYTES", 500)
    log = tmp_path / "events.jsonl"
    store = Recording(tmp_path / "ckpt")
    h = RunHistory(str(log), storage=store, node="n")
    store.fail = 1
    _append(log, _records(0, 8) + [{"event": "restart", "time": 1008.5}])
    h.poll()  # the upload fails: logged, not raised, and the segment stays open
    assert store.uploads == []
    _append(log, _records(9, 8) + [{"event": "checkpoint_committed", "time": 1017.5}])
    h.poll()
    h.close()
    got = read_mirrored_events(store.inner)
    assert [e.get("step") for e in got if e["event"] == "step"] == list(range(8)) + list(range(9, 17))


def test_a_scrape_never_waits_for_the_object_store(tmp_path):
    log = tmp_path / "events.jsonl"
    store = Recording(tmp_path / "ckpt")
    store.gate = threading.Event()  # every upload blocks until released
    h = RunHistory(str(log), storage=store, node="n")
    _append(log, _records(0, 3) + [{"event": "checkpoint_committed", "time": 1003.5}])
    done = threading.Event()
    t = threading.Thread(target=lambda: (h.export(), done.set()), daemon=True)
    t.start()
    assert done.wait(5), "export() blocked on the mirror upload"
    assert store.uploads == []
    store.gate.set()
    h.poll()  # the background thread's call uploads what the scrape left due
    assert len(store.uploads) == 1


def test_logs_of_several_nodes_and_an_unsegmented_older_mirror_merge_by_time(tmp_path, monkeypatch):
    monkeypatch.setattr(history, "SEGMENT_BYTES", 300)
    store = open_storage(str(tmp_path / "ckpt"))
    # an object mirrored by an earlier version: one whole file, no segment number
    old = [{"event": "step", "time": 990.0 + i, "step": i} for i in range(3)]
    store.write_bytes_atomic(
        store.join(EVENTS_MIRROR_DIR, "old-node-1690000000-7.jsonl"),
        "".join(json.dumps(r) + "\n" for r in old).encode(),
    )
    mine = {}
    for node, offset in (("a", 0.25), ("b", 0.75)):
        log = tmp_path / f"{node}.jsonl"
        h = RunHistory(str(log), storage=store, node=node)
        mine[node] = [{"event": "step", "time": 1000.0 + i + offset, "step": i, "node": node} for i in range(10)]
        for r in mine[node]:
            _append(log, [r, {"event": "rendezvous", "time": r["time"] + 0.01, "node": node}])
            h.poll()
        h.close()
    got = [e for e in read_mirrored_events(store) if e["event"] == "step"]
    assert got[:3] == old
    assert got[3:] == sorted(mine["a"] + mine["b"], key=lambda e: e["time"])
    assert len(store.list_files(store.join(EVENTS_MIRROR_DIR))) > 4, "each node's log was several segments"


@pytest.mark.parametrize(
    "name,log,seq",
    [
        ("n-1-2.000003.jsonl", "n-1-2", "000003"),
        ("n-1-2.jsonl", "n-1-2", None),
        ("host.example.com-1-2.000000.jsonl", "host.example.com-1-2", "000000"),
    ],
)
def test_segment_names(name, log, seq):
    m = history._SEGMENT.match(name)
    assert (m["log"], m["seq"]) == (log, seq)
    if seq is not None:
        assert history.segment_name(log, int(seq)) == name


def test_a_long_log_is_followed_in_bounded_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(history, "READ_CHUNK_BYTES", 257)  # lines straddle every chunk boundary
    log = tmp_path / "events.jsonl"
    recs = (
        [{"event": "launch", "time": 990.0}]
        + [dict(r, step_time_s=0.5) for r in _records(0, 40)]
        + [{"event": "checkpoint_committed", "time": 1040.5, "step": 39}]
    )
    _append(log, recs)
    store = Recording(tmp_path / "ckpt")
    h = RunHistory(str(log), storage=store, node="n")
    reads = []
    real_open = open

    def counting_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        if str(path) == str(log):
            orig = f.read
            f.read = lambda size=-1: reads.append(size) or orig(size)
        return f

    monkeypatch.setattr("builtins.open", counting_open)
    h.poll()
    monkeypatch.setattr("builtins.open", real_open)
    assert reads and all(0 < r <= 257 for r in reads[:-1]), reads  # the mirror's own read is the last
    assert h.ledger.result().categories["productive"] == pytest.approx(40 * 0.5), (
        "every step fed once, none torn at a boundary"
    )
    assert [e["step"] for e in read_mirrored_events(store.inner) if e["event"] == "step"] == list(range(40))


def test_a_relaunch_on_a_long_log_mirrors_it_in_bounded_segments(tmp_path, monkeypatch):
    """A node relaunched on the same run.dir mirrors its older records again: as many objects of
    at most a segment each, never one object of the whole log."""
    monkeypatch.setattr(history, "SEGMENT_BYTES", 1000)
    log = tmp_path / "events.jsonl"
    recs = _records(0, 200)
    _append(log, recs + [{"event": "rendezvous", "time": 2000.0}])  # ~20 KB from earlier launches
    store = Recording(tmp_path / "ckpt")
    h = RunHistory(str(log), storage=store, node="n")
    h.poll()
    assert len(store.uploads) > 15 and max(n for _, n in store.uploads) <= 1000, store.uploads
    assert read_mirrored_events(store.inner) == recs + [{"event": "rendezvous", "time": 2000.0}]
    before = len(store.uploads)
    _append(log, [{"event": "checkpoint_committed", "time": 2001.0, "step": 1}])
    h.poll()
    assert len(store.uploads) == before + 1, "the next mirror uploads only the open segment"
    big = {"event": "note", "time": 2002.0, "text": "y" * 3000}  # a record longer than a segment
    _append(log, [big, {"event": "restart", "time": 2003.0}])
    h.poll()
    assert read_mirrored_events(store.inner)[-3:] == [
        {"event": "checkpoint_committed", "time": 2001.0, "step": 1},
        big,
        {"event": "restart", "time": 2003.0},
    ]


def test_damaged_lines_are_skipped_by_the_follower_and_the_report(tmp_path):
    """A log (or a mirrored object) with lines that parse as JSON but are no record, bytes that are
    not UTF-8, or a record whose time is not a number: skipped, never a crash
    (a crash in poll() left the rest of the chunk unfed)."""
    log = tmp_path / "events.jsonl"
    good = _records(0, 3)
    with open(log, "wb") as f:
        f.write(b'42\n"text"\n[1, 2]\n\xff\xfe garbage\n')
        for r in good:
            f.write((json.dumps(r) + "\n").encode())
        f.write(b'{"event": "checkpoint_committed", "time": "soon", "step": 2}\n')
    store = Recording(tmp_path / "ckpt")
    h = RunHistory(str(log), storage=store, node="n")
    h.poll()
    h.close()
    got = read_mirrored_events(store.inner)
    assert [e for e in got if e["event"] == "step"] == good
    assert not [e for e in got if e["event"] == "checkpoint_committed"], "a record of the wrong types is damage"
    assert h.ledger.result().wall_seconds == pytest.approx(2.0), "every good record was fed"
