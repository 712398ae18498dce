"""Checkpoint/resume end to end: exact resume after SIGKILL, resharding resume, the failure
path, corrupt checkpoints, a different model, explicit resume, preemption."""

import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from elastic_trainer.checkpoint import layout, timeline
from tests import runs


def _launch_ok(cfg, *args, env=None):
    r = runs.run_launch(cfg, *args, env=env)
    assert r.returncode == 0, cfg.with_suffix(".log").read_text()[-4000:]
    return r


@pytest.fixture(scope="module")
def refs(tmp_path_factory, token_file):
    """Uninterrupted references: 10 steps at world 2 and at world 4."""
    out = {}
    for w in (2, 4):
        d = tmp_path_factory.mktemp(f"ref{w}")
        _launch_ok(runs.write_config(d / "c.toml", token_file, d / "run"), "--nproc-per-node", str(w))
        out[w] = d / "run"
    return out


def _committed_steps(ckpt: Path) -> list[int]:
    return sorted(layout.parse_step_dir(p.name) for p in ckpt.glob("step-*") if (p / "manifest.json").exists())


@pytest.mark.parametrize(
    "writer, interval, resumed",
    [
        ("thread", 5, 5),
        # the save of step 6 is the writer processes' third of the same kept staged copy (its
        # tensors handed over once, at step 2; steps 4 and 6 sent as references to them)
        ("process", 2, 6),
    ],
)
def test_sigkill_and_resume_is_bitwise_identical(tmp_path, token_file, refs, writer, interval, resumed):
    cfg = runs.write_config(
        tmp_path / "c.toml",
        token_file,
        tmp_path / "run",
        checkpoint={"writer": writer, "interval_steps": interval},
        elastic={"max_restarts": 1},
    )
    _launch_ok(cfg, env={"ELASTIC_TRAINER_INJECT_FAULT": f"kill@rank=1,step=8,committed={resumed}"})
    assert runs.step_losses(tmp_path / "run") == runs.step_losses(refs[2])
    restart = runs.read_events(tmp_path / "run", "restart")
    assert len(restart) == 1 and restart[0]["reason"] == "worker_failure"
    killed = [f for f in restart[0]["failures"] if f["exit_code"] == -9 or f.get("signal") == "SIGKILL"]
    assert [f["local_rank"] for f in killed] == [1], (
        f"the restart names the SIGKILLed rank 1 (one node: local = global rank): {restart[0]['failures']}"
    )
    (resume,) = runs.read_events(tmp_path / "run", "resume")
    assert resume["step"] == resumed and resume["world_size"] == 2
    # where the resume's time went: every phase between the worker's start and the resume, in order
    phases = resume["phases"]
    assert list(phases) == list(timeline.PHASES), phases
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= resume["since_start_seconds"] + 0.01
    dcp = phases["planning"] + phases["reading"] + phases["verifying"] + phases["set_state_dict"]
    assert 0 < dcp <= resume["load_seconds"] + 0.001, (dcp, resume["load_seconds"])  # DCP's part of the load
    assert resume["decision_reads"] >= 3, "a listing, the manifests, the chosen commit's .metadata"


def test_a_process_writer_without_room_in_shared_memory_falls_back_to_the_thread_writer(tmp_path, token_file, refs):
    """The process writer stages each rank's state in /dev/shm. With a 64 KiB /dev/shm (a mount
    namespace of its own; each rank's state is ~200 KiB, so neither rank's copy fits) the first
    save fails naming the shortage, every rank switches to the thread writer together, and the
    later saves commit; training is untouched."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare: a mount namespace with a small /dev/shm")
    cfg = runs.write_config(
        tmp_path / "c.toml", token_file, tmp_path / "run", checkpoint={"writer": "process", "interval_steps": 3}
    )
    r = runs.run_launch(cfg, "--nproc-per-node", "2", tmpfs=("/dev/shm", "64k"))
    assert r.returncode == 0, cfg.with_suffix(".log").read_text()[-4000:]
    run = tmp_path / "run"
    failed = runs.read_events(run, "checkpoint_failed")
    assert [f["step"] for f in failed] == [3], failed
    error = failed[0]["error"]
    assert "SharedMemoryFullError" in error and "bytes free in /dev/shm" in error, failed
    needed = int(re.search(r"this rank's state \([\d.]+ MiB = ([\d,]+) bytes\)", error).group(1).replace(",", ""))
    assert needed > 64 << 10, error  # the bytes of the state, named exactly (more than the 64 KiB mounted)
    fallback = runs.read_events(run, "checkpoint_writer_fallback")
    assert [f["writer"] for f in fallback] == ["thread"], fallback
    assert runs.read_events(run, "checkpoint_writer_restarted") == []
    assert _committed_steps(tmp_path / "run" / "ckpt") == [6, 9, 10]
    assert runs.step_losses(run) == runs.step_losses(refs[2])


def test_launch_s_checks_of_the_commit_to_resume_read_its_manifest_not_torch_s_dcp(refs):
    """A node joining a running job asks to join sooner: the checks before any worker starts
    (storage, the commit to resume, run identity, model fingerprint, data view) answer from the
    sealed manifest, without importing torch's DCP and torch.distributed.tensor (0.6 s). Also
    proves the manifest's data-view summary is that of the view the workers recorded: otherwise
    the check falls back to reading the view through DCP."""
    cfg = refs[2].parent / "c.toml"
    code = (
        "import sys\n"
        "from elastic_trainer.cli import _check_before_start\n"
        "from elastic_trainer.config import load_config\n"
        f"step = _check_before_start(load_config({str(cfg)!r}, []))\n"
        "heavy = [m for m in sys.modules if m.split('.')[:3] in (['torch', 'distributed', 'checkpoint'],"
        " ['torch', 'distributed', 'tensor'])]\n"
        "print(step, len(heavy), heavy[:3])\n"
    )
    r = runs.python_c(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[:2] == ["10", "0"], r.stdout


# Soak: the loss curve across a reshard is proven in every run by tests/e2e/test_ports.py (2 -> 3,
# two scripts under run) and test_user_models' parquet 2 -> 3; the state after 4 -> 2 and 2 -> 3
# exactly by tests/dist/test_reshard_state.py.
@pytest.mark.soak
@pytest.mark.parametrize("save_world, load_world", [(4, 2), (2, 3)])
def test_resharding_resume_continues_the_loss_curve(tmp_path, token_file, refs, save_world, load_world):
    run = tmp_path / "run"
    cfg = runs.write_config(tmp_path / "c.toml", token_file, run, train={"steps": 10}, checkpoint={"interval_steps": 5})
    # The first incarnation dies (injected failure, no restarts) right after committing step 5.
    cfg5 = runs.write_config(tmp_path / "c5.toml", token_file, run, checkpoint={"interval_steps": 5})
    r = runs.run_launch(
        cfg5, "--nproc-per-node", str(save_world), env={"ELASTIC_TRAINER_INJECT_FAULT": "raise@rank=0,step=6"}
    )
    assert r.returncode != 0 and _committed_steps(run / "ckpt") == [5]
    _launch_ok(cfg, "--nproc-per-node", str(load_world))
    (reshard,) = runs.read_events(run, "reshard")
    assert (reshard["from_world_size"], reshard["to_world_size"], reshard["step"]) == (save_world, load_world, 5)
    ref, got = runs.step_losses(refs[save_world]), runs.step_losses(run)
    assert sorted(got) == list(range(1, 11))
    for s in range(1, 6):
        assert got[s] == ref[s]
    for s in range(6, 11):
        assert runs.close_rel(got[s], ref[s], 1e-5), (s, got[s], ref[s])


def test_a_rank_that_raises_exits_fast_without_saving(tmp_path, token_file):
    run = tmp_path / "run"
    cfg = runs.write_config(tmp_path / "c.toml", token_file, run, checkpoint={"interval_steps": 5}, train={"steps": 10})
    t0 = time.monotonic()
    r = runs.run_launch(cfg, env={"ELASTIC_TRAINER_INJECT_FAULT": "raise@rank=1,step=7"}, timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode == 1
    (failure,) = [e for e in runs.read_events(run, "failure") if e["rank"] == 1]
    exit_event = runs.read_events(run, "supervisor_exit")[-1]
    assert exit_event["time"] - failure["time"] < 30, "the job must end within 30 s of the failure"
    assert elapsed < 120
    assert "injected failure on rank 1 at step 7" in failure["error"]
    assert _committed_steps(run / "ckpt") == [5], "latest committed checkpoint unchanged"
    assert sorted(p.name for p in (run / "ckpt").iterdir() if not p.name.startswith("_")) == ["step-00000005"], (
        "no save started on the failure path"
    )
    assert not runs.read_events(run, "checkpoint_failed")


@pytest.fixture
def finished_run(tmp_path, token_file, refs):
    """A copy of the world-2 reference run (checkpoints at 5 and 10) to damage."""
    run = tmp_path / "run"
    shutil.copytree(refs[2], run)
    for f in ("events.jsonl",):
        (run / f).unlink()
    return run


def _relaunch(tmp_path, token_file, run, steps=10, **sections):
    cfg = runs.write_config(tmp_path / "c2.toml", token_file, run, train={"steps": steps}, **sections)
    return cfg, runs.run_launch(cfg)


def test_truncated_shard_garbage_and_leftovers_fall_back(tmp_path, token_file, refs, finished_run):
    run = finished_run
    shard = run / "ckpt" / "step-00000010" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (run / "ckpt" / "junk").mkdir()
    (run / "ckpt" / "junk" / "x").write_text("not a checkpoint")
    leftover = run / "ckpt" / "step-00000012"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"partial")
    cfg, r = _relaunch(tmp_path, token_file, run)
    assert r.returncode == 0, cfg.with_suffix(".log").read_text()[-4000:]
    skipped = {e["step"]: e["reason"] for e in runs.read_events(run, "checkpoint_skipped")}
    assert set(skipped) == {12, 10}
    assert "uncommitted" in skipped[12] and "__1_0.distcp" in skipped[10] and "manifest says" in skipped[10]
    assert runs.read_events(run, "checkpoint_ignored")[0]["path"] == "junk"
    assert [e["step"] for e in runs.read_events(run, "checkpoint_cleaned")] == [12]
    assert not leftover.exists()
    (resume,) = runs.read_events(run, "resume")
    assert resume["step"] == 5
    assert runs.step_losses(run) == {s: v for s, v in runs.step_losses(refs[2]).items() if s > 5}


def test_missing_manifest_means_uncommitted(tmp_path, token_file, finished_run):
    (finished_run / "ckpt" / "step-00000010" / "manifest.json").unlink()
    cfg, r = _relaunch(tmp_path, token_file, finished_run)
    assert r.returncode == 0
    assert runs.read_events(finished_run, "resume")[0]["step"] == 5
    assert 10 in [e["step"] for e in runs.read_events(finished_run, "checkpoint_cleaned")]


def test_checkpoint_of_another_architecture_is_refused_before_start(tmp_path, token_file, finished_run):
    cfg = runs.write_config(tmp_path / "c3.toml", token_file, finished_run, model={"dim": 48})
    r = runs.run_launch(cfg)
    log = cfg.with_suffix(".log").read_text()
    assert r.returncode == 2
    assert "checkpoint does not match the model at 'model." in log and "different architecture" in log
    assert not runs.read_events(finished_run, "start"), "no worker may start"
    assert _committed_steps(finished_run / "ckpt") == [5, 10], "nothing deleted"


def test_resume_can_name_a_step_or_be_turned_off(tmp_path, token_file, refs, finished_run):
    cfg, r = _relaunch(tmp_path, token_file, finished_run, checkpoint={"resume": "5"})
    assert r.returncode == 0
    assert runs.read_events(finished_run, "resume")[0]["step"] == 5
    assert runs.step_losses(finished_run) == {s: v for s, v in runs.step_losses(refs[2]).items() if s > 5}
    bad = runs.write_config(tmp_path / "c4.toml", token_file, finished_run, checkpoint={"resume": "7"})
    r = runs.run_launch(bad)
    assert r.returncode == 2 and "checkpoint.resume" in bad.with_suffix(".log").read_text()
    fresh = tmp_path / "fresh"
    shutil.copytree(finished_run / "ckpt", fresh / "ckpt")
    cfg = runs.write_config(tmp_path / "c5.toml", token_file, fresh, checkpoint={"resume": "none"})
    _launch_ok(cfg)
    assert not runs.read_events(fresh, "resume")
    assert runs.step_losses(fresh) == runs.step_losses(refs[2])


# Soak: exit 75 with the final commit is proven at restart points by test_trust's preemption
# cases and for a user script by test_own_script; the exact resume after a preemption by
# test_slurm (USR1, requeue).
@pytest.mark.soak
def test_preemption_commits_exits_75_and_resumes_exactly(tmp_path, token_file):
    ref_run = tmp_path / "ref"
    _launch_ok(runs.write_config(tmp_path / "ref.toml", token_file, ref_run, train={"steps": 30}))
    run = tmp_path / "run"
    cfg = runs.write_config(tmp_path / "c.toml", token_file, run, train={"steps": 30})
    sup = runs.start_launch(cfg)
    try:
        runs.wait_event(run, "checkpoint_committed", timeout=120, proc=sup)
        sup.send_signal(signal.SIGTERM)
        code = sup.wait(timeout=90)
    finally:
        runs.stop(sup)
    assert code == 75
    (pre,) = runs.read_events(run, "preempted")
    assert pre["committed"] is True
    assert pre["step"] in _committed_steps(run / "ckpt")
    assert (run / "PREEMPTED").exists()
    _launch_ok(cfg)
    assert runs.read_events(run, "resume")[-1]["step"] == pre["step"]
    assert not (run / "PREEMPTED").exists()
    assert runs.step_losses(run) == runs.step_losses(ref_run)
