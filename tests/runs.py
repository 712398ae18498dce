"""Helpers to run real training jobs in tests: write a tiny config, launch the supervisor
(torchrun's elastic agent + real gloo workers) as a subprocess, read the event log, find and
kill worker processes. Waiting is always on events in the log, with a deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path

from elastic_trainer import contract
from elastic_trainer.config import toml_text
from elastic_trainer.supervisor.warm import Zygote, ZygoteError

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "elastic_trainer.cli"]
# What the warm CLI's interpreter imports before it forks a command (see start_cli).
CLI_PRELOAD = (
    "torch",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
    "elastic_trainer.cli",
    "elastic_trainer.supervisor.launcher",
)
COLD_CLI_ENV = "ELASTIC_TRAINER_TEST_COLD_CLI"  # "1": every command is a new interpreter
_cli_zygote: Zygote | None = None
_cli_lock = threading.Lock()

TINY = {
    "model": {"vocab_size": 256, "seq_len": 32, "dim": 32, "n_layers": 2, "n_heads": 2, "mlp_ratio": 2},
    "train": {
        "steps": 10,
        "global_batch_size": 10,
        "micro_batch_size": 5,  # one forward per rank per step at world 2; accumulation at world 1
        "seed": 7,
        "lr": 3e-3,
        "min_lr": 3e-4,
        "warmup_steps": 3,
        "log_every": 5,
    },
    "checkpoint": {"interval_steps": 5, "keep_last": 5, "mode": "async", "preempt_grace_seconds": 30.0},
    "elastic": {"nproc_per_node": 2, "max_restarts": 0, "hang_timeout_seconds": 60.0, "monitor_interval_seconds": 0.2},
    "metrics": {"port": 0},
}


def write_config(path: Path, data_path: str, run_dir: Path, ckpt_dir: str | None = None, **sections) -> Path:
    """A tiny-model TOML config; ``sections`` are dicts merged over :data:`TINY`."""
    cfg = {k: dict(v) for k, v in TINY.items()}
    cfg["run"] = {"dir": str(run_dir)}
    cfg["data"] = {"path": data_path, "dtype": "uint16"}
    cfg["checkpoint"]["dir"] = ckpt_dir or str(run_dir / "ckpt")
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path.write_text(toml_text(cfg))
    return path


# every job the tests launch serves its metrics to requests that carry this token (env_for_tests)
METRICS_TOKEN = "elastic-trainer-tests-metrics-token"


def scrape(port: int, host: str = "127.0.0.1", timeout: float = 5, token: str = METRICS_TOKEN) -> str:
    """A node's metrics exposition, asked for with the job's bearer token."""
    req = urllib.request.Request(f"http://{host}:{port}/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode()


def env_for_tests(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env[contract.METRICS_TOKEN_ENV] = METRICS_TOKEN
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TORCHELASTIC_ENABLE_FILE_TIMER", None)
    env.pop("TORCHELASTIC_TIMER_FILE", None)
    for k, v in (extra or {}).items():  # None removes a variable
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def python_c(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh interpreter (the tests' environment, the repository as the
    working directory): for what a process imports or holds from its start."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env_for_tests(), cwd=REPO
    )


def _warm_cli(argv: list[str], env: dict) -> Zygote | None:
    """The interpreter an ``elastic-trainer`` command is forked from, or None to start it cold.

    One per test process: the package's own zygote (what forks the workers of a warm start)
    with torch and the supervisor imported, so each command skips the interpreter start and
    those imports (about 3.3 CPU-seconds each). The command runs as ``python -m
    elastic_trainer.cli`` would, in a session of its own, with exactly ``env``. Cold instead: a
    command other than the CLI, a working directory other than the repository's, a PYTHONPATH
    that adds to the zygote's (its ``sys.path`` is inherited), or ``ELASTIC_TRAINER_TEST_COLD_CLI=1``."""
    global _cli_zygote
    if argv[: len(CLI)] != CLI or os.environ.get(COLD_CLI_ENV) == "1" or Path.cwd() != REPO:
        return None
    if set(env.get("PYTHONPATH", "").split(os.pathsep)) - {str(REPO), ""} - set(sys.path):
        return None
    with _cli_lock:
        if _cli_zygote is None or not _cli_zygote.alive:
            _cli_zygote = Zygote(preload=CLI_PRELOAD).start()
        return _cli_zygote


def start_cli(argv: list[str], env: dict, out, err=None) -> subprocess.Popen:
    """Start ``argv`` (``[*CLI, ...]`` or any command) in a session of its own, from the
    repository, with ``env``, stdout to the file ``out`` and stderr to ``err`` (default: ``out``):
    forked from the warm CLI when it can be (a ``subprocess.Popen`` stand-in with ``pid``,
    ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``), else a new process."""
    err = out if err is None else err
    zygote = _warm_cli(argv, env)
    if zygote is not None:
        try:
            return zygote.spawn(argv, env, stdout=out, stderr=err)  # type: ignore[return-value]
        except ZygoteError:
            pass  # started cold below
    return subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=REPO, start_new_session=True)


def run_cli(argv: list[str], env: dict, timeout: float, out=None) -> subprocess.CompletedProcess:
    """:func:`start_cli` and wait, as ``subprocess.run`` does (killed when ``timeout`` passes).
    ``out``: the file both streams go to; None: captured, as ``capture_output=True, text=True``."""
    with tempfile.TemporaryFile() as o, tempfile.TemporaryFile() as e:
        proc = start_cli(argv, env, out or o, None if out else e)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            raise
        if out is not None:
            return subprocess.CompletedProcess(argv, code)
        o.seek(0)
        e.seek(0)
        return subprocess.CompletedProcess(
            argv, code, o.read().decode(errors="replace"), e.read().decode(errors="replace")
        )


def launch_args(config: Path, *args: str) -> list[str]:
    return [*CLI, "launch", str(config), *args]


def run_args(run_dir, ckpt_dir, *flags: str, nproc: int = 2, max_restarts: int | None = None) -> list[str]:
    """``elastic-trainer run`` with the test's run.dir and checkpoint.dir, no metrics port and a fast
    monitor (``max_restarts`` None: run's default); ``flags`` go on (the script and its arguments last)."""
    restarts = [] if max_restarts is None else ["--max-restarts", str(max_restarts)]
    return [
        *CLI,
        "run",
        "--set",
        f"run.dir={run_dir}",
        "--set",
        f"checkpoint.dir={ckpt_dir}",
        "--set",
        "metrics.port=0",
        "--nproc-per-node",
        str(nproc),
        *restarts,
        "--monitor-interval",
        "0.2",
        *flags,
    ]


def run_launch(
    config: Path,
    *args: str,
    timeout: float = 240,
    env: dict | None = None,
    log: Path | None = None,
    tmpfs: tuple[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``elastic-trainer launch`` to completion. ``tmpfs=(path, size)``: in a mount namespace of
    its own where ``path`` is a tmpfs of ``size`` (e.g. ``"64k"``): a small /dev/shm, a full disk."""
    log = log or config.with_suffix(".log")
    prefix = []
    if tmpfs is not None:
        path, size = tmpfs
        prefix = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs {path} && exec "$@"', "sh"]
    with open(log, "ab") as out:
        return run_cli([*prefix, *launch_args(config, *args)], env_for_tests(env), timeout, out)


def start_launch(config: Path, *args: str, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    """Start ``elastic-trainer launch`` in its own session; returns the supervisor process."""
    log = log or config.with_suffix(".log")
    with open(log, "ab") as out:  # the process holds its own descriptor
        return start_cli(launch_args(config, *args), env_for_tests(env), out)


def read_events(run_dir: Path, name: str | None = None) -> list[dict]:
    """The run's records (of event ``name``); fails the test on any record of a catalogued event
    (contract.EVENTS) whose fields break the catalogue: an end-to-end run checks the fields the
    code only knows at run time (a ``**fields`` call) too. Events of other names are a user
    script's own (``session.events.emit`` is public API); every name our code emits is checked
    statically (tests/unit/test_contract.py)."""
    path = Path(run_dir) / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("event") in contract.EVENT_NAMES:
            problems = contract.event_problems(rec["event"], set(rec) - set(contract.RECORD_FIELDS))
            assert not problems, f"{path}: {problems}"
        if name is None or rec.get("event") == name:
            out.append(rec)
    return out


def step_losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a step logged twice (redone after a restart) keeps its last value."""
    return {r["step"]: r["loss"] for r in read_events(run_dir, "step")}


def wait_for(
    predicate: Callable[[], object],
    timeout: float,
    what: str,
    proc: subprocess.Popen | None = None,
    interval: float = 0.05,
):
    """Poll ``predicate`` until truthy; fail after ``timeout`` or if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            value = predicate()
            if value:
                return value
            raise AssertionError(f"process exited with {proc.returncode} while waiting for {what}")
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_event(
    run_dir: Path, name: str, timeout: float, proc=None, where: Callable[[dict], bool] = lambda r: True
) -> dict:
    def find():
        for r in read_events(run_dir, name):
            if where(r):
                return r
        return None

    return wait_for(find, timeout, f"event {name}", proc)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (exited, not yet reaped) or a process gone counts as exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
    except FileNotFoundError:
        pass
    return out


def worker_pids(supervisor_pid: int) -> list[int]:
    """Worker processes of a supervisor: its direct children running the worker module, or
    (warm start, ``elastic.warm_start``) the children of its zygote."""
    pids = []
    for c in children(supervisor_pid):
        try:
            cmd = open(f"/proc/{c}/cmdline", "rb").read().split(b"\0")
        except FileNotFoundError:
            continue
        if is_zygote(c):  # forked from the supervisor: its command line is the supervisor's
            pids += children(c)
        elif b"elastic_trainer.worker.main" in cmd:
            pids.append(c)
    return sorted(pids)


def is_zygote(pid: int) -> bool:
    """A warm-start zygote, by its process name (forked from the supervisor, it has its command line)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == contract.ZYGOTE_NAME
    except FileNotFoundError:
        return False


def zygote_pid(supervisor_pid: int) -> int | None:
    """The supervisor's warm-start zygote, if it runs one."""
    return next((c for c in children(supervisor_pid) if is_zygote(c)), None)


def kill(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def stop_gracefully(proc: subprocess.Popen, timeout: float = 120) -> None:
    """SIGTERM a supervisor we started (preemption: it checkpoints and exits 75); kill it if it
    has not exited within ``timeout``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stop(proc)


def stop(proc: subprocess.Popen, timeout: float = 20) -> None:
    """Stop a supervisor we started (its process group), then any of its workers left."""
    if proc.poll() is None:
        workers = worker_pids(proc.pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        kill(workers)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def close_rel(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def signal_at_step(
    args: list[str],
    run_dir: Path,
    at_step: int,
    sig: int = signal.SIGTERM,
    env: dict | None = None,
    timeout: float = 120,
) -> int:
    """Run ``args`` (a supervisor) in its own session, logging to ``run_dir/run.log``; send ``sig``
    once ``run_dir``'s event log has a step ``>= at_step``; return its exit code."""
    with open(Path(run_dir) / "run.log", "ab") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env_for_tests(env), cwd=REPO, start_new_session=True
        )
    try:
        wait_event(run_dir, "step", timeout + 60, proc, where=lambda r: r["step"] >= at_step)
        proc.send_signal(sig)
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
