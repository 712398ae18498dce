"""The loop API (``ckpt.steps`` + ``ckpt.optimizer_step``) over a user's plain ``DataLoader``
(worker processes, its own ``collate_fn``) is world-size invariant: the same global batch, each
micro-batch's mean loss weighted by its share, padding micro-batches counting zero, gradient
accumulation handled by the loop (``batch`` is one batch of the loader's ``batch_size`` at every
world size), a backward pass of the user's own refused by name."""

from .harness import run_ranks
from .workloads import loop_api_losses


def test_the_same_losses_at_one_two_and_three_ranks_with_accumulation_and_padding(tmp_path):
    # 8 samples a rank: 4 micro-batches of 2 (accumulation)
    one = run_ranks(loop_api_losses, 1, str(tmp_path), 2, 1, daemon=False)[0]
    two = run_ranks(loop_api_losses, 2, str(tmp_path), 4, 1, daemon=False)  # 4 a rank: one micro-batch
    # 3/3/2 a rank: 2 micro-batches, one of them padding on rank 2
    three = run_ranks(loop_api_losses, 3, str(tmp_path), 2, 0, True)
    assert one["code"] == 0 and one["sizes"][0] == [2, 2, 2, 2]
    assert "remove loss.backward()" in one["refused"] and "remove loss.backward()" in three[0]["refused"]
    assert two[0]["sizes"][0] == [4] and three[2]["sizes"][0] == [2, 1], three[2]["sizes"][0]
    assert two[1]["losses"] == two[0]["losses"] and three[0]["losses"] == three[1]["losses"] == three[2]["losses"], (
        "every rank sees the global loss"
    )
    for a, b, c in zip(one["losses"], two[0]["losses"], three[0]["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a) and abs(a - c) <= 1e-5 * abs(a), (
            one["losses"],
            two[0]["losses"],
            three[0]["losses"],
        )
    # A loss summed over counted items (here samples), normalised by the step's global count: the
    # same losses (the padding micro-batch of rank 2 has real samples but counts none), the count
    # recorded as the step's tokens, every rank the same.
    assert three[0]["counted_code"] == 0 and three[0]["counted"] == three[2]["counted"]
    for a, c in zip(three[0]["losses"], three[0]["counted"], strict=True):
        assert abs(a - c) <= 1e-6 * abs(a), (three[0]["losses"], three[0]["counted"])
    assert three[0]["tokens_seen"] == 6 * 8 and three[0]["tokens"] == [True] * 6
