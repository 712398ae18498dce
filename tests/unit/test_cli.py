"""The command line's own contracts: exit codes, errors naming what the user typed, help text,
and commands without side effects (in-process: ``cli.main``)."""

from __future__ import annotations

import json

import pytest

from elastic_trainer import cli
from tests.runs import REPO

DEMO = str(REPO / "configs" / "demo-cpu.toml")


@pytest.fixture(autouse=True)
def _restore_library_logger():
    """``cli.main`` gives the ``elastic_trainer`` logger its handler: undo it for later tests."""
    import logging

    logger = logging.getLogger("elastic_trainer")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield
    logger.handlers[:], logger.propagate = saved[0], saved[1]
    logger.setLevel(saved[2])


@pytest.fixture
def demo_data(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("hello elastic world\n" * 2000)
    out = tmp_path / "demo.bin"
    assert cli.main(["data", "build", "--out", str(out), "--text", str(text)]) == 0
    return out


def deep(tmp_path, *overrides: str) -> int:
    sets = [f"run.dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}", *overrides]
    return cli.main(["config", "check", DEMO, "--deep", *[x for s in sets for x in ("--set", s)]])


def test_config_check_deep_passes_a_good_config(tmp_path, demo_data, capsys):
    capsys.readouterr()
    assert deep(tmp_path, f"data.path={demo_data}") == 0
    assert json.loads(capsys.readouterr().out)["data"]["path"] == str(demo_data)


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.factory=no_such_package.models:build", "model.factory"),  # the factory is imported
        ("data.path={tmp}/missing.bin", "data.path"),  # the data source is opened
        ("checkpoint.resume=5", "checkpoint.resume"),  # storage is read: no step 5 there
        ("elastic.nnodes=2", "elastic.nnodes"),  # the launch options as launch resolves them
    ],
)
def test_config_check_deep_exits_2_naming_the_key(tmp_path, demo_data, capsys, override, key):
    sets = [f"data.path={demo_data}", override.format(tmp=tmp_path)]
    assert deep(tmp_path, *sets) == 2
    err = capsys.readouterr().err
    assert f"config error at '{key}'" in err, err
    # the schema-only check passes the same config
    assert cli.main(["config", "check", DEMO, *[x for s in sets for x in ("--set", s)]]) == 0


def test_ckpt_list_on_a_missing_root_fails_and_names_the_uri(tmp_path, capsys):
    missing = tmp_path / "no-such-root"
    assert cli.main(["ckpt", "list", str(missing)]) == 1
    assert f"no checkpoint root at {missing}" in capsys.readouterr().err
    assert cli.main(["ckpt", "inspect", str(missing)]) == 1
    assert cli.main(["ckpt", "list", "gs://bucket/prefix"]) == 2
    err = capsys.readouterr().err
    assert "config error at 'URI'" in err and "checkpoint.dir" not in err
    assert cli.main(["report", "gs://bucket/run"]) == 2
    assert "config error at 'RUN_DIR|CHECKPOINT_ROOT'" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["ckpt", "list", str(tmp_path / "empty")]) == 0  # a root without checkpoints yet


def test_every_tool_option_has_help():
    import argparse

    def walk(p: argparse.ArgumentParser, path: str):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    yield from walk(sub, f"{path} {name}")
            elif a.dest != "help":
                yield path, a

    missing = [
        f"{path} {'/'.join(a.option_strings) or a.dest}"
        for path, a in walk(cli._parser(), "elastic-trainer")
        if not a.help
    ]
    assert not missing, missing


# A daemon thread inside a torch store call, as torch's rendezvous keep-alive is every few
# seconds in the supervisor; it waits until the thread has made calls, then runs the command.
_STORE_CALLS_AT_EXIT = """
import runpy, sys, threading
import torch.distributed as dist
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
calls = threading.Semaphore(0)
def keep_alive():
    while True:
        client.compare_set("heartbeat", "", "alive")
        calls.release()
threading.Thread(target=keep_alive, daemon=True).start()
for _ in range(50):
    assert calls.acquire(timeout=30)
sys.argv = ["elastic-trainer", *sys.argv[1:]]
runpy.run_module("elastic_trainer.cli", run_name="__main__")
"""


def test_the_exit_code_survives_torch_s_daemon_threads_in_a_store_call():
    """The code a command decided is the process's, also when a daemon thread of torch's is inside
    a store call as the process ends: a thread coming back from C++ into a finalizing interpreter
    aborts the process (SIGABRT, 'terminate called without an active exception'), which once
    turned a supervisor's 75 into -6. Five runs: without ``exit_codes.exit_now`` nearly every one
    aborts."""
    import subprocess
    import sys

    for _ in range(5):
        p = subprocess.run(
            [sys.executable, "-c", _STORE_CALLS_AT_EXIT, "ckpt", "list", "gs://bucket/prefix"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert (p.returncode, "terminate called" in p.stderr) == (2, False), p.stderr[-2000:]
        assert "gs://" in p.stderr  # the command's own error, printed before the exit


def test_the_console_script_ends_through_the_same_exit():
    from importlib.metadata import entry_points

    [script] = [e for e in entry_points(group="console_scripts") if e.name == "elastic-trainer"]
    assert script.value == "elastic_trainer.cli:entry"
