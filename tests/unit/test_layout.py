"""Pure checkpoint decisions: naming, verification, resume selection, retention, cadence."""

import json

import pytest

from elastic_trainer.checkpoint import layout
from elastic_trainer.checkpoint.layout import Candidate


def manifest(step, files, key=None, **extra):
    body = layout.build_manifest(
        step=step,
        world_size=1,
        mesh_shape=[1],
        files={k: {"size": v, "xxh3": 1} for k, v in files.items()},
        created=1.0,
        torch_version="x",
        fingerprint="f",
        extra=extra,
    )
    return layout.seal(body, key)


def cand(step, files=None, manifest_files=None, committed=True, key=None, quarantine=None):
    files = files if files is not None else {"__0_0.distcp": 10, ".metadata": 5}
    mf = manifest_files if manifest_files is not None else dict(files)
    return Candidate(
        step, layout.step_dir_name(step), manifest(step, mf, key) if committed else None, files, quarantine
    )


def test_names_roundtrip_and_garbage_is_ignored():
    assert layout.step_dir_name(1200) == "step-00001200"
    assert layout.parse_step_dir("step-00001200") == 1200
    for junk in ("step-12", "foo", "step-0000120a", "step-00001200.tmp", "_epochs"):
        assert layout.parse_step_dir(junk) is None
    assert layout.parse_dir("step-00001200.2") == (1200, 2)
    assert layout.next_dir_name(5, set()) == "step-00000005"
    assert layout.next_dir_name(5, {"step-00000005", "step-00000005.1"}) == "step-00000005.2"


def test_verify_reasons():
    assert layout.verify(cand(5)) is None
    assert "uncommitted" in layout.verify(cand(5, committed=False))
    assert "missing" in layout.verify(
        cand(5, files={".metadata": 5}, manifest_files={".metadata": 5, "__0_0.distcp": 10})
    )
    assert "has 3 bytes, manifest says 10" in layout.verify(
        cand(5, files={".metadata": 5, "__0_0.distcp": 3}, manifest_files={".metadata": 5, "__0_0.distcp": 10})
    )
    bad = Candidate(5, "step-00000005", manifest(6, {".metadata": 1}), {".metadata": 1})
    assert "does not match" in layout.verify(bad)
    assert "quarantined: checksum" in layout.verify(cand(5, quarantine={"reason": "checksum mismatch"}))


def test_manifest_seal_and_signature():
    m = manifest(5, {".metadata": 5})
    c = Candidate(5, "step-00000005", m, {".metadata": 5})
    assert layout.verify(c) is None
    tampered = dict(m, world_size=2)  # valid JSON, same shape, one value changed
    assert "checksum mismatch" in layout.verify(Candidate(5, "step-00000005", tampered, {".metadata": 5}))
    assert "signature" in layout.verify(c, key=b"k"), "an unsigned manifest is refused when a key is set"
    signed = manifest(5, {".metadata": 5}, key=b"k")
    assert layout.verify(Candidate(5, "step-00000005", signed, {".metadata": 5}), key=b"k") is None
    assert "signature" in layout.verify(Candidate(5, "step-00000005", signed, {".metadata": 5}), key=b"other")
    forged = layout.seal(dict(signed, world_size=2), None) | {"hmac": signed["hmac"]}
    assert "signature" in layout.verify(Candidate(5, "step-00000005", forged, {".metadata": 5}), key=b"k")


@pytest.mark.parametrize("key", [None, b"k"])
def test_a_manifest_sealed_to_bytes_reads_back_as_the_sealed_manifest_and_verifies(key):
    """``sealed`` encodes a manifest once (the canonical bytes with the seal added): the bytes
    parse to exactly what ``seal`` gives, the seal verifies, and one changed byte does not."""
    m = manifest(5, {".metadata": 5, "__0_0.distcp": 10}) | {"time": 1.25, "extra": {"rank": 1, "chain": ["a", ""]}}
    out, data = layout.sealed(m, key)
    assert json.loads(data) == out == layout.seal(m, key)
    files = {".metadata": 5, "__0_0.distcp": 10}
    assert layout.verify(Candidate(5, "step-00000005", json.loads(data), files), key=key) is None
    forged = json.loads(data.replace(b'"world_size":1', b'"world_size":2'))
    assert forged["world_size"] == 2
    assert layout.verify(Candidate(5, "step-00000005", forged, files), key=key) is not None


def test_commit_problem_names_the_missing_shard():
    written = {".metadata": {"size": 5}, "__0_0.distcp": {"size": 10}, "__1_0.distcp": {"size": 10}}
    assert layout.commit_problem(written, {".metadata": 5, "__0_0.distcp": 10, "__1_0.distcp": 10}) is None
    assert "__1_0.distcp" in layout.commit_problem(written, {".metadata": 5, "__0_0.distcp": 10})
    assert "9 bytes" in layout.commit_problem(written, {".metadata": 5, "__0_0.distcp": 10, "__1_0.distcp": 9})


@pytest.mark.parametrize(
    "writer, mine, cleanable",
    [
        (None, "00000002-b", True),
        ("00000001-a", "00000002-b", True),
        ("00000002-b", "00000002-b", True),
        ("00000003-c", "00000002-b", False),
        ("00000002-c", "00000002-b", False),
    ],
)
def test_uncommitted_cleaned_only_by_their_epoch_or_a_newer_one(writer, mine, cleanable):
    c = Candidate(5, "step-00000005", None, {"__0_0.distcp": 3}, writer={"epoch": writer} if writer else None)
    assert (layout.cleanable_uncommitted([c], mine) == [c]) is cleanable
    assert layout.cleanable_uncommitted([cand(6)], mine) == [], "committed directories are never cleaned"


def test_select_latest_falls_back_past_broken_ones():
    truncated = cand(30, files={".metadata": 5, "__0_0.distcp": 1}, manifest_files={".metadata": 5, "__0_0.distcp": 10})
    sel = layout.select_for_resume([cand(10), cand(20), truncated, cand(40, committed=False)], "latest")
    assert sel.chosen.step == 20
    assert [s for s, _ in sel.skipped] == [40, 30]


@pytest.mark.parametrize("resume, chosen", [("none", None), ("10", 10), ("20", 20), ("15", None)])
def test_select_explicit(resume, chosen):
    sel = layout.select_for_resume([cand(10), cand(20)], resume)
    assert (sel.chosen.step if sel.chosen else None) == chosen
    if resume == "15":
        assert sel.skipped == [(15, "no such checkpoint")]


@pytest.mark.parametrize(
    "steps, keep_last, keep_every, protected, victims",
    [
        ([10, 20, 30, 40], 2, 0, set(), [10, 20]),
        ([10, 20, 30, 40], 2, 20, set(), [10]),
        ([10, 20, 30, 40], 1, 0, {10}, [20, 30]),
        ([10], 1, 0, set(), []),
        ([10, 20, 30], 5, 0, set(), []),
    ],
)
def test_retention(steps, keep_last, keep_every, protected, victims):
    assert layout.retention_victims(steps, keep_last, keep_every, protected) == victims


def test_manifest_contents():
    m = layout.build_manifest(
        step=7,
        world_size=2,
        mesh_shape=[2],
        files={"b": {"size": 2}, "a": {"size": 1}},
        created=1.0,
        torch_version="x",
        fingerprint="f",
        epoch="00000001-x",
    )
    assert (
        m["total_bytes"] == 3
        and list(m["files"]) == ["a", "b"]
        and m["world_size"] == 2
        and m["config_fingerprint"] == "f"
    )
    assert m["epoch"] == "00000001-x" and m["version"] == layout.MANIFEST_VERSION


def test_unreadable_manifest_is_skipped_not_trusted():
    c = Candidate(5, "step-00000005", {"unreadable": "Expecting value"}, {".metadata": 5})
    assert "manifest unreadable" in layout.verify(c)
    assert layout.select_for_resume([c, cand(3)], "latest").chosen.step == 3
