"""Pure checkpoint decisions: naming, verification, resume selection, retention, cadence."""

import pytest

from elastic_trainer.checkpoint import layout
from elastic_trainer.checkpoint.layout import Candidate


def cand(step, files=None, manifest_files=None, committed=True):
    files = files if files is not None else {"__0_0.distcp": 10, ".metadata": 5}
    mf = manifest_files if manifest_files is not None else dict(files)
    manifest = {"step": step, "files": mf} if committed else None
    return Candidate(step, layout.step_dir_name(step), manifest, files)


def test_names_roundtrip_and_garbage_is_ignored():
    assert layout.step_dir_name(1200) == "step-00001200"
    assert layout.parse_step_dir("step-00001200") == 1200
    for junk in ("step-12", "foo", "step-0000120a", "step-00001200.tmp"):
        assert layout.parse_step_dir(junk) is None


def test_verify_reasons():
    assert layout.verify(cand(5)) is None
    assert "uncommitted" in layout.verify(cand(5, committed=False))
    assert "missing" in layout.verify(cand(5, files={".metadata": 5}, manifest_files={".metadata": 5, "__0_0.distcp": 10}))
    assert "has 3 bytes, manifest says 10" in layout.verify(cand(5, files={".metadata": 5, "__0_0.distcp": 3}, manifest_files={".metadata": 5, "__0_0.distcp": 10}))
    bad = Candidate(5, "step-00000005", {"step": 6, "files": {"a": 1}}, {"a": 1})
    assert "does not match" in layout.verify(bad)


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


@pytest.mark.parametrize(
    "step, total, interval, time_due, preempt, expected",
    [(5, 10, 5, False, False, True), (4, 10, 5, False, False, False), (10, 10, 0, False, False, True), (3, 10, 0, True, False, True), (3, 10, 5, False, True, True), (3, 10, 0, False, False, False)],
)
def test_should_save(step, total, interval, time_due, preempt, expected):
    assert layout.should_save(step, total, interval, time_due, preempt) is expected


def test_manifest_contents():
    m = layout.build_manifest(step=7, world_size=2, mesh_shape=[2], files={"b": 2, "a": 1}, created=1.0, torch_version="x", fingerprint="f")
    assert m["total_bytes"] == 3 and list(m["files"]) == ["a", "b"] and m["world_size"] == 2 and m["config_fingerprint"] == "f"


def test_unreadable_manifest_is_skipped_not_trusted():
    c = Candidate(5, "step-00000005", {"unreadable": "Expecting value"}, {".metadata": 5})
    assert "manifest unreadable" in layout.verify(c)
    assert layout.select_for_resume([c, cand(3)], "latest").chosen.step == 3
