"""``elastic-trainer run``: any script under the supervisor, with torchrun's options.

Real supervisor + real gloo workers running ``tests/e2e/run_scripts/dist_script.py`` (plain
``torch.distributed``, no elastic_trainer API): script args pass through; a crash is restarted
(with the restart event naming the failing rank and exit code) or ends the job with exit 1; a
hung rank is reaped by the hang watchdog and the group restarted; SIGTERM to the supervisor is
forwarded and the job exits 75; a worker that exits 75 by itself makes the job exit 75;
torchrun's own flags (``-m``, ``--log-dir``/``--redirects``, ``--nproc-per-node``) and ``PET_*``
variables drive it; the Prometheus exporter serves the supervisor's metrics.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from tests.runs import (
    CLI,
    REPO,
    children,
    env_for_tests,
    is_zygote,
    kill,
    read_events,
    run_cli,
    scrape,
    start_cli,
    wait_event,
    wait_for,
)

SCRIPT = REPO / "tests" / "e2e" / "run_scripts" / "dist_script.py"
MODULE = "tests.e2e.run_scripts.dist_script"


def run_args(run_dir: Path, *args: str, config: Path | None = None) -> list[str]:
    cfg = ["--config", str(config)] if config else []
    return [
        *CLI,
        "run",
        *cfg,
        "--set",
        f"run.dir={run_dir}",
        "--set",
        "metrics.port=0",
        "--monitor-interval",
        "0.2",
        *args,
    ]


def run(
    run_dir: Path, *args: str, env: dict | None = None, timeout: float = 120, config: Path | None = None
) -> subprocess.CompletedProcess:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "run.log", "ab") as out:
        return run_cli(run_args(run_dir, *args, config=config), env_for_tests(env), timeout, out)


def start(run_dir: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "run.log", "ab") as out:  # the process holds its own descriptor
        return start_cli(run_args(run_dir, *args), env_for_tests(env), out)


def script_pids(supervisor_pid: int) -> list[int]:
    """The script's workers: the supervisor's children running it, or (warm start) its zygote's children."""
    pids = []
    for c in children(supervisor_pid):
        try:
            cmd = open(f"/proc/{c}/cmdline", "rb").read()
        except FileNotFoundError:
            continue
        if is_zygote(c):  # forked from the supervisor: its command line is the supervisor's
            pids += children(c)
        elif b"dist_script" in cmd:
            pids.append(c)
    return pids


def cleanup(proc: subprocess.Popen, pids: list[int]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(20)
    kill(pids)


def log_of(run_dir: Path) -> str:
    return (run_dir / "run.log").read_text(errors="replace")[-4000:]


def result(out: Path, restart: int = 0) -> dict:
    return json.loads((out / f"result-{restart}.json").read_text())


def test_script_runs_with_its_args_and_the_supervisor_events(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    p = run(tmp_path / "run", "--nproc-per-node", "2", str(SCRIPT), "ok", str(out), "--lr", "0.1")
    assert p.returncode == 0, log_of(tmp_path / "run")
    r = result(out)
    assert (r["world"], r["sum"], r["argv"]) == (2, 1.0, ["ok", str(out), "--lr", "0.1"])
    assert r["env"]["TORCHELASTIC_TIMER_FILE"]  # the hang watchdog is armed for the script
    launch = read_events(tmp_path / "run", "launch")[0]
    assert launch["nproc_per_node"] == 2 and "dist_script.py ok" in launch["entrypoint"]
    assert read_events(tmp_path / "run", "rendezvous")
    assert read_events(tmp_path / "run", "supervisor_exit")[-1]["exit_code"] == 0


def test_module_log_dir_and_redirects(tmp_path):
    """torchrun's -m, --log-dir and --redirects with torchrun's meaning."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    p = run(
        tmp_path / "run",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(logs),
        "--redirects",
        "3",
        "--rdzv-id",
        "flags",
        "-m",
        MODULE,
        "ok",
        str(out),
    )
    assert p.returncode == 0, log_of(tmp_path / "run")
    assert result(out)["world"] == 2
    files = sorted(f.name for f in logs.rglob("*.log"))
    assert files.count("stdout.log") == 2 and files.count("stderr.log") == 2, files


def test_pet_variables_and_config_drive_the_launch(tmp_path):
    """PET_NPROC_PER_NODE (as Kubeflow sets it) beats elastic.nproc_per_node of --config; the
    config gives what no flag or PET_* sets (max_restarts); a flag beats PET_*."""
    out = tmp_path / "out"
    out.mkdir()
    cfg = tmp_path / "run.toml"
    cfg.write_text("[elastic]\nnproc_per_node = 3\nnnodes = 1\nmax_restarts = 1\n")
    p = run(tmp_path / "a", str(SCRIPT), "crash_once", str(out), config=cfg, env={"PET_NPROC_PER_NODE": "2"})
    assert p.returncode == 0, log_of(tmp_path / "a")
    assert result(out, 1)["world"] == 2  # the config's max_restarts = 1 allowed one restart
    launch = read_events(tmp_path / "a", "launch")[0]
    assert (launch["nproc_per_node"], launch["max_restarts"]) == (2, 1)
    p = run(
        tmp_path / "b",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        str(SCRIPT),
        "ok",
        str(out),
        config=cfg,
        env={"PET_NPROC_PER_NODE": "2"},
    )
    assert p.returncode == 0, log_of(tmp_path / "b")
    launch = read_events(tmp_path / "b", "launch")[0]
    assert (launch["nproc_per_node"], launch["max_restarts"]) == (1, 0)


def test_crash_is_restarted_then_exhausts_restarts(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    p = run(tmp_path / "a", "--nproc-per-node", "2", "--max-restarts", "1", str(SCRIPT), "crash_once", str(out))
    assert p.returncode == 0, log_of(tmp_path / "a")
    (restart,) = read_events(tmp_path / "a", "restart")
    assert restart["reason"] == "worker_failure"
    # rank 1 exited 3; rank 0 (waiting in its all-reduce) may be stopped by the agent
    assert (1, 3) in [(f["local_rank"], f["exit_code"]) for f in restart["failures"]], restart
    assert result(out, 1)["restart"] == 1
    p = run(tmp_path / "b", "--nproc-per-node", "2", "--max-restarts", "0", str(SCRIPT), "crash_once", str(out))
    assert p.returncode == 1
    (failed,) = read_events(tmp_path / "b", "job_failed")
    assert 3 in [f["exit_code"] for f in failed["failures"]], failed
    assert read_events(tmp_path / "b", "supervisor_exit")[-1]["exit_code"] == 1


# Soak: test_own_script hangs a rank of a user script under `run` and checks more.
@pytest.mark.soak
def test_hung_rank_is_reaped_and_the_group_restarted(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    p = run(
        tmp_path / "run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(SCRIPT),
        "hang_once",
        str(out),
        timeout=180,
    )
    assert p.returncode == 0, log_of(tmp_path / "run")
    (restart,) = read_events(tmp_path / "run", "restart")
    assert restart["reason"] == "worker_failure"
    assert any(f["signal"] == "SIGKILL" for f in restart["failures"]), restart
    assert result(out, 1)["world"] == 2


@pytest.mark.parametrize("target", ["supervisor", "workers"])
def test_preemption_exits_75(tmp_path, target):
    """SIGTERM to the supervisor is forwarded to the script (which exits 75); a script that exits
    75 by itself (SIGTERM delivered to the workers directly) also makes the job exit 75 once no
    restart is left (with restarts left, the group is restarted, as for ``launch``). The
    supervisor's Prometheus exporter serves while the script runs."""
    from tests.fixtures.procs import free_port

    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    run_dir = tmp_path / "run"
    proc = start(
        run_dir,
        "--set",
        f"metrics.port={port}",
        "--set",
        "metrics.host=127.0.0.1",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        str(SCRIPT),
        "preempt",
        str(out),
    )
    pids: list[int] = []
    try:
        wait_for(lambda: (out / "ready-0").exists() and (out / "ready-1").exists(), 90, "both ranks ready", proc)
        pids = script_pids(proc.pid)
        assert len(pids) == 2
        body = scrape(port, timeout=10)
        assert "elastic_trainer_rendezvous_rounds_total" in body
        if target == "supervisor":
            proc.send_signal(signal.SIGTERM)
        else:
            kill(pids, signal.SIGTERM)
        assert proc.wait(60) == 75, log_of(run_dir)
    finally:
        cleanup(proc, pids)
    exit_rec = wait_event(run_dir, "supervisor_exit", 5)
    assert exit_rec["exit_code"] == 75
    if target == "workers":
        assert exit_rec["preempted"] == {"exit_codes": [75]}
    else:
        assert exit_rec["signalled"] is True


def test_bad_input_fails_before_start(tmp_path):
    env = env_for_tests()
    r = run_cli([*CLI, "run", "--set", "elastic.max_restarts=-1", str(SCRIPT)], env, 60)
    assert r.returncode == 2 and "elastic.max_restarts" in r.stderr
    r = run_cli([*CLI, "run", "--nproc-per-node"], env, 60)
    assert r.returncode == 2 and "--nproc-per-node" in r.stderr
    r = run_cli([*CLI, "run", "--config", str(tmp_path / "missing.toml"), str(SCRIPT)], env, 60)
    assert r.returncode == 2 and "missing.toml" in r.stderr


def test_kubeflow_static_pet_variables_form_a_two_node_job(tmp_path):
    """PET_NNODES/PET_NPROC_PER_NODE/PET_NODE_RANK/PET_MASTER_ADDR/PET_MASTER_PORT, as the
    Kubeflow operator sets them without an elastic policy, and no flags: torchrun's static
    rendezvous forms one world of 2 nodes x 1 worker."""
    from tests.fixtures.procs import free_port

    out = tmp_path / "out"
    out.mkdir()
    port = str(free_port())
    procs = []
    try:
        for node in (0, 1):
            env = {
                "PET_NNODES": "2",
                "PET_NPROC_PER_NODE": "1",
                "PET_NODE_RANK": str(node),
                "PET_MASTER_ADDR": "127.0.0.1",
                "PET_MASTER_PORT": port,
            }
            procs.append(start(tmp_path / f"node{node}", str(SCRIPT), "ok", str(out), env=env))
        codes = [p.wait(120) for p in procs]
    finally:
        for p in procs:
            cleanup(p, script_pids(p.pid))
    assert codes == [0, 0], [log_of(tmp_path / f"node{n}") for n in (0, 1)]
    assert (result(out)["world"], result(out)["sum"]) == (2, 1.0)
    launch = read_events(tmp_path / "node1", "launch")[0]
    assert (launch["rdzv_backend"], launch["nnodes"], launch["rdzv_endpoint"]) == ("static", "2:2", f"127.0.0.1:{port}")
