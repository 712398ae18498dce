"""Per-rank generator states and the recorded data view through a real DCP save/load (gloo).

Also the guard for :mod:`elastic_trainer.checkpoint.load_planner`, which relies on attributes of
torch's ``DefaultLoadPlanner``: if a torch release changes them, these tests fail."""

import pytest
import torch

from .harness import run_ranks

VIEW = [{"path": "/data/a.parquet", "size": 10, "id": "abc"}]


def _save(rank, world, ckpt):
    import torch.distributed.checkpoint as dcp

    from elastic_trainer.checkpoint.state import DataViewState, RNGState

    torch.manual_seed(100 + rank)
    torch.rand(3)
    dcp.save({"rng": RNGState(), "data": DataViewState(VIEW)}, checkpoint_id=ckpt)
    return torch.rand(5)  # what the rank draws next


def _load(rank, world, ckpt, as_world):
    import torch.distributed.checkpoint as dcp

    from elastic_trainer.checkpoint.load_planner import load_planner
    from elastic_trainer.checkpoint.state import DataViewState, RNGState

    torch.manual_seed(999)
    states = {"rng": RNGState(world_size=as_world), "data": DataViewState()}
    planner = load_planner(states)
    dcp.load(states, checkpoint_id=ckpt, planner=planner)
    return {
        "restored": states["rng"].restored,
        "next": torch.rand(5),
        "recorded": states["data"].recorded,
        "absent": planner.absent,
    }


def _load_strict_missing(rank, world, ckpt):
    import torch.distributed.checkpoint as dcp

    from elastic_trainer.checkpoint.load_planner import load_planner
    from elastic_trainer.checkpoint.state import RNGState, TrainState

    states = {"rng": RNGState(), "train": TrainState()}
    try:
        dcp.load(states, checkpoint_id=ckpt, planner=load_planner(states))
    except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        return f"{type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("rng") / "ckpt")
    return ckpt, run_ranks(_save, 2, ckpt)


def test_each_rank_gets_its_own_stream_back_at_the_same_world_size(saved):
    ckpt, expected = saved
    assert not torch.equal(expected[0], expected[1]), "ranks drew the same numbers: the test proves nothing"
    got = run_ranks(_load, 2, ckpt, 2)
    for rank in range(2):
        assert got[rank]["restored"] is True and got[rank]["absent"] == []
        assert torch.equal(got[rank]["next"], expected[rank]), f"rank {rank} did not get its own generator back"
        assert got[rank]["recorded"] == VIEW


def test_at_another_world_size_nothing_is_restored_and_the_rest_loads(saved):
    ckpt, _ = saved
    got = run_ranks(_load, 2, ckpt, 3)  # as if the run now had 3 ranks
    untouched = torch.rand(5, generator=torch.Generator().manual_seed(999))
    for rank in range(2):
        assert got[rank]["restored"] is False
        assert got[rank]["absent"] == [f"rng.rank{rank}_of_3.cpu"]
        assert torch.equal(got[rank]["next"], untouched), "the generator was touched"
        assert got[rank]["recorded"] == VIEW


def test_other_missing_keys_still_fail_the_load(saved):
    ckpt, _ = saved
    errors = run_ranks(_load_strict_missing, 2, ckpt)
    assert all(e and "train.step" in e for e in errors), errors


def test_reseed_is_a_function_of_seed_rank_and_step():
    from elastic_trainer.checkpoint.state import RNGState

    draws = {}
    for rank, step in [(0, 5), (1, 5), (0, 6), (0, 5)]:
        RNGState(rank=rank, world_size=3).reseed(7, step)
        draws.setdefault((rank, step), []).append(torch.rand(4))
    assert torch.equal(*draws[(0, 5)])
    assert not torch.equal(draws[(0, 5)][0], draws[(1, 5)][0])
    assert not torch.equal(draws[(0, 5)][0], draws[(0, 6)][0])


def test_the_recorded_data_view_is_read_without_a_process_group(saved, tmp_path):
    import torch.distributed.checkpoint as dcp

    from elastic_trainer.checkpoint.state import RNGState, read_data_view

    ckpt, _ = saved
    assert read_data_view(dcp.FileSystemReader(ckpt)) == VIEW
    dcp.save({"rng": RNGState(rank=0, world_size=1)}, checkpoint_id=str(tmp_path / "old"), no_dist=True)
    assert read_data_view(dcp.FileSystemReader(str(tmp_path / "old"))) is None  # written before views were recorded
