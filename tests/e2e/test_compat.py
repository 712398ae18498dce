"""A checkpoint the code cannot read is not a corrupt checkpoint (tests/e2e/run_scripts/evolve_script.py,
public API): compatibility stops with exit 2 naming the keys, integrity quarantines and falls
back, and a start never trains from step 0 over commits it could not load.

The base run trains 10 steps as one process (commits at 5 and 10); each case copies its root."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from elastic_trainer.checkpoint import layout
from elastic_trainer.checkpoint.catalog import Catalog
from elastic_trainer.storage.fs import open_storage
from tests import runs

SCRIPT = str(runs.REPO / "tests" / "e2e" / "run_scripts" / "evolve_script.py")
NO_LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _run(
    how: str, run_dir, ckpt, *script_args: str, nproc: int = 2, max_restarts: int = 2
) -> subprocess.CompletedProcess:
    """The script as one process (``python``), under plain ``torchrun`` or under ``run``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    script = [SCRIPT, "--run-dir", str(run_dir), "--ckpt", str(ckpt), *script_args]
    env = runs.env_for_tests()
    if how == "python":
        env = {k: v for k, v in env.items() if k not in NO_LAUNCHER}
        args = [sys.executable, *script]
    elif how == "torchrun":
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *script]
    else:
        args = runs.run_args(run_dir, ckpt, *script, nproc=nproc, max_restarts=max_restarts)
    return runs.run_cli(args, env, 240)


def _dirs(ckpt) -> dict[str, set[str]]:
    return {p.name: {f.name for f in p.iterdir()} for p in sorted(ckpt.iterdir()) if p.name.startswith("step-")}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compat-base")
    r = _run("python", tmp / "run", tmp / "ckpt", "--steps", "10")
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(_dirs(tmp / "ckpt")) == ["step-00000005", "step-00000010"]
    return tmp / "ckpt"


@pytest.mark.parametrize("how", ["python", "torchrun", "run"])
def test_an_added_stateful_stops_with_exit_2_naming_it_and_optional_on_load_resumes(tmp_path, base, how):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(base, ckpt)
    before = _dirs(ckpt)
    r = _run(how, tmp_path / "run", ckpt, "--steps", "15", "--counter", "required")
    out = r.stdout + r.stderr
    if how == "torchrun":  # plain torchrun reports any worker failure as 1; the workers exited 2
        assert r.returncode == 1 and "exitcode  : 2" in out, out[-3000:]
    else:
        assert r.returncode == 2, out[-3000:]
    assert "step-00000010" in out and "counter" in out and "counter.n" in out, out[-3000:]
    assert "optional_on_load" in out and "Traceback" not in out.split("elastic_trainer: checkpoint")[0][-200:]
    assert _dirs(ckpt) == before, "nothing quarantined, nothing written"
    rows = {row["name"]: row["status"] for row in _list(ckpt)}
    assert rows == {"step-00000005": "lineage", "step-00000010": "head"}
    assert not runs.read_events(tmp_path / "run", "step"), "no step was trained"
    if how == "run":
        assert not runs.read_events(tmp_path / "run", "restart"), "exit 2 is terminal: one attempt, no restart"
        assert len(runs.read_events(tmp_path / "run", "start")) == 1
        (inc,) = runs.read_events(tmp_path / "run", "checkpoint_incompatible")
        assert inc["name"] == "step-00000010" and "counter" in inc["problems"]
    if how == "torchrun":  # the resume with the state added is the core's, under python and run alike
        return
    r = _run(how, tmp_path / "run", ckpt, "--steps", "15", "--counter", "optional")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    (added,) = runs.read_events(tmp_path / "run", "state_added")
    assert added["keys"] == ["counter.n"] and added["name"] == "step-00000010"
    (resume,) = runs.read_events(tmp_path / "run", "resume")
    assert resume["step"] == 10 and min(runs.step_losses(tmp_path / "run")) == 11


def _list(ckpt):
    from elastic_trainer.checkpoint import tools

    return tools.list_checkpoints(str(ckpt))


def test_another_optimizer_type_is_incompatible_and_a_removed_stateful_is_ignored(tmp_path, base):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(base, ckpt)
    r = _run("python", tmp_path / "run", ckpt, "--steps", "12", "--sgd")
    assert r.returncode == 2 and "torch.optim.adamw.AdamW" in r.stderr and "torch.optim.sgd.SGD" in r.stderr, r.stderr[
        -3000:
    ]
    assert "momentum_buffer missing from the checkpoint" in r.stderr
    # A run with a counter, then the counter removed from the code: ignored, named in an event.
    r = _run("python", tmp_path / "run", ckpt, "--steps", "15", "--counter", "optional")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run("python", tmp_path / "run", ckpt, "--steps", "16")
    assert r.returncode == 0, r.stderr[-3000:]
    (ignored,) = runs.read_events(tmp_path / "run", "state_ignored")
    assert ignored["keys"] == ["counter"] and ignored["step"] == 15


def test_every_commit_quarantined_exits_2_and_release_lifts_a_good_one(tmp_path, base):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(base, ckpt)
    # A same-size corruption of step 10's shard: quarantined on load with a one-line reason, 5 loaded.
    shard = ckpt / "step-00000010" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = _run("python", tmp_path / "run", ckpt, "--steps", "5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert runs.read_events(tmp_path / "run", "resume")[0]["step"] == 5
    reason = json.loads((ckpt / "step-00000010" / layout.QUARANTINE).read_text())["reason"]
    assert (
        "checksum mismatch" in reason
        and "\n" not in reason
        and "Traceback" not in reason
        and "/" not in reason.split(":", 1)[1]
    ), reason
    # Step 5 quarantined too (as a storage blip, or an older version, might have): the next start stops.
    Catalog(open_storage(str(ckpt))).quarantine.mark("step-00000005", "load failed: OSError: connection reset")
    before = _dirs(ckpt)
    r = _run("python", tmp_path / "run2", ckpt, "--steps", "12")
    assert r.returncode == 2, r.stderr[-3000:]
    assert (
        "none can be loaded" in r.stderr
        and "step-00000005" in r.stderr
        and "step-00000010" in r.stderr
        and "ckpt release" in r.stderr
    )
    assert _dirs(ckpt) == before and not runs.read_events(tmp_path / "run2", "step"), "nothing trained, nothing written"
    # Release refuses the damaged one and lifts the good one; the next start resumes from it.
    release = [*runs.CLI, "ckpt", "release", str(ckpt), "--step"]
    bad = subprocess.run([*release, "10"], capture_output=True, text=True, env=runs.env_for_tests(), cwd=runs.REPO)
    assert bad.returncode == 1 and "stays quarantined" in bad.stderr and "checksum mismatch" in bad.stderr, bad.stderr
    assert (ckpt / "step-00000010" / layout.QUARANTINE).exists()
    good = subprocess.run([*release, "5"], capture_output=True, text=True, env=runs.env_for_tests(), cwd=runs.REPO)
    assert good.returncode == 0 and "released step-00000005" in good.stdout, good.stderr
    r = _run("python", tmp_path / "run3", ckpt, "--steps", "7")
    assert r.returncode == 0, r.stderr[-3000:]
    assert runs.read_events(tmp_path / "run3", "resume")[0]["step"] == 5


def test_per_rank_state_comes_back_per_rank_and_is_refused_at_another_world_size(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    assert _run("torchrun", run, ckpt, "--steps", "5", "--per-rank").returncode == 0
    r = _run("torchrun", run, ckpt, "--steps", "6", "--per-rank")
    assert r.returncode == 0, r.stderr[-3000:]
    tallies = [json.loads((run / f"tally-{rank}.json").read_text()) for rank in (0, 1)]
    assert [(t["rank"], t["loaded_from"], t["seen"]) for t in tallies] == [(0, 0, 5), (1, 1, 5)]
    r = _run("run", tmp_path / "run3", ckpt, "--steps", "8", "--per-rank", nproc=3)
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    out = r.stdout + r.stderr
    assert "tally" in out and "saved by 2 ranks cannot be loaded by 3" in out and "reshard_state_dict" in out
    assert not runs.read_events(tmp_path / "run3", "restart")


def test_run_checks_storage_and_local_dir_before_any_worker_starts(tmp_path):
    """``run`` checks what it can without the script: an unreachable store, an unwritable
    checkpoint root and an unwritable ``checkpoint.local_dir`` exit 2 before any worker starts."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cases = {
        "unreachable S3 endpoint": [
            "--set",
            "checkpoint.dir=s3://nobucket/x",
            "--set",
            f"checkpoint.s3_endpoint_url=http://127.0.0.1:{_closed_port()}",
            "--set",
            "checkpoint.storage_timeout_seconds=2",
            "--set",
            "checkpoint.storage_retries=0",
        ],
        "unwritable checkpoint.dir": ["--set", f"checkpoint.dir={blocker}/ckpt"],
        "unwritable checkpoint.local_dir": [
            "--set",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            "--set",
            f"checkpoint.local_dir={blocker}/local",
        ],
    }
    env = runs.env_for_tests(
        {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}
    )
    for what, sets in cases.items():
        run_dir = tmp_path / what.replace(" ", "-")
        args = [
            *runs.CLI,
            "run",
            "--set",
            f"run.dir={run_dir}",
            "--set",
            "metrics.port=0",
            *sets,
            "--nproc-per-node",
            "2",
            SCRIPT,
            "--run-dir",
            str(run_dir),
            "--ckpt",
            str(tmp_path / "ckpt"),
            "--steps",
            "2",
        ]
        r = runs.run_cli(args, env, 120)
        key = "checkpoint.local_dir" if "local_dir" in what else "checkpoint.dir"
        assert r.returncode == 2 and f"config error at '{key}'" in r.stderr, (what, r.stderr[-2000:])
        assert "Traceback" not in r.stderr + r.stdout, (what, r.stderr[-2000:])
        assert not runs.read_events(run_dir, "start") and not runs.read_events(run_dir, "workers_started"), (
            f"{what}: no worker may start"
        )


def test_a_launch_refused_before_training_prints_one_line_and_no_traceback(tmp_path, token_file):
    """``launch`` with an unreachable S3 endpoint: exit 2 and the one line naming the problem;
    the warm-start zygote (forked before the check) leaves quietly with its supervisor."""
    config = runs.write_config(
        tmp_path / "c.toml",
        token_file,
        tmp_path / "run",
        "s3://nobucket/x",
        checkpoint={
            "s3_endpoint_url": f"http://127.0.0.1:{_closed_port()}",
            "storage_timeout_seconds": 2,
            "storage_retries": 0,
        },
    )
    env = runs.env_for_tests(
        {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}
    )
    r = runs.run_cli(runs.launch_args(config), env, 120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "config error at 'checkpoint.dir': cannot access s3://nobucket/x" in lines[0], lines


def _closed_port() -> int:
    from tests.fixtures.procs import free_port

    return free_port()
