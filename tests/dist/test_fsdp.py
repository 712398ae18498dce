"""FSDP2 is really applied, and initial weights are identical at every world size."""

import pytest
import torch

from .harness import run_ranks
from .workloads import sharding_facts


@pytest.fixture(scope="module")
def facts():
    return {w: run_ranks(sharding_facts, w) for w in (1, 2, 3)}


@pytest.mark.parametrize("world", [2, 3])
def test_parameters_are_dtensors_sharded_over_the_mesh(facts, world):
    per_rank = facts[world]
    assert all(r["all_dtensor"] for r in per_rank)
    total = per_rank[0]["total_bytes"]
    for r in per_rank:
        # Shard(0) splits rows: each rank holds about 1/world of every parameter.
        assert abs(r["local_bytes"] - total / world) <= 0.1 * total / world, (r["local_bytes"], total / world)
    assert sum(r["local_bytes"] for r in per_rank) == total


@pytest.mark.parametrize("world", [2, 3])
def test_initialisation_is_world_size_invariant(facts, world):
    ref = facts[1][0]["full"]
    got = facts[world][0]["full"]
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


@pytest.mark.parametrize("world", [1, 2])
def test_under_bf16_the_blocks_compute_in_bf16_and_a_plain_fp32_loss_backpropagates(facts, world):
    """``auto`` is bf16 on CUDA: the user's ``F.mse_loss(model(x), y)`` with fp32 targets must work
    there as on CPU (the root's outputs are fp32; a bf16 output fails that loss's backward)."""
    for got in (r["bf16"] for r in facts[world]):
        assert got["computed"] == ["torch.bfloat16"], "the sharded blocks compute in bf16"
        assert got["output"] == "torch.float32"
        assert got["grads"] and got["grad_dtype"] == {"torch.float32"}, "fp32 master gradients"
