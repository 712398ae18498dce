"""A small causal language model trained with PyTorch Lightning and FSDP2, with elastic_trainer's
guarantees: the plain-Lightning script with two lines changed (marked ``# elastic_trainer``).

The ``LightningModule`` builds a decoder-only transformer, shards it in ``configure_model`` with
``fully_shard`` over ``self.device_mesh["data_parallel"]``, trains with AdamW and a linear warm-up
then cosine decay (an ``interval="step"`` scheduler), in bf16-mixed where the device supports it
(fp32 on CPU).

    elastic-trainer run --nproc-per-node 2 examples/lightning_fsdp2.py --steps 40
    torchrun --nproc-per-node 2 examples/lightning_fsdp2.py --steps 40

The workers are the launcher's (``--devices`` is ignored with the elastic_trainer strategy: a
restart may bring another world size); ``python examples/lightning_fsdp2.py`` is a world of one.

Checkpoints and events go to ``runs/lightning_fsdp2/`` unless ``run --set checkpoint.dir=...``
says otherwise. ``--batch-size`` is every worker's micro-batch at every world size; the global
batch is fixed by the first launch (batch size × workers × ``--accumulate``) and kept when the
job shrinks or grows, with the accumulation steps following the world size.
"""

import argparse
import math

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

from elastic_trainer.lightning import Strategy  # elastic_trainer


class Tokens(Dataset):
    """Sequences of a deterministic toy language: each token is the previous one plus a small step."""

    def __init__(self, n: int, seq_len: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        steps = torch.randint(1, 4, (n, seq_len), generator=g)
        self.data = (start + steps.cumsum(1)) % vocab

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x):
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CausalLM(L.LightningModule):
    def __init__(self, vocab=64, dim=32, layers=2, heads=2, seq_len=16, dropout=0.1, lr=3e-3, warmup=5, steps=40):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def configure_model(self):
        for block in self.blocks:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])
        fully_shard(self, mesh=self.device_mesh["data_parallel"])

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, tokens, batch_idx):
        logits = self(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=0.01)

        def schedule(step):  # linear warm-up, then cosine decay to 10%
            if step < hp.warmup:
                return (step + 1) / hp.warmup
            progress = min(1.0, (step - hp.warmup) / max(1, hp.steps - hp.warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(module=CausalLM, dataset=Tokens):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--devices", type=int, default=2, help="workers per node (torchrun's --nproc-per-node)")
    p.add_argument("--batch-size", type=int, default=4, help="per worker")
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches at the first launch")
    args = p.parse_args()
    L.seed_everything(0)
    cuda = torch.cuda.is_available()
    trainer = L.Trainer(
        accelerator="cuda" if cuda else "cpu",
        devices=args.devices,
        strategy=Strategy(),  # elastic_trainer
        precision="bf16-mixed" if cuda and torch.cuda.is_bf16_supported() else "32-true",
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = module(layers=args.layers, dropout=args.dropout, steps=args.steps)
    trainer.fit(model, DataLoader(dataset(args.samples, 17, 64), batch_size=args.batch_size, shuffle=True))


if __name__ == "__main__":
    main()
