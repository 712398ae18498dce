"""A checkpoint file system that fills up: no futile restart, a cause a person can read."""

import os
import shutil

import pytest

from tests import runs


def test_a_full_checkpoint_file_system_ends_74_at_once_naming_the_cause(tmp_path, token_file):
    """``checkpoint.dir`` on its own small tmpfs (a mount namespace of the test's): the first
    commits fit, then saves fail with ENOSPC while training goes on. The final save fails for a
    cause no restart can change: the run ends 74 without the supervisor restarting the group
    (restarts were allowed), and every ``checkpoint_failed`` event names the cause on one line."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare: a mount namespace with a small file system for checkpoint.dir")
    run = tmp_path / "run"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = runs.write_config(
        tmp_path / "c.toml",
        token_file,
        run,
        str(ckpt),
        train={"steps": 12},
        checkpoint={"interval_steps": 2, "keep_last": 10},
        elastic={"max_restarts": 2},
    )
    r = runs.run_launch(cfg, "--nproc-per-node", "2", tmpfs=(str(ckpt), "1200k"))
    text = cfg.with_suffix(".log").read_text()
    assert r.returncode == 74, text[-4000:]
    assert runs.read_events(run, "restart") == [], "a restart cannot make room: the group is not restarted"
    assert len(runs.read_events(run, "start")) == 1, "one incarnation of the group"
    committed = runs.read_events(run, "checkpoint_committed")
    failed = runs.read_events(run, "checkpoint_failed")
    assert committed and failed, (committed, failed)
    for f in failed:
        assert len(f["error"].strip().splitlines()) == 1 and "Traceback" not in f["error"], f  # one line
    # which write meets the full disk first varies; a short write inside torch.save's zip writer reaches
    # us as torch's own RuntimeError ("unexpected pos"), its errno lost: the others name errno and file
    named = [f for f in failed if "[Errno 28] No space left on device" in f["error"] and ".distcp" in f["error"]]
    assert named and named[-1]["step"] == 12, failed
    (fin,) = runs.read_events(run, "final_checkpoint_failed")
    assert fin["step"] == 12 and fin["restartable"] is False and "No space left on device" in fin["reason"], fin
    (stopped,) = runs.read_events(run, "job_stopped")
    assert stopped["exit_code"] == 74
    assert "Traceback" in text and "No space left on device" in text  # the traceback went to the log
