"""The local tier (checkpoint.local_dir) through the real manager on 2 gloo ranks.

Every save writes each rank's copy to the local tier; checkpoint.dir gets every remote_every-th.
A restart loads the newest step every rank can prove locally, bit for bit; a rank that lost its
copy, or holds one corrupted at the same size, sends *every* rank to checkpoint.dir (never a mix
of tiers), and the state is then exactly the remote commit's.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.timeout(300)


def _mgr(
    cfg, root, local, model, opt, sched, ts, rank, world, remote_every=2, launch_id="dist-local-tier", storage=None
):
    import torch.distributed as dist

    from elastic_trainer.checkpoint.manager import CheckpointManager
    from elastic_trainer.checkpoint.peer_tier import PeerNode
    from elastic_trainer.checkpoint.state import ModelState, OptimizerState, RNGState, SchedulerState
    from elastic_trainer.storage.fs import open_storage

    ccfg = dataclasses.replace(cfg.checkpoint, dir=root, mode="async", local_dir=local, remote_every=remote_every)
    states = {
        "model": ModelState(model),
        "optim": OptimizerState(model, opt),
        "lr_scheduler": SchedulerState(sched),
        "train": ts,
        "rng": RNGState(),
    }
    return CheckpointManager(
        ccfg,
        storage or open_storage(root),
        states,
        rank=rank,
        world_size=world,
        mesh_shape=[world],
        group=dist.new_group(backend="gloo"),
        fingerprint=cfg.model_fingerprint(),
        launch_id=launch_id,
        peer_node=PeerNode.from_environ(os.environ),  # this rank's node and holder, as a worker reads them
    )


def _train_and_save(rank, world, root, local):
    """Steps 1..6, a save after every 2nd step (remote_every=2: local 2, 4+remote, 6); returns
    the full state at each saved step and which steps checkpoint.dir committed."""
    from elastic_trainer.checkpoint.state import TrainState
    from tests.dist.workloads import _train_steps, build, full_state

    cfg, _, model, opt, sched = build(world)
    ts = TrainState()
    mgr = _mgr(cfg, root, local, model, opt, sched, ts, rank, world)
    assert mgr.load() is None
    states, remote = {}, []
    for step in (2, 4, 6):
        _train_steps(model, opt, sched, cfg, 2, rank, world, start=step - 2)
        ts.step = step
        remote.append(mgr.save(step).remote)  # what the cadence is told: this save goes to checkpoint.dir
        mgr.wait_for_staging()
        # full_state may alias live tensors (the optimizer's scalar 'step'): a deep copy
        states[step] = torch.utils._pytree.tree_map(
            lambda x: x.clone() if isinstance(x, torch.Tensor) else x, full_state(model, opt)
        )
        assert mgr.finish() is True
    committed = mgr.last_committed_step
    mgr.close()
    return {"states": states if rank == 0 else None, "committed": committed, "remote": remote}


def _damage(rank, world, root, local, step, how, on_rank):
    from elastic_trainer.checkpoint.local_tier import job_key

    if rank != on_rank:
        return
    job = os.path.join(local, job_key(root))
    (epoch,) = os.listdir(job)
    d = os.path.join(job, epoch, f"step-{step:08d}", f"rank-{rank}-of-{world}")
    if how == "lose":
        import shutil

        shutil.rmtree(d)
    else:
        shard = next(n for n in os.listdir(d) if n.endswith(".distcp"))
        p = os.path.join(d, shard)
        with open(p, "r+b") as f:
            f.seek(os.path.getsize(p) // 2)
            f.write(b"\xa5" * 64)


def _resume(rank, world, root, local, damage, preempt=False, launch_id="dist-local-tier"):
    """A fresh model and manager (a restart of the same launch): what load() chose, and the state."""
    import torch.distributed as dist

    from elastic_trainer.checkpoint.state import TrainState
    from tests.dist.workloads import build, full_state

    for step, how, on_rank in damage:
        _damage(rank, world, root, local, step, how, on_rank)
    dist.barrier()
    cfg, _, model, opt, sched = build(world)
    ts = TrainState()
    storage, reads = _counting(root)
    mgr = _mgr(cfg, root, local, model, opt, sched, ts, rank, world, launch_id=launch_id, storage=storage)
    loaded = mgr.load()
    state = full_state(model, opt)  # a collective
    out = {
        "step": loaded.step,
        "tier": loaded.tier,
        "train_step": ts.step,
        "state": state if rank == 0 else None,
        "committed_now": mgr.is_committed(loaded.step),
        "reads": sorted(reads),  # objects of checkpoint.dir the load read (listings are not reads)
    }
    if preempt:  # what preempt_exit does when the loaded step is not committed in checkpoint.dir
        mgr.save(loaded.step, force=True)
        out["preempt_commit"] = mgr.settle(None) and mgr.verdicts.committed_everywhere(loaded.step)
    mgr.close()
    return out


def _counting(root):
    """A storage of ``root`` that records every object read through it (manifests, records,
    DCP's files), relative to the root."""
    from elastic_trainer.storage.fs import open_storage

    storage, reads = open_storage(root), []
    read_bytes, dcp_reader = storage.read_bytes, storage.dcp.reader

    def counted(path):
        reads.append(os.path.relpath(path, root))
        return read_bytes(path)

    def reader(path):
        r = dcp_reader(path)
        create = r.fs.create_stream

        def stream(p, mode):
            reads.append(os.path.relpath(str(p), root))
            return create(p, mode)

        r.fs.create_stream = stream
        return r

    storage.read_bytes, storage.dcp.reader = counted, reader
    return storage, reads


def _same(a: dict, b: dict) -> bool:
    fa, fb = torch.utils._pytree.tree_flatten(a)[0], torch.utils._pytree.tree_flatten(b)[0]
    return len(fa) == len(fb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(fa, fb, strict=True)
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("lt")
    root, local = str(base / "remote"), str(base / "local")
    out = run_ranks(_train_and_save, 2, root, local)
    assert [o["remote"] for o in out] == [[False, True, False]] * 2
    return root, local, out[0]["states"], out[0]["committed"]


def _copy(saved, tmp_path):
    import shutil

    from elastic_trainer.checkpoint.local_tier import job_key

    root, local, states, committed = saved
    shutil.copytree(root, tmp_path / "remote")
    # a job is named by its root
    shutil.copytree(os.path.join(local, job_key(root)), tmp_path / "local" / job_key(str(tmp_path / "remote")))
    return str(tmp_path / "remote"), str(tmp_path / "local"), states


def test_every_save_is_local_and_every_second_reaches_checkpoint_dir(saved):
    root, local, _, committed = saved
    assert committed == 4
    assert sorted(d for d in os.listdir(root) if d.startswith("step-")) == ["step-00000004"]
    (epoch,) = os.listdir(os.path.join(local, os.listdir(local)[0]))
    names = sorted(os.listdir(os.path.join(local, os.listdir(local)[0], epoch)))
    steps = [n for n in names if n.startswith("step-")]
    assert steps == ["step-00000004", "step-00000006"]  # retention: the newest two per rank
    # the retired copy of step 2 is each rank's spare: uncommitted, its data file kept for reuse
    spares = [n for n in names if not n.startswith("step-")]
    assert spares == [".spare-rank-0-of-2", ".spare-rank-1-of-2"], names
    for n in spares:
        held = os.listdir(os.path.join(local, os.listdir(local)[0], epoch, n))
        assert "__0_0.distcp" in held and "manifest.json" not in held, held
    for s in steps:
        for r in (0, 1):
            assert os.path.exists(
                os.path.join(local, os.listdir(local)[0], epoch, s, f"rank-{r}-of-2", "manifest.json")
            )


def test_restart_loads_the_newest_local_step_bit_for_bit(saved, tmp_path):
    root, local, states = _copy(saved, tmp_path)
    out = run_ranks(_resume, 2, root, local, [], True)
    assert [(o["step"], o["tier"], o["train_step"]) for o in out] == [(6, "local", 6)] * 2
    assert _same(out[0]["state"], states[6])
    # its copies descend from the newest commit (step 4): decided from the listing, nothing read there
    assert [o["reads"] for o in out] == [[], []]
    # a local load is not a commit in checkpoint.dir: a preemption save writes it there
    assert not out[0]["committed_now"]
    assert [o["preempt_commit"] for o in out] == [True, True]
    assert "step-00000006" in os.listdir(root) and os.path.exists(os.path.join(root, "step-00000006", "manifest.json"))


def test_a_rank_that_lost_its_newest_copy_moves_everyone_to_the_step_all_have(saved, tmp_path):
    root, local, states = _copy(saved, tmp_path)
    out = run_ranks(_resume, 2, root, local, [(6, "lose", 1)])
    assert [(o["step"], o["tier"]) for o in out] == [(4, "local")] * 2
    assert _same(out[0]["state"], states[4])


def test_a_lost_node_sends_every_rank_to_checkpoint_dir(saved, tmp_path):
    root, local, states = _copy(saved, tmp_path)
    out = run_ranks(_resume, 2, root, local, [(6, "lose", 1), (4, "lose", 1)])
    assert [(o["step"], o["tier"]) for o in out] == [(4, "remote")] * 2
    assert _same(out[0]["state"], states[4])
    assert out[0]["committed_now"]


def test_a_copy_corrupted_at_the_same_size_sends_every_rank_to_checkpoint_dir(saved, tmp_path):
    root, local, states = _copy(saved, tmp_path)
    out = run_ranks(_resume, 2, root, local, [(6, "corrupt", 1)])
    # Rank 0 loaded its (good) copy of 6 before rank 1's failed: both reload from checkpoint.dir.
    assert [(o["step"], o["tier"]) for o in out] == [(4, "remote")] * 2
    assert _same(out[0]["state"], states[4])
    # The corrupted copy is dropped: the next restart does not try it again (takes local 4, newest common).
    again = run_ranks(_resume, 2, root, local, [])
    assert [(o["step"], o["tier"]) for o in again] == [(4, "local")] * 2


def test_a_new_launch_never_uses_an_older_launchs_copies(saved, tmp_path):
    """Another launch (a new epoch of the root) resumes from checkpoint.dir, even though the older
    launch's newer copies are intact, and removes them."""
    from elastic_trainer.checkpoint.local_tier import job_key

    root, local, states = _copy(saved, tmp_path)
    out = run_ranks(_resume, 2, root, local, [], False, "a-later-launch")
    assert [(o["step"], o["tier"]) for o in out] == [(4, "remote")] * 2
    assert _same(out[0]["state"], states[4])
    job = os.path.join(local, job_key(root))
    assert not any(os.listdir(os.path.join(job, e)) for e in os.listdir(job)), "the older launch's copies are purged"
