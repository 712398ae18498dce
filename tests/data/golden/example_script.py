"""The script that wrote tests/data/golden/example/ (examples/train_fsdp.py as it was then, on the
lower-level public API), with its end-of-step calls replaced by ``ckpt.end_of_step`` as
CHANGELOG.md says (the earlier names were removed): the golden test resumes the checkpoint that
release wrote with the script its user would run now.

A plain PyTorch FSDP2 training script on elastic_trainer's public API.

Its own model, loss, optimizer, dataset and evaluation; elastic_trainer adds the guarantees:
async checkpoints that commit atomically and verify on load, exact resume (also at another
world size), agreed preemption (exit 75 only with the final step committed), the non-finite
guard, the hang watchdog and metrics. Run it under the supervisor or plain torchrun:

    elastic-trainer run --nproc-per-node 2 examples/train_fsdp.py --steps 40 --ckpt runs/example/ckpt
    torchrun --nproc-per-node 2 examples/train_fsdp.py --steps 40 --ckpt runs/example/ckpt
    python examples/train_fsdp.py --steps 40 --ckpt runs/example/ckpt   # one process, no launcher
"""

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

import elastic_trainer as et


class Regression(torch.utils.data.Dataset):
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


def build_model(session: "et.Session", dim: int, dropout: float) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights at every world size
    model = nn.Sequential(*(Block(dim, dropout) for _ in range(3)), nn.Linear(dim, 1))
    # fully_shard each Block, then the root; gradients reduced as a SUM (the loss below is
    # normalised by the global batch), so they are the same at any world size
    return session.shard(model, [Block])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--ckpt", default="runs/example/ckpt")
    ap.add_argument("--run-dir", default="runs/example")
    ap.add_argument("--dropout", type=float, default=0.1)
    a = ap.parse_args()
    session = et.init(
        overrides=[
            f"checkpoint.dir={a.ckpt}",
            f"run.dir={a.run_dir}",
            "checkpoint.interval_steps=5",
            "train.global_batch_size=12",
            "train.micro_batch_size=4",
        ]
    )
    cfg = session.cfg.train
    data = Regression(1000, 32)
    model = build_model(session, 32, a.dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    sampler = et.GlobalBatchSampler(
        len(data),
        cfg.global_batch_size,
        cfg.micro_batch_size,
        seed=cfg.seed,
        rank=session.rank,
        world_size=session.world_size,
    )
    ckpt = et.Checkpointer(session, model=model, optimizer=opt, scheduler=sched, extra={"sampler": sampler})
    step = ckpt.resume()
    code = None if step < a.steps else ckpt.end_of_step(None, step, a.steps)  # resumed at the end
    while code is None:
        step += 1
        with session.step(step, checkpointer=ckpt) as s:
            model.train()
            loss_sum = torch.zeros(())
            for mb in sampler.micro_batches():
                x, y = (torch.stack(t) for t in zip(*(data[i] for i in mb.indices), strict=True))
                # sum over the global batch / global batch size: the same loss at every world size
                loss = F.mse_loss(model(x), y, reduction="sum") * (mb.weight > 0) / cfg.global_batch_size
                loss.backward()
                loss_sum += loss.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if s.check(loss_sum, grad_norm):  # waits for the previous save's staging first
                opt.step()
                sched.step()
                sampler.advance()
                ckpt.state.step = step
                s.record(lr=sched.get_last_lr()[0])
            opt.zero_grad(set_to_none=True)
        if not s.stop and step % 10 == 0:
            evaluate(model, data, session, step)
        code = ckpt.end_of_step(s, step, a.steps)  # fenced / preempted / non-finite / save when due / the end
        if s.nonfinite and code is None:  # rolled back: continue after the restored step
            step = ckpt.state.step
    session.close()
    return code


@torch.no_grad()
def evaluate(model: nn.Module, data: Regression, session: "et.Session", step: int) -> None:
    model.eval()
    x, y = data.x[:64], data.y[:64]
    session.events.emit("eval", step=step, mse=float(F.mse_loss(model(x), y)))


if __name__ == "__main__":
    sys.exit(main())
