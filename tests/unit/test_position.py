"""The lineage position and the save plan (checkpoint/position.py): pure, table-tested."""

from __future__ import annotations

import pytest

from elastic_trainer.checkpoint.local_tier import CHAIN_MAX
from elastic_trainer.checkpoint.position import Position, plan_save

LOADED = Position(parent="step-00000010", seq=3, chain=("step-00000010",), taken=frozenset({"step-00000010"}))


def test_without_a_local_tier_every_save_goes_to_checkpoint_dir_and_extends_the_lineage():
    plan, after = plan_save(LOADED, 20)
    assert plan.name == "step-00000020" and not plan.local and not plan.skipped
    assert plan.remote_extra == {"parent": "step-00000010", "seq": 4}  # the parent it descends from
    assert after.parent == "step-00000020" and after.seq == 4
    assert after.chain == ("step-00000010", "step-00000020") and "step-00000020" in after.taken
    assert LOADED.parent == "step-00000010", "a position is a value: the plan never changes it"


def test_a_taken_name_is_never_reused():
    """A save of the same step after a failed or abandoned one goes into another directory."""
    plan, after = plan_save(LOADED, 10)
    assert plan.name != "step-00000010" and plan.name.startswith("step-00000010")
    again, _ = plan_save(after, 10)
    assert again.name not in after.taken


@pytest.mark.parametrize(
    "kw, remote",
    [
        ({}, False),  # the 1st of remote_every=3 since the last one there
        ({"durable": True}, True),  # the final step
        ({"force": True}, True),
        ({"blocking": True}, True),  # preemption
    ],
)
def test_with_a_local_tier_checkpoint_dir_gets_the_remote_every_th_or_a_durable_forced_blocking_save(kw, remote):
    plan, after = plan_save(LOADED, 11, remote_every=3, has_local=True, **kw)
    assert plan.local and (plan.name is not None) is remote
    assert after.saves_since_remote == (0 if remote else 1) and 11 in after.local_steps


def test_the_remote_every_th_save_goes_to_both_tiers_and_the_local_copy_records_its_lineage():
    position, names = LOADED, []
    for step in (11, 12, 13):
        plan, position = plan_save(position, step, remote_every=3, has_local=True)
        names.append(plan.name)
    assert names == [None, None, "step-00000013"]
    assert plan.local_extra == {
        "parent": "step-00000013",  # the remote save started beside it
        "seq": 4,
        "remote_chain": ["step-00000010", "step-00000013"],
        "lineage": "",
    }
    assert plan.remote_extra == {"parent": "step-00000010", "seq": 4}


def test_a_local_only_save_keeps_the_parent():
    plan, after = plan_save(LOADED, 11, remote_every=5, has_local=True)
    assert plan.name is None and plan.local_extra["parent"] == "step-00000010" and after.seq == LOADED.seq


@pytest.mark.parametrize(
    "position, kw, skipped",
    [
        (LOADED, {"committed": True}, "already committed"),
        (
            Position(local_steps=frozenset({11}), saves_since_remote=1),
            {"remote_every": 5, "has_local": True},
            "already in the local tier",
        ),
    ],
)
def test_a_save_with_nothing_to_do_is_skipped_and_leaves_the_position(position, kw, skipped):
    plan, after = plan_save(position, 11, **kw)
    assert plan.skipped == skipped and after is position


def test_a_forced_save_of_a_committed_step_saves_again():
    plan, _ = plan_save(LOADED, 10, committed=True, force=True)
    assert not plan.skipped and plan.name is not None


def test_the_chain_keeps_the_newest_names():
    position = Position()
    for step in range(CHAIN_MAX + 5):
        _, position = plan_save(position, step)
    assert len(position.chain) == CHAIN_MAX and position.chain[-1] == position.parent


def test_a_load_replaces_the_lineage_but_keeps_the_taken_names():
    _, after = plan_save(LOADED, 20, has_local=True)
    local = after.loaded("step-00000010", 3, chain=["step-00000010"], local_step=15)
    assert (local.parent, local.seq, local.chain, local.local_steps) == (
        "step-00000010",
        3,
        ("step-00000010",),
        frozenset({15}),
    )
    assert local.taken == after.taken
    remote = after.loaded("step-00000020", 4)
    assert remote.chain == ("step-00000020",) and not remote.local_steps
