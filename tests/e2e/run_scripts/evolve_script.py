"""A user's script whose registered state changes between runs (tests/e2e/test_compat.py).

    evolve_script.py --steps N --ckpt DIR --run-dir DIR [--counter required|optional] [--per-rank] [--sgd]

The public API only. ``--counter`` adds a ``Stateful`` to ``extra`` (``optional`` sets
``optional_on_load = True`` on it); ``--per-rank`` registers a per-rank object
(``et.PerRank``), whose state each rank writes to ``RUN_DIR/tally-<rank>.json`` after the resume;
``--sgd`` swaps the optimizer type. Works as one process, under torchrun and under ``run``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import elastic_trainer as et


class Counter:
    optional_on_load = False

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": torch.tensor(self.n)}

    def load_state_dict(self, sd: dict) -> None:
        self.n = int(sd["n"])


class OptionalCounter(Counter):
    optional_on_load = True


class Tally:
    """Per-rank: how many micro-batches this rank saw, and which rank's copy it resumed."""

    def __init__(self, rank: int) -> None:
        self.rank, self.seen, self.loaded_from = rank, 0, None

    def state_dict(self) -> dict:
        return {"rank": self.rank, "seen": self.seen}

    def load_state_dict(self, sd: dict) -> None:
        self.seen, self.loaded_from = sd["seen"], sd["rank"]


class Block(nn.Sequential):
    def __init__(self, dim: int):
        super().__init__(nn.Linear(dim, dim), nn.GELU())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--counter", choices=["none", "required", "optional"], default="none")
    ap.add_argument("--per-rank", action="store_true")
    ap.add_argument("--sgd", action="store_true")
    a = ap.parse_args()
    session = et.init(
        overrides=[
            f"checkpoint.dir={a.ckpt}",
            f"run.dir={a.run_dir}",
            "checkpoint.interval_steps=5",
            "train.global_batch_size=6",
            "train.micro_batch_size=3",
        ]
    )
    cfg = session.cfg.train
    torch.manual_seed(0)
    model = session.shard(nn.Sequential(Block(16), Block(16), nn.Linear(16, 1)), [Block])
    opt = (
        torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        if a.sgd
        else torch.optim.AdamW(model.parameters(), lr=1e-2)
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, 4, 0.5)
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(120, 16, generator=g), torch.randn(120, 1, generator=g)
    sampler = et.GlobalBatchSampler(
        len(xs),
        cfg.global_batch_size,
        cfg.micro_batch_size,
        seed=cfg.seed,
        rank=session.rank,
        world_size=session.world_size,
    )
    extra: dict = {"sampler": sampler}
    if a.counter != "none":
        extra["counter"] = OptionalCounter() if a.counter == "optional" else Counter()
    tally = Tally(session.rank)
    if a.per_rank:
        extra["tally"] = et.PerRank(tally)
    ckpt = et.Checkpointer(session, model=model, optimizer=opt, scheduler=sched, extra=extra)
    step = ckpt.resume()
    if a.per_rank:
        with open(os.path.join(a.run_dir, f"tally-{session.rank}.json"), "w") as f:
            json.dump({"rank": session.rank, "loaded_from": tally.loaded_from, "seen": tally.seen}, f)
    code = None if step < a.steps else ckpt.end_of_step(None, step, a.steps)  # resumed at the end
    while code is None:
        step = ckpt.state.step + 1
        with session.step(step, checkpointer=ckpt) as s:
            loss_sum = torch.zeros(())
            for mb in sampler.micro_batches():
                loss = (
                    F.mse_loss(model(xs[mb.indices]), ys[mb.indices], reduction="sum")
                    * (mb.weight > 0)
                    / cfg.global_batch_size
                )
                loss.backward()
                loss_sum += loss.detach()
                tally.seen += 1
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if s.check(loss_sum, grad_norm):
                opt.step()
                sched.step()
                sampler.advance()
                ckpt.state.step = step
                if "counter" in extra:
                    extra["counter"].n += 1
            opt.zero_grad(set_to_none=True)
        code = ckpt.end_of_step(s, step, a.steps)
    session.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
