"""scripts/compat-torch.sh, CI's job on the oldest supported torch, on a machine whose disk cannot
hold that torch's CUDA build: it is skipped, saying so, its venv removed, and CI stays truthful
about everything else. The job itself runs in CI; here it meets a full disk through a stand-in
interpreter whose pip fails as pip fails on one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "compat-torch.sh"

# A stand-in for python3: `-m venv DIR` makes DIR/bin/{python,pip}; that pip fails on a full disk
# (or as told by $FAKE_PIP_ERROR), as pip did on a CI machine while unpacking torch's libraries.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin"
  cp "$0" "$3/bin/python"
  cp "$(dirname "$0")/pip" "$3/bin/pip"
  exit 0
fi
exit 1
"""
FAKE_PIP = """#!/usr/bin/env bash
echo "ERROR: Could not install packages due to an OSError: $FAKE_PIP_ERROR" >&2
exit 1
"""


def _run(tmp_path: Path, venv: Path, min_free_gib: int, pip_error: str) -> subprocess.CompletedProcess[str]:
    for name, text in (("python3", FAKE_PYTHON), ("pip", FAKE_PIP)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    env = dict(
        os.environ,
        PYTHON=str(tmp_path / "python3"),
        FAKE_PIP_ERROR=pip_error,
        ELASTIC_TRAINER_COMPAT_VENV=str(venv),
        ELASTIC_TRAINER_COMPAT_MIN_FREE_GIB=str(min_free_gib),
    )
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("min_free_gib", "pip_error", "why"),
    [
        (10**9, "unused", "ELASTIC_TRAINER_COMPAT_MIN_FREE_GIB"),  # too little free disk: nothing installed
        (0, "[Errno 28] No space left on device", "disk filled up"),  # the disk fills up during the install
    ],
    ids=["too-little-free-disk", "disk-fills-up"],
)
def test_a_disk_that_cannot_hold_torch_skips_the_job_saying_why_and_leaves_no_venv(
    tmp_path: Path, min_free_gib: int, pip_error: str, why: str
) -> None:
    venv = tmp_path / "venv"
    out = _run(tmp_path, venv, min_free_gib=min_free_gib, pip_error=pip_error)
    assert out.returncode == 0, out.stderr
    assert "compat: SKIPPED" in out.stderr and why in out.stderr
    assert not venv.exists()


def test_any_other_install_failure_fails_the_job(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    out = _run(tmp_path, venv, min_free_gib=0, pip_error="[Errno 13] Permission denied")
    assert out.returncode == 1
    assert "SKIPPED" not in out.stderr and "installing torch" in out.stderr
