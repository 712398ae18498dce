"""The data scheme: every step consumes exactly the same global samples at any world size."""

import numpy as np
import pytest
import torch

from elastic_trainer.errors import ConfigError
from elastic_trainer.runtime.sampler import GlobalOrder, micro_steps, rank_slice
from elastic_trainer.worker.data import IGNORE_INDEX, StepBatches
from elastic_trainer.worker.tokens import TokenFile


@pytest.mark.parametrize("g,w", [(g, w) for g in (1, 7, 10, 16, 33) for w in (1, 2, 3, 4, 5) if g >= w])
def test_rank_slices_partition_the_global_batch(g, w):
    covered = []
    for r in range(w):
        start, count = rank_slice(g, w, r)
        covered += list(range(start, start + count))
    assert covered == list(range(g))
    counts = [rank_slice(g, w, r)[1] for r in range(w)]
    assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize("g,w,mb,expected", [(16, 2, 4, 2), (10, 3, 2, 2), (10, 4, 2, 2), (10, 1, 2, 5), (9, 4, 4, 1)])
def test_micro_steps_same_on_every_rank(g, w, mb, expected):
    assert micro_steps(g, w, mb) == expected


@pytest.fixture
def token_path(tmp_path):
    p = tmp_path / "t.bin"
    np.arange(10_000, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(p)
    return str(p)


def test_global_order_is_a_seeded_permutation_per_epoch():
    a, b = GlobalOrder(50, seed=3), GlobalOrder(50, seed=3)
    first = [a[i] for i in range(50)]
    assert sorted(first) == list(range(50))
    assert first == [b[i] for i in range(50)]
    assert [a[i] for i in range(50, 100)] != first  # next epoch reshuffles
    assert first != [GlobalOrder(50, seed=4)[i] for i in range(50)]


def _at(batches: StepBatches, cursor: int) -> list:
    """The rank's micro-batches of the step that starts at global position ``cursor``."""
    return [batches.fetch(mb) for mb in batches.sampler.at(cursor)]


@pytest.mark.parametrize("w", [1, 2, 3, 4])
def test_step_samples_do_not_depend_on_world_size(token_path, w):
    src = TokenFile(token_path, "uint16", seq_len=16, vocab_size=256)
    reference = StepBatches(src, seed=1, global_batch=10, micro_batch=2, world=1, rank=0)
    ref_rows = torch.cat([mb.inputs for mb in _at(reference, 20)])
    rows, counts, n_micro = [], 0, set()
    for r in range(w):
        mbs = _at(StepBatches(src, seed=1, global_batch=10, micro_batch=2, world=w, rank=r), 20)
        n_micro.add(len(mbs))
        for mb in mbs:
            if mb.n_samples:
                rows.append(mb.inputs)
                counts += int((mb.targets != IGNORE_INDEX).sum())
            else:
                assert (mb.targets == IGNORE_INDEX).all(), "padding micro-batches carry no weight"
    assert len(n_micro) == 1, "every rank runs the same number of forward/backward passes"
    assert torch.equal(torch.cat(rows), ref_rows)
    assert counts == 10 * 16


def test_targets_are_inputs_shifted(token_path):
    src = TokenFile(token_path, "uint16", seq_len=8, vocab_size=256)
    x, y = src.sample(3)
    assert torch.equal(x[1:], y[:-1])


def test_token_file_errors(tmp_path, token_path):
    with pytest.raises(ConfigError) as e:
        TokenFile(str(tmp_path / "none.bin"), "uint16", 8, 256)
    assert e.value.key == "data.path"
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError) as e:
        TokenFile(str(odd), "uint16", 8, 256)
    assert e.value.key == "data.dtype"
    with pytest.raises(ConfigError) as e:
        TokenFile(token_path, "uint16", 8, vocab_size=100)
    assert e.value.key == "model.vocab_size"
    tiny = tmp_path / "tiny.bin"
    np.zeros(4, dtype=np.uint16).tofile(tiny)
    with pytest.raises(ConfigError, match="fewer than one sample"):
        TokenFile(str(tiny), "uint16", 8, 256)
