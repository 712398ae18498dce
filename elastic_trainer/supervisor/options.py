"""torchrun's options for ``launch`` and ``run``, parsed by torchrun's own parser.

Every option of ``torchrun --help`` is accepted with torchrun's name and meaning. Precedence:
a command-line flag, then the ``PET_*`` variable torchrun reads for it (what Kubeflow sets),
then the config file (``elastic.*``), then torchrun's default. torchrun's parser already gives
CLI > ``PET_*`` > default; :func:`merge` (pure, table-tested) puts the config value in only
where neither the command line nor a ``PET_*`` variable gave one.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from typing import Any

from .. import contract
from ..config import CheckpointConfig, Config, ElasticConfig, parse_nnodes, parse_rdzv_conf
from ..errors import ConfigError

logger = logging.getLogger(__name__)

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
# The agent forwards these to the workers (SIGUSR1: SLURM's time-limit warning); torchrun's
# default lacks SIGUSR1.
SIGNALS_TO_HANDLE = ",".join(contract.FORWARDED_SIGNALS)
# The agent's shutdown timeout is the preemption grace plus this margin (the workers commit first).
SHUTDOWN_MARGIN_SECONDS = 15


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


def add_overrides(p: argparse.ArgumentParser) -> None:
    """``--set SECTION.KEY=VALUE`` (repeatable), into ``overrides``: every command that reads a config."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value (repeatable)",
    )


def env_var(dest: str) -> str:
    """The variable torchrun's parser reads for option ``dest`` (``torch.distributed.argparse_util``)."""
    return f"{contract.TORCHRUN_ENV_PREFIX}{dest.upper()}"


def torchrun_parser(prog: str) -> argparse.ArgumentParser:
    p = _get_args_parser()
    p.prog = prog
    return p


def _get_args_parser() -> argparse.ArgumentParser:
    """torchrun's parser; torch 2.11's has no ``--shutdown-timeout``: added with torch 2.12's
    meaning (``PET_SHUTDOWN_TIMEOUT``; :func:`launch_config` applies it)."""
    from torch.distributed.argparse_util import env
    from torch.distributed.run import get_args_parser

    p = get_args_parser()
    if "--shutdown-timeout" not in p._option_string_actions:  # noqa: SLF001 - stdlib argparse
        p.add_argument("--shutdown-timeout", "--shutdown_timeout", action=env, type=int, default=None)
    return p


def option_dests() -> list[str]:
    """Every optional argument of torchrun's parser (its argparse dests)."""
    p = _get_args_parser()
    return [a.dest for a in p._actions if a.option_strings and a.dest != "help"]  # noqa: SLF001 - stdlib argparse


def _defaults_help() -> dict[str, str]:
    """Help for the options whose default here differs from torchrun's."""
    e, grace = ElasticConfig(), CheckpointConfig().preempt_grace_seconds

    def cfg(dest: str) -> str:
        key = CONFIG_KEYS[dest]
        return f"default: {env_var(dest)}, else elastic.{key} of the config (default {getattr(e, key)!r})"

    return {
        "nnodes": f"Number of nodes, or MIN:MAX ({cfg('nnodes')}). More than one node "
        "needs --rdzv-endpoint or --master-addr/--master-port/--node-rank.",
        "nproc_per_node": f"Workers per node: an integer, gpu, cpu or auto ({cfg('nproc_per_node')}).",
        "max_restarts": "Worker-group restarts after failures; "
        f"node joins and losses do not count ({cfg('max_restarts')}).",
        "monitor_interval": f"Seconds between checks of the workers ({cfg('monitor_interval')}).",
        "rdzv_backend": f"Rendezvous backend ({cfg('rdzv_backend')}).",
        "rdzv_endpoint": "Rendezvous endpoint HOST:PORT, e.g. an 'elastic-trainer store' "
        f"({cfg('rdzv_endpoint')}; none on one node = --standalone).",
        "rdzv_id": f"Job id shared by the nodes of one job ({cfg('rdzv_id')}).",
        "rdzv_conf": "K=V,... rendezvous settings; items replace same-named "
        f"items of elastic.rdzv_conf ({cfg('rdzv_conf')}).",
        "signals_to_handle": "Signals the agent forwards to the workers (default: "
        f"PET_SIGNALS_TO_HANDLE, else {SIGNALS_TO_HANDLE}).",
        "shutdown_timeout": "Seconds the workers get to stop before SIGKILL (default: PET_SHUTDOWN_TIMEOUT, else "
        f"checkpoint.preempt_grace_seconds + {SHUTDOWN_MARGIN_SECONDS}: {grace + SHUTDOWN_MARGIN_SECONDS:g}).",
    }


class _HelpFormatter(argparse.HelpFormatter):
    """Lists each option under one spelling (torchrun also accepts ``--nproc_per_node`` etc.)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return (
                super()._format_action_invocation(action)
                if not action.option_strings
                else ", ".join(_spellings(action))
            )
        metavar = self._format_args(action, self._get_default_metavar_for_optional(action))
        return ", ".join(f"{o} {metavar}" for o in _spellings(action))


def _spellings(action: argparse.Action) -> list[str]:
    return [o for o in action.option_strings if "_" not in o] or list(action.option_strings)


def _document_defaults(actions) -> None:
    helps = _defaults_help()
    for action in actions:
        if action.dest in helps:
            action.help = helps[action.dest].replace("%", "%%")


def launch_parser(prog: str = "elastic-trainer launch") -> argparse.ArgumentParser:
    """``CONFIG [--set k=v ...]`` plus every option of torchrun (not its script positionals).
    The script-only options stay accepted (launch refuses them with a clear error) but are not
    listed in ``--help``."""
    tr = _get_args_parser()
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run this node's supervisor (torchrun's elastic agent) for the built-in trainer.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("config", help="TOML config file")
    add_overrides(p)
    group = p.add_argument_group(
        "torchrun options (torchrun's meaning; a flag wins over its PET_* variable, which wins over the config)"
    )
    actions = [a for a in tr._actions if a.option_strings and a.dest != "help"]  # noqa: SLF001 - stdlib argparse: reuse torchrun's own option actions
    _document_defaults(actions)
    for action in actions:
        if action.dest in (*SCRIPT_ONLY, "module"):
            action.help = argparse.SUPPRESS
        group._add_action(action)  # noqa: SLF001 - stdlib argparse: the group takes torchrun's action as it is
    return p


def run_parser(prog: str = "elastic-trainer run") -> argparse.ArgumentParser:
    """torchrun's parser as it is (``[options] SCRIPT|-m MODULE [script args]``) plus
    ``--config FILE`` and ``--set k=v``."""
    p = torchrun_parser(prog)
    p.description = "Run any training script under the supervisor (torchrun's options and meaning)."
    p.formatter_class = _HelpFormatter
    _document_defaults(p._actions)  # noqa: SLF001 - stdlib argparse
    d = Config()
    p.add_argument(
        "--config",
        default=None,
        help="TOML config. The supervisor reads its run, checkpoint, elastic and metrics sections; the whole "
        "resolved config (--set included) reaches the script, whose et.init settings apply on top of it, except "
        "run.dir and checkpoint.dir (the supervisor's). Paths it does not set: run.dir runs/<config name>, "
        "checkpoint.dir <run.dir>/checkpoints. Without it: the built-in defaults (run.dir runs/<script name>, "
        f"checkpoint.dir <run.dir>/checkpoints, metrics port {d.metrics.port}, the elastic.* defaults shown above), "
        "changed only by --set",
    )
    add_overrides(p)
    p.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE[:NAME,...]",
        help="warm start: a module the zygote imports once for every worker, with MODULE:NAME,... the names "
        "taken from it as 'from MODULE import NAME' would (repeatable; besides torch, elastic_trainer and "
        "the script's top-level imports of installed packages)",
    )
    p.add_argument(
        "--no-warm-start",
        dest="no_warm_start",
        action="store_true",
        help="start every worker as torchrun does (same as --set elastic.warm_start=false)",
    )
    return p


def parse_explicit(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, set[str]]:
    """Parse ``argv``; return the namespace (CLI > PET_* > default) and the dests given on the
    command line. Uses a first pass where every default is :data:`UNSET`."""
    probe = argparse.Namespace(
        **{a.dest: UNSET for a in parser._actions if a.dest not in ("help", "overrides", "preload")}  # noqa: SLF001 - stdlib argparse
    )
    parser.parse_args(argv, namespace=probe)
    explicit = {k for k, v in vars(probe).items() if v is not UNSET}
    return parser.parse_args(argv), explicit


def _config_value(dest: str, elastic: ElasticConfig) -> Any:
    value = getattr(elastic, CONFIG_KEYS[dest])
    return str(value) if dest in ("nnodes", "nproc_per_node") else value


def merge(
    parsed: Mapping[str, Any], explicit: set[str] | frozenset[str], env: Mapping[str, str], elastic: ElasticConfig
) -> dict[str, Any]:
    """torchrun's option values with the config applied (pure).

    ``parsed``: torchrun's namespace (CLI > ``PET_*`` > torchrun default); ``explicit``: dests
    given on the command line; ``env``: the environment. Returns the final values:

    * each ``elastic.*`` key fills its option when neither the command line nor ``PET_*`` did;
    * ``rdzv_conf``: the config's items, replaced item by item by those of ``--rdzv-conf`` /
      ``PET_RDZV_CONF`` (used only by a real rendezvous backend, not standalone/static);
    * with no rendezvous endpoint anywhere: ``--master-addr/--master-port/--node-rank`` (or their
      ``PET_*``) on more than one node mean torchrun's static rendezvous (Kubeflow without an
      elastic policy); one node means ``--standalone``; more than one node without either is a
      ConfigError (each node would otherwise wait on a store of its own).
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
        # Each node would wait on a store of its own: say what is missing instead.
        raise ConfigError(
            nnodes_key,
            f"{out['nnodes']} nodes need a rendezvous endpoint: "
            "--rdzv-endpoint HOST:PORT (e.g. an 'elastic-trainer store'), "
            "PET_RDZV_ENDPOINT or elastic.rdzv_endpoint; "
            "or --master-addr/--master-port/--node-rank for a fixed set of nodes",
        )
    return out


def resolve(
    args: argparse.Namespace, explicit: set[str], elastic: ElasticConfig, env: Mapping[str, str] | None = None
) -> argparse.Namespace:
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


class _DropOmpBanner(logging.Filter):
    """torchrun's five-line warning that it sets OMP_NUM_THREADS=1 (the value stays; the
    banner is noise on every start)."""

    dropped = False

    def filter(self, record: logging.LogRecord) -> bool:
        if contract.OMP_THREADS_ENV in str(record.msg):
            self.dropped = True
            return False
        return True


def launch_config(
    args: argparse.Namespace,
    explicit: set[str],
    env: Mapping[str, str] | None = None,
    *,
    shutdown_timeout: int,
    signals: str,
):
    """``(LaunchConfig, cmd, cmd_args)`` through torchrun's ``config_from_args``. Our shutdown
    timeout and signal list apply unless the option or its ``PET_*`` variable was given."""
    from torch.distributed.run import config_from_args

    env = os.environ if env is None else env
    quiet = _DropOmpBanner()
    torchrun_logger = logging.getLogger("torch.distributed.run")
    torchrun_logger.addFilter(quiet)
    try:
        config, cmd, cmd_args = config_from_args(args)
    except (ValueError, AssertionError) as e:  # e.g. --nproc-per-node gpu without CUDA
        key = "--nproc-per-node" if "nproc_per_node" in str(e) or "not available" in str(e) else "torchrun options"
        raise ConfigError(key, str(e)) from None
    finally:
        torchrun_logger.removeFilter(quiet)
    if quiet.dropped:
        logger.debug(
            "OMP_NUM_THREADS=1 for every worker (torchrun's default with several workers per node); set it to choose"
        )
    if not hasattr(config, "shutdown_timeout"):  # torch 2.11's LaunchConfig: the option's value
        config.shutdown_timeout = 30 if args.shutdown_timeout is None else args.shutdown_timeout
    if "shutdown_timeout" not in explicit and env_var("shutdown_timeout") not in env:
        config.shutdown_timeout = shutdown_timeout
    if "signals_to_handle" not in explicit and env_var("signals_to_handle") not in env:
        config.signals_to_handle = signals
    return config, cmd, cmd_args
