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
from typing import TYPE_CHECKING

import torch

from .. import contract, exit_codes, lifeline, log
from ..config import Config, check_world_size, config_from_dict

if TYPE_CHECKING:
    from ..runtime.session import Session

logger = logging.getLogger("elastic_trainer.worker")

EXIT_FAILURE = exit_codes.FAILED


def load_worker_config() -> Config:
    raw = os.environ.get(contract.CONFIG_ENV)
    if not raw:
        raise SystemExit(f"{contract.CONFIG_ENV} is not set: start workers with 'elastic-trainer launch'")
    return config_from_dict(json.loads(raw))


def build_training(cfg: Config, d, open_data: bool = True):
    """Model (meta build, FSDP2 bottom-up, world-size-independent init), AdamW, LR schedule,
    this rank's batches and the train state: everything a rank trains with. All ranks.
    ``open_data=False``: the batches get their source later (``batches.open``), once the
    run's data view is known from the checkpoint."""
    from ..checkpoint.state import TrainState
    from ..models.spec import on_meta
    from . import parallel
    from .data import StepBatches
    from .model_factory import build_model_spec, initialise_buffers
    from .sources import open_source
    from .train_loop import lr_lambda

    with on_meta():
        spec = build_model_spec(cfg.model)
    assert spec.init_param is not None and spec.init_buffers is not None  # build_model_spec resolves both
    model = spec.model
    shard_classes = parallel.resolve_shard_classes(model, spec.shard_modules)
    parallel.shard_model(model, d.mesh, parallel.mixed_precision_policy(cfg.train, d.device), shard_classes)
    model.to_empty(device=d.device)
    parallel.deterministic_init(model, cfg.train.seed, spec.init_param)
    initialise_buffers(model, spec.init_buffers)
    t = cfg.train
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay, fused=True
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    state = TrainState()  # its cursor is where the batches stand
    batches = StepBatches(
        open_source(cfg) if open_data else None,
        t.seed,
        t.global_batch_size,
        t.micro_batch_size,
        d.world_size,
        d.rank,
        progress=state,
    )
    return model, optimizer, scheduler, batches, state


def build_and_train(session: Session) -> int:
    """The built-in trainer on the public runtime (the same API a user's script uses)."""
    from ..checkpoint.state import DataViewState
    from ..models.pretrained import init_from_pretrained
    from ..runtime import Checkpointer
    from . import parallel
    from .sources import open_data_view
    from .train_loop import Trainer

    cfg, d = session.cfg, session.dist
    check_world_size(cfg, d.world_size)
    model, optimizer, scheduler, batches, state = build_training(cfg, d, open_data=False)
    data = DataViewState()
    ckpt = Checkpointer(
        session,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        extra={"data": data},
        data=batches,
        train_state=state,
        fingerprint=cfg.model_fingerprint(),
        run_identity=cfg.run_identity(),
    )
    if d.rank == 0:
        logger.debug("checkpoints: %s", ckpt.storage.describe())
        logger.debug(
            "parameters on this rank: %.2f MB of %s total elements",
            parallel.local_param_bytes(model) / 1e6,
            sum(p.numel() for p in model.parameters()),
        )

    def after_load(loaded) -> dict:
        if loaded is None:
            init_from_pretrained(cfg.model, model, session.events, d.rank)  # model.init_from, fresh start only
        source, data.view, ignored = open_data_view(cfg, data.recorded, d.rank, d.ckpt_group)
        batches.open(source)
        if ignored:
            logger.warning(
                "data view frozen at the run's first start: ignoring %d file(s) added since, e.g. %s",
                len(ignored),
                ignored[0],
            )
            session.events.emit(
                "data_view_frozen", files=len(data.view), ignored=ignored[:100], ignored_count=len(ignored)
            )
        return {"data_view": "recorded" if data.recorded is not None else "resolved now (the checkpoint has none)"}

    ckpt.resume(after_load)
    code = Trainer(cfg, model, ckpt).run()
    session.close()
    return code


def die_with_supervisor() -> None:
    """Make the kernel SIGKILL this worker when its parent — the supervisor, or the warm-start
    zygote that forked it — dies: torch starts workers in their own session, so without this a
    SIGKILLed supervisor leaves its workers running. A parent already gone: exit 1."""
    expected = os.environ.get(contract.PARENT_PID_ENV) or os.environ.get(contract.SUPERVISOR_PID_ENV)
    lifeline.die_with_parent(int(expected) if expected else os.getppid(), code=EXIT_FAILURE)


def main() -> None:
    from ..runtime.session import failed, init

    t_start = time.monotonic()
    die_with_supervisor()
    log.setup_logging()
    cfg = load_worker_config()
    session = None
    try:
        session = init(cfg)
        session.started = t_start
        code = build_and_train(session)
    except BaseException as e:  # noqa: BLE001 - every failure exits fast, without collectives
        if isinstance(e, SystemExit) and e.code in (0, None):
            os._exit(0)
        rank = session.rank if session is not None else int(os.environ.get(contract.RANK_ENV, "0"))
        failed(e, rank=rank, run_dir=cfg.run.dir, run=session.run if session is not None else None)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
