"""The checkpoint catalog (checkpoint/catalog.py) and its pure decisions (checkpoint/layout.py)
over a real local root, with real world-1 DCP saves through the checksummed writer.

What is shown: a commit whose directory lacks a file DCP reported writing (another rank's shard
on a disk that is not shared) is refused and older commits stay; a sealed manifest catches a
changed digit and, with ``ELASTIC_TRAINER_CHECKPOINT_KEY``, a forgery (refused before the
``.metadata`` it vouches for is unpickled); resume follows the lineage; retention deletes only
within the lineage and never unless the newer commit verifies; fencing epochs order launches and
stop the older one from committing, cleaning or deleting; what start-up may clean.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastic_trainer.checkpoint import integrity, layout
from elastic_trainer.checkpoint.catalog import Catalog, checkpoint_key, lineage
from elastic_trainer.checkpoint.layout import Candidate
from elastic_trainer.contract import CHECKPOINT_KEY_ENV
from elastic_trainer.errors import CheckpointError, FencedError
from elastic_trainer.events import EventLog
from elastic_trainer.storage.fs import open_storage, write_json_atomic

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _catalog(root: Path, launch: str | None = None, key: bytes | None = None, events: Path | None = None) -> Catalog:
    cat = Catalog(open_storage(str(root)), key=key, events=EventLog(str(events) if events else None))
    if launch:
        cat.fence.acquire(launch)
    return cat


def _write(cat: Catalog, name: str, step: int) -> dict:
    """A real world-1 DCP save of a tiny state through the checksummed writer (not committed)."""
    sd = {"model": {"w": torch.full((16,), float(step)), "b": torch.arange(4) + step}, "train": {"step": step}}
    dcp.save(sd, storage_writer=integrity.ChecksummedWriter(cat.storage.dcp.writer(cat.storage.join(name))))
    return sd


def _commit(
    cat: Catalog, name: str, step: int, parent: str | None = None, seq: int = 1, extra: dict | None = None
) -> dict:
    return cat.commit(
        name,
        step=step,
        world_size=1,
        mesh_shape=[1],
        fingerprint="f",
        torch_version=torch.__version__,
        extra={"parent": parent, "seq": seq, "finite": True, **(extra or {})},
    )


def _save(cat: Catalog, step: int, parent: str | None = None, seq: int = 1) -> str:
    name = layout.next_dir_name(step, {c.name for c in cat.scan()})
    _write(cat, name, step)
    _commit(cat, name, step, parent, seq)
    return name


def _by_name(cat: Catalog) -> dict[str, Candidate]:
    return {c.name: c for c in cat.scan()}


# ------------------------------------------------------------------ commit
def test_commit_refuses_a_directory_missing_a_written_file_and_older_commits_stay(tmp_path):
    cat = _catalog(tmp_path, "A")
    five = _save(cat, 5)
    _write(cat, "step-00000010", 10)
    d = tmp_path / "step-00000010"
    shard = next(p for p in d.iterdir() if p.name.endswith(".distcp"))
    shard.unlink()
    with pytest.raises(
        CheckpointError,
        match=f"cannot commit step-00000010: file {shard.name} \\(written by DCP\\) is missing from storage",
    ):
        _commit(cat, "step-00000010", 10, parent=five, seq=2)
    assert not (d / layout.MANIFEST).exists(), "never committed"
    cands = _by_name(cat)
    assert cands["step-00000010"].manifest is None
    assert cat.head().name == five and cat.problem(cands[five]) is None


def test_commit_refuses_another_ranks_shard_that_is_not_in_this_storage(tmp_path):
    """World 2 on two nodes without a shared directory: DCP reports rank 1's shard written,
    but rank 0's storage does not hold it. The commit is refused."""
    cat = _catalog(tmp_path, "A")
    _write(cat, "step-00000005", 5)
    table_path = tmp_path / "step-00000005" / layout.CHECKSUMS
    table = json.loads(table_path.read_text())
    table["files"]["__1_0.distcp"] = {"size": 1234, "xxh3": 42, "items": [[0, 1234, 42]]}
    table_path.write_text(json.dumps(table))
    with pytest.raises(CheckpointError, match="file __1_0.distcp \\(written by DCP\\) is missing from storage"):
        _commit(cat, "step-00000005", 5)
    assert cat.head() is None and not (tmp_path / "step-00000005" / layout.MANIFEST).exists()


@pytest.mark.parametrize("damage", ["truncate", "no_checksums", "no_metadata"])
def test_commit_refuses_incomplete_saves(tmp_path, damage):
    cat = _catalog(tmp_path, "A")
    _write(cat, "step-00000005", 5)
    d = tmp_path / "step-00000005"
    if damage == "truncate":
        shard = next(p for p in d.iterdir() if p.name.endswith(".distcp"))
        shard.write_bytes(shard.read_bytes()[:-1])
        match = "bytes in storage"
    elif damage == "no_checksums":
        (d / layout.CHECKSUMS).unlink()
        match = "no readable .checksums.json"
    else:
        (d / ".metadata").unlink()
        match = "file .metadata .* is missing"
    with pytest.raises(CheckpointError, match=match):
        _commit(cat, "step-00000005", 5)
    assert not (d / layout.MANIFEST).exists()


def test_committed_manifest_lists_what_dcp_wrote_and_verifies(tmp_path):
    cat = _catalog(tmp_path, "A")
    name = _save(cat, 5)
    m = json.loads((tmp_path / name / layout.MANIFEST).read_text())
    table = json.loads((tmp_path / name / layout.CHECKSUMS).read_text())["files"]
    assert m["files"] == table and m["version"] == layout.MANIFEST_VERSION and m["epoch"] == cat.epoch
    assert m["total_bytes"] == sum(f["size"] for f in table.values())
    assert layout.seal_problem(m, None) is None and "hmac" not in m
    assert cat.problem(_by_name(cat)[name]) is None
    meta = cat.read_metadata(_by_name(cat)[name])
    assert "model.w" in meta.state_dict_metadata


def _change_a_digit(path: Path, key: str) -> None:
    """Change one digit of the manifest's ``key`` value: same size, still valid JSON."""
    text = path.read_text()
    i = text.index(f'"{key}": ') + len(f'"{key}": ')
    old = text[i]
    assert old.isdigit(), text[i : i + 20]
    new = text[:i] + str((int(old) + 1) % 10) + text[i + 1 :]
    assert len(new) == len(text)
    json.loads(new)
    path.write_text(new)


def test_a_changed_digit_in_the_manifest_breaks_its_seal(tmp_path):
    cat = _catalog(tmp_path, "A")
    five = _save(cat, 5)
    ten = _save(cat, 10, parent=five, seq=2)
    _change_a_digit(tmp_path / ten / layout.MANIFEST, "total_bytes")
    assert "manifest checksum mismatch" in cat.problem(_by_name(cat)[ten])
    assert cat.head().name == five
    plan = _catalog(tmp_path, "B").plan_resume("latest")
    assert plan.chosen.name == five and plan.skipped == [(10, "manifest checksum mismatch (corrupted manifest)")]


class _Boom:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_with_a_key_a_forged_manifest_is_refused_before_unpickling(tmp_path, monkeypatch):
    """The attacker swaps ``.metadata`` for a pickle that runs code and rewrites the manifest
    to match (files, xxh3, self-checksum), but cannot compute the HMAC."""
    monkeypatch.setenv(CHECKPOINT_KEY_ENV, "s3cr3t-key")
    assert checkpoint_key() == b"s3cr3t-key"
    cat = _catalog(tmp_path, "A", key=checkpoint_key())
    name = _save(cat, 5)
    mpath = tmp_path / name / layout.MANIFEST
    signed = json.loads(mpath.read_text())
    assert "hmac" in signed and layout.seal_problem(signed, b"s3cr3t-key") is None
    assert "signature does not verify" in layout.seal_problem(signed, b"other")

    marker = tmp_path / "PWNED"
    evil = pickle.dumps(_Boom(marker))
    (tmp_path / name / ".metadata").write_bytes(evil)
    forged = dict(signed)
    forged["files"] = dict(signed["files"], **{".metadata": {"size": len(evil), "xxh3": layout.digest(evil)}})
    forged["total_bytes"] = sum(f["size"] for f in forged["files"].values())
    forged = layout.seal(forged, None)  # valid self-checksum, stale/absent HMAC
    mpath.write_text(json.dumps(forged))

    keyed = _catalog(tmp_path, key=checkpoint_key())
    c = _by_name(keyed)[name]
    assert "signature does not verify with ELASTIC_TRAINER_CHECKPOINT_KEY" in keyed.problem(c)
    with pytest.raises(CheckpointError, match="unusable: manifest signature"):
        keyed.read_metadata(c)
    with pytest.raises(CheckpointError):
        keyed.reader(c)
    assert keyed.head() is None
    assert _catalog(tmp_path, "B", key=checkpoint_key()).plan_resume("latest").chosen is None
    assert not marker.exists(), "the forged .metadata was unpickled"
    # Without the key the forgery is indistinguishable from a real commit: the test above can fail.
    assert _catalog(tmp_path, key=None).problem(c) is None


# ------------------------------------------------------------------ quarantine
def test_quarantine_marks_without_deleting_and_resume_skips_it(tmp_path):
    ev = tmp_path / "events.jsonl"
    cat = _catalog(tmp_path / "root", "A", events=ev)
    five = _save(cat, 5)
    ten = _save(cat, 10, parent=five, seq=2)
    cat.quarantine.mark(ten, "load failed: checksum mismatch")
    q = json.loads((tmp_path / "root" / ten / layout.QUARANTINE).read_text())
    assert q["reason"] == "load failed: checksum mismatch" and q["epoch"] == cat.epoch
    assert (tmp_path / "root" / ten / layout.MANIFEST).exists() and any((tmp_path / "root" / ten).glob("*.distcp"))
    recs = [json.loads(line) for line in ev.read_text().splitlines()]
    assert any(r["event"] == "checkpoint_quarantined" and r["name"] == ten and r["step"] == 10 for r in recs)
    plan = _catalog(tmp_path / "root", "B").plan_resume("latest")
    assert plan.chosen.name == five and plan.skipped == [(10, "quarantined: load failed: checksum mismatch")]
    # A new save of step 10 gets a directory of its own: the quarantined one is never rewritten.
    assert layout.next_dir_name(10, {c.name for c in cat.scan()}) == "step-00000010.1"


def test_an_unreadable_newer_manifest_is_skipped_by_name_and_quarantined_and_a_failed_read_is_not(
    tmp_path, monkeypatch
):
    # A manifest that is no JSON object names no lineage: the lineage's older commit loads first,
    # and the newer commit must still be reported (and quarantined: its bytes are the damage), at a
    # first start and at a restart inside the launch alike.
    root = tmp_path / "root"
    a = _catalog(root, "A")
    a.fence.record_base(None)
    five = _save(a, 5)
    ten = _save(a, 10, parent=five, seq=2)
    (root / ten / layout.MANIFEST).write_bytes(b"\x8e\x00 not json")
    for plan in (a.plan_resume("latest"), _catalog(root, "B").plan_resume("latest")):
        assert plan.chosen.name == five
        ((step, reason),) = plan.skipped
        assert step == 10 and reason.startswith("manifest unreadable: "), reason
        assert plan.corrupt == [(ten, reason)]
    # A read that failed (the storage, not the bytes) is skipped by name but never quarantined.
    (root / ten / layout.MANIFEST).write_text("[]")
    assert _catalog(root, "C").plan_resume("latest").corrupt == [(ten, "manifest unreadable: not a JSON object")]
    storage = a.storage
    read_bytes = storage.read_bytes

    def failing(path):
        if path.endswith(f"{ten}/{layout.MANIFEST}"):
            raise ConnectionResetError("connection reset by peer")
        return read_bytes(path)

    monkeypatch.setattr(storage, "read_bytes", failing)
    plan = a.plan_resume("latest")
    assert plan.chosen.name == five and plan.corrupt == []
    assert plan.skipped == [(10, "manifest could not be read: connection reset by peer")]


# ------------------------------------------------------------------ lineage
@pytest.fixture
def two_launches(tmp_path):
    """Launch A commits 5 -> 10 -> 15. Launch B starts from 10 (``checkpoint.resume=10``) and
    commits its own 15 (``step-00000015.1``): A's 15 is parked."""
    a = _catalog(tmp_path, "A")
    assert a.plan_resume("latest").chosen is None
    a.fence.record_base(None)
    five = _save(a, 5)
    ten = _save(a, 10, parent=five, seq=2)
    a15 = _save(a, 15, parent=ten, seq=3)
    b = _catalog(tmp_path, "B")
    plan = b.plan_resume("10")
    assert plan.chosen.name == ten and plan.first_start
    b.fence.record_base(plan.chosen.name)
    b15 = _save(b, 15, parent=ten, seq=3)
    assert b15 == "step-00000015.1"
    return a, b, {"5": five, "10": ten, "a15": a15, "b15": b15}


def test_latest_follows_the_newest_launchs_lineage(tmp_path, two_launches):
    _, _, n = two_launches
    fresh = _catalog(tmp_path)
    assert fresh.head().name == n["b15"]
    assert [c.name for c in lineage(fresh.head(), fresh.scan())] == [n["b15"], n["10"], n["5"]]
    c = _catalog(tmp_path, "C")
    assert c.plan_resume("latest").chosen.name == n["b15"]
    # Falling back (B's 15 failed to load) goes down the lineage, not to A's parked 15.
    assert c.plan_resume("latest", exclude=frozenset({n["b15"]})).chosen.name == n["10"]
    # An explicit step takes its newest valid directory.
    assert c.plan_resume("15").chosen.name == n["b15"]
    from elastic_trainer.checkpoint.tools import list_checkpoints

    status = {r["name"]: r["status"] for r in list_checkpoints(str(tmp_path))}
    assert status == {n["5"]: "lineage", n["10"]: "lineage", n["a15"]: "parked", n["b15"]: "head"}


def test_a_restart_inside_a_launch_resumes_its_own_newest_commit_whatever_resume_says(tmp_path, two_launches):
    _, b, n = two_launches
    again = _catalog(tmp_path)
    again.epoch = b.epoch  # the same launch, restarted by the agent
    plan = again.plan_resume("none")
    assert plan.chosen.name == n["b15"] and plan.first_start is False
    assert again.plan_resume("5").chosen.name == n["b15"]
    # Its fallback stays on its own lineage (its commits, then its base and the base's ancestors).
    assert again.plan_resume("latest", exclude=frozenset({n["b15"]})).chosen.name == n["10"]
    assert again.plan_resume("latest", exclude=frozenset({n["b15"], n["10"]})).chosen.name == n["5"]
    assert again.plan_resume("latest", exclude=frozenset({n["b15"], n["10"], n["5"]})).chosen is None


def test_a_restart_before_any_commit_resumes_the_launchs_base(tmp_path, two_launches):
    _, _, n = two_launches
    c = _catalog(tmp_path, "C")
    c.fence.record_base(n["10"])  # C started from 10 (checkpoint.resume=10) and has not committed yet
    c2 = _catalog(tmp_path)
    c2.epoch = c.epoch
    assert c2.plan_resume("latest").chosen.name == n["10"]


def test_retention_deletes_only_within_the_lineage(tmp_path, two_launches):
    _, b, n = two_launches
    b20 = _save(b, 20, parent=n["b15"], seq=4)
    deleted = b.pruner.retention(b20, keep_last=2, keep_every=0)
    assert deleted == [10, 5]
    names = set(_by_name(b))
    assert names == {b20, n["b15"], n["a15"]}, "A's parked 15 is not B's to count or delete"
    # keep_every keeps multiples.
    b25 = _save(b, 25, parent=b20, seq=5)
    assert b.pruner.retention(b25, keep_last=1, keep_every=20) == [15]
    assert set(_by_name(b)) == {b25, b20, n["a15"]}


@pytest.mark.parametrize("why", ["quarantined", "corrupt_manifest", "missing"])
def test_retention_never_deletes_unless_the_newer_commit_verifies(tmp_path, why):
    cat = _catalog(tmp_path, "A")
    five = _save(cat, 5)
    ten = _save(cat, 10, parent=five, seq=2)
    if why == "quarantined":
        cat.quarantine.mark(ten, "bad")
    elif why == "corrupt_manifest":
        _change_a_digit(tmp_path / ten / layout.MANIFEST, "total_bytes")
    else:
        ten = "step-00000099"
    assert cat.pruner.retention(ten, keep_last=1, keep_every=0) == []
    assert (tmp_path / five / layout.MANIFEST).exists()


def test_retention_deletes_the_commit_marker_first_and_leaves_nothing(tmp_path, monkeypatch):
    """A deletion cut short after the commit marker leaves an uncommitted leftover (never a
    commit with files missing); a whole one leaves no file and no directory."""
    cat = _catalog(tmp_path, "A")
    five = _save(cat, 5)
    ten = _save(cat, 10, parent=five, seq=2)
    audit = tmp_path / five / "sub" / "extra.bin"  # a nested file the listing found
    audit.parent.mkdir()
    audit.write_bytes(b"x")
    calls = []
    real = cat.storage.delete_files

    def cut_short(path, names):
        calls.append(list(names))
        if len(calls) == 2:
            raise OSError("the process died here")
        real(path, names)

    monkeypatch.setattr(cat.storage, "delete_files", cut_short)
    with pytest.raises(OSError):
        cat.pruner.retention(ten, keep_last=1, keep_every=0)
    assert calls[0] == [layout.MANIFEST] and layout.MANIFEST not in calls[1]
    assert {layout.CHECKSUMS, layout.METADATA, "sub/extra.bin"} <= set(calls[1])
    left = {c.name: c for c in cat.scan()}[five]
    assert left.manifest is None, "no commit marker over a partial directory"
    assert [c.name for c in layout.cleanable_uncommitted(cat.scan(), cat.epoch or "")] == [five]
    monkeypatch.setattr(cat.storage, "delete_files", real)
    fifteen = _save(cat, 15, parent=ten, seq=3)
    assert cat.pruner.retention(fifteen, keep_last=1, keep_every=0) == [10]
    assert sorted(os.listdir(tmp_path)) == sorted(["_epochs", five, fifteen])


def test_retention_keeps_quarantined_and_invalid_ones(tmp_path):
    cat = _catalog(tmp_path, "A")
    five = _save(cat, 5)
    ten = _save(cat, 10, parent=five, seq=2)
    cat.quarantine.mark(five, "bad")
    fifteen = _save(cat, 15, parent=ten, seq=3)
    assert cat.pruner.retention(fifteen, keep_last=1, keep_every=0) == [10]
    assert (tmp_path / five / layout.QUARANTINE).exists(), "quarantined evidence is kept"


# ------------------------------------------------------------------ epochs and fencing
@pytest.mark.parametrize(
    "older, newer",
    [
        ("00000001-b", "00000002-a"),
        ("00000009-z", "00000010-a"),
        ("00000003-a", "00000003-b"),
        ("garbage", "00000001-a"),
    ],
)
def test_epoch_order(older, newer):
    assert layout.epoch_key(older) < layout.epoch_key(newer)


def test_a_newer_launch_fences_the_older_one(tmp_path):
    ev = tmp_path / "events.jsonl"
    a = _catalog(tmp_path / "root", "launch-A", events=ev)
    assert a.epoch == "00000001-launch-A"
    five = _save(a, 5)
    ten = _save(a, 10, parent=five, seq=2)
    _write(a, "step-00000012", 12)  # A's save in flight when B takes over
    b = _catalog(tmp_path / "root", "launch-B", events=ev)
    assert b.epoch == "00000002-launch-B" and b.fence.current() == b.epoch
    recs = [json.loads(line) for line in ev.read_text().splitlines() if '"checkpoint_epoch"' in line]
    assert recs[-1]["epoch"] == b.epoch and recs[-1]["previous"] == a.epoch
    with pytest.raises(FencedError, match="newer launch \\(epoch 00000002-launch-B\\).*epoch 00000001-launch-A"):
        a.fence.check()
    with pytest.raises(FencedError, match="00000002-launch-B"):
        _commit(a, "step-00000012", 12, parent=ten, seq=3)
    assert not (tmp_path / "root" / "step-00000012" / layout.MANIFEST).exists()
    with pytest.raises(FencedError):
        a.pruner.clean_uncommitted()
    with pytest.raises(FencedError):
        a.fence.record_base(ten)
    # Retention of the fenced launch deletes nothing (it would delete 5).
    with pytest.raises(FencedError):
        a.pruner.retention(ten, keep_last=1, keep_every=0)
    assert (tmp_path / "root" / five / layout.MANIFEST).exists()
    # B goes on: it resumes A's newest commit and commits on top of it.
    assert b.plan_resume("latest").chosen.name == ten
    b.fence.record_base(ten)
    _save(b, 12, parent=ten, seq=3)
    assert b.head().step == 12 and b.head().name == "step-00000012.1"
    # Another node of launch B joins B's epoch instead of taking a new one.
    joined = _catalog(tmp_path / "root", "launch-B")
    assert joined.epoch == b.epoch and len(joined.fence.records()) == 2


def test_a_race_for_the_same_epoch_number_is_broken_by_the_launch_id(tmp_path):
    cat = _catalog(tmp_path)
    for name in ("00000003-bbb", "00000003-aaa"):
        write_json_atomic(cat.storage, cat.storage.join("_epochs", name + ".json"), {"launch": name[9:]})
    assert cat.fence.current() == "00000003-bbb"
    loser = _catalog(tmp_path)
    loser.epoch = "00000003-aaa"
    with pytest.raises(FencedError, match="00000003-bbb"):
        loser.fence.check()
    winner = _catalog(tmp_path)
    winner.epoch = "00000003-bbb"
    winner.fence.check()
    assert _catalog(tmp_path, "next").epoch == "00000004-next"


def test_reserved_and_foreign_entries_are_not_checkpoints(tmp_path):
    cat = _catalog(tmp_path, "A")
    _save(cat, 5)
    (tmp_path / "junk").mkdir()
    (tmp_path / "_events").mkdir()
    (tmp_path / "step-00000007.tmp").mkdir()
    assert [c.name for c in cat.scan()] == ["step-00000005"]
    assert sorted(cat.ignored_entries()) == ["junk", "step-00000007.tmp"]


# ------------------------------------------------------------------ start-up cleanup
def _unc(name: str, writer: str | None) -> Candidate:
    p = layout.parse_dir(name)
    return Candidate(p[0], name, None, {"__0_0.distcp": 3}, None, {"epoch": writer} if writer is not None else None)


@pytest.mark.parametrize(
    "cand, cleanable",
    [
        (_unc("step-00000005", "00000002-me"), True),  # an earlier incarnation of this launch
        (_unc("step-00000006", "00000001-old"), True),  # a superseded launch
        (_unc("step-00000007", "00000003-new"), False),  # a newer launch's save in flight
        (_unc("step-00000008", "00000002-zz"), False),  # won the race for our number
        (_unc("step-00000009", None), True),  # nobody known (no marker)
        (_unc("step-00000010", ""), True),
        (Candidate(11, "step-00000011", {"step": 11}, {}, None, None), False),  # committed: never
    ],
)
def test_cleanable_uncommitted(cand, cleanable):
    assert (cand in layout.cleanable_uncommitted([cand], "00000002-me")) is cleanable


def test_clean_uncommitted_removes_leftovers_but_not_a_newer_launchs_save(tmp_path):
    a = _catalog(tmp_path, "A")
    five = _save(a, 5)
    _write(a, "step-00000010", 10)
    a.mark_writer("step-00000010")
    _write(a, "step-00000011", 11)  # no writer marker
    b = _catalog(tmp_path, "B")
    _write(b, "step-00000012", 12)
    b.mark_writer("step-00000012")
    # B (newer than A) cleans A's leftover, its own and an unmarked one unless told to keep it.
    cleaned = b.pruner.clean_uncommitted(keep=frozenset({"step-00000011"}))
    assert sorted(c.name for c in cleaned) == ["step-00000010", "step-00000012"]
    assert set(_by_name(b)) == {five, "step-00000011"}
    # A newer launch's save in flight survives an older launch's cleanup: fenced, nothing deleted.
    c = _catalog(tmp_path, "C")
    _write(c, "step-00000013", 13)
    c.mark_writer("step-00000013")
    with pytest.raises(FencedError):
        b.pruner.clean_uncommitted()
    assert (tmp_path / "step-00000013").exists()


def test_a_restarts_decision_reads_each_object_once_and_only_its_own_epoch_record(tmp_path, two_launches):
    """On a slow checkpoint.dir every read is a round trip on the restart's path: deciding what a
    restart of launch B loads reads each manifest once, B's epoch record once (no other launch's),
    and the chosen commit's ``.metadata``; checking the fence before a commit reads no record."""
    from collections import Counter

    from elastic_trainer.checkpoint import resume

    _, b, n = two_launches
    again = _catalog(tmp_path)
    reads: Counter = Counter()
    storage = again.storage
    inner = storage.read_bytes  # read_json reads through it

    def counted(path):
        reads[os.path.relpath(path, str(tmp_path))] += 1
        return inner(path)

    storage.read_bytes = counted
    opened = storage.dcp.reader

    def reader(path):
        r = opened(path)
        fs = r.fs
        create = fs.create_stream

        def stream(p, mode):
            reads[os.path.relpath(str(p), str(tmp_path))] += 1
            return create(p, mode)

        fs.create_stream = stream
        return r

    storage.dcp.reader = reader
    decision = resume.decide(again, "latest", frozenset(), clean=True, launch_id="B", events=EventLog(None))
    assert decision.refused is None, decision.message
    assert decision.chosen == n["b15"] and not decision.first_start
    assert decision.metadata is not None  # every rank plans its load from it: none reads it again
    manifests = [p for p in reads if p.endswith(layout.MANIFEST)]
    assert manifests and all(reads[p] == 1 for p in manifests), reads
    epoch_reads = {p: k for p, k in reads.items() if p.startswith("_epochs")}
    assert epoch_reads == {f"_epochs/{b.epoch}.json": 1}, reads
    assert reads[f"{n['b15']}/{layout.METADATA}"] == 1, reads
    reads.clear()
    again.fence.check()
    assert not reads, f"the fence is a listing: {reads}"


def test_a_plan_from_names_reads_no_object_and_names_the_newest_unquarantined_commit(tmp_path):
    """What a restart with local copies decides before any read (``resume.from_names``): every
    step directory's name (a new save never takes one), and the newest that lists a commit
    marker and no quarantine marker; a leftover without a manifest, a quarantined commit and a
    later generation of a step are told apart by name alone."""
    from elastic_trainer.checkpoint import resume

    cat = _catalog(tmp_path, "A")
    five = _save(cat, 5)
    seven = _save(cat, 7, five, 2)
    again = _save(cat, 7, seven, 3)  # a second save of step 7: step-00000007.1
    _write(cat, "step-00000009", 9)  # written, never committed
    eight = _save(cat, 8, again, 4)
    cat.quarantine.mark(eight, "test")
    reads: list[str] = []
    restart = _catalog(tmp_path)
    inner = restart.storage.read_bytes
    restart.storage.read_bytes = lambda p: reads.append(p) or inner(p)
    decision = resume.from_names(restart, "A", clean=False)
    assert decision.refused is None, decision.message
    assert reads == [], "nothing is read: listings only"
    assert again == "step-00000007.1"
    assert (decision.chosen, decision.manifest, decision.listed) == (again, {"step": 7}, True)
    assert decision.taken == sorted([five, seven, again, "step-00000009", eight])
    assert decision.epoch == cat.epoch and not decision.first_start
    # a process's first load also removes the uncommitted leftover, still by the listing alone
    # (this launch holds the newest epoch: no newer launch can be writing it)
    first = _catalog(tmp_path, events=tmp_path / "events.jsonl")
    first.storage.read_bytes = restart.storage.read_bytes
    decision = resume.from_names(first, "A", clean=True)
    assert reads == [] and decision.refused is None, decision.message
    assert not (tmp_path / "step-00000009").exists() and (tmp_path / again / layout.MANIFEST).exists()
    assert decision.taken == sorted([five, seven, again, eight])
    cleaned = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["name"]) for e in cleaned] == [("checkpoint_cleaned", "step-00000009")]
    # a newer launch fences it: refused, nothing deleted
    _write(cat, "step-00000010", 10)
    _catalog(tmp_path, "B")
    stale = _catalog(tmp_path)
    stale.epoch = cat.epoch
    assert resume.from_names(stale, "A", clean=True).refused is FencedError
    assert (tmp_path / "step-00000010").exists()
    # with nothing committed there is no commit to descend from
    empty = _catalog(tmp_path / "empty")
    assert resume.from_names(empty, "B", clean=False).chosen is None
