"""elastic_trainer: fault-tolerant elastic FSDP2 training with async distributed checkpoints.

The public API for your own training loop (semantic versioning applies to these names only)::

    import torch
    from torch.utils.data import DataLoader

    import elastic_trainer as et

    session = et.init()                                            # 1. process groups, events, metrics, preemption
    model = session.shard(build_model(), [Block])                  # 2. fully_shard each Block, then the root
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=100)
    loader = DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=collate)
    ckpt = et.Checkpointer(session, model=model, optimizer=opt, scheduler=sched, data=loader)  # 3.
    for step, batch in ckpt.steps(total_steps):                    # 4. resume, agree, save when due, truthful exit
        loss = compute_loss(model, batch)                          # this batch's mean loss
        ckpt.optimizer_step(loss)                                  # 5. backward; at a step's end: guard, step

``batch`` is one batch of your ``DataLoader`` (its ``batch_size`` is the micro-batch) at every world
size; ``ckpt.optimizer_step(loss)`` does the backward pass (no ``loss.backward()`` of your own)
and, after a step's last batch, the optimizer step. See docs/own-script.md. Names resolve lazily,
so ``import elastic_trainer`` stays cheap.
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
