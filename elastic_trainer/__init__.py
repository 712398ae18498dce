"""elastic_trainer: fault-tolerant elastic FSDP2 training with async distributed checkpoints.

The public API for your own training loop (semantic versioning applies to these names only)::

    import elastic_trainer as et

    session = et.init()                                   # process groups, events, metrics, preemption
    model = session.shard(build_model(), [Block])         # FSDP2, bottom-up
    ckpt = et.Checkpointer(session, model=model, optimizer=opt, scheduler=sched, data=loader)
    for step, batch in ckpt.steps(total_steps):           # resume, agree, save when due, truthful exit
        loss = compute_loss(model, batch); loss.backward()
        ckpt.optimizer_step(loss)                         # staging wait, clip, non-finite guard, step

See docs/own-script.md. Names resolve lazily, so ``import elastic_trainer`` stays cheap.
"""

from __future__ import annotations

__version__ = "0.1.0"

_API = {
    "init": "runtime.session",
    "Session": "runtime.session",
    "Checkpointer": "runtime.checkpointer",
    "StepContext": "runtime.step",
    "GlobalBatchSampler": "runtime.sampler",
    "MicroBatchIndices": "runtime.sampler",
    "TrainState": "checkpoint.state",
    "PerRank": "checkpoint.state",
    "exit_codes": "",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'elastic_trainer' has no attribute {name!r}")
    import importlib

    if not _API[name]:
        return importlib.import_module(f".{name}", __name__)
    return getattr(importlib.import_module(f".{_API[name]}", __name__), name)
