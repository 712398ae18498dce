"""A plain PyTorch FSDP2 training script on elastic_trainer's loop API.

Its own model, loss, optimizer, dataset (a ``DataLoader``), LR schedule and evaluation;
elastic_trainer adds the guarantees in five calls (init, shard, the checkpointer, the step loop,
the optimizer step): async checkpoints that commit atomically and verify on load, exact resume
(also at another world size: the loader is made world-size invariant), agreed preemption (exit 75
only with the final step committed), the non-finite guard, the hang watchdog and metrics.

    elastic-trainer run --nproc-per-node 2 examples/train_fsdp.py --steps 40
    torchrun --nproc-per-node 2 examples/train_fsdp.py --steps 40
    python examples/train_fsdp.py --steps 40          # one process, no launcher

Checkpoints and events go to ``runs/train_fsdp/`` unless ``run --set checkpoint.dir=...`` (or,
without ``run``, ``--set checkpoint.dir=...`` here) says otherwise.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import elastic_trainer as et


class Regression(Dataset):
    """y = sin(x·w): a deterministic map-style dataset."""

    def __init__(self, n: int, dim: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.sin(self.x @ torch.randn(dim, 1, generator=g))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Block(nn.Sequential):
    def __init__(self, dim: int, dropout: float):
        super().__init__(nn.Linear(dim, dim), nn.GELU(), nn.Dropout(dropout))


@torch.no_grad()
def evaluate(model: nn.Module, data: Regression, rank: int, step: int) -> None:
    model.eval()  # every rank runs the forward pass (FSDP gathers the weights); rank 0 prints
    mse = float(
        F.mse_loss(
            model(data.x[:64].to(next(model.parameters()).device)), data.y[:64].to(next(model.parameters()).device)
        )
    )
    model.train()
    if rank == 0:
        print(f"step {step}: eval mse {mse:.5f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="config overrides (without 'run')",
    )
    a = ap.parse_args()
    # 1. process groups, events, metrics, preemption (under `run`: the supervisor's config, these on top)
    session = et.init(
        overrides=[
            "checkpoint.interval_steps=5",
            "train.global_batch_size=12",
            *a.overrides,
        ]
    )
    torch.manual_seed(0)  # the same initial weights at every world size
    # 2. fully_shard each Block, then the root; gradients are reduced as a SUM of per-rank shares
    model = session.shard(nn.Sequential(*(Block(32, a.dropout) for _ in range(3)), nn.Linear(32, 1)), [Block])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    data = Regression(1000, 32)
    loader = DataLoader(data, batch_size=12, num_workers=1, pin_memory=torch.cuda.is_available())
    # 3. model, optimizer, scheduler, data (made world-size invariant), RNG: checkpointed and resumed
    ckpt = et.Checkpointer(session, model=model, optimizer=opt, scheduler=sched, data=loader)
    # 4. resume, agree, save when due, preemption and fencing, a truthful exit code
    for step, (x, y) in ckpt.steps(a.steps):
        loss = F.mse_loss(model(x), y)  # this batch's mean: it counts with its share of the global batch
        # 5. backward, staging wait, clipping, non-finite guard, optimizer and scheduler step, zero_grad;
        # the step's global loss after its last batch (None while a step accumulates more batches)
        if ckpt.optimizer_step(loss, max_norm=1.0) is not None and step % 10 == 0:
            evaluate(model, data, session.rank, step)


if __name__ == "__main__":
    main()
