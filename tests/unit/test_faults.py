"""Fault injection's ``committed=N``: a fault waits for that commit before it fires (bounded)."""

from __future__ import annotations

import pytest

from elastic_trainer import contract, faults


@pytest.fixture
def rank1(monkeypatch):
    monkeypatch.setenv(contract.RANK_ENV, "1")
    monkeypatch.setenv(contract.RESTART_COUNT_ENV, "0")


def test_parse_reads_the_commit_a_fault_waits_for():
    (kill, slow) = faults.parse("kill@rank=1,step=7,committed=5;slow@rank=0,step=1,seconds=0.3")
    assert (kill.kind, kill.rank, kill.step, kill.committed) == ("kill", 1, 7, 5)
    assert slow.committed is None and slow.seconds == 0.3


def test_a_fault_fires_only_once_the_commit_it_waits_for_is_visible(monkeypatch, rank1):
    monkeypatch.setenv(contract.INJECT_FAULT_ENV, "raise@rank=1,step=7,committed=5")
    asked = []

    def committed(step: int) -> bool:
        asked.append(step)
        return len(asked) >= 3  # visible at the third look

    faults.maybe_inject("raise", 6, committed)  # another step: nothing, not even a look
    assert asked == []
    with pytest.raises(RuntimeError, match="injected failure on rank 1 at step 7"):
        faults.maybe_inject("raise", 7, committed)
    assert asked == [5, 5, 5]


def test_a_commit_that_never_lands_delays_the_fault_only_to_its_bound(monkeypatch, rank1, caplog):
    monkeypatch.setenv(contract.INJECT_FAULT_ENV, "raise@rank=1,step=7,committed=5")
    monkeypatch.setattr(faults, "COMMITTED_WAIT_SECONDS", 0.2)
    with pytest.raises(RuntimeError, match="injected failure"):
        faults.maybe_inject("raise", 7, lambda step: False)
    assert "without the commit of step 5" in caplog.text


def test_without_committed_a_fault_fires_at_once(monkeypatch, rank1):
    monkeypatch.setenv(contract.INJECT_FAULT_ENV, "raise@rank=1,step=7")
    with pytest.raises(RuntimeError):
        faults.maybe_inject("raise", 7, lambda step: pytest.fail("no commit to wait for"))


def test_corrupt_peer_flips_the_replicas_of_its_rank_from_its_step_on(monkeypatch, rank1):
    monkeypatch.setenv(contract.INJECT_FAULT_ENV, "corrupt_peer@rank=1,step=4")
    data = bytes(200)
    assert faults.corrupting_replicas()
    assert faults.maybe_corrupt_replica(2, data) == data
    for step in (4, 6):
        bad = faults.maybe_corrupt_replica(step, data)
        assert len(bad) == len(data) and bad[100:164] == b"\xff" * 64 and bad[:100] + bad[164:] == bytes(136)
    monkeypatch.setenv(contract.RANK_ENV, "0")
    assert faults.maybe_corrupt_replica(6, data) == data


class _Killed(Exception):
    pass


@pytest.mark.parametrize("kind", ["lose_local", "corrupt_local"])
def test_local_damage_lets_the_save_in_flight_land_first_and_reaches_its_copy(monkeypatch, rank1, tmp_path, kind):
    """A copy still being written when the fault fires must not survive it by finishing after the
    listing (the CI run that resumed from a "lost" node's step 10): the save lands, then the damage."""
    monkeypatch.setenv(contract.INJECT_FAULT_ENV, f"{kind}@rank=1,step=11")
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: (_ for _ in ()).throw(_Killed()))
    calls = []
    landed = tmp_path / "step-10"

    def settle():
        calls.append("settle")
        landed.mkdir()
        (landed / "manifest.json").write_text("{}")
        (landed / "__0_0.distcp").write_bytes(bytes(256))

    def copies():
        calls.append("list")
        return [str(p) for p in sorted(tmp_path.iterdir(), reverse=True)]

    faults.maybe_damage_local(10, copies, settle)  # another step: nothing settles, nothing is listed
    assert calls == []
    with pytest.raises(_Killed):
        faults.maybe_damage_local(11, copies, settle)
    assert calls == ["settle", "list"]
    if kind == "lose_local":
        assert not landed.exists()
    else:
        data = (landed / "__0_0.distcp").read_bytes()
        assert len(data) == 256 and data[128:192] == b"\xa5" * 64
