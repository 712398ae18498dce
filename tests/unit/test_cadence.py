"""The checkpoint cadence decision (pure)."""
from __future__ import annotations

import math

import pytest

from elastic_trainer.checkpoint import cadence


@pytest.mark.parametrize(
    "step_s,save_cost,restart,rate,expect",
    [
        # Young: sqrt(2 * 2 s / (1/300 s)) = 34.6 s -> ~35 steps of 1 s (minus the save cost: Daly).
        (1.0, 2.0, 10.0, 1 / 300, range(32, 36)),
        # Failures 5x more often -> interval ~sqrt(5) shorter.
        (1.0, 2.0, 10.0, 1 / 60, range(13, 17)),
        # A cheap save -> save often.
        (1.0, 0.05, 10.0, 1 / 300, range(4, 7)),
        # No failures: never save in the window (the clamp).
        (1.0, 2.0, 10.0, 0.0, range(100_000, 100_001)),
    ],
)
def test_optimal_interval_table(step_s, save_cost, restart, rate, expect):
    n = cadence.optimal_interval(step_s, save_cost, restart, rate)
    assert n in expect, n
    best = min(range(1, 2000), key=lambda k: cadence.expected_waste(k, step_s, save_cost, restart, rate)) if rate else n
    assert n == best, "the window search finds the global optimum"


def test_interval_moves_the_right_way_and_respects_bounds():
    a = cadence.optimal_interval(0.5, 1.0, 5.0, 1 / 60)
    b = cadence.optimal_interval(0.5, 1.0, 5.0, 1 / 300)
    assert a < b, "more failures -> shorter interval"
    assert cadence.optimal_interval(0.5, 4.0, 5.0, 1 / 60) > a, "costlier saves -> longer interval"
    assert cadence.optimal_interval(0.5, 1.0, 5.0, 1 / 60, min_steps=50, max_steps=60) == 50
    assert cadence.optimal_interval(0.5, 1.0, 5.0, 1 / 60, commit_lag=3.0) == a, "commit lag costs per failure, not per interval"
    with pytest.raises(ValueError):
        cadence.optimal_interval(1.0, 1.0, 1.0, 0.1, min_steps=0)


def test_failure_rate_prior_and_observations():
    assert cadence.failure_rate(0, 0.0, 3600) == pytest.approx(1 / 3600)
    assert cadence.failure_rate(10, 600.0, 3600) == pytest.approx(11 / 4200)
    assert cadence.failure_rate(10, 36_000.0, 3600) == pytest.approx(11 / 39_600)
    assert math.isclose(cadence.failure_rate(0, 36_000.0, 3600), 1 / 39_600)
