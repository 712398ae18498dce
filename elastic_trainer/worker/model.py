"""The demo model: a small GPT-style decoder, plus its deterministic parameter initialiser.

Loss contract (for the demo and for user factories): ``model(input_ids)`` returns logits of
shape ``[batch, seq, vocab]`` (or an object with a ``.logits`` attribute); targets are token ids
with ``-100`` marking positions that do not count. The trainer computes the summed
cross-entropy and divides by the global number of counted targets.

``model.dropout`` (default 0) applies dropout in training mode to the embeddings, the attention
weights and both residual branches. Dropout draws from each rank's global generators, which
checkpoints save per rank (:class:`elastic_trainer.checkpoint.state.RNGState`), so a resume at
the same world size continues bitwise exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class Block(nn.Module):
    """One transformer block: the unit ``fully_shard`` is applied to."""

    def __init__(self, dim: int, n_heads: int, mlp_ratio: int, dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, mlp_ratio * dim)
        self.fc_out = nn.Linear(mlp_ratio * dim, dim)
        self.mlp_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp_drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.emb_drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(cfg.dim, cfg.n_heads, cfg.mlp_ratio, cfg.dropout) for _ in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.emb_drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def init_param(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """Full (unsharded) initial value of parameter ``name``; CPU fp32, deterministic in ``generator``.

        Residual output projections are scaled by 1/sqrt(2 * n_layers) (GPT-2).
        """
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if name.startswith("ln") or ".ln" in name:
            return torch.ones(shape)
        std = self.cfg.init_std
        if name.endswith(("attn.proj.weight", "fc_out.weight")):
            std = std / math.sqrt(2 * self.cfg.n_layers)
        return torch.empty(shape).normal_(0.0, std, generator=generator)


def logits_of(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output
