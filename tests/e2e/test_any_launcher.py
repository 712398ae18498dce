"""The configuration under any launcher, in real processes: a script under plain ``torchrun``
(and ``python``) with ``ELASTIC_TRAINER_CONFIG`` and ``ELASTIC_TRAINER_SET``, and the refusal
when another launcher's default checkpoint root holds the commits."""

from __future__ import annotations

import json
import subprocess
import sys

from elastic_trainer import contract
from tests import runs
from tests.fixtures.procs import free_port

_SCRIPT = """
import json
import elastic_trainer as et

s = et.init(overrides=["checkpoint.interval_steps=3", "train.seed=5", "train.lr=0.5"])
c = s.cfg
got = [s.rank, s.world_size, c.checkpoint.dir, c.checkpoint.interval_steps, c.train.seed, c.train.lr]
print("RESULT " + json.dumps(got))
s.close()
"""

_ACCELERATE = """
from accelerate.utils import ProjectConfiguration
from elastic_trainer.accelerate import Accelerator

Accelerator(project_config=ProjectConfiguration(project_dir="proj"))
print("STARTED")
"""


def _results(stdout: str) -> list[list]:
    return sorted(json.loads(x.split(" ", 1)[1]) for x in stdout.splitlines() if x.startswith("RESULT "))


def test_torchrun_reads_the_config_file_and_overrides_of_the_environment(tmp_path):
    (tmp_path / "train.py").write_text(_SCRIPT)
    (tmp_path / "job.toml").write_text(f'[checkpoint]\ndir = "{tmp_path / "ck"}"\ninterval_steps = 7\n')
    env = runs.env_for_tests(
        {
            contract.CONFIG_FILE_ENV: "job.toml",
            contract.OVERRIDES_ENV: "train.seed=9; train.steps=3",
            contract.CONFIG_ENV: None,
            contract.CONFIG_SET_ENV: None,
        }
    )
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    r = subprocess.run([*args, "train.py"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    # the file's checkpoint.dir; the environment's values win over the script's; the rest is the script's
    assert _results(r.stdout) == [[rank, 2, str(tmp_path / "ck"), 7, 9, 0.5] for rank in (0, 1)]
    written = json.loads((tmp_path / "runs" / "job" / contract.RESOLVED_CONFIG_FILE).read_text())
    assert written["checkpoint"]["dir"] == str(tmp_path / "ck") and written["train"]["seed"] == 9


def test_run_reads_the_same_variables_and_its_flags_win(tmp_path):
    """`elastic-trainer run` takes ELASTIC_TRAINER_CONFIG as its --config and ELASTIC_TRAINER_SET
    before its --set: the script resolves what it does under torchrun, but for the flag."""
    (tmp_path / "train.py").write_text(_SCRIPT)
    (tmp_path / "job.toml").write_text(f'[checkpoint]\ndir = "{tmp_path / "ck"}"\ninterval_steps = 7\n')
    env = runs.env_for_tests(
        {
            contract.CONFIG_FILE_ENV: "job.toml",
            contract.OVERRIDES_ENV: "train.seed=9; metrics.port=0",
            contract.CONFIG_ENV: None,
            contract.CONFIG_SET_ENV: None,
        }
    )
    args = [*runs.CLI, "run", "--nproc-per-node", "1", "--monitor-interval", "0.2", "--set", "train.lr=0.25"]
    r = subprocess.run([*args, "train.py"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert _results(r.stdout) == [[0, 1, str(tmp_path / "ck"), 7, 9, 0.25]]
    written = json.loads((tmp_path / "runs" / "job" / contract.RESOLVED_CONFIG_FILE).read_text())
    assert written["train"]["lr"] == 0.25


def test_python_refuses_a_root_without_commits_when_the_other_launcher_s_has_them(tmp_path):
    """An Accelerate script with a project_dir under plain python, whose commits were made under
    `elastic-trainer run` (runs/<script>/checkpoints): exit 2 naming both roots, not a fresh start."""
    (tmp_path / "acc.py").write_text(_ACCELERATE)
    step = tmp_path / "runs" / "acc" / "checkpoints" / "step-00000004"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    env = runs.env_for_tests({contract.CONFIG_ENV: None, contract.CONFIG_SET_ENV: None})
    r = subprocess.run([sys.executable, "acc.py"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert r.returncode == 2, r.stderr[-4000:]
    assert "STARTED" not in r.stdout
    assert "proj/checkpoints" in r.stderr and "runs/acc/checkpoints" in r.stderr, r.stderr[-2000:]
    env[contract.OVERRIDES_ENV] = "checkpoint.dir=runs/acc/checkpoints"  # said explicitly: it resumes there
    r = subprocess.run([sys.executable, "acc.py"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert r.returncode == 0 and "STARTED" in r.stdout, r.stderr[-4000:]
