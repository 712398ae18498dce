"""The anomaly guard's pure parts: the loss-spike test (every rank judges alike; a rollback
forgets what a replay gives again), the parameter fingerprint a replay compares (any one
flipped bit, any dtype), and which rank a difference names."""

from __future__ import annotations

import pytest
import torch

from elastic_trainer.runtime.anomaly import SpikeGuard, culprit, differences, fingerprint


def _fed(guard, losses):
    return [guard.judge(step, loss) for step, loss in enumerate(losses, start=1)]


def test_a_loss_above_the_factor_times_the_median_of_the_window_before_it_spikes():
    guard = SpikeGuard(3.0, 4)
    assert _fed(guard, [4.0, 4.0, 1.0, 5.0]) == [None] * 4, "not judged before the window is known"
    assert guard.threshold(5) == 3.0 * 4.0
    assert guard.judge(5, 12.5) == 12.0, "a spike: the threshold it exceeded"
    assert guard.judge(5, 11.9) is None, "the step redone below it is kept"
    assert guard.threshold(6) == 3.0 * 4.5


def test_a_spike_is_not_kept_and_a_rollback_forgets_the_steps_after_the_restored_one():
    guard = SpikeGuard(2.0, 2)
    _fed(guard, [1.0, 1.0, 1.0])
    assert guard.judge(4, 100.0) == 2.0 and guard.threshold(5) is None, "step 4's spike is not history"
    guard.rolled_back(2)
    assert guard.threshold(4) is None, "step 3 is the replay's to give again"
    assert guard.judge(3, 1.0) is None and guard.judge(4, 100.0) == 2.0, "the replay is judged as the run was"


def test_no_factor_no_spike_test():
    guard = SpikeGuard(0.0, 1)
    assert _fed(guard, [1.0, 1e9]) == [None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
@pytest.mark.parametrize("bit", [0, 7, 14])
def test_the_fingerprint_sees_any_one_flipped_bit(dtype, bit):
    model = torch.nn.Linear(8, 4).to(dtype)
    before = fingerprint(model)
    assert list(before) == ["weight", "bias"] and fingerprint(model) == before
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[model.bias.element_size()]
    with torch.no_grad():
        model.bias.view(ints)[2] ^= 1 << bit
    after = fingerprint(model)
    assert after["weight"] == before["weight"] and after["bias"] != before["bias"]
    assert differences(before, after)[0] == 1, "the index of the first differing parameter"
    assert differences(before, before) == (None, 0.0)


def test_the_score_is_how_far_the_largest_magnitude_moved_and_the_culprit_moved_most():
    a = {"w": (1, 2.0), "b": (5, 1.0)}
    assert differences({"w": (2, 8.0), "b": (5, 1.0)}, a) == (0, 3.0)
    rows = [[0.0, 0.0, 0.0], [1.0, 0.5, 1.0], [1.0, 3.0, 0.0], [1.0, 3.0, 1.0]]
    assert culprit(rows) == [2, 3, 1], "largest move first; ties to the lower rank"
    assert culprit([[0.0, 0.0, 0.0]]) == []


def test_the_step_guard_refuses_a_spike_like_a_non_finite_step_and_says_which(tmp_path):
    import contextlib
    import types

    from elastic_trainer.config import config_from_dict
    from elastic_trainer.events import EventLog
    from elastic_trainer.metrics.sink import NullSink
    from elastic_trainer.runtime.session import PreemptionFlag
    from elastic_trainer.runtime.step import StepContext, Votes

    guard = SpikeGuard(3.0, 3)
    hooks = types.SimpleNamespace(
        begin_step=lambda step, now: None,
        commit_visible=lambda step: False,
        inject_local_faults=lambda step: None,
        votes=lambda now: Votes(),
        agreed=lambda step, votes: None,
        before_optimizer_step=lambda: 0.0,
        judge_loss=guard.judge,
    )
    session = types.SimpleNamespace(
        cfg=config_from_dict({}),
        events=EventLog(str(tmp_path / "events.jsonl")),
        metrics=NullSink(),
        preempt=PreemptionFlag(),
        world_size=1,
        device=torch.device("cpu"),
        watchdog=lambda scope: contextlib.nullcontext(),
    )
    seen = []
    for step, loss in ((1, 1.0), (2, 1.0), (3, 1.0), (4, 3.5), (4, float("inf")), (4, 2.0)):
        with StepContext(session, step, checkpointer=types.SimpleNamespace(hooks=hooks)) as s:
            ok = s.check(torch.tensor(loss), torch.tensor(1.0))
        seen.append((ok, s.nonfinite, s.anomaly, s.spike_threshold))
    assert seen[:3] == [(True, False, None, None)] * 3
    assert seen[3] == (False, True, "loss spike", 3.0)
    assert seen[4] == (False, True, "non-finite", None)
    assert seen[5] == (True, False, None, None)
