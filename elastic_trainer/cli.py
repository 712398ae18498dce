"""``elastic-trainer`` command line.

elastic-trainer --version
elastic-trainer launch CONFIG [--set k=v ...] [torchrun options]
elastic-trainer run [--config F] [--set k=v ...] [torchrun options] SCRIPT.py|-m MODULE [script args]
elastic-trainer store [--host H] [--port P]
elastic-trainer config check CONFIG [--set k=v ...] [--deep]
elastic-trainer data build [--out PATH] [--text FILE ...]
elastic-trainer ckpt list URI | ckpt inspect URI [--step N] | ckpt export URI --out F [--dtype bf16|fp32] [--hf CONFIG]
elastic-trainer ckpt audit ROOT --from A --to B
elastic-trainer report RUN_DIR|CHECKPOINT_ROOT [--out PNG]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TypeAlias

from . import exit_codes, log
from .errors import CheckpointError, CheckpointMismatchError, CheckpointStopError, ConfigError, StorageError

logger = logging.getLogger("elastic_trainer.cli")

# What add_subparsers() returns: a string, since argparse's class is not subscriptable at run time.
_Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # noqa: SLF001 - stdlib argparse


def _add_config_args(p: argparse.ArgumentParser) -> None:
    from .supervisor import options

    p.add_argument("config", help="TOML config file")
    options.add_overrides(p)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="elastic-trainer", description="Fault-tolerant elastic FSDP2 training")
    ap.add_argument("--version", action="version", version=version_string())
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_supervisor_commands(sub)
    _add_store_command(sub)
    _add_config_commands(sub)
    _add_data_commands(sub)
    _add_ckpt_commands(sub)
    _add_report_command(sub)
    return ap


def _add_supervisor_commands(sub: _Subparsers) -> None:
    """``launch`` and ``run``: listed here for ``--help``, parsed by their own parsers (every torchrun option):
    see main()."""
    sub.add_parser(
        "launch",
        help="run this node's supervisor (torchrun's elastic agent) for the "
        "built-in trainer: launch CONFIG [--set k=v] [torchrun options]",
        add_help=False,
    )
    sub.add_parser(
        "run",
        help="run any script under the supervisor: run [--config F] "
        "[--set k=v] [torchrun options] SCRIPT.py|-m MODULE [args]",
        add_help=False,
    )


def _add_store_command(sub: _Subparsers) -> None:
    p = sub.add_parser("store", help="host the c10d rendezvous store that the nodes' agents join (outlives any node)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument(
        "--port", type=int, default=29400, help="port (default 29400; 0 picks a free one, printed on stdout)"
    )


def _add_config_commands(sub: _Subparsers) -> None:
    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_cmd", required=True)
    c = csub.add_parser("check", help="validate CONFIG and print the resolved values (exit 2 naming the key)")
    _add_config_args(c)
    c.add_argument(
        "--deep",
        action="store_true",
        help="also run every check launch runs before workers start, with its exit codes: import and build "
        "the model factory, open the data source (a text source is packed "
        "into data.cache_dir), reach checkpoint.dir, read and verify "
        "the newest commit's manifest against the model and the run's settings",
    )


def _add_data_commands(sub: _Subparsers) -> None:
    p = sub.add_parser("data", help="data set tools")
    dsub = p.add_subparsers(dest="data_cmd", required=True)
    b = dsub.add_parser("build", help="byte-level tokenise text files into a uint16 token file")
    b.add_argument(
        "--out",
        default="runs/data/demo.bin",
        help="token file to write (default runs/data/demo.bin, the demo's data.path)",
    )
    b.add_argument("--text", nargs="*", default=None, help="text files (default: Python's standard library sources)")
    b.add_argument(
        "--limit-mb", type=float, default=8.0, help="read at most this many MiB of the default texts (default 8)"
    )


_URI_HELP = "checkpoint root (checkpoint.dir): a path, file:///abs/path, s3://bucket/prefix"
_ENDPOINT_HELP = "S3 endpoint for an s3:// URI (default: AWS_ENDPOINT_URL_S3 / FSSPEC_S3_ENDPOINT_URL)"
_STEP_HELP = "step to read (default: the newest valid commit, what a resume would load)"


def _add_ckpt_commands(sub: _Subparsers) -> None:
    p = sub.add_parser(
        "ckpt",
        help="checkpoint tools: list, inspect and export only read the checkpoint root; release writes to it "
        "(it deletes a checkpoint's quarantine marker), audit writes its verdicts beside the commits",
    )
    ksub = p.add_subparsers(dest="ckpt_cmd", required=True)
    k = ksub.add_parser("list", help="list checkpoints under URI: step, directory, status, world size, bytes, problem")
    k.add_argument("uri", metavar="URI", help=_URI_HELP)
    k.add_argument("--endpoint-url", default="", help=_ENDPOINT_HELP)
    k = ksub.add_parser("inspect", help="show one checkpoint's manifest and tensors")
    k.add_argument("uri", metavar="URI", help=_URI_HELP)
    k.add_argument("--step", type=int, help=_STEP_HELP)
    k.add_argument("--endpoint-url", default="", help=_ENDPOINT_HELP)
    _add_ckpt_export(ksub)
    _add_ckpt_release(ksub)
    _add_ckpt_audit(ksub)


def _add_ckpt_export(ksub: _Subparsers) -> None:
    k = ksub.add_parser("export", help="consolidate model weights into one safetensors file")
    k.add_argument("uri", metavar="URI", help=_URI_HELP)
    k.add_argument("--out", required=True, help="safetensors file to write (with --hf: the folder)")
    k.add_argument("--step", type=int, help=_STEP_HELP)
    k.add_argument(
        "--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the exported weights (default fp32)"
    )
    k.add_argument("--endpoint-url", default="", help=_ENDPOINT_HELP)
    k.add_argument(
        "--hf",
        metavar="CONFIG",
        help="write a Hugging Face folder at --out (config.json + model.safetensors) for the model "
        "of CONFIG: a training config, or a Hugging Face config.json or folder holding one",
    )


def _add_ckpt_release(ksub: _Subparsers) -> None:
    k = ksub.add_parser(
        "release",
        help="re-verify a quarantined checkpoint (seal, sizes, every byte's "
        "checksum) and lift its quarantine; refused while its bytes are bad",
    )
    k.add_argument("uri", metavar="URI", help=_URI_HELP)
    k.add_argument(
        "--step", type=int, required=True, help="the quarantined checkpoint's step (its newest quarantined directory)"
    )
    k.add_argument("--endpoint-url", default="", help=_ENDPOINT_HELP)


def _add_ckpt_audit(ksub: _Subparsers) -> None:
    k = ksub.add_parser(
        "audit",
        help="replay the run's steps A to B (the built-in trainer, or a script under run) from commit A on this "
        "machine and compare every commit "
        "in between with the replay's: certified (the same bytes) or suspect (silent data corruption: never "
        "resumed from); exit 0 all certified, 1 one is suspect, 2 bad input",
    )
    k.add_argument("uri", metavar="ROOT", help=_URI_HELP)
    k.add_argument(
        "--from",
        dest="first",
        type=int,
        help="the committed step to replay from (trusted, not judged); 0: the run's start, replayed afresh",
    )
    k.add_argument("--to", dest="last", type=int, help="the last committed step to audit")
    k.add_argument(
        "--follow",
        action="store_true",
        help="instead of --from/--to: beside a running job, audit each new commit of its lineage as it lands, "
        "from the newest certified one (or the run's start); exit 1 at the first suspect commit",
    )
    k.add_argument("--until", type=int, default=None, help="with --follow: end (exit 0) once this step is certified")
    k.add_argument("--poll-seconds", type=float, default=30.0, help="with --follow: how often to look for a commit")
    k.add_argument("--endpoint-url", default="", help=_ENDPOINT_HELP)
    k.add_argument(
        "--scratch",
        default=None,
        help="directory in which the replay's scratch directory is made, and removed at the end "
        "(default: the system's temporary directory)",
    )
    k.add_argument(
        "--single-replay",
        action="store_true",
        help="judge by one replay (default: a replay that finds a suspect commit is run a second time, and a "
        "commit either replay reproduces is certified: the machine running the audit may be the faulty one)",
    )


def _add_report_command(sub: _Subparsers) -> None:
    p = sub.add_parser(
        "report", help="summarise a run (goodput, restarts) from its run directory or its checkpoint root, and plot it"
    )
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR|CHECKPOINT_ROOT",
        help="run.dir (events.jsonl), or checkpoint.dir (local, "
        "file:// or s3://: the event logs mirrored under _events/)",
    )
    p.add_argument(
        "--out",
        help="PNG path (default RUN_DIR/report.png; ./report.png for "
        "a checkpoint root; with --json: no plot unless given)",
    )
    p.add_argument(
        "--endpoint-url",
        default="",
        help="S3 endpoint for an s3:// checkpoint root (default: FSSPEC_S3_ENDPOINT_URL / AWS settings)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the summary as JSON (writes nothing unless --out is given)"
    )


def version_string() -> str:
    """``elastic-trainer X (torch Y)`` without importing torch."""
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"elastic-trainer {__version__} (torch {torch_version})"


def _cmd_launch(argv: list[str]) -> int:
    zygote = _early_zygote(argv)  # imports the trainer for the workers while this process sets up
    try:
        return _launch(argv, zygote)
    except BaseException:
        if zygote is not None:
            zygote.close()
        raise


def _early_zygote(argv: list[str]):
    """The warm-start zygote (``elastic.warm_start``), forked from this process before its set-up.

    A light pre-parse (CONFIG and ``--set`` only); when it cannot tell, ``launch`` starts the
    zygote itself later (and drops this one when the real config says otherwise)."""
    import os

    from .config import load_config

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("config", nargs="?")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    try:
        known, _ = p.parse_known_args(argv)
        if not known.config or not os.path.isfile(known.config):
            return None
        cfg = load_config(known.config, known.overrides)
    except (ConfigError, SystemExit, ValueError, OSError):
        return None  # the real parser reports it
    if not cfg.elastic.warm_start:
        return None
    # The supervisor's own torch imports, which it needs to join the rendezvous: done once, here,
    # and the zygote forked from this process then imports only the trainer on top.
    import torch.distributed.elastic.agent.server.local_elastic_agent
    import torch.distributed.run  # noqa: F401 - imported to be loaded in the processes forked from this one

    from .storage.fs import backend_modules
    from .supervisor.warm import Zygote, trainer_preload
    from .worker import zygote

    return Zygote(preload=trainer_preload(backend_modules(cfg.checkpoint.dir))).start(fork=zygote.fork)


def _launch(argv: list[str], zygote) -> int:
    import os

    from . import contract
    from .config import load_config
    from .supervisor import options
    from .supervisor.launcher import launch, start_zygote
    from .worker import zygote as zygote_process

    a, explicit = options.parse_explicit(options.launch_parser(), argv)
    os.environ[contract.SCRIPT_COMMAND_ENV] = json.dumps({"entry": "launch"})  # what a replay runs
    bad = [f"--{d.replace('_', '-')}" for d in options.SCRIPT_ONLY if getattr(a, d)]
    if bad:
        raise ConfigError(
            bad[0],
            "launch runs the built-in trainer (python -m elastic_trainer.worker.main); "
            "use 'elastic-trainer run' for a script",
        )
    cfg = load_config(a.config, a.overrides)
    config, cmd, cmd_args = _trainer_launch_config(cfg, a, explicit)
    _check_before_start(cfg)
    zygote = start_zygote(cfg, cmd, cmd_args, early=zygote, fork=zygote_process.fork)
    code = launch(cfg, config, cmd, cmd_args, zygote=zygote)
    _print_closing_summary(cfg, code, argv)
    return code


def _trainer_launch_config(cfg, a, explicit: set[str]):
    """``(LaunchConfig, cmd, cmd_args)`` of the built-in trainer from launch's parsed options,
    checked against the largest world size the job may reach."""
    from .config import check_max_world_size
    from .supervisor import options
    from .supervisor.launcher import build_launch_config

    a.training_script, a.training_script_args, a.module = options.WORKER_MODULE, [], True
    config, cmd, cmd_args = build_launch_config(cfg, a, explicit)
    check_max_world_size(cfg, config.max_nodes * config.nproc_per_node)
    return config, cmd, cmd_args


def _print_closing_summary(cfg, code: int, argv: list[str]) -> None:
    import os
    import shutil

    from .report import closing_summary

    prog, me = "elastic-trainer", os.path.abspath(sys.argv[0])
    if os.path.basename(me) == prog and shutil.which(prog) != me:
        prog = os.path.relpath(me)  # not the one on PATH, e.g. .venv/bin/elastic-trainer
    try:
        text = closing_summary(cfg.run.dir, cfg.checkpoint.dir, cfg.train.steps, code, prog, argv, pid=os.getpid())
    except Exception as e:  # noqa: BLE001 - the summary must never change how launch ends
        logger.warning("no closing summary: %s: %s", type(e).__name__, e)
        return
    if text:
        print(text, file=sys.stderr, flush=True)


def _check_before_start(cfg) -> int | None:
    """What ``launch`` checks before any worker starts (also ``config check --deep``): the model
    factory imports and builds, the data source opens (a text source is packed into its cache),
    ``model.init_from`` fits, storage answers, and the checkpoint a resume would load verifies
    and fits. Returns that checkpoint's step (None: a fresh start)."""
    from .data_check import check_data_source

    check_data_source(cfg)
    _check_init_from(cfg)
    from .preflight import preflight

    step = preflight(cfg)
    logger.info(
        "checks passed: %s",
        f"resuming from step {step} of {cfg.checkpoint.dir}"
        if step is not None
        else f"fresh start ({cfg.checkpoint.dir})",
    )
    return step


def _check_init_from(cfg) -> None:
    if not cfg.model.init_from:
        return
    from .models.pretrained import check_init_from
    from .models.spec import on_meta
    from .worker.model_factory import build_model_spec

    with on_meta():
        model = build_model_spec(cfg.model).model
    check_init_from(cfg.model.init_from, model)


def _cmd_run(argv: list[str]) -> int:
    import os

    from . import contract
    from .config import EnvSettings, keys_set, load_config, run_name
    from .supervisor import options
    from .supervisor.launcher import build_launch_config, launch, start_zygote
    from .worker import zygote as zygote_process

    a, explicit = options.parse_explicit(options.run_parser(), argv)
    # ELASTIC_TRAINER_CONFIG and ELASTIC_TRAINER_SET, as et.init reads them under any launcher;
    # the flags win (--config over the variable, --set after its overrides).
    env = EnvSettings.from_env()
    if a.config is not None and env.path and os.path.abspath(env.path) != os.path.abspath(a.config):
        logger.info("--config %s is used, not %s=%s", a.config, contract.CONFIG_FILE_ENV, env.path)
        env = EnvSettings(None, env.overrides)
    env.data()  # a bad variable stops here, naming it
    a.config = a.config or env.path
    a.overrides = [*env.overrides, *a.overrides]
    # Paths a config does not set are the script's own (runs/<script>/...), as et.init derives them.
    overrides = a.overrides + (["elastic.warm_start=false"] if a.no_warm_start else [])
    cfg = load_config(a.config, overrides, name=run_name(a.config) or run_name(a.training_script))
    config, cmd, cmd_args = build_launch_config(cfg, a, explicit)
    _record_script_command(a, keys_set(a.config, a.overrides))
    # Forked now, while this process has imported torch and runs no thread of its own yet.
    zygote = start_zygote(cfg, cmd, cmd_args, preload=tuple(a.preload), fork=zygote_process.fork)
    try:
        # The script's state decides compatibility (in the workers: exit 2, not restarted); what
        # needs no script is checked here, before any worker starts.
        from .preflight import check_storage

        _, plan = check_storage(cfg)
        logger.info(
            "preflight ok: %s",
            f"newest commit step {plan.chosen.step}"
            if plan is not None and plan.chosen is not None
            else "no commit to resume",
        )
        return launch(cfg, config, cmd, cmd_args, zygote=zygote, keys_set=keys_set(a.config, a.overrides))
    except BaseException:
        if zygote is not None:
            zygote.close()
        raise


def _record_script_command(a, keys: list[str]) -> None:
    """What the workers record in every manifest for ``ckpt audit`` to replay the run with: the
    script (or ``-m`` module) and its arguments, the working directory they are relative to,
    and the keys the command line set (``keys``: the script's own settings decide the others)."""
    import os

    from . import contract
    from .supervisor.options import SCRIPT_ONLY

    flags = [f"--{d.replace('_', '-')}" for d in SCRIPT_ONLY if getattr(a, d, False)]
    argv = [*flags, "-m", a.training_script] if a.module else [*flags, a.training_script]
    command = {"entry": "run", "argv": [*argv, *a.training_script_args], "cwd": os.getcwd(), "set": keys}
    os.environ[contract.SCRIPT_COMMAND_ENV] = json.dumps(command)


def _ckpt_audit(a) -> int:
    """``ckpt audit``: 0 every audited commit certified, 1 one suspect, 2 bad input."""
    import signal

    from .checkpoint.audit import audit, follow

    how = {"scratch_parent": a.scratch, "confirm": not a.single_replay}
    if a.follow:
        if a.first is not None or a.last is not None:
            raise ConfigError("--follow", "audits each new commit as it lands: leave --from and --to out")
        signal.signal(signal.SIGTERM, _interrupt)  # a sidecar's stop: the replay in flight is killed with it
        try:
            certified = follow(
                a.uri, a.endpoint_url, until=a.until, poll_seconds=a.poll_seconds, report=_print_line, **how
            )
        except KeyboardInterrupt:
            return 0  # stopped, every commit audited so far certified
        return 0 if certified else 1
    for flag, value in (("--from", a.first), ("--to", a.last)):
        if value is None:
            raise ConfigError(flag, "required (or --follow)")
    verdicts = audit(a.uri, a.first, a.last, a.endpoint_url, **how)
    for v in verdicts:
        _print_line(v)
    return 1 if any(v.suspect for v in verdicts) else 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _print_line(verdict) -> None:
    print(verdict.line(), flush=True)


def _cmd_store(a) -> int:
    from .supervisor.store import StoreAddress, serve

    if not 0 <= a.port < 65536:
        raise ConfigError("--port", f"must be in 0..65535, got {a.port}")

    def ready(port: int) -> None:
        print(f"rendezvous store ready on {a.host}:{port}", flush=True)

    return serve(StoreAddress(a.host, a.port), on_ready=ready)


def _cmd_config(a) -> int:
    from .config import load_config

    cfg = load_config(a.config, a.overrides)
    _warn_rendezvous_scale(cfg)
    if a.deep:
        from .supervisor import options

        # The launch options as this node would resolve them (PET_* variables included).
        _trainer_launch_config(cfg, *options.parse_explicit(options.launch_parser(), [a.config]))
        _check_before_start(cfg)
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0


def _warn_rendezvous_scale(cfg) -> None:
    """On stderr: whether the c10d rendezvous would drop live nodes at ``elastic.nnodes``' maximum."""
    from .config import parse_nnodes, parse_rdzv_conf
    from .supervisor.liveness import scale_warning

    e = cfg.elastic
    why = scale_warning(e.rdzv_backend, parse_nnodes(e.nnodes)[1], parse_rdzv_conf(e.rdzv_conf), e.rdzv_poll_seconds)
    if why:
        print(f"warning: elastic.nnodes: {why}", file=sys.stderr)


def _cmd_data(a) -> int:
    from .worker.tokens import build_token_file, default_demo_texts

    texts = a.text or default_demo_texts(int(a.limit_mb * (1 << 20)))
    stats = build_token_file(texts, a.out)
    print(json.dumps(stats))
    return 0


def _cmd_ckpt(a) -> int:
    from .checkpoint import tools

    if a.ckpt_cmd == "list":
        rows = tools.list_checkpoints(a.uri, a.endpoint_url)
        print(f"{'step':>10} {'name':<18} {'status':<11} {'world':>5} {'bytes':>14}  problem")
        for r in rows:
            print(
                f"{r['step']:>10} {r['name']:<18} {r['status']:<11} "
                f"{str(r['world_size'] or '-'):>5} {r['bytes']:>14,}  {r['problem'] or ''}"
            )
        return 0
    if a.ckpt_cmd == "inspect":
        json.dump(tools.inspect_checkpoint(a.uri, a.step, a.endpoint_url), sys.stdout, indent=2)
        print()
        return 0
    if a.ckpt_cmd == "export" and getattr(a, "hf", None):
        from .models.hf_export import export_hf, export_model_config

        print(json.dumps(export_hf(a.uri, a.out, export_model_config(a.hf), a.step, a.dtype, a.endpoint_url)))
        return 0
    if a.ckpt_cmd == "export":
        print(json.dumps(tools.export_safetensors(a.uri, a.out, a.step, a.dtype, a.endpoint_url)))
        return 0
    if a.ckpt_cmd == "audit":
        return _ckpt_audit(a)
    if a.ckpt_cmd == "release":
        name, marker = tools.release(a.uri, a.step, a.endpoint_url)
        print(f"released {name} (was quarantined: {marker.get('reason', 'unknown reason')})")
        return 0
    return 2


def main(argv: list[str] | None = None) -> int:
    log.setup_logging()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] in ("launch", "run"):
            return (_cmd_launch if argv[0] == "launch" else _cmd_run)(argv[1:])
        a = _parser().parse_args(argv)
        if a.cmd == "store":
            return _cmd_store(a)
        if a.cmd == "config":
            return _cmd_config(a)
        if a.cmd == "data":
            return _cmd_data(a)
        if a.cmd == "ckpt":
            return _cmd_ckpt(a)
        if a.cmd == "report":
            from . import report

            return report.main(a)
    except ConfigError as e:
        print(f"elastic-trainer: {e}", file=sys.stderr)
        return 2
    except (CheckpointMismatchError, CheckpointStopError) as e:
        print(f"elastic-trainer: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, StorageError) as e:
        print(f"elastic-trainer: {e}", file=sys.stderr)
        return 1
    return 2


def entry() -> None:
    """The ``elastic-trainer`` command: :func:`main`, its code the process's exit code (through
    :func:`exit_codes.exit_now`: torch's daemon threads cannot turn it into an abort)."""
    exit_codes.exit_now(main())


if __name__ == "__main__":
    entry()
