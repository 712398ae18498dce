"""The restart back-off's evidence of progress: the newest commit in checkpoint.dir, read bounded."""

from __future__ import annotations

import os
import threading
import time

import pytest

from elastic_trainer.supervisor import policy
from elastic_trainer.supervisor.progress import CommitWatch, newest_commit_reader
from tests.unit.test_catalog import _catalog, _save

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Reads:
    """A read that returns the queued values in order (an exception is raised)."""

    def __init__(self, *values):
        self.values = list(values)
        self.calls = 0

    def __call__(self):
        self.calls += 1
        v = self.values.pop(0)
        if isinstance(v, Exception):
            raise v
        return v


def _noted(watch: CommitWatch) -> None:
    watch.note()
    watch._pending.join(5)  # the background read of note(): done before the next failure in these tests
    assert not watch._pending.is_alive()


@pytest.mark.parametrize(
    "first, second, expected",
    [
        (5, 5, False),  # nothing committed between the failures: a crash loop
        (5, 10, True),
        (None, 5, True),  # the first commit of the job
        (None, None, False),
        (10, 5, False),  # older than before (e.g. the newest was quarantined): not progress
    ],
)
def test_progress_is_a_newer_commit_than_at_the_previous_failure(first, second, expected):
    watch = CommitWatch(Reads(first, second))
    _noted(watch)
    assert watch.progressed() is expected


def test_without_an_earlier_reading_or_when_the_read_fails_there_is_no_evidence():
    assert CommitWatch(Reads(5)).progressed() is False  # nothing recorded before
    watch = CommitWatch(Reads(5, OSError("storage down"), 10, 10))
    _noted(watch)
    assert watch.progressed() is False  # the read failed
    assert watch.progressed() is False  # ... and so it recorded nothing: this read (10) has no baseline
    assert watch.progressed() is False  # 10 then 10


def test_a_hung_read_is_given_up_after_the_timeout_and_never_doubled():
    release = threading.Event()
    calls = []

    def read():
        calls.append(1)
        if len(calls) == 2:
            release.wait(30)
        return len(calls) * 10

    watch = CommitWatch(read, timeout=0.5)
    _noted(watch)
    t0 = time.monotonic()
    assert watch.progressed() is False  # the read hangs: no evidence, back off as for a crash loop
    assert time.monotonic() - t0 < 5
    assert watch.progressed() is False and len(calls) == 2  # still hung: no second thread
    release.set()
    watch._pending.join(5)
    assert watch.progressed() is True and len(calls) == 3  # 30 after the released read's 20


def test_the_reader_sees_the_newest_commit_in_real_storage_by_listing_alone(tmp_path, monkeypatch):
    cat = _catalog(tmp_path, launch="L1")
    from elastic_trainer.storage.fs import Storage

    reader = newest_commit_reader(Storage.for_checkpoint(_Cfg(str(tmp_path)).checkpoint))
    watch = CommitWatch(reader)
    _noted(watch)  # nothing committed yet
    first = _save(cat, 5)
    assert watch.progressed() is True
    assert watch.progressed() is False  # no commit since
    ten = _save(cat, 10, parent=first, seq=2)
    assert watch.progressed() is True
    os.makedirs(tmp_path / "step-00000015")  # a save still writing is no progress
    assert watch.progressed() is False
    cat.quarantine.mark(ten, "test")  # nor is a quarantined commit
    assert reader() == 5
    # only listings: no object is read (the reader runs while the workers restart)
    from elastic_trainer.storage.fs import Storage

    monkeypatch.setattr(Storage, "read_bytes", lambda self, path: pytest.fail(f"read {path}"))
    assert reader() == 5


class _Cfg:
    def __init__(self, root: str):
        self.checkpoint = type(
            "C",
            (),
            {
                "dir": root,
                "s3_endpoint_url": "",
                "storage_timeout_seconds": 10.0,
                "storage_retries": 1,
                "direct_io": True,
            },
        )()


@pytest.mark.parametrize(
    "previous, healthy, progressed, streak, backs_off",
    [
        (1, 10.0, False, 2, True),
        (1, 10.0, True, 1, False),  # a generation that committed is not a crash loop
        (6, 10.0, True, 1, False),
        (3, 60.0, False, 1, False),  # 60 s of healthy running
        (0, 1.0, False, 1, False),  # the first failure restarts at once
    ],
)
def test_failure_streak_starts_over_on_progress(previous, healthy, progressed, streak, backs_off):
    assert policy.failure_streak(previous, healthy, progressed) == streak
    assert (policy.restart_backoff(streak) > 0) is backs_off
    assert policy.backoff_may_apply(previous, healthy) is (
        policy.restart_backoff(policy.failure_streak(previous, healthy)) > 0
    )
