"""Process set-up of a training rank (elastic_trainer.runtime.session) that needs no peers."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_trainer.runtime.session import group_store
from tests import runs
from tests.fixtures.procs import free_port


def test_restarts_under_torchruns_agent_store_never_see_the_dead_attempts_keys(monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = group_store(timedelta(seconds=10))
    first.set("rank_0_address", b"dead")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = group_store(timedelta(seconds=10))
    assert not second.check(["rank_0_address"]), "a restarted group must not read the killed group's keys"
    second.set("rank_0_address", b"alive")
    assert first.get("rank_0_address") == b"dead" and second.get("rank_0_address") == b"alive"
    # Outside torchrun's agent store (our supervisor, env:// by hand) the default is kept.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert group_store(timedelta(seconds=10)) is None
    # No launcher at all: a process-local store (a world of one, no port).
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK", raising=False)
    assert isinstance(group_store(timedelta(seconds=10)), dist.HashStore)


@pytest.mark.timeout(120)
def test_a_native_crash_leaves_the_python_stack_of_every_thread(tmp_path):
    code = (
        "import os, threading, elastic_trainer as et\n"
        f"s = et.init(overrides=['run.dir={tmp_path}', 'checkpoint.dir={tmp_path / 'ckpt'}'])\n"
        "def saver():\n    threading.Event().wait()\n"
        "threading.Thread(target=saver, name='saver', daemon=True).start()\n"
        "os.abort()\n"
    )
    env = runs.env_for_tests(
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=runs.REPO, timeout=100
    )
    assert r.returncode == -6, r.stderr[-2000:]
    assert "Fatal Python error: Aborted" in r.stderr
    assert "in saver" in r.stderr, "the other threads' stacks are dumped too"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("own_handler", [False, True])
def test_init_shows_the_librarys_log_lines_unless_the_program_configured_them(tmp_path, own_handler):
    code = (
        "import logging, sys, elastic_trainer as et\n"
        + (
            "h = logging.StreamHandler(sys.stderr); h.setFormatter(logging.Formatter('MINE %(message)s'))\n"
            "logging.getLogger('elastic_trainer').addHandler(h)\n"
            if own_handler
            else ""
        )
        + f"s = et.init(overrides=['run.dir={tmp_path}', 'checkpoint.dir={tmp_path / 'ckpt'}'])\n"
        "logging.getLogger('elastic_trainer.user').debug('debug line')\n"
        "logging.getLogger('elastic_trainer.user').warning('warning line')\n"
    )
    env = runs.env_for_tests(
        {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "ELASTIC_TRAINER_LOG_LEVEL": "DEBUG",
            "ELASTIC_TRAINER_NODE": "node-7",
        }
    )
    env.pop("GROUP_RANK", None)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=runs.REPO, timeout=100
    )
    assert r.returncode == 0, r.stderr[-2000:]
    if own_handler:
        assert "MINE warning line" in r.stderr and "[node-7/0" not in r.stderr
    else:
        assert "DEBUG [node-7/0 - step -] elastic_trainer.user: debug line" in r.stderr, r.stderr[-2000:]
        assert "WARNING [node-7/0 - step -] elastic_trainer.user: warning line" in r.stderr
