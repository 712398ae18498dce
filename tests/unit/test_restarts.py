"""supervisor/restarts.py and journal.py: the supervised agent's restart ledger and journal on
their own (no agent, no rendezvous): a fake clock, a recorded sleep, torch's ProcessFailure."""

from __future__ import annotations

import json
import os

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elastic_trainer import exit_codes
from elastic_trainer.events import EventLog, read_events
from elastic_trainer.metrics.sink import RecordingSink
from elastic_trainer.supervisor.journal import Journal
from elastic_trainer.supervisor.restarts import RestartLedger, read_marker


class Clock:
    def __init__(self):
        self.now, self.slept = 1000.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class Commits:
    """CommitWatch's two calls: ``progressed`` answers from a list, ``note`` is counted."""

    def __init__(self, *answers: bool):
        self.answers, self.asked, self.noted = list(answers), 0, 0

    def progressed(self) -> bool:
        self.asked += 1
        return self.answers.pop(0)

    def note(self) -> None:
        self.noted += 1


@pytest.fixture
def journal(tmp_path):
    return Journal(EventLog(str(tmp_path / "events.jsonl")), RecordingSink(), node="n0")


def events(journal: Journal, name: str) -> list[dict]:
    return [e for e in read_events(journal.events.path) if e["event"] == name]


def failures(*codes: int) -> dict:
    return {
        rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=c, error_file="") for rank, c in enumerate(codes)
    }


def restart(ledger: RestartLedger, clock: Clock, *, failed: bool = True, after: float = 1.0, nodes=(1, 1)) -> bool:
    """One restart that follows ``after`` seconds of a healthy group; whether it was given back."""
    clock.now += after
    r = ledger.begin(failed=failed, failures=failures(1) if failed else {}, restart_count=1, remaining=2)
    return ledger.end(r, nodes=nodes, world_sizes=(nodes[0] * 2, nodes[1] * 2), remaining=2)


def test_consecutive_failures_back_off_longer_and_a_healthy_minute_starts_over(journal):
    clock = Clock()
    ledger = RestartLedger(journal, clock=clock, sleep=clock.sleep)
    for _ in range(4):
        restart(ledger, clock)
    assert clock.slept == [1.0, 2.0, 4.0]  # the first failure restarts at once
    assert [e["backoff_seconds"] for e in events(journal, "restart")] == [0.0, 1.0, 2.0, 4.0]
    restart(ledger, clock, after=60.0)
    assert ledger.failure_streak == 1 and clock.slept == [1.0, 2.0, 4.0]
    assert journal.metrics.counters["elastic_trainer_restarts_total"] == 5
    assert len(journal.metrics.histograms["elastic_trainer_recovery_seconds"]) == 5


def test_a_failure_after_a_new_commit_is_not_backed_off(journal):
    clock, commits = Clock(), Commits(True, False)
    ledger = RestartLedger(journal, commits=commits, clock=clock, sleep=clock.sleep)
    restart(ledger, clock)  # the first one is never backed off: no storage read
    assert (commits.asked, commits.noted) == (0, 1)  # the baseline, once the failed group stopped
    restart(ledger, clock)  # a commit since: at once
    restart(ledger, clock)  # none since: backed off
    assert (commits.asked, commits.noted) == (2, 3)
    assert [e["progressed"] for e in events(journal, "restart")] == [None, True, False]
    assert clock.slept == [1.0]


def test_a_membership_change_restarts_at_once_without_reading_storage(journal):
    clock, commits = Clock(), Commits()
    ledger = RestartLedger(journal, commits=commits, clock=clock, sleep=clock.sleep)
    for _ in range(3):
        assert not restart(ledger, clock, failed=False, nodes=(1, 2))
    (first, *_) = events(journal, "restart")
    assert (first["reason"], first["failures"], first["backoff_seconds"], first["node"]) == (
        "membership_change",
        [],
        0.0,
        "n0",
    )
    assert clock.slept == [] and (commits.asked, commits.noted) == (0, 0)
    assert [e["restart_refunded"] for e in events(journal, "membership_change")] == [False] * 3


@pytest.mark.parametrize(
    "failed, nodes, refund, changes",
    [(True, (2, 1), True, 1), (True, (2, 2), False, 0), (True, (1, 2), False, 1), (False, (2, 1), False, 1)],
)
def test_only_a_failure_that_lost_a_node_is_given_back(journal, failed, nodes, refund, changes):
    clock = Clock()
    ledger = RestartLedger(journal, clock=clock, sleep=clock.sleep)
    restart(ledger, clock, failed=failed)
    streak = ledger.failure_streak
    assert restart(ledger, clock, failed=failed, nodes=nodes) is refund
    assert ledger.failure_streak == (streak + failed - refund)
    change = events(journal, "membership_change")
    assert len(change) == changes
    if changes:
        assert (change[0]["from_nodes"], change[0]["to_nodes"], change[0]["to_world_size"]) == (*nodes, nodes[1] * 2)
        assert change[0]["remaining_restarts"] == 2 + refund


def test_the_replaced_incarnation_s_marker_is_removed(journal, tmp_path):
    marker = tmp_path / "preempted.json"
    marker.write_text("{}")
    clock = Clock()
    ledger = RestartLedger(journal, marker=str(marker), clock=clock, sleep=clock.sleep)
    assert ledger.workers_ending()  # the workers are leaving with a code: no restart for a lost peer
    restart(ledger, clock)
    assert not marker.exists() and not ledger.workers_ending()
    restart(ledger, clock)  # none left: nothing to do


def test_a_marker_another_node_removed_first_does_not_stop_the_restart(journal, tmp_path, monkeypatch):
    """Nodes that share run.dir share the marker, and every node's supervisor removes it when its
    workers restart: another node's may remove it between this one's look and its remove. Seen in
    the namespace cluster: the agent's loop died there, after starting the workers it then could
    not stop."""
    marker = tmp_path / "preempted.json"
    marker.write_text("{}")
    clock = Clock()
    ledger = RestartLedger(journal, marker=str(marker), clock=clock, sleep=clock.sleep)
    remove = os.remove

    def other_node_first(path, *args, **kwargs):
        if os.path.exists(path) and str(path) == str(marker):
            remove(path)  # the other node's supervisor
        return remove(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", other_node_first)
    restart(ledger, clock, failed=False, nodes=(1, 2))
    assert not marker.exists()
    assert [(e["from_nodes"], e["to_nodes"]) for e in events(journal, "membership_change")] == [(1, 2)]


def test_a_marker_gone_or_unreadable_reads_as_none(tmp_path):
    """The supervisor reads the marker at exit; on a shared run.dir another node may have removed
    it since (no crash: the workers' own exit codes decide then)."""
    path = tmp_path / "PREEMPTED"
    assert read_marker(str(path)) is None and read_marker(None) is None
    path.write_text('{"exit_code": 75')
    assert read_marker(str(path)) is None
    path.write_text('{"exit_code": 75}')
    assert read_marker(str(path)) == {"exit_code": 75}


@pytest.mark.parametrize(
    "codes, marker, stop",
    [
        ((exit_codes.NONFINITE,) * 2, None, exit_codes.NONFINITE),
        ((exit_codes.NONFINITE, 1), None, None),  # not every worker: a restart may help
        ((exit_codes.FINAL_SAVE_FAILED,), {"restartable": False}, exit_codes.FINAL_SAVE_FAILED),
        ((exit_codes.FINAL_SAVE_FAILED,), {"restartable": True}, None),
        ((exit_codes.FINAL_SAVE_FAILED,), None, None),
    ],
)
def test_a_terminal_failure_stops_the_job_and_says_so(journal, tmp_path, codes, marker, stop):
    path = tmp_path / "marker.json"
    if marker is not None:
        path.write_text(json.dumps(marker))
    assert RestartLedger(journal, marker=str(path)).stop_code(failures(*codes)) == stop
    stopped = events(journal, "job_stopped")
    assert [(e["exit_code"], len(e["failures"])) for e in stopped] == ([(stop, len(codes))] if stop else [])


def test_the_journal_reports_rendezvous_rounds_and_hangs(journal):
    journal.rendezvous(group_rank=1, nodes=2, world_size=4, seconds=0.123456)
    journal.hang_detected()
    (e,) = events(journal, "rendezvous")
    assert (e["node"], e["group_rank"], e["nodes"], e["world_size"], e["seconds"]) == ("n0", 1, 2, 4, 0.1235)
    assert journal.metrics.counters == {
        "elastic_trainer_rendezvous_rounds_total": 1.0,
        "elastic_trainer_hang_detections_total": 1.0,
    }
