"""Worker entry point: ``python -m elastic_trainer.worker.main`` under torchrun's elastic agent.

The resolved config arrives as JSON in ``ELASTIC_TRAINER_CONFIG_JSON`` (set by the supervisor).
A rank that raises records the failure (event, log, torch's ``@record`` error file) and exits
non-zero at once with ``os._exit``: it never enters a checkpoint or any other collective on the
exception path, and no background save thread or process-group destructor can keep it alive.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback

import torch

from .. import exit_codes, log
from ..config import Config, check_world_size, config_from_dict
from ..events import EventLog

logger = logging.getLogger("elastic_trainer.worker")

CONFIG_ENV = "ELASTIC_TRAINER_CONFIG_JSON"
EPOCH_ENV = "ELASTIC_TRAINER_CHECKPOINT_EPOCH"  # set by the supervisor (fencing, see checkpoint/catalog.py)
EXIT_FAILURE = exit_codes.FAILED
FAILURE_DRAIN_SECONDS = 10.0
_ACTIVE: dict = {}  # the checkpoint manager, for the exception path


def load_worker_config() -> Config:
    raw = os.environ.get(CONFIG_ENV)
    if not raw:
        raise SystemExit(f"{CONFIG_ENV} is not set: start workers with 'elastic-trainer launch'")
    return config_from_dict(json.loads(raw))


def build_training(cfg: Config, d):
    """Model (meta build, FSDP2 bottom-up, world-size-independent init), AdamW, LR schedule,
    this rank's batches and the train state: everything a rank trains with. All ranks."""
    from ..checkpoint.state import TrainState
    from . import parallel
    from .data import StepBatches
    from .model_factory import build_model_spec, initialise_buffers
    from .sources import open_source
    from .train_loop import lr_lambda

    with torch.device("meta"):
        spec = build_model_spec(cfg.model)
    model = spec.model
    shard_classes = parallel.resolve_shard_classes(model, spec.shard_modules)
    parallel.shard_model(model, d.mesh, parallel.mixed_precision_policy(cfg.train, d.device), shard_classes)
    model.to_empty(device=d.device)
    parallel.deterministic_init(model, cfg.train.seed, spec.init_param)
    initialise_buffers(model, spec.init_buffers)
    t = cfg.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    batches = StepBatches(open_source(cfg), t.seed, t.global_batch_size, t.micro_batch_size, d.world_size, d.rank)
    return model, optimizer, scheduler, batches, TrainState()


def build_and_train(cfg: Config, t_start: float) -> int:
    import torch.distributed as dist

    from ..checkpoint.manager import CheckpointManager
    from ..checkpoint.state import ModelState, OptimizerState, RNGState, SchedulerState
    from ..metrics import factory as metrics_factory
    from ..storage.fs import open_storage
    from . import parallel
    from .train_loop import PreemptionFlag, Trainer

    preempt = PreemptionFlag()
    preempt.install()
    # Storage time is bounded by checkpoint.save_timeout_seconds, never by the hang timeout.
    ckpt_timeout = max(cfg.elastic.hang_timeout_seconds, cfg.checkpoint.save_timeout_seconds)
    d = parallel.init_distributed(cfg.train, timeout_seconds=cfg.elastic.hang_timeout_seconds, ckpt_timeout_seconds=ckpt_timeout)
    check_world_size(cfg, d.world_size)
    events = EventLog(os.path.join(cfg.run.dir, "events.jsonl"), enabled=d.rank == 0)
    metrics = metrics_factory.worker_sink(cfg, rank=d.rank)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    metrics.gauge("elastic_trainer_world_size", d.world_size)

    model, optimizer, scheduler, batches, state = build_training(cfg, d)
    storage = open_storage(cfg.checkpoint.dir, cfg.checkpoint.s3_endpoint_url, cfg.checkpoint.storage_timeout_seconds, cfg.checkpoint.storage_retries)
    ckpt = CheckpointManager(
        cfg.checkpoint,
        storage,
        {"model": ModelState(model), "optim": OptimizerState(model, optimizer), "lr_scheduler": SchedulerState(scheduler), "train": state, "rng": RNGState()},
        rank=d.rank,
        world_size=d.world_size,
        mesh_shape=list(d.mesh.shape),
        group=d.ckpt_group,
        fingerprint=cfg.model_fingerprint(),
        events=events,
        metrics=metrics,
        use_cuda_staging=d.device.type == "cuda",
        control_group=None,  # the training group: main-thread agreements never share the checkpoint group
        epoch=os.environ.get(EPOCH_ENV) or None,
        launch_id=os.environ.get("TORCHELASTIC_RUN_ID", ""),
    )
    _ACTIVE["ckpt"] = ckpt
    if d.rank == 0:
        logger.info("config: %s", cfg.to_json())
        logger.info("checkpoints: %s", storage.describe())
        logger.info("parameters on this rank: %.2f MB of %s total elements", parallel.local_param_bytes(model) / 1e6, sum(p.numel() for p in model.parameters()))
    events.emit("start", world_size=d.world_size, restart_count=restart, rank0_host=os.uname().nodename, pid=os.getpid(), checkpoint_dir=storage.describe())
    loaded = ckpt.load()
    if loaded is not None:
        saved_world = loaded.manifest.get("world_size")
        events.emit(
            "resume",
            step=loaded.step,
            from_world_size=saved_world,
            world_size=d.world_size,
            load_seconds=round(loaded.seconds, 4),
            since_start_seconds=round(time.monotonic() - t_start, 4),
            cursor=state.cursor,
            skipped=[list(s) for s in loaded.skipped],
        )
        if saved_world != d.world_size:
            events.emit("reshard", step=loaded.step, from_world_size=saved_world, to_world_size=d.world_size, from_mesh=loaded.manifest.get("mesh_shape"), to_mesh=list(d.mesh.shape))
            metrics.counter("elastic_trainer_reshard_events_total")
        if d.rank == 0:
            logger.info("resumed from step %d (saved at world %s, now %d) in %.2fs", loaded.step, saved_world, d.world_size, loaded.seconds)
    trainer = Trainer(cfg, model, optimizer, scheduler, batches, state, ckpt, events, metrics, d.rank, d.world_size, d.device, preempt=preempt)
    timer_file = os.environ.get("TORCHELASTIC_TIMER_FILE")
    if timer_file:
        from torch.distributed.elastic import timer

        timer.configure(timer.FileTimerClient(timer_file))
        trainer.timer_scope = True  # type: ignore[assignment]
    code = trainer.run()
    if code == 0:
        events.emit("finished", step=state.step, tokens_seen=state.tokens_seen, last_committed_step=ckpt.last_committed_step)
    elif d.rank == 0:
        marker = os.path.join(cfg.run.dir, "PREEMPTED")
        with open(marker, "w") as f:
            json.dump({"step": state.step, "exit_code": code, "committed_step": ckpt.last_committed_step}, f)
    ckpt.close()
    dist.destroy_process_group()
    return code


def die_with_supervisor() -> None:
    """Make the kernel SIGKILL this worker when its supervisor dies (Linux ``PR_SET_PDEATHSIG``).

    torch starts workers in their own session, so without this a SIGKILLed supervisor leaves
    its workers running. The parent-pid check closes the race where the supervisor died before
    the call."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    expected = os.environ.get("ELASTIC_TRAINER_SUPERVISOR_PID")
    if expected and os.getppid() != int(expected):
        os._exit(EXIT_FAILURE)


def main() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    t_start = time.monotonic()
    die_with_supervisor()
    log.setup_logging()
    cfg = load_worker_config()
    try:
        code = build_and_train(cfg, t_start)
    except BaseException as e:  # noqa: BLE001 - every failure exits fast, without collectives
        rank = int(os.environ.get("RANK", "0"))
        if isinstance(e, SystemExit) and e.code in (0, None):
            os._exit(0)
        from ..errors import FencedError

        if isinstance(e, FencedError):  # every rank got the same answer at load: terminal, no restart
            logger.error("rank %d: %s", rank, e)
            if rank == 0:
                EventLog(os.path.join(cfg.run.dir, "events.jsonl")).emit("fenced", step=None, error=str(e))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_codes.FENCED)
        logger.error("rank %d failed: %s", rank, "".join(traceback.format_exception(e)))
        try:
            EventLog(os.path.join(cfg.run.dir, "events.jsonl")).emit(
                "failure", rank=rank, error=f"{type(e).__name__}: {e}"[:2000], restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            )
            ckpt = _ACTIVE.get("ckpt")
            if ckpt is not None and ckpt.in_flight:
                # No new checkpoint or collective here; only let an upload already under way land.
                logger.warning("letting the save already in flight finish (at most %.0fs)", FAILURE_DRAIN_SECONDS)
                ckpt.drain_on_failure(FAILURE_DRAIN_SECONDS)
            ErrorHandler().record_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_FAILURE)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
