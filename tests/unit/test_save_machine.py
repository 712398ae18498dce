"""The save state machine and the manager around it, in one process: no process group.

The checkpoint.dir saver writes real DCP checkpoints (so rank 0's catalog really proves and
commits them) but only when a test lets them (``GatedSaver``); the manager tests run against
every saver where they mean something (:data:`SAVERS`: a fake writer, the real thread writer, the
real local tier beside; the process writer's policy runs for real with the writer processes
stubbed, as no writer process runs in one process); the agreement is a fake that plays the other
ranks' answers (``ScriptedAgreement``). Every transition of
:class:`elastic_trainer.checkpoint.save.Save` is driven here, and the races the manager closes
each have a test: a save counts as committed only once agreed committed, a rollback abandons a
save still writing (never committed, its directory not cleaned up under it, its name not reused),
and a commit that lands after a load does not move the newest-commit mark.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future

import pytest

from elastic_trainer import contract
from elastic_trainer.checkpoint import layout, writer_process
from elastic_trainer.checkpoint.agreement import SaveVotes
from elastic_trainer.checkpoint.catalog import Catalog
from elastic_trainer.checkpoint.local_tier import job_key
from elastic_trainer.checkpoint.manager import CheckpointManager
from elastic_trainer.checkpoint.peer_tier import PeerNode
from elastic_trainer.checkpoint.save import Save, SaveState
from elastic_trainer.checkpoint.savers import Saver
from elastic_trainer.config import CheckpointConfig
from elastic_trainer.events import EventLog, read_events
from elastic_trainer.storage.fs import open_storage
from elastic_trainer.storage.peer import Client, Holder

from .fakes import WAIT, GatedSaver, ScriptedAgreement, Weights

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
S = SaveState


SAVERS = ["fake", "thread", "local", "peer"]
_LOCAL = ("local", "peer")  # the savers that write a local copy


@pytest.fixture
def saver():
    """Which savers a test's manager writes with (tests parametrize it over :data:`SAVERS`):
    "fake" (the gated fake writer into checkpoint.dir), "thread" (the real thread writer, gated),
    "local" (the fake writer, and the real local tier beside it: every save also writes and
    commits this rank's local copy), "peer" (as "local", each local copy then replicated to
    another node's holder: a real one on 127.0.0.1, ``mgr.test_holder``)."""
    return "fake"


@pytest.fixture
def make(tmp_path, saver, monkeypatch):
    made = []

    def _make(*, rank=0, timeout=WAIT, weights=None, saver_kw=None, **cfg):
        root = str(tmp_path / "ckpt")
        storage = open_storage(root)
        gated = GatedSaver(storage, writer="thread" if saver == "thread" else "fake", **(saver_kw or {}))
        if saver in _LOCAL:
            cfg.setdefault("local_dir", str(tmp_path / "local"))
        if saver == "peer":
            monkeypatch.setenv(contract.CHECKPOINT_KEY_ENV, "save-machine-key")
        agreement = ScriptedAgreement()
        events_path = str(tmp_path / "events.jsonl")
        ccfg = CheckpointConfig(dir=root, save_timeout_seconds=timeout, **cfg)
        mgr = CheckpointManager(
            ccfg,
            storage,
            {"model": weights or Weights()},
            rank=rank,
            world_size=1 if rank == 0 else 2,
            mesh_shape=[1],
            group=None,
            fingerprint="f",
            events=EventLog(events_path, enabled=rank == 0),
            remote=gated,
            agreement=agreement,
            peer_node=PeerNode(node=0) if saver == "peer" else None,
        )
        made.append(mgr)
        mgr.test_saver, mgr.test_agreement, mgr.test_events = gated, agreement, events_path
        if saver == "peer":  # this node (0) and one other, whose holder is the ring's next
            mgr.test_holder = Holder(job_key(root), b"save-machine-key", "127.0.0.1").start()
            mgr._local_saver.peer.connect(_Nodes([(0, "127.0.0.1:9"), (1, mgr.test_holder.address)]))
        return mgr

    yield _make
    for m in made:
        m.test_saver.close()
        m.close()
        if hasattr(m, "test_holder"):
            m.test_holder.close()


class _Nodes:
    """The peer tier's one collective at connect: every rank's (node, holder address)."""

    def __init__(self, views):
        self.views = views

    def gather(self, obj):
        return self.views


def local_copies(m):
    """The steps of this rank's committed local copies (the local tier's own events)."""
    return [e["step"] for e in events(m, "checkpoint_local_saved")]


def events(mgr, name):
    return [e for e in read_events(mgr.test_events) if e["event"] == name]


def begin(m, step):
    """Start a save of ``step``; the Save object in flight."""
    m.save(step)
    return m._inflight


def wait_for(predicate, what):
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# ------------------------------------------------------------------ the Save object
def test_only_the_transitions_of_the_diagram_are_taken():
    s = Save(3, "step-00000003", started=0.0, deadline=1e18)
    assert s.state is S.STAGING and not s.settled
    assert not s.advance(S.COMMITTED)  # a save is never committed before it is written
    assert s.staged() and s.state is S.WRITING
    assert not s.staged()  # once
    assert s.advance(S.COMMITTING)
    assert not s.abandon("too late")  # a commit in progress is not abandoned
    assert s.advance(S.COMMITTED, manifest={"step": 3})
    for to in S:
        assert not s.advance(to), f"terminal COMMITTED moved to {to}"
    assert s.history == [S.STAGING, S.WRITING, S.COMMITTING, S.COMMITTED] and s.settled and s.manifest == {"step": 3}


@pytest.mark.parametrize(
    "path, end",
    [
        ([S.WRITING, S.WRITTEN], S.WRITTEN),
        ([S.WRITING, S.COMMITTING, S.FENCED], S.FENCED),
        ([S.WRITING, S.COMMITTING, S.FAILED], S.FAILED),
        ([S.FAILED], S.FAILED),
        ([S.ABANDONED], S.ABANDONED),
        ([S.WRITING, S.ABANDONED], S.ABANDONED),
    ],
)
def test_every_end_is_terminal(path, end):
    s = Save(1, "n", started=0.0, deadline=1e18)
    for to in path:
        assert s.advance(to, error="why" if to in (S.FAILED, S.FENCED, S.ABANDONED) else "")
    assert s.state is end and end.terminal and s.settled
    assert not s.advance(S.COMMITTED)


def test_wait_ends_at_the_deadline_and_a_settled_save_waits_for_its_local_copy():
    s = Save(1, "n", started=0.0, deadline=0.0, staged=True)
    t0 = time.monotonic()
    assert s.wait(time.monotonic() + 0.05) is S.WRITING
    assert time.monotonic() - t0 < WAIT
    local: Future = Future()
    s.track_local(local)
    s.advance(S.WRITTEN)
    # the local copy is still being written
    assert not s.settled and s.wait(time.monotonic() + 0.01) is S.WRITING and s.writing
    threading.Timer(0.02, local.set_result, (True,)).start()
    assert s.wait(time.monotonic() + WAIT) is S.WRITTEN and s.settled and not s.writing


# ------------------------------------------------------------------ the manager, every transition
@pytest.mark.parametrize("saver", SAVERS)
def test_an_async_save_goes_staging_writing_committing_committed(make, saver):
    m = make(saver_kw={"hold_staging": True})
    assert m.load() is None
    save = begin(m, 5)
    assert save.state is S.STAGING and m.save_in_progress
    assert not m.is_committed(5), "a save that only started is not committed"
    m.test_saver.stage(save.name)
    m.wait_for_staging()
    assert save.state is S.WRITING
    m.test_saver.release(save.name)
    assert m.finish() is True
    assert save.history == [S.STAGING, S.WRITING, S.COMMITTING, S.COMMITTED]
    assert m.last_committed_step == 5 and m.is_committed(5) and m._inflight is None
    assert [e["step"] for e in events(m, "checkpoint_committed")] == [5]
    assert Catalog(m.storage).plan_resume("latest").chosen.step == 5
    assert local_copies(m) == ([5] if saver in _LOCAL else [])
    if saver == "peer":
        assert m._local_saver.peer.replicator.idle(WAIT) and m._local_saver.peer.replicator.sent == [5]
        assert [
            e["step"] for e in Client(m.test_holder.address, m.test_holder.job, b"save-machine-key").inventory()
        ] == [5]
    assert all(isinstance(s, Saver) for s in (m.remote, m._local_saver) if s is not None)


@pytest.mark.parametrize("saver", SAVERS)
def test_a_failed_write_is_failed_reported_and_the_next_save_goes_on(make):
    m = make()
    m.load()
    first = begin(m, 2)
    m.test_saver.fail(first.name, OSError("disk full"))
    assert m.finish() is False
    assert first.state is S.FAILED and "disk full" in first.error and m.test_saver.failures_seen == 1
    assert not m.is_committed(2) and m.last_committed_step is None
    assert "disk full" in events(m, "checkpoint_failed")[0]["error"]
    m.save(2)  # not committed: saved again, into another directory
    second = m._inflight
    assert second.name != first.name
    m.test_saver.release(second.name)
    assert m.finish() is True and second.state is S.COMMITTED and m.is_committed(2)


@pytest.mark.parametrize("saver", SAVERS)
def test_a_commit_that_cannot_prove_the_files_fails(make):
    m = make()
    m.load()
    save = begin(m, 3)
    m.test_saver.release(save.name)
    assert m.finish() is True and save.state is S.COMMITTED
    # the same machine, with a file lost between the write and the commit
    lost = begin(m, 4)
    original = m.catalog.commit

    def commit_after_loss(name, **kw):
        os.remove(os.path.join(m.storage.root, name, ".metadata"))
        return original(name, **kw)

    m.catalog.commit = commit_after_loss
    m.test_saver.release(lost.name)
    assert m.finish() is False
    assert lost.history[-2:] == [S.COMMITTING, S.FAILED] and ".metadata" in lost.error
    assert m.last_committed_step == 3


@pytest.mark.parametrize("saver", SAVERS)
def test_a_newer_launch_fences_the_commit(make):
    m = make()
    m.load()
    save = begin(m, 1)
    Catalog(open_storage(m.storage.root)).fence.acquire("a-newer-launch")
    m.test_saver.release(save.name)
    m.finish()
    assert save.history[-2:] == [S.COMMITTING, S.FENCED]
    assert m.fenced and m.verdicts.fenced_everywhere() and not m.verdicts.committed_everywhere(1)
    assert events(m, "checkpoint_fenced")


@pytest.mark.parametrize("saver", SAVERS)
def test_other_ranks_end_written_and_rank_0_commits(make):
    m = make(rank=1)
    save = begin(m, 7)
    m.test_saver.release(save.name)
    assert m.finish() is True
    assert save.history == [S.STAGING, S.WRITING, S.WRITTEN] and m.catalog is None


@pytest.mark.parametrize("saver", SAVERS)
def test_a_save_still_writing_past_its_deadline_skips_the_next_and_lands_later(make):
    m = make(timeout=0.2)
    m.load()
    slow = begin(m, 1)
    m.save(2)  # slow is past its deadline: this one is skipped, training goes on
    assert m._inflight is slow and m.test_saver.started == [slow.name]
    assert "still writing" in events(m, "checkpoint_failed")[0]["error"]
    m.test_saver.release(slow.name)
    assert m.settle(time.monotonic() + WAIT) and slow.state is S.COMMITTED and m.is_committed(1)


@pytest.mark.parametrize("saver", SAVERS)
def test_a_save_settles_only_when_every_rank_has_settled(make):
    m = make()
    m.load()
    save = begin(m, 1)
    m.test_saver.release(save.name)
    save.wait(time.monotonic() + WAIT)
    m.test_agreement.others = False  # another rank is still writing its part
    assert not m.settle(time.monotonic() + 0.05) and m._inflight is not None
    with pytest.raises(TimeoutError):
        m.finish(timeout=0.05)
    m.test_agreement.others = True
    assert m.settle(None) and m._inflight is None and m.last_save is save


def _step_agreement(m, others_unsettled=0.0, others_failed=0.0, others_unusable=0.0):
    """What ``Step.agree`` does with the manager's votes: the all-reduced sums, the other ranks'
    votes added to this rank's."""
    mine = m.votes()
    m.agreed(SaveVotes(mine.unsettled + others_unsettled, mine.failed + others_failed, mine.unusable + others_unusable))


@pytest.mark.parametrize("saver", SAVERS)
def test_a_save_settled_on_every_rank_at_the_step_s_all_reduce_needs_no_collective_of_its_own(make):
    """The next save's wait for the previous one rides on the step's all-reduce: no collective,
    so the save call neither adds a round trip nor waits for the slowest rank."""
    m = make()
    m.load()
    save = begin(m, 1)
    m.test_saver.release(save.name)
    save.wait(time.monotonic() + WAIT)
    assert m.votes() == SaveVotes(0.0, 0.0, 0.0)
    _step_agreement(m)
    calls = m.test_agreement.calls
    stats = m.save(2)
    assert not stats.skipped and m.test_agreement.calls == calls, "the save made a collective call"
    assert m.last_save is save and m.is_committed(1)
    # a step with nothing in flight on any rank: no barrier either
    m.test_saver.release(m._inflight.name)
    assert m.finish() is True
    _step_agreement(m)
    calls = m.test_agreement.calls
    assert not m.save(3).skipped and m.test_agreement.calls == calls


@pytest.mark.parametrize("elsewhere", ["usable", "unusable", "out_of_shared_memory"])
def test_the_process_writer_s_check_rides_on_the_step_s_all_reduce_too(make, elsewhere, monkeypatch):
    m = make()
    m.test_saver.uses_writer_process = True
    stopped = []
    monkeypatch.setattr(writer_process, "stop", lambda: stopped.append(1))
    monkeypatch.setattr(writer_process, "healthy", lambda: True)
    m.load()
    save = begin(m, 1)
    m.test_saver.release(save.name)
    save.wait(time.monotonic() + WAIT)
    _step_agreement(m, others_unusable=float(elsewhere != "usable"))
    if elsewhere != "usable":  # that rank's answers: its writer is unusable; its state fits in shared memory
        m.test_agreement.answers = [False, elsewhere == "unusable"]
    calls = m.test_agreement.calls
    assert not m.save(2).skipped and m.is_committed(1)
    fallback = events(m, "checkpoint_writer_fallback")
    if elsewhere == "usable":
        assert m.test_agreement.calls == calls and not stopped and not fallback
    elif elsewhere == "unusable":  # another rank's writer died: every rank checks and restarts its writer together
        assert m.test_agreement.calls > calls and stopped == [1] and not fallback
        assert m.test_saver.uses_writer_process
    else:  # new writers could not stage that rank's state either: every rank goes on with the thread writer
        assert stopped == [1] and [e["writer"] for e in fallback] == ["thread"]
        assert not m.test_saver.uses_writer_process


@pytest.mark.parametrize("saver", SAVERS)
@pytest.mark.parametrize("case", ["unsettled_here", "unsettled_elsewhere", "failed_elsewhere", "reloaded"])
def test_without_that_agreement_the_save_settles_as_before(make, case):
    m = make()
    m.load()
    first = begin(m, 1)
    if case != "unsettled_here":
        m.test_saver.release(first.name)
        first.wait(time.monotonic() + WAIT)
    if case == "unsettled_here":
        assert m.votes() == SaveVotes(1.0, 0.0, 0.0)
    _step_agreement(
        m, others_unsettled=float(case == "unsettled_elsewhere"), others_failed=float(case == "failed_elsewhere")
    )
    if case == "unsettled_here":
        m.test_saver.release(first.name)
    if case == "reloaded":
        m.load(resume="latest")  # the agreement was about a save the load has since settled or abandoned
        assert m._agreed is None
    calls = m.test_agreement.calls
    m.save(2)
    if case == "failed_elsewhere":  # settled everywhere, but another rank's part failed: not committed
        assert m.test_agreement.calls == calls and not m.is_committed(1)
    else:
        assert m.test_agreement.calls > calls, "settled without asking the other ranks"
        if case != "reloaded":
            assert m.is_committed(1)
    assert m._agreed is None, "an agreement is used at most once"


# ------------------------------------------------------------------ the local tier alone
@pytest.mark.parametrize("saver", ["local"])
def test_a_local_only_save_commits_its_own_copy_and_is_not_saved_twice(make):
    """A save that goes to the local tier only (not the remote_every-th): the local saver commits
    the copy; the save ends COMMITTED without a checkpoint.dir directory or rank 0's commit."""
    m = make(remote_every=3)
    m.load()
    save = begin(m, 1)
    assert save.name is None and m.test_saver.started == []
    assert m.finish() is True
    assert save.history == [S.STAGING, S.WRITING, S.COMMITTED] and local_copies(m) == [1]
    assert not m.is_committed(1) and m.last_committed_step is None and not events(m, "checkpoint_committed")
    assert m.save(1).skipped == "already in the local tier"
    assert begin(m, 2).name is None and m.finish() is True
    third = begin(m, 3)  # the remote_every-th save: checkpoint.dir too
    assert third.name is not None and m.test_saver.started == [third.name]


@pytest.mark.parametrize("saver", ["local"])
def test_a_local_only_copy_that_fails_to_commit_fails_the_save_and_the_next_goes_on(make):
    m = make(remote_every=3)
    m.load()
    commit = m.local.commit
    m.local.commit = lambda *a, **kw: (_ for _ in ()).throw(OSError("local disk full"))
    save = begin(m, 1)
    assert m.finish() is False
    assert save.state is S.FAILED and save.error == "local copy failed" and local_copies(m) == []
    assert m.test_saver.failures_seen == 0, "a local copy's failure does not reset the checkpoint.dir saver"
    m.local.commit = commit
    assert not m.save(2).skipped and m.finish() is True and local_copies(m) == [2]


# ------------------------------------------------------------------ the races
@pytest.mark.parametrize("saver", SAVERS)
def test_a_step_counts_as_committed_only_once_agreed_and_a_failed_one_is_saved_again(make):
    """Before: a step was "committed" once its save started, so a failed save of the final
    step was never retried and the run could end claiming it."""
    m = make()
    m.load()
    first = begin(m, 9)
    assert not m.is_committed(9)
    m.test_saver.fail(first.name, OSError("lost"))
    m.save(9, durable=True)  # the run's final save of the same step: retried, not skipped
    assert m.test_saver.started == [first.name, m._inflight.name] and first.state is S.FAILED
    m.test_saver.release(m._inflight.name)
    assert m.finish() is True and m.is_committed(9)
    before = len(m.test_saver.started)
    assert m.save(9).skipped == "already committed" and len(m.test_saver.started) == before


@pytest.mark.parametrize("saver", SAVERS)
def test_a_rollback_abandons_a_save_still_writing_keeps_its_directory_and_never_commits_it(make, saver):
    """Before: a rollback reloaded while a timed-out save still wrote, and the start-up
    cleanup could then delete that save's directory under it (or a new save reuse its name)."""
    m = make(timeout=0.2)
    m.load()
    m.save(10)
    m.test_saver.release(m._inflight.name)
    assert m.finish(timeout=WAIT) is True
    stuck = begin(m, 20)
    wait_for(lambda: m.storage.exists(m.storage.join(stuck.name, layout.WRITER)), "the writer marker")
    assert not m.settle(time.monotonic() + 0.05)
    loaded = m.load(resume="latest")  # what a non-finite rollback does
    # with a local tier, the stuck save's own local copy (committed, descending from step 10) is newer
    assert loaded.step == (20 if saver in _LOCAL else 10) and stuck.state is S.ABANDONED and m._inflight is None
    assert m.storage.exists(m.storage.join(stuck.name, layout.WRITER)), (
        "the rollback's load cleaned up a directory still being written"
    )
    m.test_saver.release(stuck.name)
    m.test_saver.join(stuck.name)
    m.committer.pool.submit(lambda: None).result(WAIT)  # a commit, had one been (wrongly) started, has run
    assert m.storage.exists(m.storage.join(stuck.name, layout.CHECKSUMS))
    assert not m.storage.exists(m.storage.join(stuck.name, layout.MANIFEST)) and stuck.state is S.ABANDONED
    assert m.last_committed_step == 10 and not events(m, "checkpoint_committed")[1:]
    m.save(20)  # the same step again after the rollback: a new directory
    again = m._inflight
    assert again.name != stuck.name
    m.test_saver.release(again.name)
    assert m.finish(timeout=WAIT) is True and m.last_committed_step == 20


@pytest.mark.parametrize("saver", SAVERS)
def test_a_commit_in_progress_at_a_load_is_waited_for_and_counted(make):
    """A save already committing when a rollback loads: the load waits for the commit (it is
    short), so the newest commit is the one loaded and nothing lands behind the load's back."""
    m = make(timeout=0.2)
    m.load()
    save = begin(m, 30)
    gate = threading.Event()
    original = m.catalog.commit

    def slow_commit(name, **kw):
        gate.wait(WAIT)
        return original(name, **kw)

    m.catalog.commit = slow_commit
    m.test_saver.release(save.name)
    wait_for(lambda: save.state is S.COMMITTING, "the commit to start")
    threading.Timer(0.1, gate.set).start()
    loaded = m.load(resume="latest")
    assert save.state is S.COMMITTED and loaded is not None and loaded.step == 30 and m.last_committed_step == 30


@pytest.mark.parametrize("saver", SAVERS)
def test_the_newest_commit_mark_ignores_a_commit_from_before_a_load(make):
    """The commit thread and a load both write the newest-commit mark: under one lock, and a
    commit of a save older than the current load does not move it."""
    m = make()
    m.load()
    save = begin(m, 40)
    generation = m.committer.generation
    m.committer.loaded(None)  # a load happened in between (fresh state)
    save.staged()
    save.advance(S.COMMITTING)
    m.test_saver.release(save.name)
    m.test_saver.join(save.name)
    m.committer.commit(save, {}, generation)
    assert save.state is S.COMMITTED and m.last_committed_step is None
