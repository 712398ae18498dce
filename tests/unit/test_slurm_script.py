"""The SLURM batch script, without SLURM: its text, its pure bash functions, and whole runs against
stub ``srun``/``scontrol`` commands (argv rendered, signal forwarded once, requeue decided).

The real thing runs in tests/e2e/test_slurm.py on a single-node cluster.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "slurm" / "elastic-trainer.sbatch"
DEFAULT_PREEMPT_GRACE_S = 60  # checkpoint.preempt_grace_seconds default


def _text() -> str:
    return SCRIPT.read_text()


def sbatch_directives(text: str) -> list[str]:
    """``#SBATCH`` options as sbatch reads them: only in the leading comment block (sbatch stops
    at the first line that is neither blank nor a comment)."""
    out = []
    for line in text.splitlines()[1:]:
        s = line.strip()
        if s and not s.startswith("#"):
            break
        if s.startswith("#SBATCH"):
            out.append(s[len("#SBATCH") :].strip())
    return out


def bash(snippet: str, env: dict | None = None) -> str:
    """Run ``snippet`` after sourcing the script (definitions only); return stdout."""
    p = subprocess.run(
        ["bash", "-c", f"source {shlex.quote(str(SCRIPT))}\n{snippet}"],
        capture_output=True,
        text=True,
        timeout=20,
        env={"PATH": os.environ["PATH"], **(env or {})},
    )
    assert p.returncode == 0, p.stderr
    return p.stdout


# -- text ---------------------------------------------------------------------------------------


def test_bash_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=10)


def test_executable_with_bash_shebang():
    assert _text().startswith("#!/bin/bash\n")
    assert os.access(SCRIPT, os.X_OK)


def test_sbatch_directives():
    d = sbatch_directives(_text())
    assert "--requeue" in d
    assert "--ntasks-per-node=1" in d
    assert "--open-mode=append" in d, "a requeued job must append to, not truncate, its output"
    sig = [x for x in d if x.startswith("--signal=")]
    assert len(sig) == 1
    m = re.fullmatch(r"--signal=B:USR1@(\d+)", sig[0])
    assert m, f"the warning must go to the batch shell (B:) as USR1: {sig[0]}"
    assert int(m.group(1)) > DEFAULT_PREEMPT_GRACE_S, "the warning must leave room for the preemption checkpoint"
    # every #SBATCH line is in the leading block (one after a command would be silently ignored)
    assert len(d) == _text().count("\n#SBATCH")


def test_traps_and_background_wait():
    t = _text()
    assert re.search(r"^trap '[^']*USR1[^']*' USR1$", t, re.M)
    assert re.search(r"^trap '[^']*TERM[^']*' TERM$", t, re.M)
    # the step runs in the background and the shell waits for it (a trap fires only during wait)
    assert re.search(r'^"\$\{srun_cmd\[@\]\}" "\$\{cmd\[@\]\}" &$', t, re.M)
    assert 'wait "$step_pid"' in t
    assert t.index("trap 'on_signal USR1' USR1") < t.index('"${srun_cmd[@]}" "${cmd[@]}" &')
    assert 'kill -s USR1 "$step_pid"' in t
    assert 'scontrol requeue "$SLURM_JOB_ID"' in t
    assert "scontrol show hostnames" in t


def test_documents_its_settings():
    header = _text().split("#SBATCH", 1)[0]
    used = set(re.findall(r"\$\{?(ET_[A-Z_]+)", _text()))
    assert used, "no ET_ settings found"
    undocumented = sorted(v for v in used if v not in header)
    assert not undocumented, f"settings not documented at the top: {undocumented}"


# -- pure functions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rc,state,restarts,max_requeues,enabled,expected",
    [
        (75, "RUNNING", 0, "", "1", "requeue"),
        (75, "RUNNING", 5, "", "1", "requeue"),
        (75, "PREEMPTED", 0, "", "1", "requeue"),
        (0, "RUNNING", 0, "", "1", "keep: launcher exited 0"),
        (1, "RUNNING", 0, "", "1", "keep: launcher exited 1"),
        # preempted, final save missed its grace: resume from the previous commit
        (76, "RUNNING", 0, "", "1", "requeue"),
        (76, "TIMEOUT", 0, "", "1", "keep: the job is ending"),
        (76, "RUNNING", 3, "3", "1", "keep: SLURM_RESTART_COUNT=3 reached ET_MAX_REQUEUES=3"),
        (65, "RUNNING", 0, "", "1", "keep: launcher exited 65"),
        (75, "COMPLETING", 0, "", "1", "keep: the job is ending"),  # after scancel (measured)
        (75, "CANCELLED", 0, "", "1", "keep: the job is ending"),
        (75, "TIMEOUT", 0, "", "1", "keep: the job is ending"),
        (75, "PENDING", 0, "", "1", "keep: SLURM is already requeueing"),  # after scontrol requeue
        (75, "REQUEUED", 0, "", "1", "keep: SLURM is already requeueing"),
        (75, "RUNNING", 3, "3", "1", "keep: SLURM_RESTART_COUNT=3 reached ET_MAX_REQUEUES=3"),
        (75, "RUNNING", 2, "3", "1", "requeue"),
        (75, "RUNNING", 0, "", "0", "keep: ET_REQUEUE=0"),
    ],
)
def test_requeue_decision(rc, state, restarts, max_requeues, enabled, expected):
    out = bash(f"requeue_decision {rc} {state} {restarts} '{max_requeues}' {enabled}").strip()
    assert out.startswith(expected), out


@pytest.mark.parametrize(
    "env,expected",
    [
        ({}, ""),
        ({"SLURM_GPUS_ON_NODE": "8"}, "8"),
        ({"SLURM_GPUS_PER_NODE": "a100:4"}, "4"),
        ({"SLURM_GPUS_PER_NODE": "0"}, ""),
        ({"SLURM_GPUS_ON_NODE": "2", "SLURM_GPUS_PER_NODE": "8"}, "2"),
    ],
)
def test_gpus_per_node(env, expected):
    assert bash("gpus_per_node", env).strip() == expected


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"SLURM_JOB_CPUS_PER_NODE": "72(x2),36"}, "36"),
        ({"SLURM_JOB_CPUS_PER_NODE": "2"}, "2"),
        ({"SLURM_CPUS_ON_NODE": "16"}, "16"),
        ({}, "1"),
    ],
)
def test_min_cpus_per_node(env, expected):
    assert bash("min_cpus_per_node", env).strip() == expected


def test_set_overrides():
    out = bash("set_overrides --nnodes 2 --set a.b=1 --set=c.d='x y' --max-restarts 3 --set")
    assert out.splitlines() == ["a.b=1", "c.d=x y"]


# -- whole runs against stub srun / scontrol --------------------------------------------------------

STUB_SRUN = r"""#!/bin/bash
# Records its argv, then behaves like a training step: exits $FAKE_RC, or with FAKE_WAIT=1 waits for
# a signal, records it, "checkpoints" for a moment and exits 75.
printf '%s\n' "$@" > "$FAKE_DIR/srun.argv"
if [ "${FAKE_WAIT:-0}" != 1 ]; then exit "${FAKE_RC:-0}"; fi
got=""
trap 'echo USR1 >> "$FAKE_DIR/srun.signals"; got=1' USR1
trap 'echo TERM >> "$FAKE_DIR/srun.signals"; got=1' TERM
touch "$FAKE_DIR/srun.started"
for _ in $(seq 200); do
    [ -n "$got" ] && { sleep 1.5; exit 75; }
    sleep 0.05
done
exit 9
"""

STUB_SCONTROL = r"""#!/bin/bash
echo "$*" >> "$FAKE_DIR/scontrol.calls"
case "$1 $2" in
    "show hostnames") echo "node-a"; echo "node-b" ;;
    "show job") echo "JobId=$SLURM_JOB_ID JobName=x JobState=${FAKE_STATE:-RUNNING} Reason=None" ;;
    "requeue "*) exit 0 ;;
    *) exit 1 ;;
esac
"""


def _stub_env(tmp_path: Path, **extra: str) -> dict:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, body in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL)):
        (bindir / name).write_text(body)
        (bindir / name).chmod(0o755)
    env = {
        "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "FAKE_DIR": str(tmp_path),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_CPUS_PER_NODE": "8(x2)",
        "ET_LAUNCHER": f"{sys.executable} -m elastic_trainer.cli",
        "ET_RUN_DIR": str(tmp_path / "run"),
    }
    env.update(extra)
    return env


def _run_script(tmp_path: Path, env: dict, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def _events(tmp_path: Path) -> list[dict]:
    path = tmp_path / "run" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _calls(tmp_path: Path, name: str) -> list[str]:
    p = tmp_path / name
    return p.read_text().splitlines() if p.exists() else []


def test_refuses_outside_slurm(tmp_path):
    env = _stub_env(tmp_path)
    del env["SLURM_JOB_ID"]
    p = _run_script(tmp_path, env)
    assert p.returncode == 2 and "not inside a SLURM job" in p.stderr


def test_renders_srun_and_launch_command(tmp_path):
    env = _stub_env(tmp_path, SLURM_RESTART_COUNT="3", SLURM_GPUS_PER_NODE="h100:4", ET_RDZV_CONF="join_timeout=900")
    p = _run_script(tmp_path, env, "configs/demo-cpu.toml", "--set", "train.steps=7")
    assert p.returncode == 0, p.stderr
    argv = _calls(tmp_path, "srun.argv")
    head = argv[: argv.index("launch")]
    assert head[:5] == ["--nodes=2", "--ntasks-per-node=1", "--ntasks=2", "--cpus-per-task=8", "--label"]
    launch = argv[argv.index("launch") + 1 :]
    assert launch[0] == "configs/demo-cpu.toml"
    opts = launch[1:]
    assert opts[opts.index("--nnodes") + 1] == "2"
    assert opts[opts.index("--rdzv-endpoint") + 1] == f"node-a:{20000 + 4242 % 20000}"
    assert opts[opts.index("--rdzv-id") + 1] == "slurm-4242-3"
    assert opts[opts.index("--nproc-per-node") + 1] == "4"
    assert opts[opts.index("--rdzv-conf") + 1] == "join_timeout=900"
    assert opts[-4:] == ["--set", f"run.dir={tmp_path / 'run'}", "--set", "train.steps=7"]
    ev = _events(tmp_path)
    assert [e["event"] for e in ev] == ["slurm_job", "slurm_exit"]
    assert ev[0]["restart_count"] == 3 and ev[0]["rdzv_endpoint"].startswith("node-a:")
    assert ev[1]["launcher_exit_code"] == 0 and ev[1]["requeued"] is False
    assert not any(c.startswith("requeue") for c in _calls(tmp_path, "scontrol.calls"))


def test_env_overrides_topology(tmp_path):
    env = _stub_env(
        tmp_path,
        ET_NNODES="1:2",
        ET_NPROC_PER_NODE="3",
        ET_RDZV_PORT="29999",
        ET_CPUS_PER_TASK="5",
        ET_MAX_RESTARTS="7",
    )
    p = _run_script(tmp_path, env)
    assert p.returncode == 0, p.stderr
    argv = _calls(tmp_path, "srun.argv")
    assert "--cpus-per-task=5" in argv
    opts = argv[argv.index("launch") + 1 :]
    assert opts[0] == "configs/demo-cpu.toml"  # the default config
    for flag, value in (
        ("--nnodes", "1:2"),
        ("--nproc-per-node", "3"),
        ("--rdzv-endpoint", "node-a:29999"),
        ("--max-restarts", "7"),
    ):
        assert opts[opts.index(flag) + 1] == value


def test_external_store_endpoint(tmp_path):
    """ET_RDZV_ENDPOINT: every node joins a store outside the allocation and none hosts one."""
    env = _stub_env(tmp_path, ET_RDZV_ENDPOINT="store-host:29400", ET_RDZV_CONF="join_timeout=900")
    p = _run_script(tmp_path, env)
    assert p.returncode == 0, p.stderr
    argv = _calls(tmp_path, "srun.argv")
    opts = argv[argv.index("launch") + 1 :]
    assert opts[opts.index("--rdzv-endpoint") + 1] == "store-host:29400"
    assert opts[opts.index("--rdzv-conf") + 1] == "join_timeout=900,is_host=false"
    assert _events(tmp_path)[0]["rdzv_endpoint"] == "store-host:29400"


def test_invalid_config_fails_before_srun(tmp_path):
    p = _run_script(tmp_path, _stub_env(tmp_path), "configs/demo-cpu.toml", "--set", "train.steps=-1")
    assert p.returncode == 2
    assert "invalid config" in p.stderr
    assert not (tmp_path / "srun.argv").exists()


@pytest.mark.parametrize(
    "rc,state,requeued",
    [(75, "RUNNING", True), (76, "RUNNING", True), (75, "COMPLETING", False), (1, "RUNNING", False)],
)
def test_exit_code_and_requeue(tmp_path, rc, state, requeued):
    p = _run_script(tmp_path, _stub_env(tmp_path, FAKE_RC=str(rc), FAKE_STATE=state))
    assert p.returncode == rc
    assert any(c == "requeue 4242" for c in _calls(tmp_path, "scontrol.calls")) is requeued
    assert _events(tmp_path)[-1]["requeued"] is requeued


def _start_and_signal(tmp_path: Path, *signals: int) -> tuple[int, str]:
    """Run the script with a stub step that waits for a signal and send it ``signals`` in order,
    the second one only once the stub has recorded the first forward. Returns (exit code, stderr)."""
    env = _stub_env(tmp_path, FAKE_WAIT="1")
    proc = subprocess.Popen(
        ["bash", str(SCRIPT)], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "srun.started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stderr.read() if proc.poll() is not None else "stub srun not started"
            )
            time.sleep(0.02)
        for i, sig in enumerate(signals):
            proc.send_signal(sig)
            if i == 0:
                while not _calls(tmp_path, "srun.signals"):
                    assert time.monotonic() < deadline, "no signal reached the stub srun"
                    time.sleep(0.02)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def test_term_is_forwarded_as_usr1(tmp_path):
    """srun answers SIGTERM by cancelling the step; the trap sends USR1, which srun passes through."""
    rc, err = _start_and_signal(tmp_path, signal.SIGTERM)
    assert rc == 75, err
    assert _calls(tmp_path, "srun.signals") == ["USR1"], err
    assert _events(tmp_path)[-1]["signal"] == "TERM"


def test_signal_forwarded_once_then_requeued(tmp_path):
    """USR1 to the batch shell reaches the step once; a TERM after it is not forwarded again
    (a second signal would interrupt the supervisor's graceful shutdown)."""
    rc, err = _start_and_signal(tmp_path, signal.SIGUSR1, signal.SIGTERM)
    assert rc == 75, err
    assert _calls(tmp_path, "srun.signals") == ["USR1"], err
    assert "not forwarding again" in err
    assert "requeue 4242" in _calls(tmp_path, "scontrol.calls")
    last = _events(tmp_path)[-1]
    assert last["event"] == "slurm_exit" and last["signal"] == "USR1" and last["requeued"] is True
