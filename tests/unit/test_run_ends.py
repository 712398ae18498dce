"""Every way a run ends, in one process: the :class:`~elastic_trainer.runtime.run.Run` of every
front end over an injected manager (the save machine's gated saver and scripted agreement), one
test per exit code — 0, 2, 65, 69, 73, 74, 75, 76, 79 — and the rollback and the replay that are not ends.

Each asserts the code, the event that says why, and the marker the supervisor reads.
"""

from __future__ import annotations

import json
import os
import types

import pytest
import torch

from elastic_trainer import contract, exit_codes
from elastic_trainer.checkpoint.catalog import Catalog
from elastic_trainer.checkpoint.manager import CheckpointManager
from elastic_trainer.config import config_from_dict
from elastic_trainer.events import EventLog, read_events
from elastic_trainer.metrics.sink import NullSink
from elastic_trainer.runtime.run import open_run
from elastic_trainer.runtime.session import PreemptionFlag, exit_code_for
from elastic_trainer.storage.fs import open_storage

from .fakes import WAIT, GatedSaver, ScriptedAgreement, Weights

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Runs:
    """Runs of one job in ``tmp_path``: each :meth:`open` is a new incarnation over the same
    checkpoint root, with its own fake session, manager and saver."""

    def __init__(self, tmp_path):
        self.root, self.run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
        os.makedirs(self.run_dir, exist_ok=True)
        self.made: list[CheckpointManager] = []

    def open(
        self, *, seed=0, on_nonfinite="stop", timeout=WAIT, hold_writing=False, identity=True, spike=0.0, exclude=False
    ):
        cfg = config_from_dict(
            {
                "run": {"dir": self.run_dir},
                "train": {"seed": seed, "on_nonfinite": on_nonfinite, "loss_spike_factor": spike},
                "checkpoint": {"dir": self.root, "save_timeout_seconds": timeout, "preempt_grace_seconds": timeout},
                "elastic": {"exclude_corrupt_node": exclude},
            }
        )
        events = EventLog(os.path.join(self.run_dir, contract.EVENTS_FILE))
        session = types.SimpleNamespace(
            cfg=cfg,
            rank=0,
            world_size=1,
            device=torch.device("cpu"),
            events=events,
            metrics=NullSink(),
            preempt=PreemptionFlag(),
            dist=types.SimpleNamespace(local_rank=0),
            mesh=types.SimpleNamespace(shape=(1,)),
            init_seconds=0.0,
            ready=0.0,
            started=0.0,
        )
        self.weights = Weights()
        identity_keys = {"train.seed": seed} if identity else None

        def manager(states):
            storage = open_storage(self.root)
            m = CheckpointManager(
                cfg.checkpoint,
                storage,
                {"model": self.weights},  # what the gated fake writer copies
                rank=0,
                world_size=1,
                mesh_shape=[1],
                group=None,
                fingerprint="f",
                events=events,
                remote=GatedSaver(storage, hold_writing=hold_writing),
                agreement=ScriptedAgreement(),
                run_identity=identity_keys,
            )
            self.made.append(m)
            return m

        self.model = torch.nn.Linear(2, 2)  # what a replay fingerprints
        run = open_run(session, model=self.model, manager=manager, run_identity=identity_keys)
        assert session.run is run
        return run

    def events(self, name):
        return [e for e in read_events(os.path.join(self.run_dir, contract.EVENTS_FILE)) if e["event"] == name]

    def marker(self):
        with open(os.path.join(self.run_dir, contract.PREEMPT_MARKER)) as f:
            return json.load(f)

    def close(self):
        for m in self.made:
            m.remote.close()
            m.close()


@pytest.fixture
def runs(tmp_path):
    r = Runs(tmp_path)
    yield r
    r.close()


def step(n, loss=1.0, **flags):
    """A step's context as the run reads it (the agreed flags); ``anomaly``: why the guard refused it."""
    anomaly = flags.get("anomaly", "non-finite" if flags.get("nonfinite") else None)
    return types.SimpleNamespace(
        step=n,
        loss=loss,
        grad_norm=1.0,
        anomaly=anomaly,
        spike_threshold=flags.get("spike_threshold"),
        fenced=flags.get("fenced", False),
        preempt=flags.get("preempt", False),
        nonfinite=anomaly is not None,
    )


def train(run, steps, total, interval=None):
    """Steps 1..``steps`` through ``after_step``; the code of the last (None: go on)."""
    code = None
    for n in range(1, steps + 1):
        run.state.step = n
        code = run.after_step(step(n), total)
        if code is not None:
            return code
    return code


def test_the_final_step_is_committed_and_the_run_exits_0(runs):
    run = runs.open()
    assert run.resume() == 0
    assert train(run, 3, total=3) == exit_codes.OK
    (finished,) = runs.events("finished")
    assert finished["step"] == 3 and finished["last_committed_step"] == 3
    assert Catalog(open_storage(runs.root)).plan_resume("latest").chosen.step == 3
    assert not os.path.exists(os.path.join(runs.run_dir, contract.PREEMPT_MARKER))


def test_resumed_at_the_end_the_run_saves_nothing_more_and_exits_0(runs):
    run = runs.open()
    run.resume()
    assert train(run, 2, total=2) == 0
    again = runs.open()
    assert again.resume() == 2
    assert again.after_step(None, 2) == exit_codes.OK
    assert [e["step"] for e in runs.events("checkpoint_committed")] == [2]


def test_a_changed_run_defining_key_stops_the_resume_with_2_naming_it(runs):
    run = runs.open(seed=0)
    run.resume()
    assert train(run, 1, total=1) == 0
    with pytest.raises(Exception) as e:
        runs.open(seed=7).resume()
    assert exit_code_for(e.value) == exit_codes.CONFIG == 2
    assert "train.seed" in str(e.value)


def test_a_non_finite_step_under_stop_exits_65_without_saving_it(runs):
    run = runs.open(on_nonfinite="stop")
    run.resume()
    assert train(run, 2, total=10) is None
    code = run.after_step(step(3, nonfinite=True), 10)
    assert code == exit_codes.NONFINITE == 65
    (stop,) = runs.events("nonfinite_stop")
    assert stop["last_finite_step"] == 2 and stop["reason"] == "train.on_nonfinite = stop"
    assert runs.events("nonfinite")[0]["step"] == 3
    assert runs.marker()["exit_code"] == 65
    assert runs.events("checkpoint_committed") == []


def test_a_non_finite_step_under_rollback_reloads_the_last_commit_and_goes_on(runs):
    run = runs.open(on_nonfinite="rollback")
    run.resume()
    run.state.step = 1
    runs.weights.w.fill_(1.0)
    run.save(1)
    runs.made[-1].settle(None)
    runs.weights.w.fill_(5.0)  # what the bad step left
    assert run.after_step(step(2, nonfinite=True), 10) is None
    (rollback,) = runs.events("rollback")
    assert rollback["to_step"] == 1 and torch.equal(runs.weights.w, torch.full((4,), 1.0))
    # a second one before any save after the rollback stops
    assert run.after_step(step(2, nonfinite=True), 10) == 65


def test_a_fenced_root_exits_73(runs):
    run = runs.open()
    run.resume()
    assert train(run, 1, total=10) is None
    Catalog(open_storage(runs.root)).fence.acquire("a-newer-launch")
    run.save(1)
    runs.made[-1].settle(None)
    assert run.after_step(step(2, fenced=True), 10) == exit_codes.FENCED == 73
    assert runs.events("fenced") and runs.marker()["exit_code"] == 73


def test_a_final_commit_that_fails_exits_74_and_says_so(runs):
    run = runs.open(hold_writing=True)
    run.resume()
    run.state.step = 1
    saver = runs.made[-1].remote
    code = None

    def fail_when_started():
        (name,) = saver.started
        saver.fail(name, OSError("no space left on device"))

    saver.start = _after(saver.start, fail_when_started)
    code = run.after_step(step(1), 1)
    assert code == exit_codes.FINAL_SAVE_FAILED == 74
    (failed,) = runs.events("final_checkpoint_failed")
    assert failed["step"] == 1 and failed["restartable"] is True
    assert runs.marker() == {"step": 1, "exit_code": 74, "committed_step": None, "restartable": True}


def test_preemption_commits_the_final_step_and_exits_75(runs):
    run = runs.open()
    run.resume()
    assert train(run, 2, total=10) is None
    run.session.preempt.signal_name, run.session.preempt.received_at = "SIGTERM", None
    assert run.after_step(step(3, preempt=True), 10) == exit_codes.PREEMPTED == 75
    (preempted,) = runs.events("preempted")
    assert preempted["committed"] is True and preempted["step"] == 2
    assert Catalog(open_storage(runs.root)).plan_resume("latest").chosen.step == 2
    assert runs.marker()["exit_code"] == 75 and runs.marker()["committed_step"] == 2


def test_preemption_whose_save_cannot_commit_in_the_grace_exits_76(runs):
    run = runs.open(hold_writing=True, timeout=0.3)
    run.resume()
    run.state.step = 2
    run.session.preempt.signal_name = "SIGTERM"
    assert run.after_step(step(3, preempt=True), 10) == exit_codes.PREEMPTED_UNCOMMITTED == 76
    (preempted,) = runs.events("preempted")
    assert preempted["committed"] is False
    assert runs.marker()["exit_code"] == 76


def _after(method, then):
    def wrapped(*args, **kwargs):
        out = method(*args, **kwargs)
        then()
        return out

    return wrapped


def _commit_step_1(runs, run):
    run.resume()
    run.state.step = 1
    runs.weights.w.fill_(1.0)
    run.save(1)
    runs.made[-1].settle(None)


def _replay(run, steps, anomalous=()):
    """The replay's steps: each starts (the run's step hooks) and ends; ``anomalous`` ones are refused."""
    code = None
    for n in steps:
        run.hooks.begin_step(n, 0.0)
        code = run.after_step(step(n, nonfinite=n in anomalous), 10)
    return code


def test_a_replay_that_does_not_reproduce_the_anomaly_names_the_rank_and_skips_nothing(runs):
    run = runs.open(on_nonfinite="replay")
    _commit_step_1(runs, run)
    clean = {k: v.clone() for k, v in runs.model.state_dict().items()}
    with torch.no_grad():
        runs.model.bias[1] += 1.0  # a fault in the state step 3 starts from
    assert run.after_step(step(2), 10) is None
    assert run.after_step(step(3, loss=50.0, anomaly="loss spike", spike_threshold=3.0), 10) is None
    (spike,) = runs.events("loss_spike")
    assert spike["threshold"] == 3.0 and spike["action"] == "replay"
    (replay,) = runs.events("anomaly_replay")
    assert (replay["step"], replay["from_step"], replay["reason"]) == (3, 1, "loss spike")
    assert torch.equal(runs.weights.w, torch.full((4,), 1.0)), "the newest commit was reloaded"
    runs.model.load_state_dict(clean)  # the replay computes right
    assert _replay(run, (2, 3)) is None
    (sdc,) = runs.events("silent_corruption")
    assert (sdc["rank"], sdc["node"], sdc["ranks"], sdc["tensor"]) == (0, 0, [0], "bias")
    assert (sdc["loss"], sdc["replayed_loss"], sdc["from_step"]) == (50.0, 1.0, 1)
    assert not runs.events("rollback") and not runs.events("anomaly_reproduced") and run.state.skipped == []
    assert run.replayer.pending is None


@pytest.mark.parametrize("node,code", [(0, exit_codes.EXCLUDED), (1, exit_codes.REGROUP)])
def test_with_exclude_corrupt_node_the_replayed_step_is_committed_and_the_round_ends(runs, monkeypatch, node, code):
    """Two nodes of one rank each; rank 0's state was the one that differed. Its node's ranks
    exit 69 (their supervisor leaves the job), the other node's 79 (theirs re-form the group),
    both after the replayed step is committed."""
    run = runs.open(on_nonfinite="replay", exclude=True)
    monkeypatch.setenv(contract.LOCAL_WORLD_SIZE_ENV, "1")
    run.session.world_size, run.session.rank = 2, node  # this rank's node; the replay compares rank 0's state
    _commit_step_1(runs, run)
    clean = {k: v.clone() for k, v in runs.model.state_dict().items()}
    with torch.no_grad():
        runs.model.bias[1] += 1.0
    assert run.after_step(step(3, loss=50.0, anomaly="loss spike", spike_threshold=3.0), 10) is None
    runs.model.load_state_dict(clean)
    assert _replay(run, (2, 3)) == code
    (sdc,) = runs.events("silent_corruption")
    assert sdc["node"] == 0
    (excluded,) = runs.events("node_excluded")
    assert excluded == {**excluded, "step": 3, "node": 0, "nodes": 2, "committed": True}, excluded
    assert runs.made[-1].is_committed(3), "the others go on from the replayed step"
    assert runs.marker()["exit_code"] == code


def test_exclude_corrupt_node_on_a_single_node_goes_on(runs):
    run = runs.open(on_nonfinite="replay", exclude=True)
    _commit_step_1(runs, run)
    with torch.no_grad():
        runs.model.bias[1] += 1.0
    assert run.after_step(step(3, nonfinite=True), 10) is None
    runs.model.bias.data[1] -= 1.0
    assert _replay(run, (2, 3)) is None
    assert runs.events("silent_corruption") and not runs.events("node_excluded")


def test_a_replay_that_reproduces_the_anomaly_skips_its_samples_as_a_rollback_does(runs):
    run = runs.open(on_nonfinite="replay")
    _commit_step_1(runs, run)
    assert run.after_step(step(3, nonfinite=True), 10) is None
    assert _replay(run, (2, 3), anomalous=(3,)) is None
    (reproduced,) = runs.events("anomaly_reproduced")
    assert reproduced["step"] == 3 and reproduced["from_step"] == 1
    (rollback,) = runs.events("rollback")
    assert rollback["from_step"] == 3 and rollback["to_step"] == 1 and run.state.skipped == [rollback["skipped_range"]]
    assert not runs.events("silent_corruption")


def test_another_anomaly_during_a_replay_stops_with_65(runs):
    run = runs.open(on_nonfinite="replay")
    _commit_step_1(runs, run)
    assert run.after_step(step(3, nonfinite=True), 10) is None
    assert _replay(run, (2,), anomalous=(2,)) == exit_codes.NONFINITE
    (stop,) = runs.events("nonfinite_stop")
    assert stop["reason"] == "another anomaly, at step 2, while replaying step 3"


def test_a_replay_without_a_commit_to_go_back_to_stops_with_65(runs):
    run = runs.open(on_nonfinite="replay")
    run.resume()
    assert run.after_step(step(1, nonfinite=True), 10) == exit_codes.NONFINITE
    (stop,) = runs.events("nonfinite_stop")
    assert stop["reason"] == "no committed checkpoint to roll back to"
    assert not runs.events("anomaly_replay")
