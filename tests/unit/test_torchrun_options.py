"""torchrun's options for ``launch`` and ``run``: every flag accepted with torchrun's parser,
precedence CLI > PET_* > config (pure merge, table-tested), PET_* as Kubeflow sets them."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from elastic_trainer.config import ConfigError, ElasticConfig, load_config
from elastic_trainer.supervisor import options

CFG = ElasticConfig(
    nnodes="1:3",
    nproc_per_node=4,
    max_restarts=5,
    rdzv_endpoint="store:29400",
    rdzv_id="cfg-id",
    monitor_interval_seconds=0.5,
)
TORCHRUN_DEFAULTS = {
    "nnodes": "1:1",
    "nproc_per_node": "1",
    "max_restarts": 0,
    "monitor_interval": 0.1,
    "rdzv_backend": "static",
    "rdzv_endpoint": "",
    "rdzv_id": "none",
    "rdzv_conf": "",
    "standalone": False,
    "master_addr": "127.0.0.1",
    "master_port": None,
    "node_rank": 0,
}


def merged(cli: dict | None = None, env: dict | None = None, elastic: ElasticConfig = CFG) -> dict:
    """What torchrun's parser would give (CLI > PET_* > default), then merge()."""
    cli, env = cli or {}, env or {}
    parsed = dict(TORCHRUN_DEFAULTS)
    for dest, value in env.items():
        parsed[dest] = value
    parsed.update(cli)
    return options.merge(parsed, set(cli), {options.env_var(d): str(v) for d, v in env.items()}, elastic)


@pytest.mark.parametrize(
    "cli, env, key, expected",
    [
        ({}, {}, "nproc_per_node", "4"),  # config over torchrun's default
        ({}, {"nproc_per_node": "2"}, "nproc_per_node", "2"),  # PET_* over config
        ({"nproc_per_node": "3"}, {"nproc_per_node": "2"}, "nproc_per_node", "3"),  # CLI over PET_*
        ({"nproc_per_node": "auto"}, {}, "nproc_per_node", "auto"),
        ({}, {}, "max_restarts", 5),
        ({}, {"max_restarts": 1}, "max_restarts", 1),
        ({"max_restarts": 0}, {"max_restarts": 1}, "max_restarts", 0),  # an explicit 0 is still a CLI value
        ({}, {}, "nnodes", "1:3"),
        ({}, {"nnodes": "2"}, "nnodes", "2"),
        ({}, {}, "rdzv_id", "cfg-id"),
        ({}, {"rdzv_id": "job-uid"}, "rdzv_id", "job-uid"),
        ({}, {}, "rdzv_endpoint", "store:29400"),
        ({}, {"rdzv_endpoint": "master-0:23456"}, "rdzv_endpoint", "master-0:23456"),
        ({}, {}, "monitor_interval", 0.5),
        ({"monitor_interval": 2.0}, {}, "monitor_interval", 2.0),
        ({}, {}, "rdzv_backend", "c10d"),
        ({}, {"rdzv_backend": "etcd-v2"}, "rdzv_backend", "etcd-v2"),
    ],
)
def test_precedence_cli_then_pet_then_config(cli, env, key, expected):
    assert merged(cli, env)[key] == expected


@pytest.mark.parametrize(
    "cli, env, expected",
    [
        ({}, {}, "last_call_timeout=1,keep_alive_interval=0.25,keep_alive_max_attempt=8"),
        (
            {"rdzv_conf": "last_call_timeout=5,is_host=false"},
            {},
            "last_call_timeout=5,keep_alive_interval=0.25,keep_alive_max_attempt=8,is_host=false",
        ),
        (
            {},
            {"rdzv_conf": "join_timeout=900"},
            "last_call_timeout=1,keep_alive_interval=0.25,keep_alive_max_attempt=8,join_timeout=900",
        ),
        (
            {"rdzv_conf": "join_timeout=60"},
            {"rdzv_conf": "join_timeout=900"},
            "last_call_timeout=1,keep_alive_interval=0.25,keep_alive_max_attempt=8,join_timeout=60",
        ),
    ],
)
def test_rdzv_conf_items_replace_config_items(cli, env, expected):
    assert merged(cli, env)["rdzv_conf"] == expected


def test_bad_rdzv_conf_names_the_flag():
    with pytest.raises(ConfigError, match="--rdzv-conf"):
        merged({"rdzv_conf": "foo=1"})


@pytest.mark.parametrize(
    "cli, env, elastic, backend, standalone, endpoint",
    [
        # one node, no endpoint: standalone (config default)
        ({}, {}, ElasticConfig(), "c10d", True, ""),
        ({"nproc_per_node": "2"}, {}, ElasticConfig(nnodes="1"), "c10d", True, ""),
        # Kubeflow without an elastic policy: PET_NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT -> static
        (
            {},
            {"nnodes": "2", "node_rank": "1", "master_addr": "job-master-0", "master_port": "23456"},
            ElasticConfig(),
            "static",
            False,
            "",
        ),
        # ... but a single node of such a job is standalone
        (
            {},
            {"nnodes": "1", "node_rank": "0", "master_addr": "job-master-0", "master_port": "23456"},
            ElasticConfig(),
            "c10d",
            True,
            "",
        ),
        # Kubeflow with an elastic policy: PET_RDZV_* -> c10d at that endpoint
        (
            {},
            {"nnodes": "1:3", "rdzv_backend": "c10d", "rdzv_endpoint": "job-master-0:29400", "rdzv_id": "uid"},
            ElasticConfig(),
            "c10d",
            False,
            "job-master-0:29400",
        ),
        # an explicit backend wins over the static inference
        (
            {"rdzv_backend": "c10d", "rdzv_endpoint": "h:1"},
            {"nnodes": "2", "master_addr": "m"},
            ElasticConfig(),
            "c10d",
            False,
            "h:1",
        ),
        # a configured endpoint wins over the static inference
        ({}, {"nnodes": "2", "master_addr": "m"}, ElasticConfig(rdzv_endpoint="store:1"), "c10d", False, "store:1"),
        ({"standalone": True}, {}, ElasticConfig(nnodes="1:2", rdzv_endpoint="x:1"), "c10d", True, "x:1"),
    ],
)
def test_rendezvous_choice(cli, env, elastic, backend, standalone, endpoint):
    out = merged(cli, env, elastic)
    assert (out["rdzv_backend"], bool(out["standalone"]), out["rdzv_endpoint"]) == (backend, standalone, endpoint)
    if standalone or backend == "static":
        assert out["rdzv_conf"] == ""


@pytest.mark.parametrize(
    "cli, env, elastic, key",
    [
        ({"nnodes": "2"}, {}, ElasticConfig(), "--nnodes"),
        ({}, {"nnodes": "1:2"}, ElasticConfig(), "--nnodes"),
        ({}, {}, ElasticConfig(nnodes="2:4"), "elastic.nnodes"),
        ({"nnodes": "2", "rdzv_backend": "c10d"}, {}, ElasticConfig(), "--nnodes"),
    ],
)
def test_several_nodes_without_endpoint_or_master_is_a_config_error(cli, env, elastic, key):
    """Each node would otherwise wait on a store of its own at localhost."""
    with pytest.raises(ConfigError, match=f"{key}.*rendezvous endpoint.*--master-addr"):
        merged(cli, env, elastic)


def test_launch_help_lists_each_option_once_with_launch_defaults():
    text = options.launch_parser().format_help()
    flags = [f for a in torchrun_actions() for f in a.option_strings if "_" not in f]
    for flag in flags:
        # as an option, not in help text
        n = len(re.findall(rf"^  (?:-\S+(?: [A-Z_]+)?, )?{re.escape(flag)}(?=[ ,\n])", text, re.M))
        assert n == (0 if flag in ("--no-python", "--run-path", "-m", "--module") else 1), (flag, n)
    assert "--no-python" not in text and "--run-path" not in text and "--nproc_per_node" not in text
    helps = {a.dest: " ".join(a.help.split()) for a in options.launch_parser()._actions if a.help}
    assert "elastic.nproc_per_node of the config (default 2)" in helps["nproc_per_node"]
    assert "elastic.max_restarts of the config (default 3)" in helps["max_restarts"]
    assert options.SIGNALS_TO_HANDLE in helps["signals_to_handle"] and "SIGUSR1" in options.SIGNALS_TO_HANDLE
    assert "checkpoint.preempt_grace_seconds + 15: 75" in helps["shutdown_timeout"]


def test_run_help_says_which_config_applies_without_config():
    helps = {a.dest: " ".join(a.help.split()) for a in options.run_parser()._actions if a.help}
    assert "the whole resolved config (--set included) reaches the script" in helps["config"]
    assert (
        "Without it: the built-in defaults (run.dir runs/<script name>, checkpoint.dir <run.dir>/checkpoints"
        in helps["config"]
    )
    assert "elastic.max_restarts of the config (default 3)" in helps["max_restarts"]


def test_int_nnodes_in_config():
    cfg = load_config(None, ["elastic.nnodes=2", "data.path=x", "checkpoint.dir=/tmp/x"])
    assert cfg.elastic.nnodes == "2"
    with pytest.raises(ConfigError, match="elastic.nnodes"):
        load_config(None, ["elastic.nnodes=0", "data.path=x", "checkpoint.dir=/tmp/x"])
    with pytest.raises(ConfigError, match="elastic.nnodes"):
        load_config(None, ["elastic.nnodes=true", "data.path=x", "checkpoint.dir=/tmp/x"])


def sample_value(action: argparse.Action) -> list[str]:
    """A valid command-line value for one torchrun option."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [list(action.choices)[0]]
    if action.type is int:
        return ["1"]
    if action.type is float:
        return ["0.5"]
    special = {
        "nnodes": "1",
        "nproc_per_node": "1",
        "redirects": "0",
        "tee": "0",
        "local_ranks_filter": "0",
        "signals_to_handle": "SIGTERM",
    }
    return [special.get(action.dest, "x")]


def torchrun_actions() -> list[argparse.Action]:
    from torch.distributed.run import get_args_parser

    return [a for a in get_args_parser()._actions if a.option_strings and a.dest != "help"]


def test_torchrun_parser_shape():
    """Fails loudly if torch changes what this module relies on: optional actions in
    ``parser._actions``, the env actions reading PET_<DEST>, the script positionals."""
    dests = options.option_dests()
    for d in (
        "nnodes",
        "nproc_per_node",
        "rdzv_backend",
        "rdzv_endpoint",
        "rdzv_id",
        "rdzv_conf",
        "standalone",
        "max_restarts",
        "monitor_interval",
        "master_addr",
        "master_port",
        "node_rank",
        "log_dir",
        "redirects",
        "tee",
        "no_python",
        "run_path",
        "module",
    ):
        assert d in dests
    assert set(options.CONFIG_KEYS) <= set(dests)


@pytest.mark.parametrize("action", torchrun_actions(), ids=lambda a: a.option_strings[-1])
def test_every_torchrun_flag_is_accepted_by_launch_and_run(action):
    for flag in action.option_strings:
        argv = [flag, *sample_value(action)]
        la, lexp = options.parse_explicit(options.launch_parser(), ["cfg.toml", *argv])
        assert la.config == "cfg.toml" and action.dest in lexp
        ra, rexp = options.parse_explicit(options.run_parser(), [*argv, "train.py", "--lr", "1"])
        assert ra.training_script == "train.py" and ra.training_script_args == ["--lr", "1"] and action.dest in rexp
        assert getattr(la, action.dest) == getattr(ra, action.dest)
    # options given after CONFIG too
    la, _ = options.parse_explicit(options.launch_parser(), ["--set", "a.b=1", "cfg.toml", *argv, "--set", "c.d=2"])
    assert la.overrides == ["a.b=1", "c.d=2"]


def test_pet_variables_drive_the_parsers(monkeypatch):
    """torchrun's own env action: PET_* read when the parser is built, a flag wins."""
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_NNODES", "2")
    a, explicit = options.parse_explicit(options.launch_parser(), ["cfg.toml", "--nnodes", "1"])
    assert (a.nproc_per_node, a.nnodes, explicit & {"nproc_per_node", "nnodes"}) == ("3", "1", {"nnodes"})
    out = options.resolve(a, explicit, CFG)
    assert (out.nproc_per_node, out.nnodes, out.max_restarts) == ("3", "1", 5)


def test_launch_config_nproc_auto_and_gpu(monkeypatch):
    import os

    monkeypatch.delenv("PET_NPROC_PER_NODE", raising=False)
    a, explicit = options.parse_explicit(options.run_parser(), ["--nproc-per-node", "auto", "-m", "pkg.mod"])
    config, cmd, cmd_args = options.launch_config(
        options.resolve(a, explicit, ElasticConfig()), explicit, shutdown_timeout=75, signals="SIGTERM"
    )
    assert config.nproc_per_node == (os.cpu_count() or 1)  # no accelerator here: torchrun counts CPUs
    assert cmd_args[-2:] == ["-m", "pkg.mod"] and config.shutdown_timeout == 75
    a, explicit = options.parse_explicit(
        options.run_parser(), ["--nproc-per-node", "gpu", "--shutdown-timeout", "9", "x.py"]
    )
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--nproc-per-node"):
            options.launch_config(
                options.resolve(a, explicit, ElasticConfig()), explicit, shutdown_timeout=75, signals="SIGTERM"
            )


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    from tests.runs import REPO

    return subprocess.run(
        [sys.executable, "-m", "elastic_trainer.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )


def test_version():
    from importlib.metadata import version

    import torch

    import elastic_trainer

    r = cli("--version")
    assert r.returncode == 0
    # the installed distribution's version (PyPI's CUDA wheels: "2.11.0" for torch "2.11.0+cu130")
    assert r.stdout.strip() == f"elastic-trainer {elastic_trainer.__version__} (torch {version('torch')})"
    assert torch.__version__.split("+")[0] == version("torch").split("+")[0]


def test_launch_rejects_script_only_flags_and_stray_positionals(tmp_path):
    r = cli("launch", "configs/demo-cpu.toml", "--no-python", "--set", f"run.dir={tmp_path}")
    assert r.returncode == 2 and "--no-python" in r.stderr and "elastic-trainer run" in r.stderr
    r = cli("launch", "configs/demo-cpu.toml", "train.py")
    assert r.returncode == 2 and "unrecognized arguments: train.py" in r.stderr
    r = cli("launch", "configs/demo-cpu.toml", "--nproc-per-node", "gpu", "--set", f"run.dir={tmp_path}")
    if "CUDA" not in r.stderr:
        assert r.returncode == 2 and "--nproc-per-node" in r.stderr, r.stderr
