"""torchrun's options for ``launch`` and ``run``, parsed by torchrun's own parser.

Every option of ``torchrun --help`` is accepted with torchrun's name and meaning. Precedence:
a command-line flag, then the ``PET_*`` variable torchrun reads for it (what Kubeflow sets),
then the config file (``elastic.*``), then torchrun's default. torchrun's parser already gives
CLI > ``PET_*`` > default; :func:`merge` (pure, table-tested) puts the config value in only
where neither the command line nor a ``PET_*`` variable gave one.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Mapping

from ..config import ElasticConfig, parse_nnodes, parse_rdzv_conf
from ..errors import ConfigError

WORKER_MODULE = "elastic_trainer.worker.main"

# torchrun option (argparse dest) -> elastic config key it defaults from
CONFIG_KEYS: dict[str, str] = {
    "nnodes": "nnodes",
    "nproc_per_node": "nproc_per_node",
    "max_restarts": "max_restarts",
    "monitor_interval": "monitor_interval_seconds",
    "rdzv_backend": "rdzv_backend",
    "rdzv_endpoint": "rdzv_endpoint",
    "rdzv_id": "rdzv_id",
    "rdzv_conf": "rdzv_conf",
}
# Options that only choose how torchrun starts a *script*; launch always runs the trainer module.
SCRIPT_ONLY = ("no_python", "run_path")
# torchrun's static rendezvous (what Kubeflow sets without an elastic policy).
STATIC_KEYS = ("master_addr", "master_port", "node_rank")


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


def env_var(dest: str) -> str:
    """The variable torchrun's parser reads for option ``dest`` (``torch.distributed.argparse_util``)."""
    return f"PET_{dest.upper()}"


def torchrun_parser(prog: str) -> argparse.ArgumentParser:
    p = _get_args_parser()
    p.prog = prog
    return p


def _get_args_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def option_dests() -> list[str]:
    """Every optional argument of torchrun's parser (its argparse dests)."""
    p = _get_args_parser()
    return [a.dest for a in p._actions if a.option_strings and a.dest != "help"]  # noqa: SLF001 - stdlib argparse


def launch_parser(prog: str = "elastic-trainer launch") -> argparse.ArgumentParser:
    """``CONFIG [--set k=v ...]`` plus every option of torchrun (not its script positionals)."""
    tr = _get_args_parser()
    p = argparse.ArgumentParser(prog=prog, description="Run this node's supervisor (torchrun's elastic agent) for the built-in trainer.")
    p.add_argument("config", help="TOML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value (repeatable)")
    group = p.add_argument_group("torchrun options (torchrun's meaning; default: the PET_* variable, then elastic.* of CONFIG)")
    for action in tr._actions:  # noqa: SLF001 - stdlib argparse: reuse torchrun's own option actions
        if action.option_strings and action.dest != "help":
            group._group_actions.append(action)  # noqa: SLF001
            p._add_action(action)  # noqa: SLF001
    return p


def run_parser(prog: str = "elastic-trainer run") -> argparse.ArgumentParser:
    """torchrun's parser as it is (``[options] SCRIPT|-m MODULE [script args]``) plus
    ``--config FILE`` and ``--set k=v``."""
    p = torchrun_parser(prog)
    p.description = "Run any training script under the supervisor (torchrun's options and meaning)."
    p.add_argument("--config", default=None, help="TOML config (run, elastic, metrics, checkpoint sections); defaults when absent")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value (repeatable)")
    p.add_argument("--preload", action="append", default=[], metavar="MODULE",
                   help="warm start: a module the zygote imports once for every worker (repeatable; besides torch, elastic_trainer and the script's top-level imports of installed packages)")
    p.add_argument("--no-warm-start", dest="no_warm_start", action="store_true", help="start every worker as torchrun does (same as --set elastic.warm_start=false)")
    return p


def parse_explicit(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, set[str]]:
    """Parse ``argv``; return the namespace (CLI > PET_* > default) and the dests given on the
    command line. Uses a first pass where every default is :data:`UNSET`."""
    probe = argparse.Namespace(**{a.dest: UNSET for a in parser._actions if a.dest not in ("help", "overrides", "preload")})  # noqa: SLF001
    parser.parse_args(argv, namespace=probe)
    explicit = {k for k, v in vars(probe).items() if v is not UNSET}
    return parser.parse_args(argv), explicit


def _config_value(dest: str, elastic: ElasticConfig) -> Any:
    value = getattr(elastic, CONFIG_KEYS[dest])
    return str(value) if dest in ("nnodes", "nproc_per_node") else value


def merge(parsed: Mapping[str, Any], explicit: set[str] | frozenset[str], env: Mapping[str, str], elastic: ElasticConfig) -> dict[str, Any]:
    """torchrun's option values with the config applied (pure).

    ``parsed``: torchrun's namespace (CLI > ``PET_*`` > torchrun default); ``explicit``: dests
    given on the command line; ``env``: the environment. Returns the final values:

    * each ``elastic.*`` key fills its option when neither the command line nor ``PET_*`` did;
    * ``rdzv_conf``: the config's items, replaced item by item by those of ``--rdzv-conf`` /
      ``PET_RDZV_CONF`` (used only by a real rendezvous backend, not standalone/static);
    * with no rendezvous endpoint anywhere: ``--master-addr/--master-port/--node-rank`` (or their
      ``PET_*``) on more than one node mean torchrun's static rendezvous (Kubeflow without an
      elastic policy); one node means ``--standalone``.
    """
    given = set(explicit) | {d for d in parsed if env_var(d) in env}
    out = dict(parsed)
    for dest in CONFIG_KEYS:
        if dest != "rdzv_conf" and dest not in given:
            out[dest] = _config_value(dest, elastic)
    nnodes_key = "--nnodes" if "nnodes" in given else "elastic.nnodes"
    _, max_nodes = parse_nnodes(str(out["nnodes"]), nnodes_key)
    if not out["rdzv_endpoint"] and "rdzv_backend" not in given and max_nodes > 1 and given & set(STATIC_KEYS):
        out["rdzv_backend"] = "static"
    if not out.get("standalone") and not out["rdzv_endpoint"] and out["rdzv_backend"] != "static" and max_nodes == 1:
        out["standalone"] = True
    if out.get("standalone") or out["rdzv_backend"] == "static":
        out["rdzv_conf"] = parsed["rdzv_conf"] if "rdzv_conf" in given else ""
    else:
        conf = parse_rdzv_conf(elastic.rdzv_conf)
        if "rdzv_conf" in given:
            conf.update(parse_rdzv_conf(parsed["rdzv_conf"] or "", "--rdzv-conf"))
        out["rdzv_conf"] = ",".join(f"{k}={v}" for k, v in conf.items())
    if not out.get("standalone") and out["rdzv_backend"] != "static" and not out["rdzv_endpoint"]:
        out["rdzv_endpoint"] = "localhost:29400"
    return out


def resolve(args: argparse.Namespace, explicit: set[str], elastic: ElasticConfig, env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """:func:`merge` applied to a parsed namespace, then torchrun's own standalone rule."""
    import uuid

    env = os.environ if env is None else env
    out = argparse.Namespace(**merge(vars(args), explicit, env, elastic))
    if out.standalone:  # what torchrun's run() does for --standalone
        out.rdzv_backend = "c10d"
        out.rdzv_endpoint = "localhost:0"
        out.rdzv_id = str(uuid.uuid4())
    if out.master_port is None:
        out.master_port = 29500
    return out


def launch_config(args: argparse.Namespace, explicit: set[str], env: Mapping[str, str] | None = None, *, shutdown_timeout: int, signals: str):
    """``(LaunchConfig, cmd, cmd_args)`` through torchrun's ``config_from_args``. Our shutdown
    timeout and signal list apply unless the option or its ``PET_*`` variable was given."""
    from torch.distributed.run import config_from_args

    env = os.environ if env is None else env
    try:
        config, cmd, cmd_args = config_from_args(args)
    except (ValueError, AssertionError) as e:  # e.g. --nproc-per-node gpu without CUDA
        key = "--nproc-per-node" if "nproc_per_node" in str(e) or "not available" in str(e) else "torchrun options"
        raise ConfigError(key, str(e)) from None
    if "shutdown_timeout" not in explicit and env_var("shutdown_timeout") not in env:
        config.shutdown_timeout = shutdown_timeout
    if "signals_to_handle" not in explicit and env_var("signals_to_handle") not in env:
        config.signals_to_handle = signals
    return config, cmd, cmd_args
