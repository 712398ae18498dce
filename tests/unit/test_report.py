"""Goodput accounting and the run report, on synthetic event logs."""

from __future__ import annotations

import argparse
import json

import pytest

from elastic_trainer import report


class Log:
    """Builds an event list on a fake clock."""

    def __init__(self, t0: float = 1000.0):
        self.t = t0
        self.events: list[dict] = []

    def at(self, dt: float, event: str, **fields) -> Log:
        self.t += dt
        self.events.append({"event": event, "time": self.t, **fields})
        return self

    def steps(
        self, first: int, last: int, seconds: float = 1.0, gap: float = 0.0, world: int = 2, loss0: float = 5.0
    ) -> Log:
        for s in range(first, last + 1):
            self.at(
                seconds + gap,
                "step",
                step=s,
                loss=loss0 - 0.01 * s,
                lr=1e-3,
                grad_norm=1.0,
                world_size=world,
                step_time_s=seconds,
                tokens_per_s=100.0 / seconds,
            )
        return self


def test_no_events():
    g = report.account([])
    assert g.wall_seconds == 0 and g.goodput is None


def test_clean_run_is_all_productive_but_startup_and_checkpoints():
    log = Log().at(0, "launch").at(5, "start", world_size=2, restart_count=0)
    log.steps(1, 10, seconds=1.0)
    log.at(0.5, "checkpoint_committed", step=10, bytes=100, seconds=0.5)
    log.at(0, "finished", step=10, tokens_seen=1000).at(0.5, "supervisor_exit", exit_code=0)
    g = report.account(log.events)
    assert g.wall_seconds == pytest.approx(5 + 10 + 1)
    assert g.startup_seconds == pytest.approx(5)
    assert g.productive_seconds == pytest.approx(10)
    assert g.recompute_seconds == 0 and g.recompute_steps == 0
    assert g.interruptions == []
    assert g.other_seconds == pytest.approx(1)
    assert g.goodput == pytest.approx(10 / 16)


def test_a_save_to_the_local_tier_only_is_a_checkpoint_stall_like_a_commit():
    """Between step 10 and 11 the save call blocked 0.5 s; that the save went only to the local
    tier (no commit record) does not make the time idle, whether its copy committed or failed."""

    def run(record: str, **fields) -> report.Goodput:
        log = Log().at(0, "launch").at(1, "start", world_size=2, restart_count=0).steps(1, 10)
        log.at(0.1, record, step=10, **fields).steps(11, 12, gap=0.4)
        return report.account(log.events)

    local = run("checkpoint_local_saved", bytes=100, seconds=0.1)
    remote = run("checkpoint_committed", bytes=100, seconds=0.1)
    failed = run("checkpoint_local_failed", error="OSError: [Errno 28] No space left on device", seconds=0.1)
    assert local.categories["checkpoint_stall"] == pytest.approx(remote.categories["checkpoint_stall"])
    assert failed.categories["checkpoint_stall"] == pytest.approx(remote.categories["checkpoint_stall"])
    assert local.categories["checkpoint_stall"] >= 0.5 - 1e-9
    assert local.goodput == pytest.approx(remote.goodput) == pytest.approx(failed.goodput)


def test_restart_splits_recompute_and_recovery():
    log = Log().at(0, "launch").at(2, "start", world_size=2, restart_count=0)
    log.steps(1, 10)  # t = 1012
    log.at(0.5, "checkpoint_committed", step=10, bytes=1, seconds=0.5)
    log.steps(11, 13)  # ran, then lost: the job resumes from step 10
    log.at(0.2, "failure", rank=1, error="boom")
    log.at(0.3, "restart", reason="worker_failure", restart_count=1)
    log.at(4.0, "start", world_size=2, restart_count=1)
    log.at(1.5, "resume", step=10, from_world_size=2, world_size=2, load_seconds=1.5)
    log.steps(11, 20)
    log.at(0, "finished", step=20, tokens_seen=2000)
    g = report.account(log.events)
    assert g.productive_seconds == pytest.approx(20)
    assert g.recompute_steps == 3 and g.recompute_seconds == pytest.approx(3)
    [i] = g.interruptions
    assert (i.reason, i.after_step, i.resumed_step, i.redone_steps) == ("worker_failure", 13, 10, 3)
    # from the end of step 13 to the start of the redone step 11: failure + restart + start + load
    assert i.seconds == pytest.approx(0.2 + 0.3 + 4.0 + 1.5)
    assert i.load_seconds == pytest.approx(1.5)
    assert g.interruption_seconds == pytest.approx(6.0)
    total = g.productive_seconds + g.recompute_seconds + g.interruption_seconds + g.startup_seconds + g.other_seconds
    assert total == pytest.approx(g.wall_seconds)
    assert g.other_seconds == pytest.approx(0.5)  # the checkpoint between steps 10 and 11
    assert g.goodput == pytest.approx(20 / g.wall_seconds)


def test_rollback_without_resume_event_still_counts_as_recompute():
    """A restart that found no checkpoint starts from step 1 again: every earlier step is lost."""
    log = Log().at(0, "launch").steps(1, 5).at(0, "restart", reason="worker_failure").at(1, "start").steps(1, 5)
    g = report.account(log.events)
    assert g.recompute_steps == 5 and g.productive_seconds == pytest.approx(5)
    assert g.interruptions[0].resumed_step == 0


def test_membership_change_reshard_and_relaunch_after_preemption():
    log = Log().at(0, "launch").steps(1, 4, world=2)
    log.at(0.1, "checkpoint_committed", step=4, bytes=1, seconds=0.1)
    log.at(0.1, "restart", reason="membership_change").at(
        2, "resume", step=4, from_world_size=2, world_size=3, load_seconds=0.5
    )
    log.at(0, "reshard", step=4, from_world_size=2, to_world_size=3)
    log.steps(5, 8, world=3)
    log.at(0.1, "preempt_requested", step=8).at(0.5, "preempted", step=8, committed=True).at(
        0.1, "supervisor_exit", exit_code=75
    )
    log.at(60, "launch").at(3, "resume", step=8, from_world_size=3, world_size=3, load_seconds=0.7).steps(
        9, 10, world=3
    )
    log.at(0, "finished", step=10, tokens_seen=500)
    g = report.account(log.events)
    assert [i.reason for i in g.interruptions] == ["membership_change", "preempted"]
    a, b = g.interruptions
    assert (a.world_size_before, a.world_size_after, a.redone_steps) == (2, 3, 0)
    assert b.seconds == pytest.approx(0.1 + 0.5 + 0.1 + 60 + 3 + 1.0 - 1.0)
    assert g.load_seconds == pytest.approx(1.2)
    s = report.summarize(log.events)
    assert (s["status"], s["steps"], s["tokens"], s["reshards"], s["launches"], s["world_sizes"]) == (
        "finished",
        10,
        500,
        1,
        2,
        [2, 3],
    )
    assert s["restarts"] == 1 and s["restart_reasons"] == {"membership_change": 1}


def test_kept_steps_is_one_continuous_curve():
    log = Log().steps(1, 6, loss0=5).at(0, "restart").steps(4, 9, loss0=4)
    kept = report.kept_steps(log.events)
    assert [e["step"] for e in kept] == list(range(1, 10))
    assert kept[3]["loss"] == pytest.approx(4 - 0.04), "a redone step keeps its last run"


def test_summary_of_an_unfinished_run_estimates_tokens():
    log = Log().at(0, "launch").steps(1, 3, seconds=2.0)
    s = report.summarize(log.events)
    assert s["status"] == "running or killed"
    assert s["tokens"] == 300  # tokens_per_s * step_time_s per kept step
    assert "goodput" in report.render_text(s, "x")


def _write(tmp_path, events):
    run = tmp_path / "run"
    run.mkdir()
    # torn last line
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "step", "ti')
    return run


def test_cli_report_writes_png_and_text(tmp_path, capsys):
    log = Log().at(0, "launch").steps(1, 6).at(0.1, "checkpoint_committed", step=5, bytes=1, seconds=0.1)
    log.at(0.1, "restart", reason="worker_failure").at(
        1, "resume", step=5, from_world_size=2, world_size=1, load_seconds=0.3
    )
    log.at(0, "reshard", step=5, from_world_size=2, to_world_size=1).steps(6, 9, world=1).at(
        0, "finished", step=9, tokens_seen=900
    )
    run = _write(tmp_path, log.events)
    out = tmp_path / "r.png"
    assert report.main(argparse.Namespace(run_dir=str(run), out=str(out), json=False)) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "finished at step 9 (900 tokens)" in text and "restarts 1" in text and "goodput" in text
    assert "after step 6: worker_failure, resumed from step 5 (1 steps redone)" in text

    assert report.main(argparse.Namespace(run_dir=str(run), out=None, json=True)) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["restarts"] == 1 and data["goodput"]["recompute_steps"] == 1
    assert not (run / "report.png").exists() and data["plot"] is None  # --json only reads

    assert report.main(argparse.Namespace(run_dir=str(run), out=None, json=False)) == 0
    assert (run / "report.png").exists() and f"plot: {run / 'report.png'}" in capsys.readouterr().out


def test_records_damaged_into_other_types_are_skipped_like_torn_lines(tmp_path, capsys):
    # Bytes damaged in place can still parse as JSON: a record whose event, time or step has
    # another type is damage, skipped as a torn line is, not a crash of every reader.
    log = Log().at(0, "launch").steps(1, 6).at(0, "finished", step=6, tokens_seen=600)
    run = _write(tmp_path, log.events)
    with open(run / "events.jsonl", "a") as f:
        f.write("\n")  # after _write's torn line
        for bad in (
            {"event": "step", "time": 1.0, "step": "x"},
            {"event": 5, "time": 1.0},
            {"event": "step", "time": "t"},
        ):
            f.write(json.dumps(bad) + "\n")
        f.write('[1, 2]\n{"event": "step", "ste')
    assert report.main(argparse.Namespace(run_dir=str(run), out=None, json=True)) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["restarts"] == 0 and data["goodput"]["recompute_steps"] == 0


def test_plot_draws_the_kept_curve_and_markers(tmp_path):
    log = Log().at(0, "launch").steps(1, 6).at(0.1, "checkpoint_committed", step=5, bytes=1, seconds=0.1)
    log.at(0.1, "restart", reason="worker_failure").steps(6, 8)
    s = report.summarize(log.events)
    fig = report.plot(log.events, s, str(tmp_path / "p.png"))
    ax = fig.axes[0]
    [loss] = [line for line in ax.lines if line.get_gid() == "loss"]
    assert list(loss.get_xdata()) == list(range(1, 9))
    [commits] = [line for line in ax.lines if line.get_gid() == "commits"]
    assert list(commits.get_xdata()) == [5]
    labels = ax.get_legend_handles_labels()[1]
    assert "restart (worker_failure)" in labels and any("rolled back" in label for label in labels)


def test_missing_event_log(tmp_path, capsys):
    assert report.main(argparse.Namespace(run_dir=str(tmp_path), out=None, json=False)) == 2
    assert "no event log" in capsys.readouterr().err


# ---------------------------------------------------------------- the finer categories (live ledger)


def _cats(g):
    assert sum(g.categories.values()) == pytest.approx(g.wall_seconds), g.categories
    return g.categories


def test_categories_partition_the_wall_time_of_a_failure_and_preemption():
    log = Log().at(0, "launch").at(1.0, "rendezvous", seconds=0.4).at(2.0, "start").steps(1, 4)
    log.at(0.3, "checkpoint_committed", step=4, bytes=1, seconds=0.2)  # 0.3 s after step 4: stall
    log.steps(5, 6, gap=0.1)  # 0.1 s idle before step 5 (after the stall) and before step 6
    log.at(0.2, "failure", rank=1).at(0.5, "restart", reason="worker_failure")
    log.at(1.5, "rendezvous", seconds=0.5).at(0.5, "start").at(0.8, "resume", step=4, load_seconds=0.6)
    log.steps(5, 8)  # 5 and 6 redone
    log.at(0.1, "preempt_requested", step=8).at(0.7, "preempted", step=8, committed=True).at(
        0.2, "supervisor_exit", exit_code=75
    )
    c = _cats(report.account(log.events))
    assert c["productive"] == pytest.approx(8.0)
    assert c["recompute"] == pytest.approx(2.0)
    assert c["rendezvous"] == pytest.approx(0.4 + 0.5)
    assert c["startup"] == pytest.approx(0.6 + 2.0 + 0.7)  # launch->rdzv, rdzv->step 1, rdzv->resume minus its load
    assert c["checkpoint_load"] == pytest.approx(0.6)
    assert c["checkpoint_stall"] == pytest.approx(0.3 + 0.1)  # the gap after step 4 holds the save
    # step 6 -> failure -> restart -> rdzv start; preempted -> exit
    assert c["restart"] == pytest.approx(0.2 + 0.5 + 1.0 + 0.2)
    assert c["preemption_save"] == pytest.approx(0.7)
    assert c["idle"] == pytest.approx(0.1 + 0.1)  # before step 6, and step 8 -> preempt_requested


def test_the_live_ledger_fed_record_by_record_agrees_with_the_whole_log_at_every_moment():
    log = (
        Log()
        .at(0, "launch")
        .at(1.0, "rendezvous", seconds=0.4)
        .steps(1, 4)
        .at(0.3, "checkpoint_committed", step=4, bytes=1, seconds=0.2)
    )
    log.steps(5, 6).at(0.2, "failure", rank=1).at(0.5, "restart", reason="worker_failure").at(
        1.5, "rendezvous", seconds=0.5
    )
    log.at(0.8, "resume", step=4, load_seconds=0.6).steps(5, 8).at(0.1, "finished", step=8)
    ledger = report.Ledger()
    for i, e in enumerate(log.events):
        ledger.feed(e)
        whole = report.account(log.events[: i + 1])
        assert ledger.result().categories == pytest.approx(whole.categories)
        assert ledger.result().goodput == whole.goodput
    # Live: the time since the last record goes to the category the run is in.
    live = ledger.result(now=log.t + 5.0)
    assert live.wall_seconds == pytest.approx(report.account(log.events).wall_seconds + 5.0)
    assert live.categories["idle"] == pytest.approx(report.account(log.events).categories["idle"] + 5.0)
    mid = report.Ledger()
    for e in log.events[:3]:  # launch, rendezvous, step 1: now between steps 1 and 2 -> idle
        mid.feed(e)
    assert _cats(mid.result(now=log.events[2]["time"] + 2.0))["idle"] == pytest.approx(2.0)


def test_a_week_long_log_keeps_the_ledger_bounded_and_exact():
    """The supervisor feeds every record of a job that may run for millions of steps and computes
    the result at each scrape: its bookkeeping stays bounded while commit records that arrive steps
    late, the slowdown of the step a save overlaps and a rollback are still accounted exactly."""
    from elastic_trainer import goodput

    n, late, slow = 3 * goodput.GAP_MEMORY_STEPS, 3, 0.05
    ledger = goodput.Ledger()
    ledger.feed({"event": "launch", "time": 0.0})
    t, expect = 0.0, {"productive": 0.0, "checkpoint_stall": 0.0, "idle": 0.0, "recompute": 0.0}
    kept: dict[int, float] = {}
    pending: list[int] = []
    step, rolled = 0, False
    while True:
        step += 1
        dur = 0.1 + (slow if step % 10 == 1 else 0.0)  # the step after a save runs beside its write
        t += dur
        ledger.feed({"event": "step", "time": t, "step": step, "step_time_s": dur})
        if step in kept:  # redone after the rollback below
            expect["recompute"] += kept[step]
        kept[step] = dur
        if step == n:
            break
        saved = step % 10 == 0
        gap = 0.05 if saved else 0.02
        if saved:
            pending.append(step)
        # each arrives `late` steps after its step
        commits = [pending.pop(0) for _ in list(pending) if pending[0] <= step - late]
        for k, c in enumerate(commits):
            ledger.feed({"event": "checkpoint_committed", "time": t + 0.001 * (k + 1), "step": c})
            kept[c + 1] -= slow  # its write slowed step c + 1, which started before this record
            expect["checkpoint_stall"] += slow
        t += gap
        expect["checkpoint_stall" if saved else "idle"] += gap
        if step == n // 2 and not rolled:  # a rollback of 25 steps (no failure record)
            rolled, step = True, step - 25
    expect["productive"] = sum(kept.values())
    r = ledger.result()
    assert (
        len(ledger._gap_after) <= 2 * goodput.GAP_MEMORY_STEPS
        and len(ledger._uncharged) <= 2 * goodput.OVERLAP_MEMORY_STEPS
    )
    assert r.recompute_steps == 25
    for cat in expect:
        assert r.categories[cat] == pytest.approx(expect[cat], rel=1e-9), cat
    assert sum(r.categories.values()) == pytest.approx(r.wall_seconds, rel=1e-9)


def test_a_commit_recorded_mid_step_charges_only_the_steps_slowdown():
    """The background write's commit record lands while the next step runs: that step's normal
    time stays productive, its excess over the recent median is the save's cost (stall)."""
    log = Log().at(0, "launch").at(0.5, "rendezvous", seconds=0.2).steps(1, 6, seconds=1.0, gap=0.1)
    log.at(0.3, "checkpoint_committed", step=6, bytes=1, seconds=0.5)  # 0.2 s into step 7
    log.at(1.3, "step", step=7, step_time_s=1.5, world_size=2)  # started 0.1 s after step 6, 0.5 s slower
    log.steps(8, 9, seconds=1.0, gap=0.1)
    c = _cats(report.account(log.events))
    assert c["checkpoint_stall"] == pytest.approx(0.1 + 0.5)  # the gap after step 6 + step 7's slowdown
    # steps 2-6, 8, 9 (step 1 starts the wall clock) + step 7 less its slowdown
    assert c["productive"] == pytest.approx(8 * 1.0 + 1.0)
    assert c["idle"] == pytest.approx(7 * 0.1)
    # the same record landing after step 7 instead: nothing overlapped the write, no slowdown charged
    log2 = Log().at(0, "launch").at(0.5, "rendezvous", seconds=0.2).steps(1, 7, seconds=1.0, gap=0.1)
    log2.at(0.05, "checkpoint_committed", step=6, bytes=1, seconds=0.5).steps(8, 9, seconds=1.0, gap=0.1)
    c2 = _cats(report.account(log2.events))
    assert c2["checkpoint_stall"] == pytest.approx(0.1)


def test_closing_summary_covers_this_launch_only(tmp_path):
    older = Log().at(0, "launch", pid=1).steps(1, 6).at(0.1, "checkpoint_committed", step=5, bytes=1, seconds=0.1)
    mine = Log().at(0, "launch", pid=2).steps(6, 9).at(0.1, "checkpoint_committed", step=8, bytes=1, seconds=0.1)
    mine.at(0.1, "supervisor_exit", exit_code=75, preempted=None, signalled=True)
    run = _write(tmp_path, older.events + mine.events)
    text = report.closing_summary(
        str(run), "s3://b/ckpt", 20, 75, "elastic-trainer", ["c.toml", "--set", "train.steps=20"], pid=2
    )
    first, ckpt, rep, again = text.splitlines()
    assert first.startswith("preempted at step 9/20, final step committed: ") and "1 checkpoint(s) committed" in first
    assert (
        ckpt == "  checkpoints: s3://b/ckpt (newest commit: step 8); list them: elastic-trainer ckpt list s3://b/ckpt"
    )
    assert rep.startswith(f"  report:      elastic-trainer report {run}")
    assert (
        again
        == "  resume:      elastic-trainer launch c.toml --set train.steps=20   (continues from the newest commit)"
    )
    done = report.closing_summary(
        str(run),
        "ck",
        8,
        0,
        ".venv/bin/elastic-trainer",
        ["c.toml", "--set", "train.steps=8", "--set=train.steps=8"],
        pid=2,
    )
    assert (
        done.splitlines()[-1]
        == "  train longer: .venv/bin/elastic-trainer launch c.toml --set train.steps=N   (continues from step 8)"
    )
    assert report.closing_summary(str(tmp_path / "elsewhere"), "ck", 8, 0, "elastic-trainer", [], pid=2) is None


def test_closing_summary_says_when_the_event_log_missed_records(tmp_path):
    """run.dir full: the event log drops records and training goes on; the summary must not
    present the steps it holds as the whole launch."""
    log = Log().at(0, "launch", pid=2).steps(1, 4)  # no supervisor_exit: the writes failed from step 5 on
    run = _write(tmp_path, log.events)
    text = report.closing_summary(str(run), "ck", 9, 0, "elastic-trainer", [], pid=2)
    assert text.splitlines()[-1] == report.INCOMPLETE_LOG and "finished at step 4/9" in text


def test_an_event_log_that_cannot_be_written_drops_records_warns_once_and_recovers(tmp_path, caplog):
    from elastic_trainer.events import EventLog, read_events, write_record

    path = tmp_path / "events.jsonl"
    path.mkdir()  # any write fails (as on a full disk): EISDIR
    log = EventLog(str(path))
    with caplog.at_level("WARNING", logger="elastic_trainer.events"):
        assert log.emit("finished", step=1, tokens_seen=0, last_committed_step=None)["step"] == 1
        log.emit("finished", step=2, tokens_seen=0, last_committed_step=None)
        assert log.dropped == 2 and len(caplog.records) == 1 and str(path) in caplog.text
        path.rmdir()
        log.emit("finished", step=3, tokens_seen=0, last_committed_step=None)
    assert log.dropped == 0 and "2 event(s) dropped" in caplog.records[-1].getMessage()
    assert [r["step"] for r in read_events(str(path))] == [3]
    marker = tmp_path / "blocked" / "PREEMPTED"
    (tmp_path / "blocked").write_text("a file where run.dir should be")
    assert write_record(str(marker), {"exit_code": 75}, "the marker") is False
    assert write_record(str(tmp_path / "PREEMPTED"), {"exit_code": 75}, "the marker") is True
    assert json.loads((tmp_path / "PREEMPTED").read_text()) == {"exit_code": 75}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left
