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


def test_parse_reads_a_bitflip():
    (flip,) = faults.parse("bitflip@rank=1,step=13")
    assert (flip.kind, flip.rank, flip.step, flip.restart) == ("bitflip", 1, 13, 0)


class _Sharded:
    """A parameter as FSDP2 holds it: a DTensor whose local shard is what this rank owns."""

    def __init__(self, local):
        self.local = local

    def to_local(self):
        return self.local


def test_a_bitflip_changes_one_low_bit_of_the_first_float_shard_of_its_rank_once(monkeypatch, rank1):
    import torch

    monkeypatch.setenv(contract.INJECT_FAULT_ENV, "bitflip@rank=1,step=13")
    monkeypatch.setattr(faults, "_FIRED", set())
    empty, ints = _Sharded(torch.zeros(0)), torch.arange(4)
    weight = torch.full((3, 2), 0.25)
    params = [("empty", empty), ("ints", ints), ("w", _Sharded(weight)), ("b", torch.ones(2))]
    assert faults.maybe_flip_bit(12, params) is None and bool((weight == 0.25).all())
    assert faults.maybe_flip_bit(13, params) == "w"
    changed = (weight != 0.25).nonzero().tolist()
    assert changed == [[0, 0]], "one element"
    x = float(weight[0, 0])
    assert x != 0.25 and abs(x - 0.25) / 0.25 < 1e-3, "finite, and close: a low mantissa bit"
    flipped = weight.view(-1)[:1].view(torch.int32) ^ torch.tensor([0.25]).view(torch.int32)
    assert bin(int(flipped)).count("1") == 1, "exactly one bit"
    assert faults.maybe_flip_bit(13, params) is None, "once per process (a rollback redoes the step clean)"
    monkeypatch.setattr(faults, "_FIRED", set())
    monkeypatch.setenv(contract.RANK_ENV, "0")
    assert faults.maybe_flip_bit(13, params) is None, "another rank"


def test_a_bitflip_can_name_its_bit_and_parameter(monkeypatch, rank1):
    import torch

    monkeypatch.setenv(contract.INJECT_FAULT_ENV, "bitflip@rank=1,step=13,bit=30,param=qkv")
    monkeypatch.setattr(faults, "_FIRED", set())
    first, qkv = torch.full((2,), 0.25), torch.full((2,), 0.25)
    assert faults.maybe_flip_bit(13, [("emb.weight", first), ("attn.qkv.weight", qkv)]) == "attn.qkv.weight"
    assert bool((first == 0.25).all())
    assert float(qkv[0]) == 0.25 * 2.0**128 and float(qkv[1]) == 0.25, "the top exponent bit: a large flip"
    monkeypatch.setenv(contract.INJECT_FAULT_ENV, "bitflip@rank=1,step=14,bit=31")
    sign = torch.full((1,), 0.5)
    assert faults.maybe_flip_bit(14, [("w", sign)]) == "w" and float(sign[0]) == -0.5, "the sign bit"
    with pytest.raises(ValueError, match="bit=64"):
        faults.parse("bitflip@rank=1,step=1,bit=64")
