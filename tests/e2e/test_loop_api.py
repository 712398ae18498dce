"""Truthful ends and agreeing paths for a user's script and the built-in trainer: Ctrl-C (SIGINT)
is a preemption (final commit, exit 75), a final save that fails ends with 74, ``run`` without
``--config`` uses the script's own paths (never the demo's), a script that asks for another
checkpoint root than its supervisor's stops with exit 2, and the own-script docs' S3 command
checkpoints to the configured root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from elastic_trainer.checkpoint.catalog import Catalog
from elastic_trainer.storage.fs import open_storage
from tests import runs

EXAMPLE = str(runs.REPO / "examples" / "train_fsdp.py")
EVOLVE = str(runs.REPO / "tests" / "e2e" / "run_scripts" / "evolve_script.py")


def test_sigint_to_launch_commits_the_final_step_and_exits_75(tmp_path, token_file):
    """Ctrl-C sends SIGINT to the supervisor's process group: the workers stop at the next step
    boundary with the final step committed (it was step 10's save at a save every 10 steps)."""
    run = tmp_path / "run"
    cfg = runs.write_config(
        tmp_path / "c.toml", token_file, run, train={"steps": 400}, checkpoint={"interval_steps": 10}
    )
    sup = runs.start_launch(cfg)
    try:
        runs.wait_event(run, "step", 180, sup, where=lambda r: r["step"] >= 12)
        os.killpg(sup.pid, signal.SIGINT)
        code = sup.wait(120)
    finally:
        runs.stop(sup)
    assert code == 75, cfg.with_suffix(".log").read_text()[-4000:]
    (pre,) = runs.read_events(run, "preempted")
    assert pre["committed"] is True and pre["step"] >= 12
    head = Catalog(open_storage(str(run / "ckpt"))).head()
    assert head is not None and head.step == pre["step"], "a commit of the final step exists"


def test_a_final_save_that_fails_exits_74_with_an_event(tmp_path):
    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    ckpt.mkdir()
    (ckpt / "step-00000004").write_text("a file where the final save's directory must go")
    env = {
        k: v
        for k, v in runs.env_for_tests().items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    r = subprocess.run(
        [sys.executable, EVOLVE, "--steps", "4", "--ckpt", str(ckpt), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=runs.REPO,
        timeout=120,
    )
    assert r.returncode == 74, r.stderr[-3000:]
    (ev,) = runs.read_events(run_dir, "final_checkpoint_failed")
    assert ev["step"] == 4 and ev["last_committed_step"] is None
    assert not runs.read_events(run_dir, "finished")


def test_run_without_config_uses_the_scripts_own_paths_and_refuses_a_disagreeing_script(tmp_path):
    args = [*runs.CLI, "run", "--set", "metrics.port=0", "--nproc-per-node", "2", "--monitor-interval", "0.2"]
    # the script's et.init asks for a save every 5 steps: the command line's 2 wins (one rule)
    r = subprocess.run(
        [*args, "--set", "checkpoint.interval_steps=2", EXAMPLE, "--steps", "5", "--dropout", "0"],
        capture_output=True,
        text=True,
        env=runs.env_for_tests(),
        cwd=tmp_path,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    own = tmp_path / "runs" / "train_fsdp"
    assert not (tmp_path / "runs" / "demo").exists(), "the demo's paths are never used"
    assert runs.read_events(own, "finished") and Catalog(open_storage(str(own / "checkpoints"))).head().step == 5
    assert [e["step"] for e in runs.read_events(own, "checkpoint_committed")] == [2, 4, 5]
    assert "checkpoint.interval_steps=5" in r.stderr, "the script's value that was not used is logged"
    assert runs.read_events(own, "launch"), "the supervisor's events and the script's are one log"
    # The script asks for another checkpoint root than its supervisor's: exit 2, one attempt.
    r = subprocess.run(
        [
            *args,
            "--max-restarts",
            "2",
            EVOLVE,
            "--steps",
            "2",
            "--ckpt",
            str(tmp_path / "elsewhere"),
            "--run-dir",
            "runs/evolve_script",
        ],
        capture_output=True,
        text=True,
        env=runs.env_for_tests(),
        cwd=tmp_path,
        timeout=240,
    )
    assert r.returncode == 2 and "config error at 'checkpoint.dir'" in r.stderr and "supervisor" in r.stderr, r.stderr[
        -3000:
    ]
    assert not runs.read_events(tmp_path / "runs" / "evolve_script", "restart")
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.s3
def test_the_own_script_s3_command_writes_to_the_configured_root(tmp_path, s3_server, s3_bucket):
    env = runs.env_for_tests(
        {
            "AWS_ACCESS_KEY_ID": s3_server.access_key,
            "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
            "AWS_DEFAULT_REGION": s3_server.region,
        }
    )
    args = [
        *runs.CLI,
        "run",
        "--nproc-per-node",
        "2",
        "--set",
        f"checkpoint.dir=s3://{s3_bucket}/run",
        "--set",
        f"checkpoint.s3_endpoint_url={s3_server.endpoint_url}",
        "--set",
        "metrics.port=0",
        EXAMPLE,
        "--steps",
        "5",
    ]
    try:
        r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    except subprocess.TimeoutExpired as e:  # say where it stood: its events and its log's end
        events = [(ev.get("event"), ev.get("step")) for ev in runs.read_events(tmp_path / "runs" / "train_fsdp")]
        log = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        pytest.fail(f"still running after {e.timeout:.0f}s; events {events}; log:\n{log[-4000:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    fs = s3_server.fs()
    assert sorted(p.rsplit("/", 2)[-2] for p in fs.glob(f"{s3_bucket}/run/step-*/manifest.json")) == ["step-00000005"]
    assert not (tmp_path / "runs" / "train_fsdp" / "checkpoints").exists(), "nothing on local disk"


_MANY_RANKS = """
import torch
import elastic_trainer as et
from torch.utils.data import DataLoader, TensorDataset

session = et.init()
model = torch.nn.Linear(4, 1)
for p in model.parameters():
    torch.distributed.broadcast(p.data, 0)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)))
ckpt = et.Checkpointer(session, model=model, optimizer=opt, data=DataLoader(data, batch_size=2, shuffle=True))
for step, (x,) in ckpt.steps(2):
    assert x.shape[0] <= 2, x.shape
    ckpt.optimizer_step(model(x).pow(2).mean())
session.close()
"""


def test_twenty_ranks_start_without_a_global_batch_set(tmp_path):
    """No default caps the world size: the global batch of a run that sets none is the loader's
    ``batch_size`` × processes of its first launch (2 × 20 here)."""
    script = tmp_path / "many.py"
    script.write_text(_MANY_RANKS)
    run_dir = tmp_path / "run"
    args = runs.run_args(run_dir, tmp_path / "ckpt", str(script), nproc=20, max_restarts=0)
    r = runs.run_cli(args, runs.env_for_tests(), 300)
    assert r.returncode == 0, r.stderr[-4000:]
    steps = runs.read_events(run_dir, "step")
    assert [e["step"] for e in steps] == [1, 2] and {e["world_size"] for e in steps} == {20}
