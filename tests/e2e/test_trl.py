"""TRL's ``SFTTrainer`` on elastic_trainer by one class line (examples/trl_sft.py), with the real
``trl`` package on CPU (gloo, under ``elastic-trainer run``): examples of their own length, padded
per micro-batch, the loss normalised by the step's token count. Float32 and no dropout, so that
one uninterrupted run is the reference of both checks: a SIGKILLed worker → the same losses bit
for bit; 2 workers stopped after a commit, 3 continuing → within 1e-5 (micro-batches of other
sizes and paddings at 3)."""

from __future__ import annotations

import inspect
import shutil
import time

import pytest

from tests import runs

pytest.importorskip("trl")

EXAMPLE = str(runs.REPO / "examples" / "trl_sft.py")
STEPS = 9


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    d = tmp_path_factory.mktemp("trl")
    shutil.copy(inspect.getsourcefile(inspect), d / "corpus.txt")
    return d


def launch(tmp, name: str, *, nproc: int = 2, env=None, max_restarts: int = 0, want: int = 0):
    run_dir, ckpt = tmp / name, tmp / f"{name}-ckpt"
    run_dir.mkdir(exist_ok=True)
    script = [EXAMPLE, "--train-files", str(tmp / "corpus.txt"), "--output-dir", str(tmp / f"{name}-out")]
    script += ["--steps", str(STEPS), "--save-steps", "3", "--dropout", "0", "--no-bf16"]
    args = runs.run_args(run_dir, ckpt, *script, nproc=nproc, max_restarts=max_restarts)
    with open(run_dir / "run.log", "ab") as out:
        r = runs.run_cli(args, runs.env_for_tests(env), 240, out)
    assert r.returncode == want, (run_dir / "run.log").read_text()[-5000:]
    return run_dir


@pytest.fixture(scope="module")
def reference(tmp):
    losses = runs.step_losses(launch(tmp, "ref"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def test_a_sigkilled_worker_resumes_with_the_same_losses_bit_for_bit(tmp, reference):
    run_dir = launch(
        tmp, "kill", env={"ELASTIC_TRAINER_INJECT_FAULT": "kill@rank=1,step=8,committed=6"}, max_restarts=1
    )
    (resume,) = runs.read_events(run_dir, "resume")
    assert resume["step"] == 6
    assert runs.step_losses(run_dir) == reference
    assert [e["warm"] for e in runs.read_events(run_dir, "workers_started")] == [True, True]  # from the zygote


def test_three_workers_continue_what_two_committed_within_1e_5(tmp, reference):
    started = time.monotonic()
    launch(tmp, "grow", env={"ELASTIC_TRAINER_INJECT_FAULT": "raise@rank=0,step=7,committed=6"}, want=1)
    # the raising rank's exit starts no collective: its peer is not left waiting for the hang watchdog (120 s)
    assert time.monotonic() - started < 60
    run_dir = launch(tmp, "grow", nproc=3)
    (reshard,) = runs.read_events(run_dir, "reshard")
    assert (reshard["from_world_size"], reshard["to_world_size"]) == (2, 3)
    got = runs.step_losses(run_dir)
    assert set(got) == set(range(1, STEPS + 1))
    for step in sorted(got):
        assert runs.close_rel(got[step], reference[step], 1e-5), (step, got[step], reference[step])
