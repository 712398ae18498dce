"""Checkpoint cadence from measurements (Young/Daly style): the interval, in steps, that
maximises the expected goodput. Pure; table-tested in tests/unit/test_cadence.py.

Model, per interval of ``n`` steps of ``step_seconds`` each, with failures arriving at rate
``failure_rate`` (per second of wall time):

* each save costs ``save_cost`` seconds of training (the stall plus the slowdown of the steps
  that overlap the asynchronous save);
* a failure costs ``restart_cost`` seconds (detection, rendezvous, start-up, load) plus the work
  since the last *committed* checkpoint: on average half an interval, plus ``commit_lag`` (a
  save commits that long after it starts).

Expected wasted fraction of the wall time::

    waste(n) = save_cost / (n * step_seconds + save_cost)
             + failure_rate * (restart_cost + (n * step_seconds + save_cost) / 2 + commit_lag)

:func:`optimal_interval` returns the ``n`` in ``[min_steps, max_steps]`` with the least waste;
for a small save cost it is Young's ``sqrt(2 * save_cost / failure_rate) / step_seconds``.
:func:`failure_rate` estimates the rate from the lineage with a prior (one failure per
``prior_mtbf_seconds``, weighted as that much observed time), so a fresh job starts from the
prior and a job that fails often moves towards what it observes.
"""

from __future__ import annotations

import math


def expected_waste(n: int, step_seconds: float, save_cost: float, restart_cost: float, failure_rate: float, commit_lag: float = 0.0) -> float:
    """Expected fraction of wall time lost with a save every ``n`` steps (see the module docstring)."""
    period = n * step_seconds + save_cost
    return save_cost / period + failure_rate * (restart_cost + period / 2 + commit_lag)


def optimal_interval(step_seconds: float, save_cost: float, restart_cost: float, failure_rate: float,
                     commit_lag: float = 0.0, min_steps: int = 1, max_steps: int = 100_000) -> int:
    """The interval in steps with the least expected waste. Deterministic: equal inputs give
    equal outputs on every rank."""
    if min_steps < 1 or max_steps < min_steps:
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
    if step_seconds <= 0:
        return min_steps
    if failure_rate <= 0:
        return max_steps
    # The waste is convex in the period: search around Young's optimum, clamped.
    young = math.sqrt(2 * max(save_cost, 1e-9) / failure_rate) / step_seconds
    lo = max(min_steps, int(young / 4))
    hi = min(max_steps, max(lo, int(young * 4) + 2))
    best = min(range(lo, hi + 1), key=lambda n: (expected_waste(n, step_seconds, save_cost, restart_cost, failure_rate, commit_lag), n))
    for edge in (min_steps, max_steps):  # the clamp can beat the window's ends
        if expected_waste(edge, step_seconds, save_cost, restart_cost, failure_rate, commit_lag) < expected_waste(best, step_seconds, save_cost, restart_cost, failure_rate, commit_lag):
            best = edge
    return best


def failure_rate(failures: int, observed_seconds: float, prior_mtbf_seconds: float) -> float:
    """Failures per second from a lineage's history and a prior of one failure per
    ``prior_mtbf_seconds`` (a Gamma prior worth that much observed time)."""
    if prior_mtbf_seconds <= 0:
        raise ValueError("prior_mtbf_seconds must be > 0")
    return (1.0 + max(0, failures)) / (prior_mtbf_seconds + max(0.0, observed_seconds))
