"""EpochBatchSampler: the global order read in epochs; a cursor handed from 2 ranks to 3 continues
the same samples (none replayed, none skipped); len() is the same at every world size."""

from __future__ import annotations

from elastic_trainer.runtime.epochs import EpochBatchSampler


def _step(samplers) -> list[int]:
    """The global batch of one step: every rank's micro-batches, in rank order."""
    out = []
    for s in samplers:
        it = iter(s)
        for _ in range(s.per_step):
            out += next(it)
    return out


def test_two_then_three_ranks_read_the_same_global_order():
    n, g = 40, 6
    one = EpochBatchSampler(n, g, g, seed=3, rank=0, world_size=1)
    ref = []
    for _ in range(10):
        ref.append(_step([one]))
        one.advance()
    two = [EpochBatchSampler(n, g, 3, seed=3, rank=r, world_size=2) for r in range(2)]
    got = []
    for _ in range(4):
        got.append(_step(two))
        for s in two:
            s.advance()
    three = [EpochBatchSampler(n, g, 2, seed=3, rank=r, world_size=3) for r in range(3)]
    for s in three:
        s.load_state_dict(two[0].state_dict())
    for _ in range(6):
        got.append(_step(three))
        for s in three:
            s.advance()
    assert got == ref
    assert len(two[0]) == len(three[0]) == len(one) == n // g


def test_an_iteration_ends_at_the_epoch_end_and_offset_counts_the_steps_taken():
    s = EpochBatchSampler(20, 4, 2, seed=0, rank=0, world_size=1)  # 5 steps of 2 micro-batches per epoch
    assert len(list(iter(s))) == len(s) == 10
    for _ in range(3):
        s.advance()
    assert s.offset == 6 and len(list(iter(s))) == 4  # the rest of the epoch
    for _ in range(2):
        s.advance()
    assert s.offset == 0 and len(list(iter(s))) == 10  # the next epoch
