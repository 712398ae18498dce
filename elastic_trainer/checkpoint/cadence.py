"""When to save: :class:`Cadence`, the one policy (fixed steps, seconds, ``auto``, the final
step, an early stop or preemption), and for ``auto`` the interval from measurements (Young/Daly
style): the interval, in steps, that maximises the expected goodput. The interval math is pure;
all of it is table-tested in tests/unit/test_cadence.py.

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

import logging
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..config import CheckpointConfig
from ..events import EventLog, read_events
from ..goodput import Ledger
from ..metrics.sink import MetricsSink, NullSink

logger = logging.getLogger(__name__)


def expected_waste(
    n: int, step_seconds: float, save_cost: float, restart_cost: float, failure_rate: float, commit_lag: float = 0.0
) -> float:
    """Expected fraction of wall time lost with a save every ``n`` steps (see the module docstring)."""
    period = n * step_seconds + save_cost
    return save_cost / period + failure_rate * (restart_cost + period / 2 + commit_lag)


def optimal_interval(
    step_seconds: float,
    save_cost: float,
    restart_cost: float,
    failure_rate: float,
    commit_lag: float = 0.0,
    min_steps: int = 1,
    max_steps: int = 100_000,
) -> int:
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
    best = min(
        range(lo, hi + 1),
        key=lambda n: (expected_waste(n, step_seconds, save_cost, restart_cost, failure_rate, commit_lag), n),
    )
    for edge in (min_steps, max_steps):  # the clamp can beat the window's ends
        if expected_waste(edge, step_seconds, save_cost, restart_cost, failure_rate, commit_lag) < expected_waste(
            best, step_seconds, save_cost, restart_cost, failure_rate, commit_lag
        ):
            best = edge
    return best


def failure_rate(
    failures: int, observed_seconds: float, prior_mtbf_seconds: float, prior_weight_seconds: float | None = None
) -> float:
    """Failures per second from a lineage's history and a prior of one failure per
    ``prior_mtbf_seconds``: a Gamma prior worth ``prior_weight_seconds`` of observed time
    (default: ``prior_mtbf_seconds``, i.e. one pseudo-failure). A lighter prior follows what the
    job observes sooner."""
    if prior_mtbf_seconds <= 0:
        raise ValueError("prior_mtbf_seconds must be > 0")
    weight = prior_mtbf_seconds if prior_weight_seconds is None else prior_weight_seconds
    if weight <= 0:
        raise ValueError("prior_weight_seconds must be > 0")
    return (weight / prior_mtbf_seconds + max(0, failures)) / (weight + max(0.0, observed_seconds))


# --- interval_steps = "auto": lineage, re-evaluation and agreement -----------------------------

INITIAL_STEPS = 10  # the interval until a save has been measured (in this incarnation or the lineage)
CHANGE_MARGIN = 0.02  # switch only when the current interval wastes 2 % more than the best one
WARMUP_ITERATIONS = 3  # the first iterations of an incarnation are not a step-time measurement
# The first measured save of an incarnation is not a measurement either: it pays what later saves
# do not (the staging buffer's allocation, DCP's plan): ~0.12 s against ~0.02 s for the demo's
# in-memory copy, which sent the interval to ~170 steps before a second save could correct it.
WARMUP_SAVES = 1
COST_WINDOWS = 8  # the save cost is the mean of this many recent saves' measured excess
MAX_STEP_DOWN = 2  # one measurement shortens the interval at most this many times (a lineage re-read may more)
INTERRUPTED_BY_FAILURE = ("worker_failure", "membership_change")
LINEAGE_TAIL_BYTES = 8 << 20  # the lineage is read from the log's last 8 MiB (~40,000 records): rank 0
# parses it at every (re)start before the first step, so a week-long log must not make restarts slower


@dataclass(frozen=True)
class Lineage:
    """What this job's event log says, read once by rank 0 at start (:func:`lineage_from_events`)."""

    failures: int = 0  # restarts that lost work (worker failure, node loss or join)
    observed_seconds: float = 0.0  # first to last record
    restart_cost: float | None = None  # mean seconds from the last step before a failure to the next step
    step_seconds: float | None = None  # the last recorded cadence measurement (checkpoint_interval_changed)
    save_cost: float | None = None
    commit_lag: float | None = None


def lineage_from_events(events: Iterable[dict[str, Any]]) -> Lineage:
    """The failure count, observed time, restart cost and last cadence measurement of a log. Pure."""
    ledger = Ledger()
    failures = 0
    last: dict[str, Any] | None = None
    first_t: float | None = None
    last_t: float | None = None
    for e in events:
        ledger.feed(e)
        t = e.get("time")
        if isinstance(t, (int, float)):
            first_t = t if first_t is None else first_t
            last_t = t
        ev = e.get("event")
        if ev == "restart" and e.get("reason") in INTERRUPTED_BY_FAILURE:
            failures += 1
        elif (
            ev == "checkpoint_interval_changed"
            and e.get("save_cost_s") is not None
            and e.get("step_seconds") is not None
        ):
            last = e
    costs = [i.seconds for i in ledger.result().interruptions if i.reason in INTERRUPTED_BY_FAILURE]
    return Lineage(
        failures=failures,
        observed_seconds=float(last_t - first_t) if first_t is not None and last_t is not None else 0.0,
        restart_cost=statistics.mean(costs) if costs else None,
        step_seconds=float(last["step_seconds"]) if last else None,
        save_cost=float(last["save_cost_s"]) if last else None,
        commit_lag=float(last.get("commit_lag_s") or 0.0) if last else None,
    )


def next_interval(
    current: int | None,
    step_seconds: float,
    save_cost: float,
    restart_cost: float,
    failure_rate: float,
    commit_lag: float,
    min_steps: int,
    max_steps: int,
) -> int:
    """The interval to use from now: the optimum, unless ``current`` (clamped) wastes at most
    :data:`CHANGE_MARGIN` more (so noise in the measurements does not flip it every save). Pure."""
    best = optimal_interval(step_seconds, save_cost, restart_cost, failure_rate, commit_lag, min_steps, max_steps)
    if current is None or not (min_steps <= current <= max_steps):
        return best
    w_cur = expected_waste(current, step_seconds, save_cost, restart_cost, failure_rate, commit_lag)
    w_best = expected_waste(best, step_seconds, save_cost, restart_cost, failure_rate, commit_lag)
    return current if w_cur <= w_best * (1 + CHANGE_MARGIN) else best


@dataclass(frozen=True)
class IntervalChange:
    """An agreed change of the interval (every rank); ``basis`` is rank 0's measurement behind it."""

    interval_steps: int
    previous: int | None
    basis: dict[str, Any]


class AutoCadence:
    """ "Save at this step?" for ``checkpoint.interval_steps = "auto"``.

    Rank 0 measures (:meth:`observe`: the wall time of each loop iteration, and which of them
    overlap a save) and proposes an interval (:meth:`vote`); the proposal rides on the step's
    all-reduce, where the other ranks add 0, so every rank receives rank 0's value exactly and
    adopts it (:meth:`agree`). :meth:`due` and :meth:`saved` use only agreed values, so all ranks
    save at the same steps. Not thread-safe; main thread only.

    Save cost = the wall time of the iterations from a save's start until this rank's part of it
    is written, minus as many median step times (the stall plus the slowdown of the overlapped
    steps), averaged over the last :data:`COST_WINDOWS` saves with its sign (a save whose
    window happened to run fast counts negative, so step-time noise cancels instead of pulling
    the estimate to zero); commit lag = that window's length. One measurement shortens the
    interval at most :data:`MAX_STEP_DOWN` times. A save started with ``measured=False`` (with a
    local tier: one that also goes to checkpoint.dir, whose cadence ``remote_every`` sets) is
    no measurement of the interval's save, nor are the first :data:`WARMUP_SAVES` of an
    incarnation: their windows count as neither a step nor a save cost."""

    def __init__(
        self,
        *,
        rank: int,
        start_step: int,
        lineage: Lineage,
        prior_mtbf_seconds: float,
        prior_weight_seconds: float,
        min_steps: int,
        max_steps: int,
        now: float,
    ) -> None:
        self.rank = rank
        self.lineage = lineage
        self.prior_mtbf, self.prior_weight = prior_mtbf_seconds, prior_weight_seconds
        self.min_steps, self.max_steps = min_steps, max_steps
        self.t0 = now
        self.interval: int | None = None  # agreed
        self.last_saved = start_step  # agreed
        self._steps: deque[float] = deque(maxlen=32)
        self._costs: deque[float] = deque(maxlen=COST_WINDOWS)
        self._lag = lineage.commit_lag or 0.0
        self._window: list[float] | None = None
        self._window_measured = True  # the open window's save measures the interval's cost
        self._warmup_saves = WARMUP_SAVES
        self._iterations = 0
        self._proposal = min(max(INITIAL_STEPS, min_steps), max_steps)
        self.basis: dict[str, Any] = {
            "reason": "initial",
            "restart_cost_s": _round(lineage.restart_cost, 3),
            "failure_rate_per_h": round(self.rate(now) * 3600, 4),
            "failures": lineage.failures,
        }
        if lineage.step_seconds is not None and lineage.save_cost is not None:
            self._steps.append(lineage.step_seconds)
            self._costs.append(lineage.save_cost)
            self._evaluate(now, "lineage")

    # -- agreed (every rank) --------------------------------------------------------------------
    def vote(self) -> float:
        """This rank's element of the step's all-reduce (SUM): rank 0's proposal, 0 elsewhere."""
        return float(self._proposal) if self.rank == 0 else 0.0

    def agree(self, summed: float) -> IntervalChange | None:
        """Adopt the all-reduced vote; the change when it differs from the interval in force."""
        new = int(round(summed))
        if new < 1 or new == self.interval:
            return None
        previous, self.interval = self.interval, new
        return IntervalChange(new, previous, dict(self.basis) if self.rank == 0 else {})

    def due(self, step: int) -> bool:
        """Whether the interval has elapsed at the end of ``step`` (agreed inputs only)."""
        return self.interval is not None and step - self.last_saved >= self.interval

    def saved(self, step: int) -> None:
        self.last_saved = step

    # -- measured (rank 0) ----------------------------------------------------------------------
    def observe(
        self, seconds: float, save_started: bool, save_in_progress: bool, now: float, measured: bool = True
    ) -> bool:
        """One loop iteration took ``seconds`` (wall); it started a save (``measured``: one whose
        cost is the interval's, see the class) / a save is still being written at its end.
        Returns True when the proposal was re-evaluated."""
        self._iterations += 1
        evaluated = False
        if self._window is not None:
            if not save_started:
                self._window.append(seconds)
                return self._close_window(now) if not save_in_progress else False
            evaluated = self._close_window(now)  # a new save began before the last one was written
        if save_started:
            if measured and self._warmup_saves > 0:
                self._warmup_saves, measured = self._warmup_saves - 1, False
            self._window, self._window_measured = [seconds], measured
            if not save_in_progress:
                evaluated = self._close_window(now) or evaluated
        elif self._iterations > WARMUP_ITERATIONS:
            self._steps.append(seconds)
        return evaluated

    def _close_window(self, now: float) -> bool:
        window, self._window = self._window or [], None
        if not self._steps or not self._window_measured:
            return False
        step = statistics.median(self._steps)
        self._costs.append(sum(window) - len(window) * step)  # signed: noise cancels in the mean
        self._lag = sum(window)
        self._evaluate(now, "measured")
        return True

    def rate(self, now: float) -> float:
        observed = self.lineage.observed_seconds + max(0.0, now - self.t0)
        return failure_rate(self.lineage.failures, observed, self.prior_mtbf, self.prior_weight)

    def _evaluate(self, now: float, reason: str) -> None:
        step = statistics.median(self._steps)
        cost = max(0.0, statistics.fmean(self._costs))
        rate = self.rate(now)
        restart = self.lineage.restart_cost or 0.0
        current = self.interval if self.interval is not None else None
        proposal = next_interval(current, step, cost, restart, rate, self._lag, self.min_steps, self.max_steps)
        if reason == "measured" and current is not None:
            # A few saves that happened to look free (their excess is step-time noise) must not
            # send the job to a save every step: one measurement at most halves the interval.
            proposal = max(proposal, -(-current // MAX_STEP_DOWN))  # ceil(current / MAX_STEP_DOWN)
        self._proposal = proposal
        self.basis = {
            "reason": reason,
            "step_seconds": round(step, 6),
            "save_cost_s": round(cost, 6),
            "commit_lag_s": round(self._lag, 6),
            "restart_cost_s": _round(self.lineage.restart_cost, 3),
            "failure_rate_per_h": round(rate * 3600, 4),
            "failures": self.lineage.failures,
        }


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


class Cadence:
    """When to save: the one policy for a fixed step interval (``checkpoint.interval_steps``), a
    time interval (``interval_seconds``), ``auto`` (:class:`AutoCadence`), the final step and an
    early stop or preemption. Main thread; every rank holds one and decides alike, because its
    decisions use only agreed values.

    Per step: :meth:`begin_step` (rank 0 measures for ``auto``), :meth:`votes` (this rank's
    inputs to the step's all-reduce), :meth:`agreed` (the all-reduced values), :meth:`due` (the
    decision at the end of the step), and :meth:`saved` when a save started. The gauge
    ``elastic_trainer_checkpoint_interval_steps`` and the event ``checkpoint_interval_changed``
    follow the interval in force."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        rank: int,
        start_step: int,
        now: float,
        events: EventLog | None = None,
        metrics: MetricsSink | None = None,
        lineage: Lineage | None = None,
    ):
        self.rank = rank
        self.every_seconds = cfg.interval_seconds
        self.fixed = 0 if cfg.interval_steps == "auto" else int(cfg.interval_steps)
        self._events, self._metrics = events or EventLog(None), metrics or NullSink()
        self._last_save_time = now
        self._time_due = False  # agreed at this step
        # (start of the loop iteration, it started a save, that save measures the interval's cost)
        self._tick: tuple[float, bool, bool] | None = None
        self._tiered = bool(cfg.local_dir)  # the interval is the local tier's; checkpoint.dir's is remote_every
        self.auto: AutoCadence | None = None
        if cfg.interval_steps == "auto":
            self.auto = AutoCadence(
                rank=rank,
                start_step=start_step,
                lineage=lineage or Lineage(),
                prior_mtbf_seconds=cfg.auto_prior_mtbf_seconds,
                prior_weight_seconds=cfg.auto_prior_weight_seconds,
                min_steps=cfg.auto_min_steps,
                max_steps=cfg.auto_max_steps,
                now=now,
            )
        else:
            self._metrics.gauge("elastic_trainer_checkpoint_interval_steps", self.fixed)

    @property
    def interval(self) -> int | None:
        """The step interval in force (None: ``auto`` before its first agreement; 0: none)."""
        return self.auto.interval if self.auto is not None else self.fixed

    def begin_step(self, now: float, save_in_progress: bool) -> None:
        """Rank 0, start of each step (``auto``): the previous loop iteration's wall time."""
        if self.auto is None or self.rank != 0:
            return
        if self._tick is not None:
            start, started, measured = self._tick
            self.auto.observe(now - start, started, save_in_progress, now, measured)
        self._tick = (now, False, True)

    def votes(self, now: float) -> tuple[float, float]:
        """This rank's elements of the step's all-reduce (SUM): the time trigger, and rank 0's
        proposed ``auto`` interval (0 elsewhere)."""
        time_due = self.every_seconds > 0 and now - self._last_save_time >= self.every_seconds
        return float(time_due), self.auto.vote() if self.auto is not None else 0.0

    def agreed(self, step: int, time_due: float, vote: float) -> None:
        """The all-reduced :meth:`votes` of ``step``."""
        self._time_due = time_due > 0
        change = self.auto.agree(vote) if self.auto is not None else None
        if change is None:
            return
        b = change.basis
        self._metrics.gauge("elastic_trainer_checkpoint_interval_steps", change.interval_steps)
        self._events.emit(
            "checkpoint_interval_changed",
            step=step,
            interval_steps=change.interval_steps,
            previous=change.previous,
            save_cost_s=b.get("save_cost_s"),
            restart_cost_s=b.get("restart_cost_s"),
            failure_rate_per_h=b.get("failure_rate_per_h"),
            reason=b.get("reason"),
            step_seconds=b.get("step_seconds"),
            commit_lag_s=b.get("commit_lag_s"),
            failures=b.get("failures"),
        )

    def due(self, step: int, total_steps: int, *, stop: bool = False) -> bool:
        """Save at the end of ``step``? The final step, an agreed stop (early stop, preemption),
        the fixed or ``auto`` interval, or the agreed time trigger."""
        if stop or step >= total_steps:
            return True
        if self.fixed > 0 and step % self.fixed == 0:
            return True
        return self._time_due or (self.auto is not None and self.auto.due(step))

    def saved(self, step: int, now: float, *, remote: bool = True) -> None:
        """A save of ``step`` started (every rank); ``remote``: it goes to checkpoint.dir. With a
        local tier, ``auto`` sets the local tier's interval and measures its cost on the saves that
        go there alone (the ``remote_every``-th save's own cost is not the interval's)."""
        self._last_save_time = now
        self._time_due = False
        if self.auto is not None:
            self.auto.saved(step)
        if self._tick is not None:
            self._tick = (self._tick[0], True, not (self._tiered and remote))


def from_run(
    cfg: CheckpointConfig,
    events_path: str,
    *,
    rank: int,
    start_step: int,
    now: float,
    events: EventLog | None = None,
    metrics: MetricsSink | None = None,
) -> Cadence:
    """The cadence of a (re)start: for ``auto``, rank 0 reads this job's lineage from the tail of
    its event log (failures, observed time, restart cost, last measurement); a damaged log
    starts from the prior."""
    lineage = Lineage()
    if cfg.interval_steps == "auto" and rank == 0:
        try:
            lineage = lineage_from_events(read_events(events_path, tail_bytes=LINEAGE_TAIL_BYTES))
        except (OSError, ValueError, TypeError, KeyError) as e:
            logger.warning("checkpoint cadence: could not read the event log (%s); using the prior", e)
    return Cadence(cfg, rank=rank, start_step=start_step, now=now, events=events, metrics=metrics, lineage=lineage)
