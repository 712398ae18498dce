"""The step's all-reduce (runtime/step.py's Votes): the caller's sums first, then named flags."""

from __future__ import annotations

import torch

from elastic_trainer.checkpoint.agreement import SaveVotes
from elastic_trainer.runtime.step import Votes


def test_votes_travel_as_one_tensor_after_the_sums_and_come_back_named():
    mine = Votes(preempt=1.0, time_due=0.0, fenced=0.0, interval=50.0, save=SaveVotes(1.0, 0.0, 1.0))
    t = mine.to_tensor((7.0, 2.5), torch.device("cpu"))
    assert t.dtype == torch.float64 and t.tolist() == [7.0, 2.5, 1.0, 0.0, 0.0, 50.0, 1.0, 0.0, 1.0]
    other = Votes(time_due=1.0, save=SaveVotes(failed=1.0)).to_tensor((3.0, 0.5), torch.device("cpu"))
    sums, summed = Votes.from_tensor(t + other, 2)  # what the SUM all-reduce of two ranks gives
    assert sums == [10.0, 3.0]
    assert summed == Votes(preempt=1.0, time_due=1.0, fenced=0.0, interval=50.0, save=SaveVotes(1.0, 1.0, 1.0))


def test_no_sums():
    sums, votes = Votes.from_tensor(Votes().to_tensor((), torch.device("cpu")), 0)
    assert sums == [] and votes == Votes()
