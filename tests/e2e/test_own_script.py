"""A user's own FSDP2 script (examples/train_fsdp.py, public API only) gets the guarantees.

Under ``elastic-trainer run``: SIGKILL of a worker → resume with bitwise-equal losses (with
dropout: per-rank RNG is restored); 2 → 3 workers → within 1e-5; SIGTERM → the final step
committed and exit 75. Under plain ``torchrun`` (no supervisor): it still checkpoints and
resumes exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from elastic_trainer.checkpoint.catalog import Catalog
from elastic_trainer.storage.fs import open_storage
from tests import runs
from tests.fixtures.procs import free_port

SCRIPT = str(runs.REPO / "examples" / "train_fsdp.py")
HANG_S = 5  # elastic.hang_timeout_seconds of the hung-rank test: the smallest the config accepts


def run_script(
    tmp,
    name: str,
    *script_args: str,
    nproc: int = 2,
    env: dict | None = None,
    max_restarts: int = 0,
    timeout: float = 240,
    run_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """The example under ``elastic-trainer run`` (the paths are the supervisor's: the script sets none)."""
    run_dir = tmp / name
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = tmp / (name + "-ckpt")
    args = runs.run_args(run_dir, ckpt, *run_args, SCRIPT, *script_args, nproc=nproc, max_restarts=max_restarts)
    with open(run_dir / "run.log", "ab") as out:
        return runs.run_cli(args, runs.env_for_tests(env), timeout, out)


def _paths(run_dir, ckpt) -> list[str]:
    """The example's own overrides for its paths (without ``run``, nobody else sets them)."""
    return ["--set", f"run.dir={run_dir}", "--set", f"checkpoint.dir={ckpt}"]


def _ok(r, tmp, name):
    assert r.returncode == 0, (tmp / name / "run.log").read_text()[-4000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("own-ref")
    _ok(run_script(tmp, "ref", "--steps", "12"), tmp, "ref")
    _ok(run_script(tmp, "ref0", "--steps", "12", "--dropout", "0"), tmp, "ref0")
    return {"dropout": runs.step_losses(tmp / "ref"), "plain": runs.step_losses(tmp / "ref0")}


def test_sigkill_restart_is_forked_from_the_zygote_and_resumes_bitwise_with_dropout(tmp_path, reference):
    """Warm restarts for 'run': both generations are forked from the zygote (fresh PIDs), which
    preloaded the script's imports; the resume is bitwise equal to the uninterrupted run."""
    r = run_script(
        tmp_path,
        "k",
        "--steps",
        "12",
        max_restarts=1,
        env={"ELASTIC_TRAINER_INJECT_FAULT": "kill@rank=1,step=8,committed=5"},
    )
    _ok(r, tmp_path, "k")
    started = runs.read_events(tmp_path / "k", "workers_started")
    assert [w["warm"] for w in started] == [True, True] and len({w["zygote_pid"] for w in started}) == 1, started
    assert [w["zygote_forked"] for w in started] == [True, True]  # one torch import on the node, not two
    assert not set(started[0]["pids"]) & set(started[1]["pids"])
    assert not runs.read_events(tmp_path / "k", "warm_start_unavailable")
    (resume,) = runs.read_events(tmp_path / "k", "resume")
    assert resume["step"] == 5 and resume["rng"] == "restored"
    assert runs.step_losses(tmp_path / "k") == reference["dropout"], "bitwise equal to the uninterrupted run"


def test_no_warm_start_starts_the_script_as_torchrun_does(tmp_path):
    _ok(run_script(tmp_path, "cold", "--steps", "1", nproc=1, run_args=("--no-warm-start",)), tmp_path, "cold")
    (started,) = runs.read_events(tmp_path / "cold", "workers_started")
    assert started["warm"] is False and started["zygote_pid"] is None


# Soak: tests/e2e/test_ports.py resumes a script under `run` at 3 workers from what 2 committed
# (within 1e-5) in every run, for two scripts.
@pytest.mark.soak
def test_two_to_three_workers_within_1e5(tmp_path, reference):
    r = run_script(
        tmp_path, "g", "--steps", "12", "--dropout", "0", env={"ELASTIC_TRAINER_INJECT_FAULT": "raise@rank=0,step=11"}
    )
    assert r.returncode != 0
    _ok(run_script(tmp_path, "g", "--steps", "12", "--dropout", "0", nproc=3), tmp_path, "g")
    (reshard,) = runs.read_events(tmp_path / "g", "reshard")
    assert (reshard["from_world_size"], reshard["to_world_size"], reshard["step"]) == (2, 3, 10)
    got, ref = runs.step_losses(tmp_path / "g"), reference["plain"]
    assert sorted(got) == list(range(1, 13))
    for step in (11, 12):
        assert abs(got[step] - ref[step]) <= 1e-5 * abs(ref[step]), (step, got[step], ref[step])


def test_sigterm_commits_the_final_step_and_exits_75(tmp_path):
    run_dir = tmp_path / "p"
    run_dir.mkdir()
    ckpt = tmp_path / "p-ckpt"
    args = runs.run_args(run_dir, ckpt, SCRIPT, "--steps", "400")
    code = runs.signal_at_step(args, run_dir, 7)
    (pre,) = runs.read_events(run_dir, "preempted")
    assert code == 75 and pre["committed"] is True, (run_dir / "run.log").read_text()[-3000:]
    head = Catalog(open_storage(str(ckpt))).head()
    assert head is not None and head.step == pre["step"], "a commit of the final step exists in storage"


# Soak: plain torchrun's bitwise resume is proven in every run by the restart test below, and a
# separate later torchrun launch resuming a checkpoint by the world-of-one test.
@pytest.mark.soak
def test_plain_torchrun_checkpoints_and_resumes_exactly(tmp_path, reference):
    run_dir, ckpt = tmp_path / "t", tmp_path / "t-ckpt"

    def torchrun(steps: int) -> None:
        args = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            SCRIPT,
            *_paths(run_dir, ckpt),
            "--steps",
            str(steps),
        ]
        r = runs.run_cli(args, runs.env_for_tests(), 240)
        assert r.returncode == 0, r.stderr[-3000:]

    torchrun(8)
    torchrun(12)
    (resume,) = runs.read_events(run_dir, "resume")
    assert resume["step"] == 8
    assert runs.step_losses(run_dir) == reference["dropout"], (
        "plain torchrun: the resumed run equals the uninterrupted one bitwise"
    )


def test_plain_torchrun_restart_resumes_exactly(tmp_path, reference):
    """torchrun's default (static) rendezvous keeps one store across restarts: the restarted
    group must not read the killed group's addresses (it used to hang, then fail)."""
    run_dir, ckpt = tmp_path / "s", tmp_path / "s-ckpt"
    # The restarted rank 0 starts late, so rank 1 always finds the killed rank 0's address first.
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '0' and "
        "os.environ.get('TORCHELASTIC_RESTART_COUNT') == '1':\n    time.sleep(4)\n"
    )
    env = runs.env_for_tests({"ELASTIC_TRAINER_INJECT_FAULT": "kill@rank=1,step=8,committed=5"})
    env["PYTHONPATH"] = f"{hook}{os.pathsep}{env['PYTHONPATH']}"
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.2",
        SCRIPT,
        *_paths(run_dir, ckpt),
        "--steps",
        "12",
    ]
    r = runs.run_cli(args, env, 240)
    assert r.returncode == 0, r.stderr[-3000:]
    (resume,) = runs.read_events(run_dir, "resume")
    assert resume["step"] == 5
    assert runs.step_losses(run_dir) == reference["dropout"], (
        "plain torchrun restart: bitwise equal to the uninterrupted run"
    )


def test_plain_python_is_a_world_of_one_and_torchrun_reshards_it_to_two(tmp_path, reference):
    """``python script.py`` (no launcher, no port) trains and commits as one process; a later
    ``torchrun`` at 2 workers resumes it through DCP, within 1e-5 of a 2-worker run."""
    run_dir, ckpt = tmp_path / "p", tmp_path / "p-ckpt"
    script = [SCRIPT, *_paths(run_dir, ckpt), "--dropout", "0"]
    env = {
        k: v
        for k, v in runs.env_for_tests().items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    r = subprocess.run(
        [sys.executable, *script, "--steps", "6"], capture_output=True, text=True, env=env, cwd=runs.REPO, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (finished,) = runs.read_events(run_dir, "finished")
    assert finished["last_committed_step"] == 6
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            *script,
            "--steps",
            "12",
        ],
        capture_output=True,
        text=True,
        env=runs.env_for_tests(),
        cwd=runs.REPO,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (reshard,) = runs.read_events(run_dir, "reshard")
    assert (reshard["from_world_size"], reshard["to_world_size"], reshard["step"]) == (1, 2, 6)
    got, ref = runs.step_losses(run_dir), reference["plain"]
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert abs(got[step] - ref[step]) <= 1e-5 * abs(ref[step]), (step, got[step], ref[step])


@pytest.mark.s3
@pytest.mark.timeout(300)
def test_a_raising_rank_of_a_script_exits_within_seconds_while_a_save_is_stuck_uploading(
    tmp_path, s3_server, s3_bucket, fault_proxy
):
    """Rank 0 of the user's script raises at step 12 while the save of step 10 is held by the
    storage for 90 s: the job still ends within seconds of the failure (a 10 s drain, then the
    script's exit does not wait for the upload thread), exit 1, and the latest commit stays 5."""
    run_dir, ckpt = tmp_path / "x", f"s3://{s3_bucket}/own-stuck"
    fault_proxy.delay_next(16, 90.0, methods=("PUT", "POST"), path_contains="/step-00000010/")
    args = [
        *runs.CLI,
        "run",
        "--set",
        f"run.dir={run_dir}",
        "--set",
        f"checkpoint.dir={ckpt}",
        "--set",
        f"checkpoint.s3_endpoint_url={fault_proxy.endpoint_url}",
        "--set",
        "checkpoint.storage_timeout_seconds=200",
        "--set",
        "checkpoint.save_timeout_seconds=200",
        "--set",
        "metrics.port=0",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.2",
        SCRIPT,
        "--steps",
        "14",
        "--dropout",
        "0",
    ]
    env = {
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_DEFAULT_REGION": s3_server.region,
        "ELASTIC_TRAINER_INJECT_FAULT": "raise@rank=0,step=12",
    }
    run_dir.mkdir()
    with open(run_dir / "run.log", "ab") as out:
        r = runs.run_cli(args, runs.env_for_tests(env), 280, out)
    ended = time.time()
    log = (run_dir / "run.log").read_text()
    assert r.returncode == 1, log[-4000:]
    assert fault_proxy.faulted.get("PUT", 0) + fault_proxy.faulted.get("POST", 0) >= 1, (
        "the save of step 10 was never held"
    )
    last_step = max(e["time"] for e in runs.read_events(run_dir, "step"))
    assert max(runs.step_losses(run_dir)) == 11
    assert ended - last_step < 45, (
        f"the job took {ended - last_step:.0f}s to end after the failure (the upload is held 90 s)"
    )
    assert "a save is still uploading after the failure" in log
    fs = s3_server.fs()
    assert sorted(p.rsplit("/", 2)[-2] for p in fs.glob(f"{s3_bucket}/own-stuck/step-*/manifest.json")) == [
        "step-00000005"
    ]


def test_hung_rank_is_restarted_and_metrics_are_served(tmp_path, reference):
    """A SIGSTOPped rank of the user's script is reaped by the hang watchdog, the group restarts
    and resumes exactly; the supervisor's exporter serves the script's step metrics meanwhile."""

    from tests.fixtures.procs import free_port

    run_dir, ckpt, port = tmp_path / "h", tmp_path / "h-ckpt", free_port()
    run_dir.mkdir()
    args = [
        *runs.CLI,
        "run",
        "--set",
        f"run.dir={run_dir}",
        "--set",
        f"checkpoint.dir={ckpt}",
        "--set",
        f"metrics.port={port}",
        "--set",
        "metrics.host=127.0.0.1",
        "--set",
        f"elastic.hang_timeout_seconds={HANG_S}",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.2",
        SCRIPT,
        "--steps",
        "12",
    ]
    with open(run_dir / "run.log", "ab") as out:
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=runs.env_for_tests({"ELASTIC_TRAINER_INJECT_FAULT": "hang@rank=1,step=11"}),
            cwd=runs.REPO,
            start_new_session=True,
        )
    try:
        runs.wait_event(run_dir, "step", 120, proc, where=lambda r: r["step"] >= 3)
        body = runs.wait_for(lambda: _scrape(port), 60, "step metrics on the supervisor's endpoint", proc)
        assert "elastic_trainer_train_loss" in body
        code = proc.wait(240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(20)
    assert code == 0, (run_dir / "run.log").read_text()[-3000:]
    (restart,) = runs.read_events(run_dir, "restart")
    assert restart["reason"] == "worker_failure"
    # Detected within the hang timeout from the last step rank 1 finished, plus the agent's
    # monitor interval and the watchdog's polling.
    last = max(e["time"] for e in runs.read_events(run_dir, "step") if e["time"] < restart["time"])
    assert restart["time"] - last <= HANG_S + 5, restart["time"] - last
    (resume,) = runs.read_events(run_dir, "resume")
    # The save of step 10 starts only once step 5's has landed, so at the hang (step 11) step 5
    # at least is committed; the resume loads the newest commit made before the restart.
    before = [e["step"] for e in runs.read_events(run_dir, "checkpoint_committed") if e["time"] < restart["time"]]
    assert 5 in before and resume["step"] == max(before), (before, resume)
    assert runs.step_losses(run_dir) == reference["dropout"]


def _scrape(port: int) -> str | None:
    try:
        body = runs.scrape(port)
    except OSError:
        return None
    return body if "elastic_trainer_train_step{" in body or "elastic_trainer_train_step " in body else None
