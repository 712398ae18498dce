"""Port of the PyTorch examples' FSDP2 transformer training (``distributed/FSDP2`` in
pytorch/examples) to elastic_trainer's loop API; see docs/own-script.md for the diff from the
plain-torchrun form and what each changed line buys.

A toy decoder (token and position embeddings, pre-norm blocks of attention and an MLP, a linear
head), each block ``fully_shard``-ed, then the root; Adam with gradient clipping; synthetic token
sequences (here a map-style dataset, so a resume continues the same samples); optional bf16
mixed precision.

    elastic-trainer run --nproc-per-node 2 examples/fsdp2_transformer.py --steps 20
"""

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import elastic_trainer as et


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 128
    max_seq_len: int = 32
    dim: int = 32
    n_heads: int = 4


class Block(nn.Module):
    """Pre-norm attention and MLP with residuals."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads = a.n_heads
        self.norm1, self.norm2 = nn.LayerNorm(a.dim), nn.LayerNorm(a.dim)
        self.qkv = nn.Linear(a.dim, 3 * a.dim, bias=False)
        self.proj = nn.Linear(a.dim, a.dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(a.dim, 4 * a.dim), nn.GELU(), nn.Linear(4 * a.dim, a.dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.tok, self.pos = nn.Embedding(a.vocab_size, a.dim), nn.Embedding(a.max_seq_len, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm, self.output = nn.LayerNorm(a.dim), nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


class RandomTokens(Dataset):
    """Sample ``i`` is a fixed random sequence (a function of ``i`` only)."""

    def __init__(self, n: int, vocab: int, seq_len: int):
        self.n, self.vocab, self.seq_len = n, vocab, seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.randint(0, self.vocab, (self.seq_len + 1,), generator=torch.Generator().manual_seed(i))


def main() -> None:
    ap = argparse.ArgumentParser(description="FSDP2 transformer on elastic_trainer")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mixed-precision", action="store_true", help="bf16 parameters for compute, fp32 reduction")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = ap.parse_args()
    session = et.init(
        overrides=[
            "checkpoint.interval_steps=5",
            "train.global_batch_size=8",
            f"train.mixed_precision={'bf16' if args.mixed_precision else 'fp32'}",
            *args.overrides,
        ]
    )
    model_args = ModelArgs()
    torch.manual_seed(0)
    model = session.shard(Transformer(model_args), [Block])
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(RandomTokens(4096, model_args.vocab_size, model_args.max_seq_len - 1), batch_size=8)
    ckpt = et.Checkpointer(session, model=model, optimizer=optim, data=loader)
    for _, tokens in ckpt.steps(args.steps):
        logits = model(tokens[:, :-1])
        ckpt.optimizer_step(F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()), max_norm=1.0)


if __name__ == "__main__":
    main()
