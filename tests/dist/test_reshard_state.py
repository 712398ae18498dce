"""DCP resharding restores the full training state exactly at another world size."""

import pytest
import torch

from .harness import run_ranks
from .workloads import load_and_continue, save_after_training


def _assert_states_equal(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            _assert_states_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_states_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("save_world, load_world, mode", [(4, 2, "sync"), (2, 3, "async")])
def test_reshard_restores_params_and_optimizer_state_exactly(tmp_path, save_world, load_world, mode):
    ckpt = str(tmp_path / "ckpt")
    saved = run_ranks(save_after_training, save_world, ckpt, mode)
    assert saved[0]["committed"]
    loaded = run_ranks(load_and_continue, load_world, ckpt)
    assert loaded[0]["step"] == 3 and loaded[0]["saved_world"] == save_world
    # Saving a committed step again (same incarnation, or the step just loaded) writes nothing.
    assert {r["save_again"] for r in saved} == {"already committed"} and {r["save_loaded"] for r in loaded} == {
        "already committed"
    }
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")) == ["step-00000003"]
    assert all(r["train"] == (3, 3 * 8 * 16, 24) for r in loaded)
    before, after = saved[0]["state"], loaded[0]["state"]
    _assert_states_equal(before["model"], after["model"], "model")
    _assert_states_equal(before["optim"]["state"], after["optim"]["state"], "optim")
    exp = before["optim"]["state"]
    assert all({"exp_avg", "exp_avg_sq", "step"} <= set(v) for v in exp.values())
    assert loaded[0]["lr"] == saved[0]["lr"], "the LR schedule position survives the reshard exactly"
    ref, got = saved[0]["next"], loaded[0]["next"]
    if save_world == load_world:
        assert ref == got, "same world size: bitwise"
    else:
        for a, b in zip(ref, got, strict=True):
            assert abs(a - b) <= 1e-5 * abs(a), (ref, got)
