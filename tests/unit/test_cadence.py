"""The checkpoint cadence decision (pure)."""

from __future__ import annotations

import json
import math

import pytest

from elastic_trainer.checkpoint import cadence
from elastic_trainer.config import load_config
from elastic_trainer.errors import ConfigError


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
    assert cadence.optimal_interval(0.5, 1.0, 5.0, 1 / 60, commit_lag=3.0) == a, (
        "commit lag costs per failure, not per interval"
    )
    with pytest.raises(ValueError):
        cadence.optimal_interval(1.0, 1.0, 1.0, 0.1, min_steps=0)


def test_failure_rate_prior_and_observations():
    assert cadence.failure_rate(0, 0.0, 3600) == pytest.approx(1 / 3600)
    assert cadence.failure_rate(10, 600.0, 3600) == pytest.approx(11 / 4200)
    assert cadence.failure_rate(10, 36_000.0, 3600) == pytest.approx(11 / 39_600)
    assert math.isclose(cadence.failure_rate(0, 36_000.0, 3600), 1 / 39_600)


# --- checkpoint.interval_steps = "auto" -----------------------------------------------------------


@pytest.mark.parametrize(
    "override, expect",
    [
        ("checkpoint.interval_steps=auto", "auto"),
        ('checkpoint.interval_steps="auto"', "auto"),
        ("checkpoint.interval_steps=25", 25),
        ("checkpoint.interval_steps=0", 0),
    ],
)
def test_interval_steps_takes_an_integer_or_auto(override, expect):
    assert load_config(None, [override]).checkpoint.interval_steps == expect


@pytest.mark.parametrize(
    "override, key, fragment",
    [
        ("checkpoint.interval_steps=often", "checkpoint.interval_steps", "expected an integer or 'auto'"),
        ("checkpoint.interval_steps=AUTO", "checkpoint.interval_steps", "expected an integer or 'auto'"),
        ("checkpoint.interval_steps=2.5", "checkpoint.interval_steps", "expected an integer or 'auto'"),
        ("checkpoint.interval_steps=true", "checkpoint.interval_steps", "expected an integer or 'auto'"),
        ("checkpoint.interval_steps=-3", "checkpoint.interval_steps", "must be >= 0"),
        ("checkpoint.auto_prior_mtbf_seconds=0", "checkpoint.auto_prior_mtbf_seconds", "must be > 0"),
        ("checkpoint.auto_prior_weight_seconds=-1", "checkpoint.auto_prior_weight_seconds", "must be > 0"),
        ("checkpoint.auto_min_steps=0", "checkpoint.auto_min_steps", "must be >= 1"),
        ("checkpoint.auto_max_steps=3", "checkpoint.auto_max_steps", "must be >= checkpoint.auto_min_steps"),
    ],
)
def test_bad_auto_settings_name_the_key(override, key, fragment):
    overrides = [override] + (["checkpoint.auto_min_steps=5"] if "auto_max_steps" in override else [])
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert e.value.key == key and fragment in str(e.value)


def test_auto_in_toml(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[checkpoint]\ninterval_steps = "auto"\nauto_max_steps = 200\n')
    c = load_config(p).checkpoint
    assert (c.interval_steps, c.auto_max_steps, c.auto_prior_mtbf_seconds) == ("auto", 200, 3600.0)


def test_prior_weight_sets_how_fast_observations_win():
    # Same prior mean (1/h) for a fresh job, whatever the weight.
    assert cadence.failure_rate(0, 0.0, 3600, 60) == pytest.approx(1 / 3600)
    heavy = cadence.failure_rate(5, 300.0, 3600)  # worth an hour of observation
    light = cadence.failure_rate(5, 300.0, 3600, 60)  # worth a minute
    assert light == pytest.approx((60 / 3600 + 5) / 360) and light > 5 * heavy


@pytest.mark.parametrize(
    "current, expect",
    [
        (None, "best"),  # nothing in force: the optimum
        (35, 35),  # the optimum itself
        (33, 33),  # within 2 % of the least waste: keep (no flapping on noise)
        (10, "best"),  # clearly worse: switch
        (500, "best"),  # outside the bounds: switch
    ],
)
def test_next_interval_keeps_a_near_optimal_interval(current, expect):
    best = cadence.optimal_interval(1.0, 2.0, 10.0, 1 / 300, 0.0, 1, 100)
    got = cadence.next_interval(current, 1.0, 2.0, 10.0, 1 / 300, 0.0, 1, 100)
    assert got == (best if expect == "best" else expect)


NO_HISTORY = cadence.Lineage()  # a fresh job: no failures, nothing measured yet


def _auto(rank=0, lineage=NO_HISTORY, **kw):
    args = dict(
        rank=rank,
        start_step=0,
        lineage=lineage,
        prior_mtbf_seconds=3600.0,
        prior_weight_seconds=60.0,
        min_steps=1,
        max_steps=1000,
        now=0.0,
    )
    args.update(kw)
    return cadence.AutoCadence(**args)


def _feed(c, step_s, save_every, save_extra, overlap, n, t=0.0):
    """Rank 0's loop: iterations of ``step_s``; a save every ``save_every`` steps costs ``save_extra``
    on its iteration and is written ``overlap`` iterations later."""
    writing = 0
    for i in range(1, n + 1):
        saved = i % save_every == 0
        t += step_s + (save_extra if saved else 0.0)
        writing = overlap if saved else max(0, writing - 1)
        c.observe(step_s + (save_extra if saved else 0.0), saved, writing > 0, t)
    return t


def _warm(c, t=0.0):
    """The incarnation's first save (its one-time costs: no measurement), at a 0.5 s step."""
    t = _feed(c, 0.5, 1000, 0.0, 0, cadence.WARMUP_ITERATIONS + 1, t)
    for secs, saved in ((0.5 + 9.0, True), (0.5, False)):
        t += secs
        assert c.observe(secs, saved, False, t) is False
    return t


def test_the_first_save_of_an_incarnation_is_no_measurement():
    c = _auto()
    c.agree(c.vote())
    t = _warm(c)  # 9 s of one-time costs (the staging buffer, DCP's plan)
    assert c.basis["reason"] == "initial" and not c._costs
    assert 9.5 not in c._steps, "nor a step"
    t = _feed(c, 0.5, 1, 0.25, 0, 1, t)
    assert c.basis["reason"] == "measured" and c.basis["save_cost_s"] == pytest.approx(0.25)


def test_auto_starts_at_the_initial_interval_then_follows_measurements():
    c = _auto()
    assert c.vote() == cadence.INITIAL_STEPS and c.basis["reason"] == "initial"
    assert c.agree(c.vote()).previous is None and c.interval == cadence.INITIAL_STEPS
    t0 = _warm(c)
    _feed(c, 0.5, 10, 2.0, 0, 10, t0)  # one save of 2 s extra stall
    assert (
        c.basis["reason"] == "measured"
        and c.basis["save_cost_s"] == pytest.approx(2.0)
        and c.basis["step_seconds"] == pytest.approx(0.5)
    )
    rate = cadence.failure_rate(0, t0 + 5.0 + 2.0, 3600, 60)
    assert c.vote() == cadence.optimal_interval(0.5, 2.0, 0.0, rate, 2.5, 1, 1000)
    change = c.agree(c.vote())
    assert (
        change.previous == 10
        and change.interval_steps == c.vote()
        and change.basis["save_cost_s"] == pytest.approx(2.0)
    )
    assert c.agree(c.vote()) is None, "no event without a change"


def test_overlap_slowdown_counts_as_save_cost():
    c = _auto()
    c.agree(c.vote())
    t = _feed(c, 0.5, 1000, 0.0, 0, 9, _warm(c))  # baseline only
    for secs, saved, writing in [(0.6, True, True), (0.9, False, True), (0.8, False, True), (0.5, False, False)]:
        t += secs
        c.observe(secs, saved, writing, t)
    assert c.basis["save_cost_s"] == pytest.approx(0.6 + 0.9 + 0.8 + 0.5 - 4 * 0.5)
    assert c.basis["commit_lag_s"] == pytest.approx(2.8)


def test_saves_that_look_free_by_noise_neither_zero_the_cost_nor_collapse_the_interval():
    """Seen in bench/goodput.py: three saves in a row whose windows ran no slower than the median
    step made the median cost 0.0 and the interval 1 (a save every step). The cost is now the
    signed mean, and one measurement at most halves the interval."""
    c = _auto(prior_mtbf_seconds=40.0, prior_weight_seconds=1e6)  # a failure every 40 s, firmly
    c.agree(c.vote())
    t = _feed(c, 0.2, 1000, 0.0, 0, 9, _warm(c))  # the median step: 0.2 s
    # Saves whose measured excess is +0.3, then three at or below zero (step-time noise).
    for extra in (0.3, 0.0, -0.05, -0.02):
        t += 0.2 + extra
        c.observe(0.2 + extra, True, False, t)
    assert c.basis["save_cost_s"] == pytest.approx((0.3 + 0.0 - 0.05 - 0.02) / 4)
    before = c.interval
    c.agree(c.vote())
    assert c.interval >= -(-before // cadence.MAX_STEP_DOWN) and c.interval > 1
    # Only the noise now: the estimate floors at zero, and the interval halves per measurement.
    for _ in range(cadence.COST_WINDOWS):
        t += 0.19
        c.observe(0.19, True, False, t)
    assert c.basis["save_cost_s"] == 0.0
    previous = c.interval
    c.agree(c.vote())
    assert c.interval == max(1, -(-previous // cadence.MAX_STEP_DOWN))


def test_more_failures_in_the_lineage_shorten_the_interval():
    calm = _auto(
        lineage=cadence.Lineage(failures=1, observed_seconds=600.0, step_seconds=0.3, save_cost=0.2, commit_lag=1.0)
    )
    busy = _auto(
        lineage=cadence.Lineage(failures=10, observed_seconds=600.0, step_seconds=0.3, save_cost=0.2, commit_lag=1.0)
    )
    assert calm.basis["reason"] == busy.basis["reason"] == "lineage"
    assert busy.vote() < calm.vote()
    assert busy.basis["failure_rate_per_h"] > calm.basis["failure_rate_per_h"]


def test_every_rank_decides_from_the_agreed_vote_only():
    """Rank 1 measures differently (its own timings), yet with the summed vote both ranks save at
    the same steps: the decision is a pure function of agreed inputs."""
    busy = cadence.Lineage(failures=20, observed_seconds=600.0)  # rank 0 read it; rank 1 did not
    r0, r1 = _auto(rank=0, lineage=busy), _auto(rank=1)
    assert r1.vote() == 0.0
    saves = {0: [], 1: []}
    t = 0.0
    for step in range(1, 120):
        summed = r0.vote() + r1.vote()
        for r in (r0, r1):
            r.agree(summed)
        assert r0.interval == r1.interval
        due = [r0.due(step), r1.due(step)]
        assert due[0] == due[1]
        for k, r in ((0, r0), (1, r1)):
            if due[k]:
                r.saved(step)
                saves[k].append(step)
        t += 0.2
        r0.observe(0.2 + (0.5 if due[0] else 0.0), due[0], False, t)
        r1.observe(0.9, due[1], True, t)  # different local measurements: ignored for the decision
    assert saves[0] == saves[1] and len(saves[0]) >= 3
    assert saves[0][0] == cadence.INITIAL_STEPS


def test_resume_counts_the_interval_from_the_loaded_step():
    c = _auto(start_step=40)
    c.agree(10.0)
    assert [s for s in range(41, 61) if c.due(s)] == [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60]
    c.saved(50)
    assert not c.due(59) and c.due(60)


def test_lineage_from_events():
    ev = [
        {"event": "launch", "time": 0.0},
        {"event": "step", "step": 1, "time": 10.0, "step_time_s": 0.5},
        {"event": "step", "step": 2, "time": 10.5, "step_time_s": 0.5},
        {
            "event": "checkpoint_interval_changed",
            "time": 10.6,
            "interval_steps": 7,
            "step_seconds": 0.5,
            "save_cost_s": 0.1,
            "commit_lag_s": 1.5,
        },
        {"event": "failure", "time": 11.0},
        {"event": "restart", "reason": "worker_failure", "time": 11.2},
        {"event": "rendezvous", "time": 12.0, "seconds": 0.5},
        {"event": "step", "step": 1, "time": 17.0, "step_time_s": 0.5},
        {"event": "restart", "reason": "membership_change", "time": 20.0},
        {"event": "preempt_requested", "time": 30.0},
        {
            "event": "checkpoint_interval_changed",
            "time": 31.0,
            "interval_steps": 10,
            "reason": "initial",
            "save_cost_s": None,
            "step_seconds": None,
        },
    ]
    lin = cadence.lineage_from_events(ev)
    assert lin.failures == 2 and lin.observed_seconds == pytest.approx(31.0)
    assert lin.restart_cost == pytest.approx(16.5 - 10.5)  # end of step 2 -> start of the next step
    assert (lin.step_seconds, lin.save_cost, lin.commit_lag) == (0.5, 0.1, 1.5)
    assert cadence.lineage_from_events([]) == cadence.Lineage()


def _cadence(cfg, sink, log, start_step=0):
    return cadence.from_run(cfg.checkpoint, log.path, rank=0, start_step=start_step, now=0.0, events=log, metrics=sink)


@pytest.mark.parametrize(
    "step, total, every, seconds_due, stop, expected",
    [
        (5, 10, 5, False, False, True),
        (4, 10, 5, False, False, False),
        (10, 10, 0, False, False, True),
        (3, 10, 0, True, False, True),
        (3, 10, 5, False, True, True),
        (3, 10, 0, False, False, False),
        (11, 10, 0, False, False, True),
    ],
)
def test_one_policy_decides_fixed_time_final_and_stop(step, total, every, seconds_due, stop, expected):
    cfg = load_config(None, [f"checkpoint.interval_steps={every}", "checkpoint.interval_seconds=60"])
    c = cadence.Cadence(cfg.checkpoint, rank=0, start_step=0, now=0.0)
    time_due, vote = c.votes(now=61.0 if seconds_due else 1.0)
    assert (time_due, vote) == (float(seconds_due), 0.0)
    c.agreed(step, time_due, vote)  # what every rank gets back from the step's all-reduce
    assert c.due(step, total, stop=stop) is expected


def test_the_time_trigger_counts_from_the_last_save_and_is_agreed():
    cfg = load_config(None, ["checkpoint.interval_steps=0", "checkpoint.interval_seconds=10"])
    c = cadence.Cadence(cfg.checkpoint, rank=1, start_step=0, now=0.0)
    assert c.votes(now=9.0)[0] == 0.0
    c.agreed(1, 1.0, 0.0)  # another rank's clock passed 10 s: every rank saves
    assert c.due(1, 100)
    c.saved(1, now=9.5)
    assert not c.due(2, 100) and c.votes(now=19.0)[0] == 0.0 and c.votes(now=19.5)[0] == 1.0


def test_the_gauge_and_the_event_follow_the_interval_in_force(tmp_path):
    from elastic_trainer.events import EventLog, read_events
    from elastic_trainer.metrics.sink import RecordingSink

    cfg = load_config(None, [f"run.dir={tmp_path}", "checkpoint.interval_steps=auto"])
    sink, log = RecordingSink(), EventLog(str(tmp_path / "events.jsonl"))
    c = _cadence(cfg, sink, log)
    assert "elastic_trainer_checkpoint_interval_steps" not in sink.gauges, (
        "auto: nothing in force before the first agreement"
    )
    c.agreed(1, 0.0, 10.0)
    c.agreed(2, 0.0, 10.0)
    assert sink.gauges["elastic_trainer_checkpoint_interval_steps"] == 10 and c.interval == 10
    (ev,) = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "checkpoint_interval_changed"]
    assert ev["interval_steps"] == 10 and ev["previous"] is None and ev["reason"] == "initial" and ev["step"] == 1
    assert {"save_cost_s", "restart_cost_s", "failure_rate_per_h"} <= set(ev)
    sink = RecordingSink()
    fixed = _cadence(load_config(None, ["checkpoint.interval_steps=25"]), sink, log)
    assert (
        sink.gauges["elastic_trainer_checkpoint_interval_steps"] == 25 and fixed.auto is None and fixed.interval == 25
    )


def test_read_events_tail_starts_at_a_record_boundary(tmp_path):
    from elastic_trainer.events import read_events

    path = tmp_path / "events.jsonl"
    lines = [json.dumps({"event": "step", "step": i, "time": float(i)}) + "\n" for i in range(50)]
    path.write_text("".join(lines))
    size = path.stat().st_size
    assert [e["step"] for e in read_events(str(path), tail_bytes=size + 10)] == list(range(50))
    for k in (1, 7, 49):  # the window starts exactly at record k, then one byte into record k - 1
        at = sum(len(x) for x in lines[:k])
        assert [e["step"] for e in read_events(str(path), tail_bytes=size - at)] == list(range(k, 50))
        assert [e["step"] for e in read_events(str(path), tail_bytes=size - at + 1)] == list(range(k, 50))
    with open(path, "ab") as f:
        f.write(b'{"event": "step", "st')  # torn by a killed writer
    assert [e["step"] for e in read_events(str(path), tail_bytes=200)][-1] == 49


def test_a_restart_reads_only_the_recent_lineage(tmp_path, monkeypatch):
    """Rank 0 parses the lineage before the first step of every restart: a week-long log must not
    make that slower, so only its tail counts (old failures age out of the estimate)."""
    from elastic_trainer.events import EventLog
    from elastic_trainer.metrics.sink import RecordingSink

    log = EventLog(str(tmp_path / "events.jsonl"))
    t = [1000.0]

    def at(event, **kw):
        rec = {"event": event, "time": t[0], **kw}
        with open(log.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    for _ in range(5):  # an early crash loop
        at("restart", reason="worker_failure")
        t[0] += 1
    for i in range(2000):
        at("step", step=i, step_time_s=0.5)
        t[0] += 0.5
    at("restart", reason="worker_failure")
    for i in range(10):
        t[0] += 0.5
        at("step", step=i, step_time_s=0.5)
    monkeypatch.setattr(cadence, "LINEAGE_TAIL_BYTES", 40_000)  # ~500 records of this log
    cfg = load_config(None, [f"run.dir={tmp_path}", "checkpoint.interval_steps=auto"])
    c = _cadence(cfg, RecordingSink(), log)
    assert c.auto.lineage.failures == 1
    assert 200 < c.auto.lineage.observed_seconds < 300
    monkeypatch.setattr(cadence, "LINEAGE_TAIL_BYTES", 1 << 30)
    assert _cadence(cfg, RecordingSink(), log).auto.lineage.failures == 6


@pytest.mark.parametrize("local_dir", ["", "/dev/shm/job"])
def test_with_a_local_tier_auto_measures_the_local_saves_alone(local_dir):
    """With a local tier the interval is the local tier's (checkpoint.dir gets every
    ``remote_every``-th save): a save that also goes to checkpoint.dir, slower by far, is no
    measurement of its cost; without one every save is."""
    overrides = ["checkpoint.interval_steps=auto", "checkpoint.auto_prior_mtbf_seconds=120"]
    cfg = load_config(None, overrides + ([f"checkpoint.local_dir={local_dir}"] if local_dir else []))
    c = cadence.Cadence(cfg.checkpoint, rank=0, start_step=0, now=0.0)
    t = 0.0

    def iteration(seconds, save=None):
        nonlocal t
        c.begin_step(t, save_in_progress=False)
        t += seconds
        if save is not None:
            c.saved(1, t, remote=save == "remote")

    for _ in range(cadence.WARMUP_ITERATIONS + 8):
        iteration(0.2)  # the median step: 0.2 s
    iteration(0.2 + 5.0, save="local")  # the incarnation's first save: no measurement
    iteration(0.2)
    for k in range(6):  # a local copy costs 0.02 s; every third save also goes to checkpoint.dir: 1.5 s
        remote = k % 3 == 2
        iteration(0.2 + (1.5 if remote else 0.02), save="remote" if remote else "local")
        iteration(0.2)
    costs = list(c.auto._costs)
    if local_dir:
        assert costs == pytest.approx([0.02] * 4)
    else:
        assert sorted(costs) == pytest.approx([0.02] * 4 + [1.5] * 2)
