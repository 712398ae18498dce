"""Checkpoints on ``s3://`` end to end, on a real object store on loopback (issue #3).

SeaweedFS (``tests/fixtures/s3.py``) checks SigV4 signatures with random per-session
credentials, which reach the supervisor and its workers only through the ``AWS_*``
environment. Storage faults are injected between the writers and the server by
``tests/fixtures/faultproxy.py`` (``checkpoint.s3_endpoint_url`` points at the proxy).

What is checked: where checkpoints live does not change training (losses bitwise equal to a
local-disk run, through a SIGKILL and a restart); resharding 2 → 3 from S3; transient faults
are absorbed; a permanent outage fails each save visibly and in bounded time while training
goes on and the previous commit stays the latest; bad credentials or a missing bucket stop
``launch`` before any worker starts; credentials never appear in any output.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import runs
from tests.fixtures.faultproxy import FaultProxy
from tests.fixtures.procs import free_port

pytestmark = [pytest.mark.s3, pytest.mark.timeout(240)]

STEPS = 20  # every run here trains this many steps, saving every 5
OUTAGE_FAILURE_BOUND_S = 45.0  # a save under a permanent outage must fail within this
FAST_STORAGE = {"storage_timeout_seconds": 8.0, "storage_retries": 0}


def _creds(s3) -> dict[str, str]:
    """Credentials and region only: the endpoint then has to come from the config."""
    return {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key, "AWS_DEFAULT_REGION": s3.region}


def _config(tmp_path: Path, token_file: str, name: str, ckpt_dir: str | None, **sections) -> tuple[Path, Path]:
    run = tmp_path / name
    train = {"steps": STEPS, **sections.pop("train", {})}
    return runs.write_config(tmp_path / f"{name}.toml", token_file, run, ckpt_dir, train=train, **sections), run


def _launch_ok(cfg: Path, *args: str, env: dict | None = None, timeout: float = 180):
    r = runs.run_launch(cfg, *args, env=env, timeout=timeout)
    assert r.returncode == 0, cfg.with_suffix(".log").read_text()[-4000:]
    return r


def _committed(s3, bucket: str, prefix: str) -> list[int]:
    """Steps whose manifest.json exists in the bucket, read directly from the server."""
    fs = s3.fs()
    return sorted(
        int(m.group(1))
        for p in fs.glob(f"{bucket}/{prefix}/step-*/manifest.json")
        if (m := re.search(r"step-(\d+)/manifest\.json$", p))
    )


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*runs.CLI, *args], capture_output=True, text=True, timeout=120, env=runs.env_for_tests(env), cwd=runs.REPO
    )


def _texts_of_run(tmp_path: Path) -> dict[str, str]:
    """Every text a run leaves: launch logs, configs, events, markers under ``tmp_path``
    (binary checkpoint data excluded), and the torch error files its events point to."""
    out = {}
    for p in tmp_path.rglob("*"):
        if p.is_file() and p.suffix not in (".distcp", ".bin", ".safetensors") and p.stat().st_size < 50_000_000:
            out[str(p)] = p.read_bytes().decode("utf-8", errors="replace")
    for events in tmp_path.rglob("events.jsonl"):
        for path in re.findall(r'"error_file": "([^"]+)"', events.read_text()):
            if Path(path).is_file():
                out[path] = Path(path).read_text(errors="replace")
    return out


def _assert_no_secrets(s3, tmp_path: Path, *extra: str) -> None:
    texts = _texts_of_run(tmp_path)
    texts.update({f"output{i}": t for i, t in enumerate(extra)})
    assert any("events.jsonl" in k for k in texts), "no event log found to check"
    for where, text in texts.items():
        assert s3.secret_key not in text, f"secret key leaked into {where}"
        assert s3.access_key not in text, f"access key leaked into {where}"


@pytest.fixture(scope="module")
def ref(tmp_path_factory, token_file) -> Path:
    """The local-disk reference: the same config, uninterrupted, at world 2."""
    d = tmp_path_factory.mktemp("ref")
    cfg, run = _config(d, token_file, "run", None)
    _launch_ok(cfg)
    return run


@dataclass
class S3Run:
    tmp_path: Path
    cfg: Path
    run: Path
    bucket: str
    prefix: str
    exit_code: int
    faulted: dict
    seen: dict
    pending_faults: int


@pytest.fixture(scope="module")
def s3_run(tmp_path_factory, token_file, s3_server) -> S3Run:
    """An S3 run at world 2 through a fault proxy: transient faults hit the save of step 5,
    and rank 1 is SIGKILLed after the commit of step 10; the agent restarts the group, which
    resumes from S3 and finishes. The endpoint comes from ``checkpoint.s3_endpoint_url``,
    the credentials from the environment only. (One run serves several tests: each launch
    costs ~15 s on a loaded machine.)"""
    tmp_path = tmp_path_factory.mktemp("s3run")
    bucket, prefix = s3_server.make_bucket(), "jobs/kill"
    host, port = s3_server.endpoint_url.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = FaultProxy((host, int(port)), fs_factory=s3_server.fs).start()
    # Nothing is PUT before the first save, so these hit the save of step 5: three 503s, a
    # dropped connection, then a request held past the read timeout (2 s with a storage
    # timeout of 8 s).
    proxy.fail_next(3, status=503, methods=("PUT",))
    proxy.drop_next(1, methods=("PUT",))
    proxy.delay_next(1, 3.0, methods=("PUT",))
    cfg, run = _config(
        tmp_path,
        token_file,
        "run",
        f"s3://{bucket}/{prefix}",
        checkpoint={"s3_endpoint_url": proxy.endpoint_url, "storage_timeout_seconds": 8.0},
        elastic={"max_restarts": 1},
    )
    sup = runs.start_launch(cfg, env=_creds(s3_server))
    try:
        runs.wait_event(run, "checkpoint_committed", timeout=120, proc=sup, where=lambda r: r["step"] == 10)
        workers = runs.worker_pids(sup.pid)
        assert len(workers) == 2
        runs.kill(workers[-1:])
        code = sup.wait(timeout=150)
    finally:
        runs.stop(sup)
        proxy.stop()
    return S3Run(tmp_path, cfg, run, bucket, prefix, code, dict(proxy.faulted), dict(proxy.seen), proxy.pending)


def test_sigkill_and_resume_on_s3_is_bitwise_identical_to_local_disk(s3_run, ref, s3_server):
    tmp_path, cfg, run, s3_bucket, prefix, code = (
        s3_run.tmp_path,
        s3_run.cfg,
        s3_run.run,
        s3_run.bucket,
        s3_run.prefix,
        s3_run.exit_code,
    )
    uri = f"s3://{s3_bucket}/{prefix}"
    assert code == 0, cfg.with_suffix(".log").read_text()[-4000:]
    assert len(runs.read_events(run, "restart")) == 1
    (resume,) = runs.read_events(run, "resume")
    assert resume["step"] in (10, 15)
    assert runs.step_losses(run) == runs.step_losses(ref), "checkpoint location must not change training"

    committed = _committed(s3_server, s3_bucket, prefix)
    assert {resume["step"], STEPS} <= set(committed) and committed == sorted(
        r["step"] for r in runs.read_events(run, "checkpoint_committed") if r["step"] in committed
    )
    manifest = json.loads(s3_server.fs().cat_file(f"{s3_bucket}/{prefix}/step-{STEPS:08d}/manifest.json"))
    assert manifest["step"] == STEPS and manifest["world_size"] == 2 and ".metadata" in manifest["files"]

    # The tools read S3 with the environment's credentials and --endpoint-url.
    listed = _cli("ckpt", "list", uri, "--endpoint-url", s3_server.endpoint_url, env=_creds(s3_server))
    assert listed.returncode == 0, listed.stderr
    rows = {int(line.split()[0]): line.split() for line in listed.stdout.splitlines()[1:]}
    # Columns: step, name, status, world, bytes[, problem]: every committed step is usable, none has a problem.
    assert sorted(rows) == committed and all(r[2] in ("head", "lineage") and len(r) == 5 for r in rows.values()), (
        listed.stdout
    )
    assert rows[STEPS][2] == "head", listed.stdout
    out = tmp_path / "s3.safetensors"
    exp = _cli(
        "ckpt", "export", uri, "--out", str(out), "--endpoint-url", s3_server.endpoint_url, env=_creds(s3_server)
    )
    assert exp.returncode == 0, exp.stderr
    assert json.loads(exp.stdout.strip().splitlines()[-1])["step"] == STEPS
    from safetensors.torch import load_file

    from elastic_trainer.checkpoint.tools import load_model_weights

    got = load_file(str(out))
    step, want = load_model_weights(str(ref / "ckpt"))
    assert step == STEPS and sorted(got) == sorted(want)
    assert all(got[k].equal(want[k]) for k in want), "S3 and local-disk checkpoints of the last step differ"

    # Credentials never logged (issue #3): logs, events, error files, CLI output.
    _assert_no_secrets(s3_server, tmp_path, listed.stdout, listed.stderr, exp.stdout, exp.stderr)


# Soak: resharding is storage-independent (test_resume); S3 loads run in the SIGKILL test.
@pytest.mark.soak
def test_resharding_resume_2_to_3_from_s3(tmp_path, token_file, ref, s3_run, s3_server, s3_bucket):
    """World 3 resumes from the step-5 checkpoint the world-2 run wrote to S3 (copied within
    the server to a bucket of its own). The endpoint comes from the environment
    (AWS_ENDPOINT_URL_S3), not the config."""
    src_bucket, src_prefix = s3_run.bucket, s3_run.prefix
    prefix = "jobs/reshard"
    fs = s3_server.fs()
    src = f"{src_bucket}/{src_prefix}/step-00000005"
    for path in fs.find(src):
        fs.copy(path, f"{s3_bucket}/{prefix}/step-00000005/{path[len(src) + 1 :]}")
    assert _committed(s3_server, s3_bucket, prefix) == [5]
    cfg, run = _config(tmp_path, token_file, "run", f"s3://{s3_bucket}/{prefix}")
    _launch_ok(cfg, "--nproc-per-node", "3", env=s3_server.env())
    (reshard,) = runs.read_events(run, "reshard")
    assert (reshard["from_world_size"], reshard["to_world_size"], reshard["step"]) == (2, 3, 5)
    want, got = runs.step_losses(ref), runs.step_losses(run)
    assert sorted(got) == list(range(6, STEPS + 1))
    for s in range(6, STEPS + 1):
        assert runs.close_rel(got[s], want[s], 1e-5), (s, got[s], want[s])
    assert _committed(s3_server, s3_bucket, prefix) == [5, 10, 15, 20]


def test_transient_storage_faults_during_a_save_are_absorbed(s3_run, ref, s3_server):
    """3x503, a dropped connection and a request held past the read timeout, all during the
    save of step 5: it commits anyway, nothing is reported failed, losses are untouched."""
    assert s3_run.exit_code == 0
    assert s3_run.pending_faults == 0, "every armed fault was hit"
    assert s3_run.faulted == {"PUT": 5} and s3_run.seen["PUT"] > 5
    run = s3_run.run
    # A save the SIGKILL of rank 1 interrupts (its collective breaks) may be reported failed;
    # nothing before the kill may be.
    (restart,) = runs.read_events(run, "restart")
    failed = runs.read_events(run, "checkpoint_failed")
    assert all(e["step"] > 10 and e["time"] <= restart["time"] for e in failed), failed
    commits = {r["step"]: r["seconds"] for r in runs.read_events(run, "checkpoint_committed")}
    assert {5, 10, STEPS} <= set(commits)
    print(
        f"save of step 5 through 3x503 + drop + 3 s delay: {commits[5]:.2f}s; clean saves: "
        + ", ".join(f"{commits[s]:.2f}s" for s in sorted(commits) if s != 5)
    )
    assert 5 in _committed(s3_server, s3_run.bucket, s3_run.prefix)
    assert all(v == runs.step_losses(ref)[s] for s, v in runs.step_losses(run).items())


def _scrape(port: int) -> str:
    return runs.scrape(port)


def _failures_metric(text: str) -> float:
    vals = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("elastic_trainer_checkpoint_save_failures_total")
    ]
    return sum(vals)


def test_permanent_outage_fails_saves_visibly_while_training_goes_on(
    tmp_path, token_file, ref, s3_server, s3_bucket, fault_proxy
):
    prefix = "jobs/outage"
    port = free_port()
    cfg, run = _config(
        tmp_path,
        token_file,
        "run",
        f"s3://{s3_bucket}/{prefix}",
        checkpoint={"s3_endpoint_url": fault_proxy.endpoint_url, **FAST_STORAGE},
        metrics={"port": port, "host": "127.0.0.1"},
    )
    # Steps 16..20 take 4 s each, so training is still running when save 15's failure (storage
    # timeout 8 s) is reported: the loop must go on after a failure, not only around one.
    slow_tail = {"ELASTIC_TRAINER_INJECT_FAULT": "slow@rank=0,step=16,seconds=4.0"}
    sup = runs.start_launch(cfg, env={**_creds(s3_server), **slow_tail})
    try:
        runs.wait_event(run, "checkpoint_committed", timeout=120, proc=sup, where=lambda r: r["step"] == 10)
        fault_proxy.outage(True)
        t_outage = time.monotonic()
        failed15 = runs.wait_event(run, "checkpoint_failed", timeout=90, proc=sup, where=lambda r: r["step"] == 15)
        latency = time.monotonic() - t_outage
        assert _committed(s3_server, s3_bucket, prefix) == [5, 10], "the previous commit stays the latest"
        metrics = _scrape(port)
        code = sup.wait(timeout=150)
        t_exit = time.monotonic() - t_outage
    finally:
        runs.stop(sup)
        fault_proxy.outage(False)
    log = cfg.with_suffix(".log").read_text()
    failed = {r["step"]: r for r in runs.read_events(run, "checkpoint_failed")}
    print(
        "outage on after commit 10: save 15 failed after "
        f"{failed15['seconds']:.1f}s (event {latency:.1f}s after the outage began); "
        f"failed saves {sorted(failed)} in "
        + ", ".join(f"{r['seconds']:.1f}s" for r in failed.values())
        + f"; job exited {t_exit:.1f}s after the outage began"
    )
    assert code == 74, log[-4000:]  # trained to the end, but the final checkpoint is not committed: not a success
    assert sorted(failed) == [15, 20]
    assert all(r["seconds"] < OUTAGE_FAILURE_BOUND_S for r in failed.values())
    assert latency < OUTAGE_FAILURE_BOUND_S + 10
    assert t_exit < 2 * OUTAGE_FAILURE_BOUND_S + 10, "two failing saves, then the job must end"
    assert "checkpoint step 15 failed, not committed" in log  # rank 0, with the error
    assert "checkpoint step 15 failed on this rank" in log  # rank 1 got the failure too: nobody hangs
    assert _failures_metric(metrics) >= 1, [line for line in metrics.splitlines() if "save_failures" in line]

    # Training went on: every step ran, with the reference losses, and steps were logged after
    # the first failure was reported.
    assert runs.step_losses(run) == runs.step_losses(ref)
    steps_after = [r for r in runs.read_events(run, "step") if r["time"] > failed15["time"]]
    assert steps_after and steps_after[-1]["step"] == STEPS
    (fin,) = runs.read_events(run, "final_checkpoint_failed")
    assert fin["step"] == STEPS and fin["last_committed_step"] == 10
    assert not runs.read_events(run, "finished")
    assert not runs.read_events(run, "failure") and not runs.read_events(run, "restart")
    assert _committed(s3_server, s3_bucket, prefix) == [5, 10]
    _assert_no_secrets(s3_server, tmp_path)


@pytest.mark.parametrize("problem", ["wrong_secret", "missing_bucket"])
def test_bad_credentials_or_missing_bucket_stop_launch_before_any_worker(
    tmp_path, token_file, s3_server, s3_bucket, problem
):
    env = _creds(s3_server)
    bucket = s3_bucket
    if problem == "wrong_secret":
        env["AWS_SECRET_ACCESS_KEY"] = "Wr0ng-" + s3_server.secret_key[::-1]
    else:
        bucket = "no-such-bucket-" + s3_bucket[2:]
    cfg, run = _config(
        tmp_path, token_file, "run", f"s3://{bucket}/jobs/x", checkpoint={"s3_endpoint_url": s3_server.endpoint_url}
    )
    t0 = time.monotonic()
    r = runs.run_launch(cfg, env=env, timeout=120)
    elapsed = time.monotonic() - t0
    log = cfg.with_suffix(".log").read_text()
    assert r.returncode == 2, log[-4000:]
    assert "config error at 'checkpoint.dir'" in log and f"s3://{bucket}/jobs/x" in log, log[-2000:]
    if problem == "wrong_secret":
        assert "access denied: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY" in log, log[-2000:]
    else:
        assert "does not exist" in log, log[-2000:]
    assert not runs.read_events(run, "start"), "no worker may start"
    assert elapsed < 60
    for where, text in _texts_of_run(tmp_path).items():
        assert env["AWS_SECRET_ACCESS_KEY"] not in text and s3_server.secret_key not in text, (
            f"secret leaked into {where}"
        )
    if problem == "wrong_secret":
        assert not s3_server.fs().find(bucket), "nothing may be written with refused credentials"
