"""A checkpoint file system that fills up: no futile restart, a cause a person can read."""

import os
import shlex
import shutil
import subprocess

import pytest

from elastic_trainer import report
from tests import runs

# each test mounts a small tmpfs in a mount namespace of its own (runs.run_launch's tmpfs=)
SMALL_FILE_SYSTEM = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare: a mount namespace with a small file system",
)


@SMALL_FILE_SYSTEM
def test_a_full_checkpoint_file_system_ends_74_at_once_naming_the_cause(tmp_path, token_file):
    """``checkpoint.dir`` on its own small tmpfs (a mount namespace of the test's): the first
    commits fit, then saves fail with ENOSPC while training goes on. The final save fails for a
    cause no restart can change: the run ends 74 without the supervisor restarting the group
    (restarts were allowed), and every ``checkpoint_failed`` event names the cause on one line."""
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


@SMALL_FILE_SYSTEM
def test_two_nodes_with_their_own_run_dirs_both_end_74_at_once_on_a_full_disk(tmp_path, token_file, store):
    """Two nodes (one supervisor and one worker each, ``--nnodes 2``), each with its own
    ``run.dir`` as on two machines, one ``checkpoint.dir`` on a small tmpfs: the node without
    rank 0 must not restart its worker for a final save no restart can change (it would wait
    for a rendezvous its peer never joins): both supervisors end 74, neither restarts."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = runs.write_config(
        tmp_path / "c.toml",
        token_file,
        tmp_path / "unused",
        str(ckpt),
        train={"steps": 12},
        checkpoint={"interval_steps": 2, "keep_last": 10},
        elastic={"max_restarts": 2},
    )
    nodes = {"a": "127.0.0.2", "b": "127.0.0.3"}  # a sorts first: rank 0
    lines = [f"mount -t tmpfs -o size=1200k tmpfs {shlex.quote(str(ckpt))} || exit 90"]
    for name, addr in nodes.items():
        args = runs.launch_args(
            cfg,
            *("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", store, "--rdzv-id", "full"),
            *("--local-addr", addr, "--set", f"run.dir={tmp_path / name}"),
        )
        lines.append(f"{shlex.join(args)} > {shlex.quote(str(tmp_path / name))}.log 2>&1 & {name}=$!")
    lines += ["wait $a; echo $? > a.code", "wait $b; echo $? > b.code"]
    subprocess.run(
        ["unshare", "-m", "sh", "-c", "\n".join(lines)],
        cwd=tmp_path,
        env=runs.env_for_tests(),
        timeout=180,
        check=True,
    )
    for name in nodes:
        log = (tmp_path / f"{name}.log").read_text()
        assert (tmp_path / f"{name}.code").read_text().strip() == "74", log[-4000:]
        assert runs.read_events(tmp_path / name, "restart") == [], f"node {name} restarted its group"
        (stopped,) = runs.read_events(tmp_path / name, "job_stopped")
        assert stopped["exit_code"] == 74, stopped
    (fin,) = runs.read_events(tmp_path / "a", "final_checkpoint_failed")
    assert fin["restartable"] is False and "No space left on device" in fin["reason"], fin


@SMALL_FILE_SYSTEM
def test_a_full_run_dir_drops_events_and_training_goes_on_to_its_final_commit(tmp_path, token_file):
    """``run.dir`` (event log, resolved config, marker) on a tiny tmpfs that fills after a few
    steps: the event log is a record, not a dependency. The job trains to the end and commits
    its final step in ``checkpoint.dir`` (exit 0; was: rank 0 and then the supervisor died on
    ENOSPC, the job failed), one warning per process names the log, and the closing summary says
    the log is incomplete instead of presenting its last step as the end."""
    run = tmp_path / "run"
    run.mkdir()
    ckpt = tmp_path / "ckpt"
    steps = 40
    cfg = runs.write_config(tmp_path / "c.toml", token_file, run, str(ckpt), train={"steps": steps})
    r = runs.run_launch(cfg, "--nproc-per-node", "2", tmpfs=(str(run), "12k"))
    text = cfg.with_suffix(".log").read_text()
    assert r.returncode == 0, text[-4000:]
    assert "No space left on device" in text and "events are dropped" in text, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert report.INCOMPLETE_LOG in text
    listing = subprocess.run(
        [*runs.CLI, "ckpt", "list", str(ckpt)], capture_output=True, text=True, timeout=120, env=runs.env_for_tests()
    )
    head = [line.split() for line in listing.stdout.splitlines() if " head " in f" {line} "]
    assert head and int(head[0][0]) == steps, listing.stdout


@SMALL_FILE_SYSTEM
def test_a_full_local_tier_fails_its_copies_by_name_and_training_and_commits_go_on(tmp_path, token_file):
    """``checkpoint.local_dir`` on a tmpfs with room for one copy of each rank: the copies after it
    fail with ENOSPC. Each failed copy is a ``checkpoint_local_failed`` event naming the cause and
    the file on one line (the traceback once per rank in the log); ``checkpoint.dir`` commits every
    ``remote_every``-th save as before; the run is not restarted and ends 0."""
    run = tmp_path / "run"
    local = tmp_path / "local"
    local.mkdir()
    cfg = runs.write_config(
        tmp_path / "c.toml",
        token_file,
        run,
        train={"steps": 12},
        checkpoint={"interval_steps": 2, "local_dir": str(local), "remote_every": 3},
        elastic={"max_restarts": 2},
    )
    r = runs.run_launch(cfg, "--nproc-per-node", "2", tmpfs=(str(local), "600k"))
    text = cfg.with_suffix(".log").read_text()
    assert r.returncode == 0, text[-4000:]
    assert runs.read_events(run, "restart") == []
    assert [e["step"] for e in runs.read_events(run, "checkpoint_committed")] == [6, 12]
    saved = [e["step"] for e in runs.read_events(run, "checkpoint_local_saved")]
    failed = runs.read_events(run, "checkpoint_local_failed")
    assert saved[:1] == [2] and failed, (saved, failed)
    assert sorted(saved + [e["step"] for e in failed]) == [2, 4, 6, 8, 10, 12]  # each copy: one or the other
    for f in failed:
        assert len(f["error"].splitlines()) == 1, f
        assert f["error"].startswith("OSError: [Errno 28] No space left on device: ") and str(local) in f["error"], f
    logged = text.count("failed on this rank: OSError: [Errno 28]")
    assert logged >= len(failed) and text.count("Traceback") < logged  # a traceback at a run's first only
