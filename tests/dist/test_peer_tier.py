"""The peer tier through the real manager on gloo ranks: copies saved at world 3, loaded at world 2.

The own-copy local load is impossible at another world size; the peer tier assembles the newest
step from every source rank's copy (this node's disk, and a holder for the copies not on it),
merges the three ranks' metadata and reshards through DCP's planner: the state is bit for bit the
one saved. A byte of a held copy corrupted at the same size sends every rank to checkpoint.dir.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from elastic_trainer import contract
from tests.dist.harness import run_ranks
from tests.dist.test_local_tier import _mgr, _same, _train_and_save

pytestmark = pytest.mark.timeout(300)

KEY = "peer-tier-test-key"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("pt")
    root, local = str(base / "remote"), str(base / "local")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(contract.CHECKPOINT_KEY_ENV, KEY)
        out = run_ranks(_train_and_save, 3, root, local)
    return root, local, out[0]["states"], out[0]["committed"]


def _resume(rank, world, root, local, save_after=()):
    from elastic_trainer.checkpoint.state import TrainState
    from tests.dist.workloads import build, full_state

    cfg, _, model, opt, sched = build(world)
    ts = TrainState()
    mgr = _mgr(cfg, root, local, model, opt, sched, ts, rank, world)
    loaded = mgr.load()
    out = {"step": loaded.step, "tier": loaded.tier, "tiers": loaded.tiers, "train_step": ts.step}
    out["state"] = full_state(model, opt)  # a collective
    if rank != 0:
        out["state"] = None
    for step in save_after:  # local-only saves at this world size
        ts.step = step
        mgr.save(step)
        assert mgr.finish() is True
    mgr.close()
    return out


def _job_dir(root, local):
    from elastic_trainer.checkpoint.local_tier import job_key

    job = os.path.join(local, job_key(root))
    (epoch,) = os.listdir(job)
    return os.path.join(job, epoch)


def _hold_rank_2(root, local, holder) -> None:
    """Move source rank 2's copies from this node's disk into ``holder`` (as its replica would be)."""
    from elastic_trainer.storage.peer import Client

    c = Client(holder.address, holder.job, KEY.encode())
    base = _job_dir(root, local)
    for step in (4, 6):
        d = os.path.join(base, f"step-{step:08d}", "rank-2-of-3")
        with open(os.path.join(d, "manifest.json")) as f:
            manifest = json.load(f)
        for name in manifest["files"]:
            with open(os.path.join(d, name), "rb") as f:
                c.put(manifest["epoch"], step, 2, 3, name, f.read())
        listing = [[n, f["size"], f["xxh3"]] for n, f in manifest["files"].items()]
        c.seal(manifest["epoch"], step, 2, 3, listing, json.dumps(manifest).encode())
        shutil.rmtree(d)
    c.close()


def _copy(saved, tmp_path):
    from elastic_trainer.checkpoint.local_tier import job_key

    root, local, states, _ = saved
    shutil.copytree(root, tmp_path / "remote")
    shutil.copytree(os.path.join(local, job_key(root)), tmp_path / "local" / job_key(str(tmp_path / "remote")))
    return str(tmp_path / "remote"), str(tmp_path / "local"), states


@pytest.fixture
def holder(saved, tmp_path, monkeypatch):
    from elastic_trainer.checkpoint.local_tier import job_key
    from elastic_trainer.storage.peer import Holder

    root, local, states = _copy(saved, tmp_path)
    h = Holder(job_key(root), KEY.encode(), "127.0.0.1").start()
    _hold_rank_2(root, local, h)
    monkeypatch.setenv(contract.CHECKPOINT_KEY_ENV, KEY)
    monkeypatch.setenv(contract.PEER_HOLDER_ENV, h.address)
    yield root, local, states, h
    h.close()


def test_three_ranks_copies_on_this_node_load_at_world_2_bit_for_bit(saved, tmp_path, monkeypatch):
    root, local, states = _copy(saved, tmp_path)
    monkeypatch.setenv(contract.CHECKPOINT_KEY_ENV, KEY)
    out = run_ranks(_resume, 2, root, local, (8, 10))
    assert [(o["step"], o["tier"], o["tiers"], o["train_step"]) for o in out] == [(6, "peer", ["local"] * 2, 6)] * 2
    assert _same(out[0]["state"], states[6])
    # two saves at the new world size retire the old world size's copies
    base = _job_dir(root, local)
    held = sorted((s, r) for s in os.listdir(base) for r in os.listdir(os.path.join(base, s)))
    assert held == [(f"step-{s:08d}", f"rank-{r}-of-2") for s in (8, 10) for r in (0, 1)], held


def test_a_source_rank_held_by_a_peer_is_fetched_and_a_corrupted_byte_falls_back(holder):
    root, local, states, h = holder
    out = run_ranks(_resume, 2, root, local)
    assert [(o["step"], o["tier"]) for o in out] == [(6, "peer")] * 2
    assert "peer" in out[0]["tiers"] and set(out[0]["tiers"]) <= {"local", "peer"}
    assert _same(out[0]["state"], states[6])
    # the two ranks are one node: it asked the holder for its inventory once and fetched each
    # file once (both ranks read rank 2's .metadata for the merge)
    assert h.answered[("INVENTORY", "", 0)] == 1, h.answered
    gets = {k: n for k, n in h.answered.items() if k[0] == "GET"}
    assert ("GET", ".metadata", 0) in gets and set(gets.values()) == {1}, h.answered
    assert not [n for n in os.listdir(os.path.join(local, os.listdir(local)[0])) if n.startswith(".peer-load")]

    # the held copy of rank 2's shard, corrupted at the same size after it was sealed
    (key,) = [k for k in h._copies if k[1:] == (6, 2, 3)]
    name = next(n for n in h._copies[key].files if n.endswith(".distcp"))
    data = h._copies[key].files[name].data
    data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
    out = run_ranks(_resume, 2, root, local)
    assert [(o["step"], o["tier"]) for o in out] == [(4, "remote")] * 2
    assert _same(out[0]["state"], states[4])
    assert not any(k[1:] == (6, 2, 3) for k in h._copies), "the bad replica is dropped"


def _resume_on_node(rank, world, root, locals_, holders):
    """``_resume`` with rank r on node r: its ``checkpoint.local_dir`` ``locals_[r]``, its holder
    ``holders[r]``."""
    os.environ[contract.GROUP_RANK_ENV] = str(rank)
    os.environ[contract.PEER_HOLDER_ENV] = holders[rank]
    return _resume(rank, world, root, locals_[rank])


def test_each_holder_is_asked_for_its_inventory_once_and_each_metadata_is_read_once(holder):
    """Two nodes, each with its holder; rank 2's copies only in node 1's. Each node asks its own
    holder and the answers are gathered: every holder answers one inventory per load (two, one per
    node, when every node asked every holder), and node 0 still reads rank 2 from node 1's. Each
    source's .metadata is read by one rank and gathered (was: once per node)."""
    from elastic_trainer.checkpoint.local_tier import job_key
    from elastic_trainer.storage.peer import Holder

    root, local, states, held = holder
    other = local + "-node1"  # node 1's disk: the same copies of ranks 0 and 1
    shutil.copytree(local, other)
    mine = Holder(job_key(root), KEY.encode(), "127.0.0.1").start()
    try:
        out = run_ranks(_resume_on_node, 2, root, [local, other], [mine.address, held.address])
        asked = (mine.answered.copy(), held.answered.copy())
        # the holder does not serve rank 2's .metadata (a request that fails is no bad byte):
        # every rank loads checkpoint.dir and the replica is kept
        (key,) = [k for k in held._copies if k[1:] == (6, 2, 3)]
        files = held._copies[key].files
        kept = files.pop(".metadata")
        unserved = run_ranks(_resume_on_node, 2, root, [local, other], [mine.address, held.address])
        still_held = key in held._copies
        files[".metadata"] = kept
        # the held .metadata of rank 2 corrupted at the same size: the rank that reads it tells
        # the others, every rank loads checkpoint.dir, and the bad replica is dropped
        meta = files[".metadata"].data
        meta[:8] = bytes(b ^ 0xFF for b in meta[:8])
        fallback = run_ranks(_resume_on_node, 2, root, [local, other], [mine.address, held.address])
    finally:
        mine.close()
    assert [(o["step"], o["tier"], o["tiers"]) for o in out] == [(6, "peer", ["peer", "peer"])] * 2
    assert _same(out[0]["state"], states[6])
    assert asked[0][("INVENTORY", "", 0)] == 1 and asked[1][("INVENTORY", "", 0)] == 1, asked
    # rank 2's .metadata, which both nodes merge, was read from its holder once in the job
    assert asked[1][("GET", ".metadata", 0)] == 1, asked
    assert [(o["step"], o["tier"]) for o in unserved] == [(4, "remote")] * 2 and still_held
    assert [(o["step"], o["tier"]) for o in fallback] == [(4, "remote")] * 2
    assert _same(fallback[0]["state"], states[4])
    assert not any(k[1:] == (6, 2, 3) for k in held._copies), "the bad replica is dropped"


def test_a_step_some_source_rank_lacks_everywhere_is_not_loaded(saved, tmp_path, monkeypatch):
    root, local, states = _copy(saved, tmp_path)
    base = _job_dir(root, local)
    shutil.rmtree(os.path.join(base, "step-00000006", "rank-1-of-3"))
    monkeypatch.setenv(contract.CHECKPOINT_KEY_ENV, KEY)
    out = run_ranks(_resume, 2, root, local)
    assert [(o["step"], o["tier"]) for o in out] == [(4, "peer")] * 2
    assert _same(out[0]["state"], states[4])
    assert torch.is_tensor(next(iter(out[0]["state"]["model"].values())))
