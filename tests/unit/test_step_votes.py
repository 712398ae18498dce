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


def test_the_samples_metric_counts_what_the_step_s_data_counted_not_the_configured_batch(tmp_path):
    """A front end whose sampler's global batch is not ``train.global_batch_size`` (Accelerate's
    loader, a first launch's batch) records it; the counter counts it and the event stays as it is."""
    import contextlib
    import types

    from elastic_trainer.config import config_from_dict
    from elastic_trainer.events import EventLog, read_events
    from elastic_trainer.runtime.session import PreemptionFlag
    from elastic_trainer.runtime.step import StepContext

    counted: dict[str, float] = {}
    metrics = types.SimpleNamespace(
        counter=lambda name, value=1.0: counted.__setitem__(name, counted.get(name, 0.0) + value),
        gauge=lambda *a: None,
        histogram=lambda *a: None,
    )
    session = types.SimpleNamespace(
        cfg=config_from_dict({"train": {"global_batch_size": 16}}),
        events=EventLog(str(tmp_path / "events.jsonl")),
        metrics=metrics,
        preempt=PreemptionFlag(),
        world_size=1,
        device=torch.device("cpu"),
        watchdog=lambda scope: contextlib.nullcontext(),
    )
    for step, samples in ((1, 24), (2, None)):
        with StepContext(session, step) as s:
            assert s.check(torch.tensor(1.0))
            if samples is not None:
                s.record(samples=samples)
    assert counted["elastic_trainer_train_samples_total"] == 24 + 16, "recorded, else the configured batch"
    assert all("samples" not in e for e in read_events(str(tmp_path / "events.jsonl")))
